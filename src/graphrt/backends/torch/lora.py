"""LoRA adapters of a :class:`~graphrt.backends.torch.executor.TorchExecutor`: :class:`TorchLora`
swaps the target linears for :class:`~graphrt.models.torch.lora.LoRALinear`, copies the step's
LoRA tables, sets the key's adapter count, and loads adapters into the layers' persistent
stacks (never reallocated, so graphs captured before a load replay with the new weights)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import torch

from graphrt.backends.base import LoraSlots
from graphrt.config import GraphConfig
from graphrt.core import defaults, memory_bounds
from graphrt.core.dispatch import BatchDescriptor
from graphrt.core.errors import InputError
from graphrt.core.lora import LORA_GROUP_PAD, LORA_GROUPS, LORA_INDEX, NO_LORA
from graphrt.core.memory_bounds import Need, check_needs
from graphrt.models.torch.lora import LoRALinear, LoraState, enable_lora, lora_slot_bytes


def free_memory_bytes(device: torch.device) -> int | None:
    """Bytes an allocation on ``device`` can take now: the host's available RAM for the CPU;
    the device's free memory where torch can say (``mem_get_info``) plus what its caching
    allocator holds unused; else None."""
    if device.type == "cpu":
        return memory_bounds.available_memory_bytes()
    module = getattr(torch, device.type, None)
    info = getattr(module, "mem_get_info", None)
    if info is None:
        return None
    try:
        free = int(info(device)[0])
        cached = int(module.memory_reserved(device)) - int(module.memory_allocated(device))
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None
    return free + max(cached, 0)


def check_lora_fits(model: torch.nn.Module, config: GraphConfig, device: torch.device) -> None:
    """Refuse adapter slots that do not fit in the memory free on ``device`` now, before they are
    allocated: ConfigError naming ``max_lora_rank`` or ``max_loras`` (the one further above its
    default), both values and the bytes. The preflight check (backends/preflight.py) bounds them
    by the device's total memory before loading; this one sees what the model and the buffers
    made since left (a raw allocator error, or the OOM killer, otherwise)."""
    free = free_memory_bytes(device)
    if free is None:
        return
    field = ("max_lora_rank" if config.max_lora_rank / defaults.DEFAULT_MAX_LORA_RANK >= config.max_loras
             else "max_loras")
    what = f"LoRA slots (max_loras={config.max_loras} x max_lora_rank={config.max_lora_rank})"
    where = "available host RAM" if device.type == "cpu" else f"free {device.type} memory"
    check_needs([Need(field, what, lora_slot_bytes(model, config.max_loras, config.max_lora_rank))], free, where)


class TorchLora(LoraSlots):
    """``max_loras`` adapter slots of rank ``max_lora_rank`` over the model's LoRA-capable linears."""

    def __init__(self, model: torch.nn.Module, config: GraphConfig, device: torch.device, pin: bool) -> None:
        self.max_loras, self.max_rank = config.max_loras, config.max_lora_rank
        max_t = config.max_num_batched_tokens
        self._host = {LORA_INDEX: torch.full((max_t,), NO_LORA, dtype=torch.int64, pin_memory=pin),
                      LORA_GROUPS: torch.full((self.max_loras,), LORA_GROUP_PAD, dtype=torch.int64, pin_memory=pin)}
        self.host_buffers = {name: t.numpy() for name, t in self._host.items()}
        same = device.type == "cpu"
        static = self._host if same else {name: t.to(device) for name, t in self._host.items()}
        self._copy = not same
        self.state = LoraState(static[LORA_INDEX], static[LORA_GROUPS])
        check_lora_fits(model, config, device)
        self.layers: dict[str, LoRALinear] = enable_lora(model, self.state, self.max_loras, self.max_rank)
        self.loaded = np.zeros(self.max_loras, dtype=bool)

    def targets(self) -> dict[str, tuple[int, int]]:
        """The LoRA-capable modules by name: ``(in_features, out_features)``."""
        return {name: (layer.in_features, layer.out_features) for name, layer in self.layers.items()}

    def use_key(self, key: Any) -> None:
        """Before a capture: the forward applies ``key.num_loras`` adapter groups (0 for a sampler key)."""
        self.state.num_groups = key.num_loras if isinstance(key, BatchDescriptor) else 0

    def before_step(self, key: BatchDescriptor, num_tokens: int) -> None:
        """Before a replay or an eager run: the key's groups, and the tables copied to the device
        (a step without adapters reads neither)."""
        self.state.num_groups = key.num_loras
        if self._copy and key.num_loras:
            self.state.index[:num_tokens].copy_(self._host[LORA_INDEX][:num_tokens], non_blocking=True)
            self.state.groups.copy_(self._host[LORA_GROUPS], non_blocking=True)

    def _slot(self, slot: Any) -> int:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.max_loras:
            raise InputError("slot", f"must be an integer in [0, {self.max_loras}) (max_loras), got {slot!r}")
        return int(slot)

    def load(self, slot: int, weights: Mapping[str, tuple[Any, Any]], scale: float = 1.0) -> None:
        """Copy an adapter into ``slot``: ``weights`` maps module names (:meth:`targets`) to
        ``(lora_a [rank, in], lora_b [out, rank])`` in PEFT's layout, rank <= ``max_lora_rank``;
        modules left out get no adapter. Every value is checked before the first copy."""
        slot = self._slot(slot)
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) \
                or not math.isfinite(scale):
            raise InputError("scale", f"must be a finite real number, got {scale!r}")
        if not isinstance(weights, Mapping) or not weights:
            raise InputError("weights", f"must map module names to (lora_a, lora_b), got {weights!r}")
        unknown = sorted(set(weights) - set(self.layers))
        if unknown:
            raise InputError("weights", f"unknown modules {unknown}; LoRA-capable: {sorted(self.layers)}")
        tensors = {name: self._pair(name, value) for name, value in weights.items()}
        with torch.no_grad():
            for name, layer in self.layers.items():
                layer.lora_a[slot].zero_()
                layer.lora_b[slot].zero_()
                if name in tensors:
                    a, b = tensors[name]
                    rank = a.shape[0]
                    layer.lora_a[slot, :, :rank].copy_(a.t())
                    layer.lora_b[slot, :rank].copy_(b.t() * scale)
        self.loaded[slot] = True

    def _pair(self, name: str, value: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """One module's ``(lora_a, lora_b)`` as float tensors of checked shapes and finite values."""
        field = f"weights[{name!r}]"
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise InputError(field, "must be a pair (lora_a [rank, in], lora_b [out, rank])")
        layer = self.layers[name]
        try:
            a, b = (torch.as_tensor(np.asarray(v) if not isinstance(v, torch.Tensor) else v) for v in value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InputError(field, f"not numeric arrays ({exc})") from None
        rank = a.shape[0] if a.ndim == 2 else -1
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != layer.in_features or tuple(b.shape) != (layer.out_features, rank):
            raise InputError(field, f"shapes {tuple(a.shape)}, {tuple(b.shape)}; expected (rank, {layer.in_features}) "
                                    f"and ({layer.out_features}, rank)")
        if not 1 <= rank <= self.max_rank:
            raise InputError(field, f"rank {rank} outside [1, {self.max_rank}] (max_lora_rank)")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise InputError(field, f"must be floating point, got {a.dtype}, {b.dtype}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise InputError(field, "holds non-finite values")
        dtype, device = layer.lora_a.dtype, layer.lora_a.device
        return a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)

    def remove(self, slot: int) -> bool:
        """Zero ``slot``'s weights and mark it empty; False when it held nothing."""
        slot = self._slot(slot)
        if not self.loaded[slot]:
            return False
        with torch.no_grad():
            for layer in self.layers.values():
                layer.lora_a[slot].zero_()
                layer.lora_b[slot].zero_()
        self.loaded[slot] = False
        return True


__all__ = ["TorchLora", "check_lora_fits", "free_memory_bytes"]
