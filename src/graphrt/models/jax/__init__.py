"""JAX reference models: the functional decoder (``decoder``), its loader (``loader``) and a
flax nnx wrapper (``nnx``).

What a recurrent layer of one's own needs on ``xla`` (docs/hybrid.md, "A recurrent layer of
your own") is exported here, imported on first use (so importing this package imports no jax):
:func:`state_meta` (the step's :class:`StateMeta`), :func:`read_states` and :func:`write_states`
(``recurrent``).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {name: "graphrt.layers.jax.recurrent" for name in ("StateMeta", "read_states", "state_meta", "write_states")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'graphrt.models.jax' has no attribute {name!r}")


__all__ = sorted(_LAZY)
