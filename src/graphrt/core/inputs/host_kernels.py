"""Compiled host kernels: the loops behind the fast path of input preparation and padding.

A step needs 25-40 small numpy calls whose fixed cost outweighs the work at a few hundred
requests; here each job is one numba-compiled loop (written once in :mod:`graphrt.core.inputs.host_loops`),
one call per step, every check before the first write. ``kernel="numpy"``, or no numba, runs
:mod:`graphrt.core.inputs.prepare_numpy` instead; ``GRAPHRT_HOST_KERNEL`` sets the default.

numba compiles a variant per argument dtype / layout (1.4-2.4 s each), so arrays come in one
form: request arrays int32 (:class:`RequestArrays`), tables as compiled for
(:func:`table_variant`: int32 / int64, C-contiguous, writeable, aligned) or a
:func:`canonical_table` copy; ``InputPreparer.compile_kernels`` compiles the variants at warm-up."""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import types
from pathlib import Path
from typing import Any, Callable

import numpy as np

from graphrt.core.errors import ConfigError, InputError
from graphrt.core.inputs.fields import INDEX_MAX

logger = logging.getLogger(__name__)

#: Names accepted by ``kernel=`` and ``GRAPHRT_HOST_KERNEL``.
KERNELS = ("auto", "numba", "numpy")
KERNEL_ENV = "GRAPHRT_HOST_KERNEL"
#: The loops called from Python (the rest are compiled into them), and their modules.
ENTRY_POINTS = {"check_step": "host_loops", "prepare_step": "host_loops",
                "write_checked_step": "host_loops", "clamp_requests": "host_loops",
                "pad_step": "host_loops", "fill_padding": "host_loops"}
#: The modules (``graphrt.core.inputs.<name>``) whose functions are compiled into the loops.
LOOP_MODULES = ("loop_primitives", "pad_loops", "host_loops")
#: Every module whose code or constants the compiled loops hold: the stamp of their disk cache
#: (numba alone stamps an entry point's own file, so an edited helper would load stale code).
#: (paths relative to ``graphrt/core``).
LOOP_SOURCES = tuple(f"inputs/{m}.py" for m in (*LOOP_MODULES, "fields", "step_codes")) + ("defaults.py",)

_numba: types.ModuleType | None = None     # numba, once imported
_numba_error: str | None = None
_registered = False                         # the loop modules' functions registered with numba
_compiled: dict[str, Any] = {}
_disk_cache = True                          # False where numba's cache locators are not as expected


def _load() -> bool:
    """Import numba and register every function of the loop modules with it (helpers are
    compiled into the entry points that call them); False when numba does not import."""
    global _numba, _numba_error, _registered, _disk_cache
    if _numba is not None:
        return True
    if _numba_error is not None:
        return False
    try:
        import numba
        from numba.extending import overload, register_jitable
    except Exception as exc:  # noqa: BLE001 - any import failure means "use numpy"
        _numba_error = f"numba does not import ({type(exc).__name__}: {exc})"
        logger.info("graphrt: %s; input preparation and padding use the numpy path", _numba_error)
        return False
    if not _registered:
        from graphrt.core.inputs import fields, host_loops

        options = host_loops.JIT_OPTIONS
        register_jitable(**options)(fields.field_rows)
        for module in map(_loop_module, LOOP_MODULES):
            for name, fn in vars(module).items():
                if not isinstance(fn, types.FunctionType) or fn.__module__ != module.__name__:
                    continue            # imported: registered with its own module
                inline = "always" if name in host_loops.INLINED else "never"
                if name in host_loops.COMPILED_FORMS:
                    forms = tuple(getattr(module, form) for form in host_loops.COMPILED_FORMS[name])
                    overload(fn, jit_options=options, strict=False, inline=inline)(
                        lambda dst, *args, forms=forms: forms[dst.ndim > 1])
                else:
                    register_jitable(inline=inline, **options)(fn)
        _registered = True
    _disk_cache = _stamp_loop_caches()
    _numba = numba
    return True


def compiled(name: str) -> Callable[..., Any]:
    """The compiled form of the loop ``name`` (one of :data:`ENTRY_POINTS`; numba must import),
    cached on disk."""
    if not _load():
        raise ConfigError(f"no compiled host kernels: {_numba_error}")
    loop = _compiled.get(name)
    if loop is None:
        if name not in ENTRY_POINTS:
            raise ConfigError(f"{name!r} is not a host-loop entry point: {sorted(ENTRY_POINTS)}")
        from graphrt.core.inputs import host_loops

        loop = _compiled[name] = _numba.njit(cache=_disk_cache, **host_loops.JIT_OPTIONS)(
            getattr(_loop_module(ENTRY_POINTS[name]), name))
    return loop


def _loop_module(name: str) -> types.ModuleType:
    return importlib.import_module(f"graphrt.core.inputs.{name}")


@functools.cache
def loop_sources_stamp() -> str:
    """The loops' disk-cache stamp: a hash of the source of every module in :data:`LOOP_SOURCES`
    (read once per process: numba asks for it at every cache load and save of every variant)."""
    digest = hashlib.sha256()
    core = Path(__file__).resolve().parents[1]
    for name in LOOP_SOURCES:
        digest.update((core / name).read_bytes())
    return digest.hexdigest()


def _stamp_loop_caches() -> bool:
    """Make numba stamp the loops' disk cache with :func:`loop_sources_stamp`: a locator class
    (numba's own, its stamp replaced) ahead of numba's for the functions of ``LOOP_MODULES``.

    This reaches into numba's caching internals (the locator list of ``CacheImpl``); where they
    are not as expected (a numba this was not written for) the loops are compiled without the
    disk cache - correct, only slower to start - and False is returned, with a warning."""
    try:
        from numba.core import caching

        impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl    # numba < 0.61: private
        classes = impl._locator_classes
        bases = (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator)
        if not isinstance(classes, list) or not all(hasattr(b, "get_source_stamp") for b in bases):
            raise TypeError("unexpected locator classes")
    except Exception as exc:  # noqa: BLE001 - any mismatch means "no disk cache"
        logger.warning("graphrt: numba's cache locators are not as expected (%s: %s); the host "
                       "loops compile without numba's disk cache", type(exc).__name__, exc)
        return False

    def stamped(base: type) -> type:
        class LoopSources(base):  # type: ignore[misc, valid-type]
            @classmethod
            def from_function(cls, py_func: Any, py_file: str) -> Any:
                if py_func.__module__ not in {f"graphrt.core.inputs.{m}" for m in LOOP_MODULES}:
                    return None
                return super().from_function(py_func, py_file)

            def get_source_stamp(self) -> str:
                return loop_sources_stamp()
        return LoopSources

    if not any(getattr(c, "__name__", "") == "LoopSources" for c in classes):
        classes[:0] = [stamped(base) for base in bases]
    return True


def compiled_loops() -> dict[str, Any]:
    """The entry points compiled so far (numba dispatchers: ``.signatures`` lists the variants)."""
    return dict(_compiled)


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
#: The table dtypes the loops are compiled for (and the request dtypes ``prepare`` passes as they are).
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
    """The request arrays (rows, computed, scheduled) of a step as int32, C-contiguous (the
    form the loops take on both paths), for any integer dtype and layout: int32 C-contiguous
    ones as they are; others clamped to the int32 range into persistent buffers (no
    allocation): three C-contiguous int64 ones by one compiled call where numba imports
    (``host_loops.clamp_requests``; ``compiled_copy=False``: numpy), the rest with numpy."""

    def __init__(self, max_num_reqs: int, *, compiled_copy: bool) -> None:
        self.max_num_reqs = max_num_reqs
        self.int32 = np.zeros((3, max_num_reqs), dtype=np.int32)
        self.wide = np.zeros((3, max_num_reqs), dtype=np.int64)     # scratch of clamp_into
        self._views: dict[int, tuple[np.ndarray, ...]] = {}
        self._copy_all = compiled("clamp_requests") if compiled_copy else None

    def convert(self, rows: object, computed: object, scheduled: object) -> tuple[np.ndarray, ...]:
        """The three arrays in the loops' form (an array longer than ``max_num_reqs`` is left
        as it is: the preparer's shape check refuses it)."""
        if (self._copy_all is not None and type(rows) is np.ndarray and type(computed) is np.ndarray
                and type(scheduled) is np.ndarray and rows.ndim == 1 and rows.dtype is _INT64
                and computed.dtype is _INT64 and scheduled.dtype is _INT64
                and rows.shape == computed.shape == scheduled.shape and rows.shape[0] <= self.max_num_reqs
                and rows.flags.num & computed.flags.num & scheduled.flags.num & CANONICAL_FLAGS
                == CANONICAL_FLAGS):
            self._copy_all(rows, computed, scheduled, self.int32)     # all int64: one compiled call
            return self.views(rows.shape[0])[:3]
        return tuple(self._one(k, value) for k, value in enumerate((rows, computed, scheduled)))

    def _one(self, k: int, value: object) -> np.ndarray:
        """Request array ``k`` (0: rows, 1: computed, 2: scheduled) in the loops' form."""
        arr = as_int_array(_NAMES[k], value, 1)
        n = arr.shape[0]
        if (arr.dtype == _INT32 and arr.flags.num & CANONICAL_FLAGS == CANONICAL_FLAGS) or n > self.max_num_reqs:
            return arr
        views = self.views(n)
        clamp_into(arr, views[k], views[3 + k])
        return views[k]

    def views(self, n: int) -> tuple[np.ndarray, ...]:
        """The first ``n`` entries of each buffer row (int32, then the int64 scratch)."""
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = (*self.int32[:, :n], *self.wide[:, :n])
        return views

    def compile(self) -> None:
        """Compile the int64 conversion now (a runner's warm-up)."""
        if self._copy_all is not None:
            one = np.zeros(1, dtype=np.int64)
            self._copy_all(one, one, one, self.int32)
