"""Stock transformers hybrid mixers routed to graphrt's recurrent kernels and state slots.

A transformers hybrid (Granite-4-H, Bamba, Qwen3-Next) keeps recurrent state in its own per-sequence
``Cache``, unusable for graphrt's packed rows. :func:`route_recurrent_mixers` replaces each
recurrent mixer with a :class:`RoutedMixer` around graphrt's own module for that kind
(:class:`Mamba2Mixer`, :class:`GatedDeltaNet`) sharing the transformers parameters; these read
their ``state_cache`` slots and are the PIECEWISE split points. Only classes whose computation
graphrt reproduces are routed (:data:`MAMBA2_MIXERS`, :data:`DELTA_MIXERS`); any other recurrent
layer is refused by :func:`served_types`. See docs/hybrid.md.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from graphrt.core.errors import ConfigError
from graphrt.core.state_spec import StateGroup, StateSpec, StateTensor
from graphrt.models.torch.mamba2 import Mamba2Mixer
from graphrt.models.torch.qwen3_next import GatedDeltaNet

#: ``layer_types`` entries of recurrent layers that a routed mixer can serve.
RECURRENT_TYPES = frozenset({"mamba", "linear_attention"})
#: transformers' Mamba2 mixers of the Granite-4-H / Bamba shape (x|B|C convolution, SSD scan,
#: grouped gated RMSNorm): graphrt's Mamba2Mixer computes the same.
MAMBA2_MIXERS = frozenset({"GraniteMoeHybridMambaLayer", "BambaMixer"})
#: transformers' gated delta nets of Qwen3-Next's layout (grouped q|k|v|z and b|a projections).
DELTA_MIXERS = frozenset({"Qwen3NextGatedDeltaNet"})
#: Class-name fragments of recurrent mixers graphrt does not route (for the refusal).
RECURRENT_HINTS = ("Mamba", "Mixer", "DeltaNet", "LinearAttention", "ShortConv", "Recurrent")


class RoutedMixer(nn.Module):
    """Stands where transformers' mixer stood: ``hidden_states [1, T, hidden]`` (one packed row
    of the step's requests) -> ``[1, T, hidden]`` through graphrt's ``mixer``; transformers'
    cache and mask arguments are ignored (the state lives in graphrt's slots, the mask is None)."""

    def __init__(self, mixer: nn.Module, kind: str, source: str) -> None:
        super().__init__()
        self.mixer, self.kind, self.source = mixer, kind, source

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.mixer(hidden_states[0])[None]


def _check_silu(path: str, module: nn.Module) -> None:
    if getattr(module, "activation", "silu") not in ("silu", "swish"):
        raise ConfigError(f"{path} ({type(module).__name__}) convolves with activation {module.activation!r}; "
                          "graphrt's recurrent kernels apply SiLU")


def _mamba2(path: str, hf: nn.Module) -> Mamba2Mixer:
    """graphrt's Mamba2Mixer over ``hf``'s parameters."""
    _check_silu(path, hf)
    groups = int(hf.n_groups)
    c = SimpleNamespace(mamba_heads=int(hf.num_heads), mamba_head_dim=int(hf.head_dim), mamba_groups=groups,
                        mamba_state=int(hf.ssm_state_size), mamba_intermediate=int(hf.intermediate_size),
                        conv_dim=int(hf.conv_dim), chunk_size=int(hf.chunk_size),
                        time_step_limit=tuple(hf.time_step_limit or (0.0, float("inf"))),
                        hidden_size=int(hf.in_proj.in_features), mamba_bias=hf.in_proj.bias is not None,
                        conv_kernel=int(hf.conv_kernel_size), conv_bias=hf.conv1d.bias is not None,
                        mamba_norm_eps=float(hf.norm.variance_epsilon))
    want = c.mamba_intermediate + c.conv_dim + c.mamba_heads
    if hf.in_proj.out_features != want or c.mamba_heads * c.mamba_head_dim != c.mamba_intermediate:
        raise ConfigError(f"{path}: in_proj gives {hf.in_proj.out_features} features and {c.mamba_heads} heads x "
                          f"{c.mamba_head_dim}; graphrt's Mamba2 mixer needs gate|x|B|C|dt = {want} and heads x "
                          f"head_dim = intermediate ({c.mamba_intermediate})")
    if getattr(hf.norm, "group_size", c.mamba_intermediate // groups) * groups != c.mamba_intermediate:
        raise ConfigError(f"{path}: its gated norm's groups are not the mixer's {groups} groups")
    with torch.device("meta"):
        mixer = Mamba2Mixer(c)
    mixer.in_proj, mixer.conv1d, mixer.out_proj = hf.in_proj, hf.conv1d, hf.out_proj
    mixer.dt_bias, mixer.A_log, mixer.D = hf.dt_bias, hf.A_log, hf.D
    mixer.norm.weight = hf.norm.weight
    return _all_shared(path, mixer)


def _all_shared(path: str, mixer: nn.Module) -> nn.Module:
    """``mixer``, checked to hold no parameter of its own (each one transformers')."""
    own = [name for name, p in mixer.named_parameters() if p.is_meta]
    if own:
        raise ConfigError(f"{path}: graphrt's {type(mixer).__name__} has parameters {own} that the transformers "
                          "module does not provide")
    return mixer


def _delta(path: str, hf: nn.Module) -> GatedDeltaNet:
    """graphrt's GatedDeltaNet over ``hf``'s parameters."""
    _check_silu(path, hf)
    if hf.conv1d.bias is not None or hf.num_v_heads % hf.num_k_heads:
        raise ConfigError(f"{path}: a biased convolution or {hf.num_v_heads} value heads over {hf.num_k_heads} key "
                          "heads (not a multiple): graphrt's gated delta net has neither")
    c = SimpleNamespace(delta_key_heads=int(hf.num_k_heads), delta_value_heads=int(hf.num_v_heads),
                        delta_key_dim=int(hf.head_k_dim), delta_value_dim=int(hf.head_v_dim),
                        chunk_size=int(getattr(hf, "chunk_size", 64)), delta_conv_dim=int(hf.conv_dim),
                        conv_kernel=int(hf.conv_kernel_size), hidden_size=int(hf.hidden_size),
                        mamba_norm_eps=float(hf.norm.variance_epsilon))
    with torch.device("meta"):
        mixer = GatedDeltaNet(c, torch.float32)
    mixer.conv1d, mixer.in_proj_qkvz, mixer.in_proj_ba, mixer.out_proj = (hf.conv1d, hf.in_proj_qkvz, hf.in_proj_ba,
                                                                          hf.out_proj)
    mixer.dt_bias, mixer.A_log = hf.dt_bias, hf.A_log
    mixer.norm.weight = hf.norm.weight
    return _all_shared(path, mixer)


def _layer_of(path: str) -> int | None:
    """The decoder layer index in a module path (``model.layers.3.mamba`` -> 3)."""
    parts = path.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def recurrent_mixers(hf_model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """``(decoder layer, module path, module)`` of every routable recurrent mixer of ``hf_model``
    (transformers' own modules, not yet replaced), in layer order."""
    found = []
    for name, module in hf_model.named_modules():
        if type(module).__name__ in MAMBA2_MIXERS | DELTA_MIXERS:
            layer = _layer_of(name)
            if layer is None:
                raise ConfigError(f"{name} ({type(module).__name__}): cannot tell its decoder layer "
                                  "(no 'layers.<i>' in its path), which graphrt numbers its state slots by")
            found.append((layer, name, module))
    return sorted(found, key=lambda f: f[0])


def served_types(hf_model: nn.Module, config: Any, found: list[tuple[int, str, nn.Module]]) -> frozenset[str]:
    """The ``layer_types`` kinds the routable mixers ``found`` serve; a ConfigError naming the
    layers when ``config`` declares recurrent layers that none serves, or when a module that looks
    like a recurrent mixer is of no class graphrt routes."""
    types = list(getattr(config, "layer_types", None) or ())
    layers = {layer for layer, _, _ in found}
    routes = sorted(MAMBA2_MIXERS | DELTA_MIXERS)
    unserved = [i for i, kind in enumerate(types) if kind in RECURRENT_TYPES and i not in layers]
    if unserved:
        raise ConfigError(f"{type(hf_model).__name__}: layer_types marks layers {unserved} recurrent "
                          f"({sorted({types[i] for i in unserved})}), but their mixers are of no class graphrt routes "
                          f"to its recurrent kernels ({routes})")
    left = [f"{name} ({type(m).__name__})" for name, m in hf_model.named_modules()
            if any(h in type(m).__name__ for h in RECURRENT_HINTS) and hasattr(m, "conv1d")
            and type(m).__name__ not in MAMBA2_MIXERS | DELTA_MIXERS and not isinstance(m, (Mamba2Mixer, GatedDeltaNet))]
    if left:
        raise ConfigError(f"{type(hf_model).__name__}: recurrent mixers {left} are of no class graphrt routes to its "
                          f"recurrent kernels ({routes}): their state would live in transformers' own cache, which "
                          "graphrt's packed steps cannot keep per request")
    return frozenset(types[i] for i in layers if i < len(types))


def route_recurrent_mixers(hf_model: nn.Module, found: list[tuple[int, str, nn.Module]]) -> list[RoutedMixer]:
    """Replace each mixer of ``found`` (:func:`recurrent_mixers`) in ``hf_model`` by a
    :class:`RoutedMixer` over the same parameters; those, in layer order."""
    routed = []
    for _, name, module in found:
        kind = "mamba2" if type(module).__name__ in MAMBA2_MIXERS else "gated_delta_net"
        mixer = _mamba2(name, module) if kind == "mamba2" else _delta(name, module)
        parent_name, _, child = name.rpartition(".")
        wrapper = RoutedMixer(mixer, kind, f"{name} ({type(module).__name__})")
        setattr(hf_model.get_submodule(parent_name), child, wrapper)
        routed.append(wrapper)
    return routed


def state_spec_of(routed: list[RoutedMixer]) -> StateSpec:
    """One state group per mixer kind and layout (indices into the routed mixers), as graphrt's
    reference hybrids declare it: a convolution window and an SSM / delta-rule matrix each."""
    groups: dict[tuple, list[int]] = {}
    for i, wrapper in enumerate(routed):
        names = ("conv", "ssm") if wrapper.kind == "mamba2" else ("conv", "delta")
        tensors = tuple(StateTensor(name, shape) for name, shape in zip(names, wrapper.mixer.state_shapes()))
        groups.setdefault((wrapper.kind, tensors), []).append(i)
    return StateSpec(tuple(StateGroup(tuple(layers), tensors, kind) for (kind, tensors), layers in groups.items()))


__all__ = ["DELTA_MIXERS", "MAMBA2_MIXERS", "RECURRENT_TYPES", "RoutedMixer", "recurrent_mixers",
           "route_recurrent_mixers", "served_types", "state_spec_of"]
