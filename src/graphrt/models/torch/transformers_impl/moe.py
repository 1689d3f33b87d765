"""MoE experts of transformers models under graphrt's graphs.

transformers runs a model's experts through its experts interface
(``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``, ``config._experts_implementation``):
``grouped_mm`` (sort the routed tokens by expert, one grouped matmul; group sizes by ``histc``) and
``batched_mm`` (gather each routed token's expert weights, batched matmuls) stay on the device
with static shapes, so graphs hold them. ``eager`` loops in Python over the experts that were hit,
which it finds on the host (``nonzero`` over the routing mask): no graph can hold that.

graphrt loads MoE models with ``grouped_mm`` (:data:`DEFAULT_EXPERTS`). ``eager`` is accepted
and then refused for every graph with that reason named (:func:`experts_blocker`): the model
runs eagerly.
"""

from __future__ import annotations

from typing import Any

import torch

from graphrt.core.errors import ConfigError

#: The experts implementation graphrt asks transformers for: capturable.
DEFAULT_EXPERTS = "grouped_mm"
#: transformers' experts implementations that graphs can hold.
CAPTURABLE_EXPERTS = ("grouped_mm", "batched_mm")
EXPERTS_CHOICES = (*CAPTURABLE_EXPERTS, "eager")


def experts_implementation(choice: str | None) -> str:
    """The experts implementation to load with (``None``: :data:`DEFAULT_EXPERTS`), checked."""
    value = DEFAULT_EXPERTS if choice is None else choice
    if value not in EXPERTS_CHOICES:
        raise ConfigError(f"experts implementation {value!r}: expected one of {EXPERTS_CHOICES}")
    return value


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules that dispatch through transformers' experts interface (``@use_experts_implementation``)."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "has_gate") and hasattr(m, "is_transposed") and hasattr(m, "_apply_gate")]


def experts_blocker(model: torch.nn.Module) -> str | None:
    """Why ``model``'s experts keep it out of graphs (the eager loop), or None."""
    modules = experts_modules(model)
    if not modules:
        return None
    name, module = modules[0]
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if impl in CAPTURABLE_EXPERTS:
        return None
    return (f"MoE experts {name} ({type(module).__name__}) run transformers' experts_implementation={impl!r}: it "
            "reads on the host which experts a step hit (a host sync over the routing mask) and loops over them in "
            "Python with shapes that follow the routing; no graph can hold it. Load with "
            f"experts={DEFAULT_EXPERTS!r} (the default) or 'batched_mm' for graphs; this model runs eagerly")


__all__ = ["CAPTURABLE_EXPERTS", "DEFAULT_EXPERTS", "EXPERTS_CHOICES", "experts_blocker",
           "experts_implementation", "experts_modules"]
