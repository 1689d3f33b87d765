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
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any, Callable

from graphrt.core.errors import ConfigError

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
