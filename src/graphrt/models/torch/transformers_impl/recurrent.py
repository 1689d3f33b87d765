"""Stock transformers hybrid mixers routed to graphrt's recurrent kernels and state slots.

A transformers hybrid (Granite-4-H, Bamba, Nemotron-H, Falcon-H1, Zamba2, Qwen3-Next, Jamba,
RecurrentGemma, MiniMax), recurrent model (Mamba, Falcon-Mamba) or short-convolution model (LFM2)
keeps recurrent state in its own per-sequence ``Cache``, unusable for graphrt's packed rows.
:func:`route_recurrent_mixers` replaces each recurrent mixer with a :class:`RoutedMixer` around
graphrt's own module for that kind (:class:`Mamba2Mixer`, :class:`GatedDeltaNet`,
:class:`Mamba1Mixer`, :class:`ShortConvMixer`, :class:`RGLRUMixer`, :class:`LightningAttentionMixer`)
sharing the transformers parameters; these read their ``state_cache`` slots and are the
PIECEWISE split points. Only classes whose computation graphrt reproduces are routed
(:data:`MAMBA2_MIXERS`, :data:`DELTA_MIXERS`, :data:`MAMBA1_MIXERS`, :data:`SHORT_CONV_MIXERS`,
:data:`RG_LRU_MIXERS`, :data:`LIGHTNING_MIXERS`);
any other recurrent layer is refused by :func:`served_types` (naming the kernel graphrt lacks for
the stock classes of :data:`MISSING_KERNELS`).

Most of these models' classes do not declare ``_supports_attention_backend``: the loader takes
them all the same when their modeling module defines a routed mixer class
(:func:`routed_mixer_classes`, logged), and :func:`check_attention_routed` then requires every
layer that ``layer_types`` marks as attention to have called transformers' AttentionInterface in
the layer probe -- what the flag would have promised. See docs/hybrid.md.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any, Sequence

import torch
from torch import nn

from graphrt.core.errors import ConfigError
from graphrt.core.state_spec import StateGroup, StateSpec, StateTensor
from graphrt.models.torch.lightning import LightningAttentionMixer
from graphrt.models.torch.mamba1 import Mamba1Mixer
from graphrt.models.torch.transformers_impl.facts import FULL_TYPES, HYBRID_TYPES, SLIDING_TYPES, layer_of_path
from graphrt.models.torch.mamba2 import Mamba2Mixer
from graphrt.models.torch.qwen3_next import GatedDeltaNet
from graphrt.models.torch.rg_lru import ACTIVATIONS, RGLRUMixer
from graphrt.models.torch.short_conv import ShortConvMixer

#: ``layer_types`` entries of recurrent layers that a routed mixer can serve.
RECURRENT_TYPES = frozenset({"mamba", "linear_attention", "conv"})
#: transformers' Mamba2 mixers of the Granite-4-H / Bamba shape (x|B|C convolution, SSD scan,
#: grouped gated RMSNorm): graphrt's Mamba2Mixer computes the same; Nemotron-H's and Zamba2's
#: are of that shape too, Falcon-H1's adds µP multipliers and its own gating (:func:`_mamba2`).
MAMBA2_MIXERS = frozenset({"GraniteMoeHybridMambaLayer", "BambaMixer", "NemotronHMamba2Mixer", "Zamba2MambaMixer",
                           "FalconH1Mixer"})
#: transformers' gated delta nets of Qwen3-Next's layout (grouped q|k|v|z and b|a projections).
DELTA_MIXERS = frozenset({"Qwen3NextGatedDeltaNet"})
#: transformers' Mamba1 mixers (selective scan): Mamba's, Falcon-Mamba's (unweighted RMS norms of
#: dt, B and C) and Jamba's (weighted ones).
MAMBA1_MIXERS = frozenset({"MambaMixer", "FalconMambaMixer", "JambaMambaMixer"})
#: LFM2's gated short convolutions (``conv`` layers): ``out_proj(C * conv(B * x))``, no activation.
SHORT_CONV_MIXERS = frozenset({"Lfm2ShortConv", "Lfm2MoeShortConv"})
#: RecurrentGemma's recurrent blocks (``linear_attention`` layers): a convolution without
#: activation then the RG-LRU, gated by ``act(linear_y(h))``; they return ``(hidden, None)``.
RG_LRU_MIXERS = frozenset({"RecurrentGemmaRecurrentBlock"})
#: MiniMax's lightning attention (``linear_attention`` layers): linear attention with a fixed decay
#: per head, an RMS norm over the heads and an output gate; they return ``(hidden, kv)``.
LIGHTNING_MIXERS = frozenset({"MiniMaxLightningAttention"})
#: Kinds whose transformers modules return ``(hidden, second)`` (:class:`RoutedMixer`'s ``pair``).
PAIRED_KINDS = frozenset({"rg_lru", "lightning_attention"})
#: The names of each kind's state tensors (the state spec's, in the module's ``state_shapes()`` order).
STATE_NAMES = {"mamba2": ("conv", "ssm"), "gated_delta_net": ("conv", "delta"), "mamba1": ("conv", "ssm"),
               "short_conv": ("conv",), "rg_lru": ("conv", "lru"), "lightning_attention": ("kv",)}
#: Stock recurrent mixers graphrt does not route yet -> the kernel it lacks (named in the refusal).
MISSING_KERNELS: dict[str, str] = {}
#: Class-name fragments of recurrent mixers graphrt does not route (for the refusal).
RECURRENT_HINTS = ("Mamba", "Mixer", "DeltaNet", "LinearAttention", "ShortConv", "Recurrent")


class RoutedMixer(nn.Module):
    """Stands where transformers' mixer stood: ``hidden_states [1, T, hidden]`` (one packed row
    of the step's requests) -> ``[1, T, hidden]`` through graphrt's ``mixer``; transformers'
    cache and mask arguments are ignored (the state lives in graphrt's slots, the mask is None).
    ``pair``: return ``(hidden, None)``, as RecurrentGemma's blocks and MiniMax's lightning
    attention do (the second item, unused by their decoder layers)."""

    def __init__(self, mixer: nn.Module, kind: str, source: str, pair: bool = False) -> None:
        super().__init__()
        self.mixer, self.kind, self.source, self.pair = mixer, kind, source, pair

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = self.mixer(hidden_states[0])[None]
        return (out, None) if self.pair else out


def _check_silu(path: str, module: nn.Module) -> None:
    if getattr(module, "activation", "silu") not in ("silu", "swish"):
        raise ConfigError(f"{path} ({type(module).__name__}) convolves with activation {module.activation!r}; "
                          "graphrt's recurrent kernels apply SiLU")


def _mamba2_gate(path: str, hf: nn.Module) -> tuple[str, float]:
    """How ``hf`` gates its scan's output (one of ``mamba2.GATES``) and its norm's epsilon: a
    grouped norm of ``y * silu(z)``, Falcon-H1's ``mamba_norm_before_gate`` norm of ``y`` times
    ``silu(z)``, or Falcon-H1's ``y * silu(z)`` without a norm (``mamba_rms_norm=False``)."""
    if isinstance(hf.norm, nn.Identity) and not getattr(hf, "mamba_rms_norm", True):
        return "gate", 1e-6
    eps = float(hf.norm.variance_epsilon)
    return ("gate_after_norm" if getattr(hf.norm, "norm_before_gate", False) else "norm_gated"), eps


def _mamba2(path: str, hf: nn.Module) -> Mamba2Mixer:
    """graphrt's Mamba2Mixer over ``hf``'s parameters; Falcon-H1's input multiplier
    (``ssm_in_multiplier``) and µP vector (``mup_vector``, a buffer) carried over."""
    _check_silu(path, hf)
    groups = int(hf.n_groups)
    gate, eps = _mamba2_gate(path, hf)
    mup = getattr(hf, "mup_vector", None)
    c = SimpleNamespace(mamba_heads=int(hf.num_heads), mamba_head_dim=int(hf.head_dim), mamba_groups=groups,
                        mamba_state=int(hf.ssm_state_size), mamba_intermediate=int(hf.intermediate_size),
                        conv_dim=int(hf.conv_dim), chunk_size=int(hf.chunk_size),
                        time_step_limit=tuple(hf.time_step_limit or (0.0, float("inf"))),
                        hidden_size=int(hf.in_proj.in_features), mamba_bias=hf.in_proj.bias is not None,
                        conv_kernel=int(hf.conv_kernel_size), conv_bias=hf.conv1d.bias is not None,
                        mamba_norm_eps=eps, mamba_gate=gate,
                        mamba_in_scale=float(getattr(hf, "ssm_in_multiplier", 1.0)),
                        mamba_proj_scaled=mup is not None)
    want = c.mamba_intermediate + c.conv_dim + c.mamba_heads
    if hf.in_proj.out_features != want or c.mamba_heads * c.mamba_head_dim != c.mamba_intermediate:
        raise ConfigError(f"{path}: in_proj gives {hf.in_proj.out_features} features and {c.mamba_heads} heads x "
                          f"{c.mamba_head_dim}; graphrt's Mamba2 mixer needs gate|x|B|C|dt = {want} and heads x "
                          f"head_dim = intermediate ({c.mamba_intermediate})")
    if gate != "gate" and (getattr(hf.norm, "group_size", c.mamba_intermediate // groups) * groups
                           != c.mamba_intermediate or getattr(hf.norm, "n_groups", groups) != groups):
        raise ConfigError(f"{path}: its gated norm's groups are not the mixer's {groups} groups")
    with torch.device("meta"):
        mixer = Mamba2Mixer(c)
    mixer.in_proj, mixer.conv1d, mixer.out_proj = hf.in_proj, hf.conv1d, hf.out_proj
    mixer.dt_bias, mixer.A_log, mixer.D = hf.dt_bias, hf.A_log, hf.D
    if mixer.norm is not None:
        mixer.norm.weight = hf.norm.weight
    if mup is not None:
        if mup.numel() != hf.in_proj.out_features:
            raise ConfigError(f"{path}: its mup_vector has {mup.numel()} entries, its in_proj "
                              f"{hf.in_proj.out_features} features")
        mixer.proj_scale = mup.detach().reshape(-1).clone()
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


def _mamba1(path: str, hf: nn.Module) -> Mamba1Mixer:
    """graphrt's Mamba1Mixer over ``hf``'s parameters (Mamba's, Falcon-Mamba's or Jamba's)."""
    _check_silu(path, hf)
    norm, eps = "none", 1e-6
    if hasattr(hf, "dt_layernorm"):
        ln = hf.dt_layernorm
        norm = "weighted" if isinstance(getattr(ln, "weight", None), nn.Parameter) else "unweighted"
        eps = float(getattr(ln, "variance_epsilon", getattr(ln, "eps", eps)))
    c = SimpleNamespace(hidden_size=int(hf.in_proj.in_features), intermediate=int(hf.intermediate_size),
                        d_state=int(hf.ssm_state_size), dt_rank=int(hf.time_step_rank),
                        conv_kernel=int(hf.conv_kernel_size), use_bias=hf.in_proj.bias is not None,
                        conv_bias=hf.conv1d.bias is not None, norm=norm, norm_eps=eps)
    if hf.x_proj.out_features != c.dt_rank + 2 * c.d_state or tuple(hf.A_log.shape) != (c.intermediate, c.d_state):
        raise ConfigError(f"{path}: x_proj gives {hf.x_proj.out_features} features and A_log is "
                          f"{tuple(hf.A_log.shape)}; graphrt's Mamba1 mixer needs dt|B|C = {c.dt_rank + 2 * c.d_state} "
                          f"and A_log [{c.intermediate}, {c.d_state}]")
    with torch.device("meta"):
        mixer = Mamba1Mixer(c)
    mixer.in_proj, mixer.conv1d, mixer.x_proj, mixer.dt_proj, mixer.out_proj = (hf.in_proj, hf.conv1d, hf.x_proj,
                                                                                hf.dt_proj, hf.out_proj)
    mixer.A_log, mixer.D = hf.A_log, hf.D
    if norm == "weighted":
        for name in ("dt_layernorm", "b_layernorm", "c_layernorm"):
            getattr(mixer, name).weight = getattr(hf, name).weight
    return _all_shared(path, mixer)


def routed_kinds() -> dict[str, str]:
    """Every routed class name -> the kind graphrt's module for it declares in the state spec
    (read from the class sets at each call)."""
    return {**{name: "mamba2" for name in MAMBA2_MIXERS}, **{name: "gated_delta_net" for name in DELTA_MIXERS},
            **{name: "mamba1" for name in MAMBA1_MIXERS}, **{name: "short_conv" for name in SHORT_CONV_MIXERS},
            **{name: "rg_lru" for name in RG_LRU_MIXERS},
            **{name: "lightning_attention" for name in LIGHTNING_MIXERS}}


def _short_conv(path: str, hf: nn.Module) -> ShortConvMixer:
    """graphrt's ShortConvMixer over ``hf``'s parameters (LFM2's ``conv`` layers)."""
    h = int(hf.in_proj.in_features)
    if hf.in_proj.out_features != 3 * h or hf.conv.in_channels != h or hf.conv.groups != h:
        raise ConfigError(f"{path}: in_proj gives {hf.in_proj.out_features} features and the convolution "
                          f"{hf.conv.in_channels} channels in {hf.conv.groups} groups; graphrt's short convolution "
                          f"needs B|C|x = {3 * h} and a depthwise convolution of {h} channels")
    c = SimpleNamespace(hidden_size=h, conv_kernel=int(hf.conv.kernel_size[0]), bias=hf.in_proj.bias is not None)
    if (hf.conv.bias is not None) != c.bias or (hf.out_proj.bias is not None) != c.bias:
        raise ConfigError(f"{path}: its projections and convolution disagree on biases; graphrt's short convolution "
                          "has all or none")
    with torch.device("meta"):
        mixer = ShortConvMixer(c)
    mixer.in_proj, mixer.conv, mixer.out_proj = hf.in_proj, hf.conv, hf.out_proj
    return _all_shared(path, mixer)


def _rg_lru(path: str, hf: nn.Module) -> RGLRUMixer:
    """graphrt's RGLRUMixer over ``hf``'s parameters (RecurrentGemma's recurrent blocks)."""
    lru, conv = hf.rg_lru, hf.conv_1d
    w = int(hf.linear_x.out_features)
    act = getattr(getattr(hf, "config", None), "hidden_activation", None) or _activation_name(hf.act_fn)
    if conv.in_channels != w or conv.groups != w or conv.bias is None or tuple(lru.recurrent_param.shape) != (w,):
        raise ConfigError(f"{path}: its convolution has {conv.in_channels} channels in {conv.groups} groups (bias: "
                          f"{conv.bias is not None}) and recurrent_param {tuple(lru.recurrent_param.shape)}; graphrt's "
                          f"RG-LRU block needs a biased depthwise convolution of lru_width = {w} channels")
    c = SimpleNamespace(hidden_size=int(hf.linear_x.in_features), lru_width=w, heads=int(lru.num_attention_heads),
                        conv_kernel=int(conv.kernel_size[0]), activation=act)
    with torch.device("meta"):
        mixer = RGLRUMixer(c)
    mixer.linear_y, mixer.linear_x, mixer.linear_out, mixer.conv_1d = hf.linear_y, hf.linear_x, hf.linear_out, conv
    for name in ("recurrent_param", "input_gate_weight", "input_gate_bias", "recurrent_gate_weight",
                 "recurrent_gate_bias"):
        setattr(mixer.rg_lru, name, getattr(lru, name))
    return _all_shared(path, mixer)


def _lightning(path: str, hf: nn.Module) -> LightningAttentionMixer:
    """graphrt's LightningAttentionMixer over ``hf``'s parameters and decay rates (MiniMax's
    ``linear_attention`` layers)."""
    heads, d = int(hf.num_attention_heads), int(hf.head_dim)
    slope = hf.slope_rate
    if (hf.qkv_proj.out_features != 3 * heads * d or hf.output_gate.out_features != heads * d
            or slope.numel() != heads or any(m.bias is not None for m in (hf.qkv_proj, hf.output_gate, hf.out_proj))):
        raise ConfigError(f"{path}: qkv_proj gives {hf.qkv_proj.out_features} features, output_gate "
                          f"{hf.output_gate.out_features}, slope_rate has {slope.numel()} entries; graphrt's lightning "
                          f"attention needs q|k|v = {3 * heads * d}, heads x head_dim = {heads * d}, one decay rate "
                          f"per head ({heads}) and unbiased projections")
    c = SimpleNamespace(hidden_size=int(hf.qkv_proj.in_features), heads=heads, head_dim=d,
                        activation=_activation_name(hf.act_fn, "lightning attention"),
                        norm_eps=float(hf.norm.variance_epsilon), chunk_size=int(hf.block_size))
    with torch.device("meta"):
        mixer = LightningAttentionMixer(c)
    mixer.qkv_proj, mixer.output_gate, mixer.out_proj = hf.qkv_proj, hf.output_gate, hf.out_proj
    mixer.norm.weight = hf.norm.weight
    mixer.slope_rate = slope.detach().reshape(heads)
    return _all_shared(path, mixer)


def _activation_name(act: nn.Module, what: str = "RG-LRU block") -> str:
    """transformers' name of the activation module ``act`` (a ConfigError for one graphrt lacks)."""
    names = {"PytorchGELUTanh": "gelu_pytorch_tanh", "GELUTanh": "gelu_pytorch_tanh", "GELUActivation": "gelu",
             "SiLUActivation": "silu", "SiLU": "silu", "ReLU": "relu"}
    name = names.get(type(act).__name__)
    if name is None or name not in ACTIVATIONS:
        raise ConfigError(f"{what}: activation {type(act).__name__} is not one graphrt applies "
                          f"({sorted(ACTIVATIONS)})")
    return name


def recurrent_mixers(hf_model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """``(decoder layer, module path, module)`` of every routable recurrent mixer of ``hf_model``
    (transformers' own modules, not yet replaced), in layer order."""
    found, kinds = [], routed_kinds()
    for name, module in hf_model.named_modules():
        if type(module).__name__ in kinds:
            layer = layer_of_path(name)
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
    kinds = routed_kinds()
    routes = sorted(kinds)
    unserved = [i for i, kind in enumerate(types) if kind in RECURRENT_TYPES and i not in layers]
    if unserved:
        lacking = sorted({f"{type(m).__name__} needs {MISSING_KERNELS[type(m).__name__]}"
                          for name, m in hf_model.named_modules()
                          if type(m).__name__ in MISSING_KERNELS and layer_of_path(name) in unserved})
        raise ConfigError(f"{type(hf_model).__name__}: layer_types marks layers {unserved} recurrent "
                          f"({sorted({types[i] for i in unserved})}), but their mixers are of no class graphrt routes "
                          f"to its recurrent kernels ({routes})" + (f": {'; '.join(lacking)}" if lacking else ""))
    left = [f"{name} ({type(m).__name__})" for name, m in hf_model.named_modules()
            if any(h in type(m).__name__ for h in RECURRENT_HINTS) and hasattr(m, "conv1d")
            and type(m).__name__ not in kinds
            and not isinstance(m, (Mamba2Mixer, GatedDeltaNet, Mamba1Mixer, ShortConvMixer, RGLRUMixer,
                                   LightningAttentionMixer))]
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
        kind = routed_kinds()[type(module).__name__]
        mixer = {"mamba2": _mamba2, "gated_delta_net": _delta, "mamba1": _mamba1, "short_conv": _short_conv,
                 "rg_lru": _rg_lru, "lightning_attention": _lightning}[kind](name, module)
        parent_name, _, child = name.rpartition(".")
        wrapper = RoutedMixer(mixer, kind, f"{name} ({type(module).__name__})", pair=kind in PAIRED_KINDS)
        setattr(hf_model.get_submodule(parent_name), child, wrapper)
        routed.append(wrapper)
    return routed


def state_spec_of(routed: list[RoutedMixer]) -> StateSpec:
    """One state group per mixer kind and layout (indices into the routed mixers), as graphrt's
    reference hybrids declare it: a convolution window and an SSM / delta-rule matrix each."""
    groups: dict[tuple, list[int]] = {}
    for i, wrapper in enumerate(routed):
        tensors = tuple(StateTensor(name, shape) for name, shape in zip(STATE_NAMES[wrapper.kind],
                                                                        wrapper.mixer.state_shapes()))
        groups.setdefault((wrapper.kind, tensors), []).append(i)
    return StateSpec(tuple(StateGroup(tuple(layers), tensors, kind) for (kind, tensors), layers in groups.items()))


def routed_mixer_classes(cls: type) -> list[str]:
    """The routed mixer classes (:func:`routed_kinds`) that ``cls``'s modeling module defines: a model
    class without ``_supports_attention_backend`` is loaded when there is one (module docstring)."""
    module = sys.modules.get(getattr(cls, "__module__", ""))
    return sorted(name for name in routed_kinds()
                  if module is not None and isinstance(getattr(module, name, None), type))


def check_attention_routed(hf_model: nn.Module, config: Any, attended: Sequence[int]) -> None:
    """For a class that does not declare ``_supports_attention_backend``: every layer that
    ``config.layer_types`` marks as attention is one of ``attended`` (the layers whose attention
    called graphrt's in the layer probe), or a ConfigError naming the layers that attend on their
    own (their attention would run without graphrt's KV cache)."""
    if getattr(type(hf_model), "_supports_attention_backend", False):
        return
    name = type(hf_model).__name__
    types = getattr(config, "layer_types", None)
    if types is None:
        raise ConfigError(f"{name} does not declare _supports_attention_backend and its config has no layer_types: "
                          "graphrt cannot check that each of its attention layers goes through AttentionInterface")
    want = [i for i, kind in enumerate(types) if kind in FULL_TYPES | SLIDING_TYPES | HYBRID_TYPES]
    missing = sorted(set(want) - set(attended))
    if missing:
        raise ConfigError(f"{name} does not declare _supports_attention_backend, and its layers {missing} (attention "
                          "by layer_types) never called AttentionInterface in graphrt's layer probe: they attend on "
                          "their own, without graphrt's paged KV cache")


__all__ = ["DELTA_MIXERS", "LIGHTNING_MIXERS", "MAMBA1_MIXERS", "MAMBA2_MIXERS", "MISSING_KERNELS", "PAIRED_KINDS",
           "RECURRENT_TYPES", "RG_LRU_MIXERS", "RoutedMixer", "SHORT_CONV_MIXERS", "check_attention_routed",
           "recurrent_mixers", "route_recurrent_mixers", "routed_kinds", "routed_mixer_classes", "served_types",
           "state_spec_of"]
