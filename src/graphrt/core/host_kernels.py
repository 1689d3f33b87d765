"""Compiled host kernels: the loops behind the fast path of input preparation and padding.

Every step, the engine's host does the same small jobs (vLLM's ``_prepare_inputs``): spread each request's
schedule over its tokens, gather ids and KV slots from the engine's tables, copy block-table
rows, pad to the bucket. numpy does each job in one call, but a step needs 25-40 of them,
and at a few hundred requests their fixed cost (and the caches a forward evicts between
steps) outweighs the work. Here each job is one loop compiled by numba (as vLLM does for its
n-gram proposer): one call per step, every check before the first write.

The loops are the same rules as the numpy path (:mod:`graphrt.core.prepare_numpy`, and
:class:`graphrt.Padder` applying its rule table), the reference they are tested against; the
error messages are built by :class:`graphrt.InputPreparer` from the codes of
:mod:`graphrt.core.step_codes`. ``kernel="auto"`` uses numba when it imports and numpy
otherwise; ``GRAPHRT_HOST_KERNEL`` (``numba`` / ``numpy``) sets the default.

numba compiles one variant of a loop per combination of its arguments' dtypes, layouts,
alignment and writeability (1.4-2.4 s each). So the preparer hands both implementations the
step's arrays in one form: request arrays as int32 (:class:`RequestArrays`, into persistent
buffers), tables as they are when :func:`table_variant` finds them compiled for (int32 or
int64, C-contiguous, writeable, aligned) and otherwise as a :func:`canonical_table` copy, or,
in strict mode, not at all. ``InputPreparer.compile_kernels`` compiles those four table
variants at warm-up.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any, Callable

import numpy as np

from graphrt.core.errors import ConfigError, InputError
from graphrt.core.fields import INDEX_MAX

logger = logging.getLogger(__name__)

#: Names accepted by ``kernel=`` and ``GRAPHRT_HOST_KERNEL``.
KERNELS = ("auto", "numba", "numpy")
KERNEL_ENV = "GRAPHRT_HOST_KERNEL"

_loops: ModuleType | None = None       # graphrt.core.host_loops, once imported
_numba_error: str | None = None


def _load() -> bool:
    """Import :mod:`graphrt.core.host_loops` (compiled on first call, cached on disk); False when
    numba does not import."""
    global _loops, _numba_error
    if _loops is not None:
        return True
    if _numba_error is not None:
        return False
    try:
        import numba  # noqa: F401 - host_loops needs it; fail here with a clear reason
    except Exception as exc:  # noqa: BLE001 - any import failure means "use numpy"
        _numba_error = f"numba does not import ({type(exc).__name__}: {exc})"
        logger.info("graphrt: %s; input preparation and padding use the numpy path", _numba_error)
        return False
    from graphrt.core import host_loops

    _loops = host_loops
    return True


def compiled(name: str) -> Callable[..., Any]:
    """The compiled loop ``name`` of :mod:`graphrt.core.host_loops` (numba must import)."""
    if not _load():
        raise ConfigError(f"no compiled host kernels: {_numba_error}")
    return getattr(_loops, name)


def resolve_kernel(kernel: str | None) -> str:
    """``numba`` or ``numpy`` for a requested ``kernel`` (None: ``GRAPHRT_HOST_KERNEL`` or auto)."""
    name = kernel if kernel is not None else os.environ.get(KERNEL_ENV, "auto")
    if name not in KERNELS:
        raise ConfigError(f"host kernel {name!r} is not one of {KERNELS}")
    if name == "numpy":
        return "numpy"
    if _load():
        return "numba"
    if name == "numba":
        raise ConfigError(f"host kernel 'numba' was asked for but {_numba_error}; "
                          f"install numba or use kernel='numpy'")
    return "numpy"


#: numpy's flag bits (``NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | NPY_ARRAY_WRITEABLE``,
#: stable C API values) of an array the compiled loops take as it is: ``a.flags.num & F == F``
#: is the cheapest test of all three on the per-step path.
CANONICAL_FLAGS = 0x0001 | 0x0100 | 0x0400
#: The table dtypes the loops are compiled for; request arrays always reach them as int32.
TABLE_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def table_variant(arr: np.ndarray) -> str | None:
    """Why the compiled loops have no variant for the integer table ``arr``, or None."""
    if arr.dtype not in TABLE_DTYPES:            # other widths, unsigned, non-native byte order
        return f"has dtype {arr.dtype}"
    flags = arr.flags
    if not flags.c_contiguous:
        return "is Fortran-ordered" if flags.f_contiguous else "is a strided view, not contiguous"
    if not flags.writeable:
        return "is read-only"
    if not flags.aligned:
        return "is not aligned"
    return None


def canonical_table(arr: np.ndarray) -> np.ndarray:
    """A C-contiguous, writeable, aligned int32 (int64 where int32 cannot hold the dtype)
    copy of the integer table ``arr``; unsigned values past int64 are clamped to its maximum."""
    dt = arr.dtype
    if dt.kind == "u" and dt.itemsize == 8:
        arr = np.minimum(arr, np.iinfo(np.int64).max)
    fits = dt.itemsize < 4 or (dt.kind == "i" and dt.itemsize == 4)
    return np.array(arr, dtype=np.int32 if fits else np.int64, order="C")


def clamp_into(src: np.ndarray, dst: np.ndarray, wide: np.ndarray) -> None:
    """The 1-d integer array ``src`` (any dtype or layout) into int32 ``dst``, each value
    clamped to the int32 range (a clamped value fails exactly the checks its own value would:
    see ``step_codes``); ``wide``: int64 scratch as long as ``dst``."""
    dt = src.dtype
    if dt.kind == "u" and dt.itemsize >= 4:
        np.minimum(src, INDEX_MAX, out=dst, casting="unsafe")
    elif dt.itemsize > 4:
        np.maximum(src, -INDEX_MAX - 1, out=wide)
        np.minimum(wide, INDEX_MAX, out=dst, casting="unsafe")
    else:
        np.copyto(dst, src, casting="unsafe")


def as_int_array(name: str, value: object, ndim: int) -> np.ndarray:
    """``value`` as an ndarray of ``ndim`` dimensions and an integer dtype (not converted
    further), or an InputError naming ``name``."""
    try:
        arr = value if type(value) is np.ndarray else np.asarray(value)
    except (ValueError, TypeError) as exc:          # ragged nesting, unconvertible objects
        raise InputError(name, f"expected a {ndim}-d integer array: {exc}") from None
    if arr.ndim != ndim:
        raise InputError(name, f"expected a {ndim}-d integer array, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise InputError(name, f"expected integers, got dtype {arr.dtype}")
    return arr


_INT32, _INT64 = np.dtype(np.int32), np.dtype(np.int64)
_NAMES = ("req_rows", "num_computed_tokens", "num_scheduled_tokens")


class RequestArrays:
    """The request arrays (rows, computed, scheduled) of a step in the form the
    implementation takes, for any integer dtype and layout: int32 C-contiguous ones as they
    are; others clamped to the int32 range into persistent buffers (no allocation), int64 ones
    by a compiled loop (``host_loops.clamp_copy``, one variant). The numpy path copies request
    arrays into its own int64 scratch and clamps there, so only uint64 ones (which that copy
    would wrap) are converted for it (``numba=False``)."""

    def __init__(self, max_num_reqs: int, *, numba: bool) -> None:
        self.max_num_reqs = max_num_reqs
        self.int32 = np.zeros((3, max_num_reqs), dtype=np.int32)
        self.wide = np.zeros((3, max_num_reqs), dtype=np.int64)     # scratch of clamp_into
        self._views: dict[int, tuple[np.ndarray, ...]] = {}
        self._copy = compiled("clamp_copy") if numba else None
        self._copy3 = compiled("clamp_requests") if numba else None

    def convert(self, rows: object, computed: object, scheduled: object) -> tuple[np.ndarray, ...]:
        """The three arrays in the implementation's form (an array longer than
        ``max_num_reqs`` is left as it is: the preparer's shape check refuses it)."""
        c, d, e = rows, computed, scheduled
        if (self._copy3 is not None and type(c) is np.ndarray and type(d) is np.ndarray
                and type(e) is np.ndarray and c.ndim == 1 and c.dtype is _INT64 and d.dtype is _INT64
                and e.dtype is _INT64 and c.shape == d.shape == e.shape
                and c.shape[0] <= self.max_num_reqs and c.flags.num & CANONICAL_FLAGS == CANONICAL_FLAGS
                and d.flags.num & CANONICAL_FLAGS == CANONICAL_FLAGS
                and e.flags.num & CANONICAL_FLAGS == CANONICAL_FLAGS):
            self._copy3(c, d, e, self.int32)              # all int64: one compiled call
            return self.views(c.shape[0])[:3]
        return tuple(self._one(k, value) for k, value in enumerate((c, d, e)))

    def _one(self, k: int, value: object) -> np.ndarray:
        arr = as_int_array(_NAMES[k], value, 1)
        n, dt = arr.shape[0], arr.dtype
        plain = arr.flags.num & CANONICAL_FLAGS == CANONICAL_FLAGS
        if (dt == _INT32 and plain) or n > self.max_num_reqs or (
                self._copy is None and not (dt.kind == "u" and dt.itemsize == 8)):
            return arr
        views = self.views(n)
        if dt == _INT64 and plain and self._copy is not None:
            self._copy(arr, self.int32, k)
        else:
            clamp_into(arr, views[k], views[3 + k])
        return views[k]

    def views(self, n: int) -> tuple[np.ndarray, ...]:
        """The first ``n`` entries of each buffer row (int32, then the int64 scratch)."""
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = (*self.int32[:, :n], *self.wide[:, :n])
        return views

    def compile(self) -> None:
        """Compile the int64 conversions now (a runner's warm-up)."""
        if self._copy3 is not None:
            one = np.zeros(1, dtype=np.int64)
            self._copy3(one, one, one, self.int32)
            self._copy(one, self.int32, 0)
