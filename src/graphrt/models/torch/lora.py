"""A LoRA-capable linear for graphrt's torch models: ``y = x W^T + b + (x A_s^T) (scale_s B_s^T)``
for each token's adapter slot ``s``, capturable and reading adapters from persistent stacked
tensors, so a graph captured before an adapter was loaded applies it.

A model names its adaptable ``nn.Linear`` children in ``lora_target_modules``; :func:`enable_lora`
swaps them only when LoRA is on. Per step the layers read one :class:`LoraState`; ``num_groups``
(the key's ``num_loras``) is a Python int set per key, so the value a graph bakes in is the same
for every step that replays it (0: no LoRA op at all).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from graphrt.core.errors import ConfigError


class LoraState:
    """The step's LoRA tables every :class:`LoRALinear` of one model reads."""

    def __init__(self, index: torch.Tensor, groups: torch.Tensor) -> None:
        self.index = index          # int64 [max_tokens]: adapter slot per token, -1: none
        self.groups = groups        # int64 [max_loras]: active slots, then LORA_GROUP_PAD
        self.num_groups = 0         # groups the forward applies (the key's num_loras)


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` (same weight and bias objects) plus stacked adapters ``lora_a
    [max_loras, in, rank]`` and ``lora_b [max_loras, rank, out]`` (the scale folded in).
    ``graphrt_fx_leaf`` keeps it whole in the PIECEWISE split, so pieces read ``num_groups``."""

    graphrt_fx_leaf: ClassVar[bool] = True

    def __init__(self, base: nn.Linear, state: LoraState, max_loras: int, max_rank: int) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.lora_state = state
        w = base.weight
        self.register_buffer("lora_a", torch.zeros(max_loras, self.in_features, max_rank, dtype=w.dtype,
                                                   device=w.device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, max_rank, self.out_features, dtype=w.dtype,
                                                   device=w.device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in]`` -> ``[T, out]``; tokens without an adapter get exactly the base output."""
        base = F.linear(x, self.weight, self.bias)
        n = self.lora_state.num_groups
        if n == 0:
            return base
        groups = self.lora_state.groups[:n]
        slots = groups.clamp(min=0)
        xa = torch.matmul(x.unsqueeze(0), self.lora_a.index_select(0, slots))      # [n, T, rank]
        delta = torch.bmm(xa, self.lora_b.index_select(0, slots))                  # [n, T, out]
        index = self.lora_state.index[:x.shape[0]]
        hit = index.unsqueeze(0) == groups.unsqueeze(1)                             # [n, T]: one group per token
        delta = torch.where(hit.unsqueeze(-1), delta, 0).sum(0)
        return torch.where((index >= 0).unsqueeze(-1), base + delta, base)


def lora_targets(model: nn.Module) -> dict[str, tuple[nn.Module, str, nn.Linear]]:
    """By module name, ``(parent, child name, linear)`` of every ``nn.Linear`` child named in
    ``model.lora_target_modules``: what :func:`enable_lora` swaps (and what it allocates for)."""
    names = tuple(getattr(model, "lora_target_modules", ()))
    return {f"{prefix}.{child_name}" if prefix else child_name: (module, child_name, child)
            for prefix, module in list(model.named_modules())
            for child_name, child in list(module.named_children())
            if child_name in names and isinstance(child, nn.Linear)}


def lora_slot_bytes(model: nn.Module, max_loras: int, max_rank: int) -> int:
    """Bytes of the adapter stacks :func:`enable_lora` allocates: ``max_loras`` slots of rank
    ``max_rank`` over each target's in + out features, in its weight's dtype."""
    return sum(max_loras * max_rank * (child.in_features + child.out_features) * child.weight.element_size()
               for _, _, child in lora_targets(model).values())


def enable_lora(model: nn.Module, state: LoraState, max_loras: int, max_rank: int) -> dict[str, LoRALinear]:
    """Swap every ``nn.Linear`` child named in ``model.lora_target_modules`` for a
    :class:`LoRALinear` over the same weights reading ``state``; returns them by module name.
    Raises :class:`ConfigError` when the model declares no such module, or is a tensor-parallel
    shard (its adapters would have to be sharded like the layers they adapt; not built)."""
    tp_size = getattr(model, "tp_size", 1)
    if tp_size > 1:
        raise ConfigError(f"max_loras > 0 with tensor_parallel_size {tp_size}: LoRA adapters run on "
                          "unsharded models only (tensor_parallel_size 1)")
    layers: dict[str, LoRALinear] = {}
    for name, (module, child_name, child) in lora_targets(model).items():
        layer = LoRALinear(child, state, max_loras, max_rank)
        setattr(module, child_name, layer)
        layers[name] = layer
    if not layers:
        raise ConfigError(f"max_loras > 0 but {type(model).__name__} has no LoRA-capable linear: name the "
                          "nn.Linear children to adapt in its lora_target_modules (docs/models.md)")
    return layers



__all__ = ["LoRALinear", "LoraState", "enable_lora", "lora_slot_bytes", "lora_targets"]
