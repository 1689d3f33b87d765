"""Torch reference models: paged attention (``attention``), the decoder (``decoder``), its
safetensors loader (``loader``), the tensor-parallel layers a sharded decoder is built from
(``parallel``) and LoRA (``lora``).

What a recurrent layer of one's own needs (docs/hybrid.md, "A recurrent layer of your own") is
exported here, imported on first use (so importing this package imports no torch):
``get_state_context()`` (the step's :class:`StateMetadata`), :func:`read_states` and
:func:`write_states` (``state_metadata``).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"StateMetadata": "graphrt.layers.torch.state.metadata",
         "read_states": "graphrt.layers.torch.state.metadata",
         "write_states": "graphrt.layers.torch.state.metadata",
         "get_state_context": "graphrt.layers.torch.forward_context"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'graphrt.models.torch' has no attribute {name!r}")


__all__ = sorted(_LAZY)
