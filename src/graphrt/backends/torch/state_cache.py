"""The torch executor's recurrent-state cache, per the model's state spec (core/state_spec.py).

:func:`model_state_spec` resolves and checks ``state_spec()`` (ConfigError before any
allocation; None without state), and checks it against what each recurrent layer says it keeps
(``state_shapes()``, :func:`check_against_state_layers`). :class:`TorchStateCache` allocates a zeroed ``[num_slots + 1,
checkpoints, *shape]`` tensor per layer and state tensor and sets ``layer.state_cache``. It is
allocated with the executor, before graph memory is measured and the KV cache sized (a byte
budget has it deducted). Each step's metadata is the recurrent state backend's
(:mod:`graphrt.layers.torch.state.backend`), which the executor composes beside the attention
backend."""

from __future__ import annotations

from typing import Any

import torch

from graphrt.backends.torch.kv_cache import TORCH_KV_DTYPES
from graphrt.core.errors import ConfigError
from graphrt.core.numerics import dtype_name
from graphrt.core.state_spec import (STATE_SHAPES, STATE_SPEC_FIELD, StateMemory, StateSpec, check_against_state_layers,
                                     resolve_state_spec, state_memory)


def model_state_spec(model: torch.nn.Module, backend: str) -> StateSpec | None:
    """``model``'s resolved state spec, or None when it keeps no recurrent state (no
    ``state_spec()``, or an empty one)."""
    declare = getattr(model, STATE_SPEC_FIELD, None)
    if declare is None:
        return None
    if not callable(declare) or not callable(getattr(model, "state_layers", None)):
        raise ConfigError(f"{STATE_SPEC_FIELD}: {type(model).__name__} needs both state_spec() -> graphrt.StateSpec "
                          "and state_layers() -> its recurrent modules in layer order (docs/hybrid.md)")
    layers = model.state_layers()
    param = next(model.parameters(), None)
    spec = resolve_state_spec(declare(), model_dtype=dtype_name(param.dtype) if param is not None else "float32",
                              supported=TORCH_KV_DTYPES, backend=backend, num_layers=len(layers))
    check_against_state_layers(spec, [layer_state_shapes(layer) for layer in layers],
                               [type(layer).__name__ for layer in layers])
    return spec if spec.groups else None


def layer_state_shapes(layer: Any) -> tuple[tuple[int, ...], ...] | None:
    """What a recurrent layer says it keeps per request: its ``state_shapes()`` -- one shape per
    state tensor, in the spec's tensor order (``layer.state_cache``'s order), without the slot
    and checkpoint dimensions -- or None where it says nothing."""
    declare = getattr(layer, STATE_SHAPES, None)
    if declare is None:
        return None
    shapes = declare() if callable(declare) else declare
    try:
        return tuple(tuple(int(d) for d in shape) for shape in shapes)
    except TypeError:
        raise ConfigError(f"{type(layer).__name__}.{STATE_SHAPES}(): {shapes!r} is not a sequence of shapes (one "
                          "per state tensor, in the state spec's order)") from None


class TorchStateCache:
    """Allocates a hybrid model's state slots on ``device``."""

    def __init__(self, model: torch.nn.Module, spec: StateSpec, config: Any, device: torch.device) -> None:
        self.model, self.spec, self.device = model, spec, device
        #: Slots, checkpoints and bytes (:class:`~graphrt.core.state_spec.StateMemory`).
        self.memory: StateMemory = state_memory(spec, max_num_seqs=config.max_num_seqs,
                                                decode_query_len=config.decode_query_len)
        self.num_slots, self.checkpoints = self.memory.num_slots, self.memory.checkpoints
        self.decode_query_len = config.decode_query_len
        self.tensors: list[torch.Tensor] = []

    def allocate(self) -> list[torch.Tensor]:
        """Zeroed state tensors; each recurrent layer gets its tuple as ``state_cache``."""
        layers = self.model.state_layers()
        self.tensors = []
        for index, layer in enumerate(layers):
            own = tuple(torch.zeros(self.num_slots + 1, self.checkpoints, *t.shape, dtype=TORCH_KV_DTYPES[t.dtype],
                                    device=self.device) for t in self.spec.layer_tensors(index))
            layer.state_cache = own
            self.tensors.extend(own)
        return self.tensors


__all__ = ["TorchStateCache", "layer_state_shapes", "model_state_spec"]
