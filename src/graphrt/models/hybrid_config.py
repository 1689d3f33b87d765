"""The architecture facts graphrt's hybrid reference models read from a Hugging Face ``config.json``.

Hybrid models mix attention with recurrent layers (docs/hybrid.md): Mamba2
(``Mamba2ForCausalLM``, every layer a Mamba2 mixer, no attention), Granite-4-H
(``GraniteMoeHybridForCausalLM``: Mamba2 and attention layers, a shared MLP and optional
experts, Granite's multipliers), Qwen3-Next (``Qwen3NextForCausalLM``: gated delta-net and
gated attention layers, experts with a shared expert), Mamba and Falcon-Mamba
(``MambaForCausalLM``, ``FalconMambaForCausalLM``: every layer a Mamba1 mixer; Falcon-Mamba
RMS-normalises dt, B and C), LFM2 (``Lfm2ForCausalLM``: short convolutions and attention
layers, a SwiGLU MLP) and Jamba (``JambaForCausalLM``: Mamba1 layers with weighted dt / B / C
norms, attention without rotary, experts every ``expert_layer_period``-th layer) and
RecurrentGemma (``RecurrentGemmaForCausalLM``: RG-LRU blocks and local attention, soft-capped
logits), MiniMax (``MiniMaxForCausalLM``: lightning attention and attention layers, every
MLP experts, residuals from the normed hidden states with per-part factors), and -- with Mamba2
mixers -- Nemotron-H (``NemotronHForCausalLM``: Mamba2, attention without rotary, relu² MLP and
sigmoid-routed relu² expert blocks, each its own layer) and Falcon-H1 (``FalconH1ForCausalLM``:
attention beside a Mamba2 mixer in every layer, µP multipliers) and Zamba2
(``Zamba2ForCausalLM``: Mamba2 layers, some of them first running a shared attention + MLP block
on the hidden state beside the embeddings, each use with its own KV cache and adapters).
Shared by the torch and the JAX models (graphrt's torch models implement
:data:`TORCH_HYBRID_ARCHITECTURES`; the others run on xla only: on the torch backends they go
through the Transformers backend); framework-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphrt.core.errors import InputError
from graphrt.core.kv_spec import KVCacheGroup, KVCacheSpec
from graphrt.core.state_spec import StateGroup, StateSpec, StateTensor

#: The hybrid architectures graphrt's own torch models implement.
TORCH_HYBRID_ARCHITECTURES = ("Mamba2ForCausalLM", "GraniteMoeHybridForCausalLM", "Qwen3NextForCausalLM")
#: Every hybrid architecture of graphrt's own models (the JAX models implement all of them).
HYBRID_ARCHITECTURES = TORCH_HYBRID_ARCHITECTURES + ("MambaForCausalLM", "FalconMambaForCausalLM", "Lfm2ForCausalLM",
                                                     "JambaForCausalLM", "RecurrentGemmaForCausalLM",
                                                     "MiniMaxForCausalLM")
#: The Mamba2 hybrids with JAX models only (on torch backends transformers' model runs, its mixers routed).
MAMBA2_JAX_ARCHITECTURES = ("NemotronHForCausalLM", "FalconH1ForCausalLM", "Zamba2ForCausalLM")
HYBRID_ARCHITECTURES += MAMBA2_JAX_ARCHITECTURES
MAMBA, ATTENTION, DELTA = "mamba", "attention", "gated_delta_net"
MAMBA1, SHORT_CONV, RG_LRU = "mamba1", "short_conv", "rg_lru"
LIGHTNING = "lightning_attention"
#: Nemotron-H's feed-forward layers (a norm and an MLP / experts block; no attention, no state).
FFN, MOE = "mlp", "moe"
_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}


@dataclass(frozen=True)
class HybridConfig:
    """A hybrid decoder as graphrt's reference models see it. ``layer_kinds``: per layer
    ``mamba``, ``attention``, ``gated_delta_net``, ``mamba1``, ``short_conv``, ``rg_lru``,
    ``lightning_attention``, ``mlp`` or ``moe`` (Nemotron-H's feed-forward layers);
    ``mamba_attention_layers``: Mamba2 layers that attend too (Falcon-H1's beside the mixer;
    Zamba2's hybrid layers through their shared block first)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_kinds: tuple[str, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    torch_dtype: str
    max_position_embeddings: int
    eos_token_id: tuple[int, ...]
    # attention layers
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    attention_bias: bool = False
    attention_scale: float | None = None          # None: head_dim ** -0.5
    rope_theta: float | None = None               # None: no rotary (Granite's position_embedding_type None)
    rotary_dim: int = 0                           # rotated features of a head (Qwen3-Next: a quarter)
    qk_norm: bool = False
    attention_output_gate: bool = False
    # Mamba2 layers
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0
    mamba_groups: int = 1
    conv_kernel: int = 4
    mamba_intermediate: int = 0
    chunk_size: int = 256
    conv_bias: bool = True
    mamba_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    mamba_norm_eps: float = 1e-6
    # gated delta-net layers (Qwen3-Next)
    delta_key_heads: int = 0
    delta_value_heads: int = 0
    delta_key_dim: int = 0
    delta_value_dim: int = 0
    # Mamba1 layers (their width, state, kernel and biases are the Mamba2 fields above)
    dt_rank: int = 0
    scan_norm: str = "none"              # RMS norms of dt, B, C: "unweighted" (Falcon-Mamba), "weighted" (Jamba)
    scan_norm_eps: float = 1e-6
    # the MLP after each mixer: "none" (Mamba, Mamba2), "granite" (shared MLP + experts), "qwen3_next",
    # "lfm2" (SwiGLU: w1, w3, w2), "jamba" (SwiGLU, or experts in ``moe_layers``)
    mlp: str = "none"
    intermediate_size: int = 0
    shared_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()               # Jamba: the layers whose MLP is experts
    # RecurrentGemma: RG-LRU blocks of lru_width channels, local attention, GeLU branches
    lru_width: int = 0
    sliding_window: int = 0                        # > 0: attention sees the last W positions
    activation: str = "silu"
    logits_soft_cap: float = 0.0                   # > 0: logits = cap * tanh(logits / cap)
    # multipliers (Granite)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    #: Qwen3-Next's norms scale by ``1 + weight`` (weights stored around 0).
    zero_centered_norm: bool = False
    #: MiniMax: the residual of each part is its normed input, ``alpha * normed + beta * out``
    #: with ``(part, alpha, beta)`` per part (a layer kind or "mlp"); empty: ``x + out``.
    residual_factors: tuple[tuple[str, float, float], ...] = ()
    # Mamba2 hybrids of JAX models only (Nemotron-H, Falcon-H1)
    mamba_attention_layers: tuple[int, ...] = ()  # Mamba2 layers with attention beside the mixer (Falcon-H1)
    mamba_gate: str = "norm_gated"                # rmsnorm(y * silu(z)); "gate_after_norm": rmsnorm(y) * silu(z);
    #                                               "gate": y * silu(z) without norm (Falcon-H1's two options)
    mamba_in_scale: float = 1.0                   # Falcon-H1's ssm_in_multiplier (on the mixer's input)
    mamba_proj_scales: tuple[float, ...] = ()     # Falcon-H1's ssm_multipliers: z, x, B, C, dt of in_proj
    ssm_out_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    key_multiplier: float = 1.0
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)  # Falcon-H1: on the gate's input, on the MLP's output
    lm_head_multiplier: float = 1.0
    routed_scaling_factor: float = 1.0            # Nemotron-H's router: sigmoid scores, grouped top-k
    expert_groups: int = 1
    topk_groups: int = 1
    shared_blocks: int = 0                        # Zamba2: its shared blocks (num_mem_blocks), used in turn
    shared_attention_adapters: bool = False       # Zamba2: per-use LoRA adapters on q / k / v

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds)
                     if kind == ATTENTION or i in self.mamba_attention_layers)

    @property
    def state_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind not in (ATTENTION, FFN, MOE))

    @property
    def conv_dim(self) -> int:
        """Channels of a Mamba2 layer's convolution: x, B and C."""
        return self.mamba_intermediate + 2 * self.mamba_groups * self.mamba_state

    @property
    def delta_conv_dim(self) -> int:
        """Channels of a gated delta-net layer's convolution: q, k and v."""
        return 2 * self.delta_key_heads * self.delta_key_dim + self.delta_value_heads * self.delta_value_dim

    def kv_cache_spec(self) -> KVCacheSpec:
        """One group of every attention layer (indices into ``attention_layers()``); no group for
        a model without attention (a pure Mamba2)."""
        n = len(self.attention_layer_ids)
        return KVCacheSpec((KVCacheGroup(tuple(range(n)), self.num_key_value_heads, self.head_dim),) if n else ())

    def state_spec(self) -> StateSpec:
        """Per recurrent layer (indices into ``state_layers()``): its convolution window and its
        SSM / delta-rule matrix, in the weights' dtype."""
        kinds = [self.layer_kinds[i] for i in self.state_layer_ids]
        window = self.conv_kernel - 1
        tensors = {
            MAMBA: (StateTensor("conv", (self.conv_dim, window)),
                    StateTensor("ssm", (self.mamba_heads, self.mamba_head_dim, self.mamba_state))),
            DELTA: (StateTensor("conv", (self.delta_conv_dim, window)),
                    StateTensor("delta", (self.delta_value_heads, self.delta_key_dim, self.delta_value_dim))),
            MAMBA1: (StateTensor("conv", (self.mamba_intermediate, window)),
                     StateTensor("ssm", (self.mamba_intermediate, self.mamba_state))),
            SHORT_CONV: (StateTensor("conv", (self.hidden_size, window)),),
            RG_LRU: (StateTensor("conv", (self.lru_width, window)), StateTensor("lru", (self.lru_width,))),
            LIGHTNING: (StateTensor("kv", (self.num_attention_heads, self.head_dim, self.head_dim)),),
        }
        groups = []
        for kind, layout in tensors.items():
            layers = tuple(j for j, k in enumerate(kinds) if k == kind)
            if layers:
                groups.append(StateGroup(layers, layout, kind))
        return StateSpec(tuple(groups))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "HybridConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in HYBRID_ARCHITECTURES), None)
        if arch is None:
            raise InputError("architectures", f"{archs} is not one of graphrt's hybrid models {list(HYBRID_ARCHITECTURES)}")
        eos = raw.get("eos_token_id")
        common = dict(architecture=arch, vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
                      num_hidden_layers=int(raw.get("num_hidden_layers") or 0),
                      tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                      torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                      max_position_embeddings=int(raw.get("max_position_embeddings") or 1 << 20),
                      eos_token_id=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)))
        if arch == "Mamba2ForCausalLM":
            return cls(**common, **_mamba2(raw))
        if arch == "GraniteMoeHybridForCausalLM":
            return cls(**common, **_granite(raw))
        if arch in ("MambaForCausalLM", "FalconMambaForCausalLM"):
            return cls(**common, **_mamba1(raw, falcon=arch == "FalconMambaForCausalLM"))
        if arch == "Lfm2ForCausalLM":
            return cls(**common, **_lfm2(raw))
        if arch == "JambaForCausalLM":
            return cls(**common, **_jamba(raw))
        if arch == "RecurrentGemmaForCausalLM":
            return cls(**common, **_recurrent_gemma(raw))
        if arch == "MiniMaxForCausalLM":
            return cls(**common, **_minimax(raw))
        if arch == "NemotronHForCausalLM":           # its layer count is its block list's length
            fields = _nemotron_h(raw)
            return cls(**{**common, "num_hidden_layers": len(fields["layer_kinds"])}, **fields)
        if arch == "FalconH1ForCausalLM":
            return cls(**common, **_falcon_h1(raw))
        if arch == "Zamba2ForCausalLM":
            return cls(**common, **_zamba2(raw))
        from graphrt.models.qwen3_next_config import qwen3_next_fields
        return cls(**common, **qwen3_next_fields(raw))


def _number(value: Any) -> float:
    """A float of config.json: a number, or transformers' ``{"__float__": "Infinity"}``."""
    return float(value["__float__"]) if isinstance(value, dict) and "__float__" in value else float(value)


def _limit(raw: dict[str, Any]) -> tuple[float, float]:
    limit = raw.get("time_step_limit") or (0.0, math.inf)
    return _number(limit[0]), _number(limit[1])


def _rope_theta(raw: dict[str, Any]) -> float:
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) not in (None, "default"):
        raise InputError("rope_parameters", f"{rope} not supported (only default rotary)")
    return float(raw.get("rope_theta", rope.get("rope_theta", 10000.0)))


def _mamba2(raw: dict[str, Any]) -> dict[str, Any]:
    heads, head_dim = int(raw["num_heads"]), int(raw["head_dim"])
    layers = int(raw["num_hidden_layers"])
    if int(raw.get("expand", 2)) * int(raw["hidden_size"]) != heads * head_dim:
        raise InputError("num_heads", f"{heads} heads of {head_dim} != expand * hidden_size")
    return dict(layer_kinds=(MAMBA,) * layers, rms_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
                mamba_heads=heads, mamba_head_dim=head_dim, mamba_state=int(raw["state_size"]),
                mamba_groups=int(raw.get("n_groups", 1)), conv_kernel=int(raw.get("conv_kernel", 4)),
                mamba_intermediate=heads * head_dim, chunk_size=int(raw.get("chunk_size", 256)),
                conv_bias=bool(raw.get("use_conv_bias", True)), mamba_bias=bool(raw.get("use_bias", False)),
                time_step_limit=_limit(raw), mamba_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)))


def _mamba1(raw: dict[str, Any], falcon: bool) -> dict[str, Any]:
    """Mamba's and Falcon-Mamba's fields (transformers' defaults where the file omits one)."""
    hidden, layers = int(raw["hidden_size"]), int(raw["num_hidden_layers"])
    if raw.get("hidden_act", "silu") != "silu":
        raise InputError("hidden_act", f"{raw['hidden_act']!r} not supported (graphrt's Mamba1 layers gate with silu)")
    rank = raw.get("time_step_rank", "auto")
    eps = float(raw.get("layer_norm_epsilon", 1e-5))
    return dict(layer_kinds=(MAMBA1,) * layers, rms_norm_eps=eps,
                mamba_intermediate=int(raw.get("intermediate_size") or int(raw.get("expand", 2)) * hidden),
                mamba_state=int(raw.get("state_size", 16)), conv_kernel=int(raw.get("conv_kernel", 4)),
                conv_bias=bool(raw.get("use_conv_bias", True)), mamba_bias=bool(raw.get("use_bias", False)),
                dt_rank=math.ceil(hidden / 16) if rank in (None, "auto") else int(rank),
                scan_norm="unweighted" if falcon else "none", scan_norm_eps=float(raw.get("mixer_rms_eps", 1e-6)))


def _lfm2(raw: dict[str, Any]) -> dict[str, Any]:
    """LFM2's fields: ``layer_types`` ("conv" / "full_attention"; else ``full_attn_idxs``), the
    feed-forward width as transformers derives it (``block_auto_adjust_ff_dim``)."""
    layers, hidden = int(raw["num_hidden_layers"]), int(raw["hidden_size"])
    names = raw.get("layer_types")
    if names is None:
        full = raw.get("full_attn_idxs")
        full = range(layers) if full is None else full
        names = ["full_attention" if i in full else "conv" for i in range(layers)]
    kinds = tuple({"conv": SHORT_CONV, "full_attention": ATTENTION}.get(name, "") for name in names)
    if len(kinds) != layers or "" in kinds:
        raise InputError("layer_types", f"{names}: 'conv' or 'full_attention' per layer ({layers})")
    ff = int(raw.get("intermediate_size", 12288))
    if raw.get("block_auto_adjust_ff_dim", True):
        ff = int(2 * ff / 3)
        if raw.get("block_ffn_dim_multiplier", 1.0) is not None:
            multiple = int(raw.get("block_multiple_of", 256))
            ff = multiple * -(-int(float(raw.get("block_ffn_dim_multiplier", 1.0)) * ff) // multiple)
    heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    return dict(layer_kinds=kinds, rms_norm_eps=float(raw.get("norm_eps", 1e-5)), num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads), head_dim=head_dim,
                rope_theta=_rope_theta(raw), rotary_dim=head_dim, qk_norm=True,
                conv_kernel=int(raw.get("conv_L_cache", 3)), conv_bias=bool(raw.get("conv_bias", False)),
                mlp="lfm2", intermediate_size=ff)


def _jamba(raw: dict[str, Any]) -> dict[str, Any]:
    """Jamba's fields: attention where ``i % attn_layer_period == attn_layer_offset`` (else
    Mamba1), experts where ``i % expert_layer_period == expert_layer_offset``."""
    layers, hidden = int(raw["num_hidden_layers"]), int(raw["hidden_size"])
    if raw.get("hidden_act", "silu") != "silu":
        raise InputError("hidden_act", f"{raw['hidden_act']!r} not supported (graphrt's Jamba layers use silu)")
    every, at = int(raw.get("attn_layer_period", 8)), int(raw.get("attn_layer_offset", 4))
    e_every, e_at = int(raw.get("expert_layer_period", 2)), int(raw.get("expert_layer_offset", 1))
    experts = int(raw.get("num_experts", 16))
    heads = int(raw["num_attention_heads"])
    rank = raw.get("mamba_dt_rank", "auto")
    eps = float(raw.get("rms_norm_eps", 1e-6))
    return dict(layer_kinds=tuple(ATTENTION if i % every == at else MAMBA1 for i in range(layers)), rms_norm_eps=eps,
                num_attention_heads=heads, num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=hidden // heads, mamba_intermediate=int(raw.get("mamba_expand", 2)) * hidden,
                mamba_state=int(raw.get("mamba_d_state", 16)), conv_kernel=int(raw.get("mamba_d_conv", 4)),
                conv_bias=bool(raw.get("mamba_conv_bias", True)), mamba_bias=bool(raw.get("mamba_proj_bias", False)),
                dt_rank=math.ceil(hidden / 16) if rank in (None, "auto") else int(rank), scan_norm="weighted",
                scan_norm_eps=eps, mlp="jamba", intermediate_size=int(raw.get("intermediate_size", 14336)),
                num_experts=experts, num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)),
                moe_layers=tuple(i for i in range(layers) if experts > 1 and i % e_every == e_at))


#: The MLP / branch activations of RecurrentGemma graphrt implements (transformers' names).
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "silu", "relu")


def _bfloat16(x: float) -> float:
    """``x`` rounded to bfloat16 (round to nearest even): RecurrentGemma keeps its embedding
    normaliser ``sqrt(hidden_size)`` as a bfloat16 buffer."""
    bits = int(np.float32(x).view(np.uint32))
    return float(np.uint32((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).view(np.float32))


def _recurrent_gemma(raw: dict[str, Any]) -> dict[str, Any]:
    """RecurrentGemma's fields: ``block_types`` ("recurrent" / "attention") cycled over the
    layers, attention of ``attention_window_size`` positions rotating ``partial_rotary_factor``
    of each head, norms scaling by ``1 + weight``, the embeddings times bfloat16 ``sqrt(hidden)``."""
    layers, hidden = int(raw["num_hidden_layers"]), int(raw["hidden_size"])
    blocks = list(raw.get("block_types") or ["recurrent", "recurrent", "attention"])
    kinds = tuple({"recurrent": RG_LRU, "attention": ATTENTION}.get(b, "") for b in (blocks * layers)[:layers])
    if "" in kinds:
        raise InputError("block_types", f"{blocks}: 'recurrent' or 'attention' each")
    act = raw.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise InputError("hidden_activation", f"{act!r} is not one of {list(ACTIVATIONS)}")
    heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    width = int(raw.get("lru_width") or hidden)
    if width % heads:
        raise InputError("lru_width", f"{width} is not a multiple of num_attention_heads {heads} (the RG-LRU's gate "
                                      "blocks)")
    rope = raw.get("rope_parameters") or {}
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5)))
    return dict(layer_kinds=kinds, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads), head_dim=head_dim,
                attention_bias=bool(raw.get("attention_bias", False)), rope_theta=_rope_theta(raw),
                rotary_dim=int(head_dim * partial), conv_kernel=int(raw.get("conv1d_width", 4)), lru_width=width,
                sliding_window=int(raw.get("attention_window_size", 2048)), activation=act,
                logits_soft_cap=float(raw.get("logits_soft_cap") or 0.0), mlp="recurrent_gemma",
                intermediate_size=int(raw.get("intermediate_size", 3 * hidden)) // 2,
                embedding_multiplier=_bfloat16(hidden ** 0.5), zero_centered_norm=True)


def _minimax(raw: dict[str, Any]) -> dict[str, Any]:
    """MiniMax's fields: ``layer_types`` ("linear_attention" / "full_attention"; transformers'
    default alternates, full first), lightning attention of ``block_size`` chunks over the
    attention heads, experts in every layer, the residual factors of each part."""
    layers, hidden = int(raw["num_hidden_layers"]), int(raw["hidden_size"])
    names = raw.get("layer_types") or ["full_attention" if i % 2 == 0 else "linear_attention" for i in range(layers)]
    kinds = tuple({"linear_attention": LIGHTNING, "full_attention": ATTENTION}.get(n, "") for n in names)
    if len(kinds) != layers or "" in kinds:
        raise InputError("layer_types", f"{names}: 'linear_attention' or 'full_attention' per layer ({layers})")
    act = raw.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise InputError("hidden_act", f"{act!r} is not one of {list(ACTIVATIONS)}")
    heads = int(raw["num_attention_heads"])

    def factors(part: str, prefix: str) -> tuple[str, float, float]:
        return part, float(raw.get(f"{prefix}_alpha_factor", 1.0)), float(raw.get(f"{prefix}_beta_factor", 1.0))

    return dict(layer_kinds=kinds, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)), num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads), rope_theta=_rope_theta(raw),
                rotary_dim=int(raw.get("head_dim") or hidden // heads), chunk_size=int(raw.get("block_size", 256)),
                sliding_window=int(raw.get("sliding_window") or 0), activation=act, mlp="minimax",
                mamba_norm_eps=1e-6,         # the lightning output's norm: transformers' default eps
                intermediate_size=int(raw.get("intermediate_size", 14336)),
                num_experts=int(raw.get("num_local_experts", 8)),
                num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)),
                residual_factors=(factors(ATTENTION, "full_attn"), factors(LIGHTNING, "linear_attn"),
                                  factors("mlp", "mlp")))


def _granite(raw: dict[str, Any]) -> dict[str, Any]:
    layers = int(raw["num_hidden_layers"])
    names = raw.get("layer_types") or raw.get("layers_block_type") or ["linear_attention"] * layers
    kinds = tuple(_KINDS.get(name, "") for name in names)
    if len(kinds) != layers or "" in kinds:
        raise InputError("layer_types", f"{names}: one of {sorted(_KINDS)} per layer ({layers})")
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    intermediate = int(raw.get("mamba_expand", 2)) * hidden
    m_heads = int(raw.get("mamba_n_heads", 128))
    m_head_dim = raw.get("mamba_d_head", "auto")
    m_head_dim = intermediate // m_heads if m_head_dim in (None, "auto") else int(m_head_dim)
    rope = raw.get("position_embedding_type") == "rope"
    head_dim = int(raw.get("head_dim") or hidden // heads)
    return dict(layer_kinds=kinds, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                num_attention_heads=heads, num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=head_dim, attention_bias=bool(raw.get("attention_bias", False)),
                attention_scale=float(raw.get("attention_multiplier", 1.0)),
                rope_theta=_rope_theta(raw) if rope else None, rotary_dim=head_dim if rope else 0,
                mamba_heads=m_heads, mamba_head_dim=m_head_dim, mamba_state=int(raw.get("mamba_d_state", 256)),
                mamba_groups=int(raw.get("mamba_n_groups", 1)), conv_kernel=int(raw.get("mamba_d_conv", 4)),
                mamba_intermediate=intermediate, chunk_size=int(raw.get("mamba_chunk_size", 256)),
                conv_bias=bool(raw.get("mamba_conv_bias", True)), mamba_bias=bool(raw.get("mamba_proj_bias", False)),
                time_step_limit=_limit(raw), mamba_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                mlp="granite", intermediate_size=int(raw.get("intermediate_size", 0)),
                shared_intermediate_size=int(raw.get("shared_intermediate_size", 0)),
                num_experts=int(raw.get("num_local_experts") or 0), num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
                embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
                logits_scaling=float(raw.get("logits_scaling", 1.0)))


def _nemotron_h(raw: dict[str, Any]) -> dict[str, Any]:
    """Nemotron-H's fields: ``layers_block_type`` (or the legacy ``hybrid_override_pattern``,
    ``M`` / ``*`` / ``-`` / ``E``) gives each layer's one block; its Mamba2 mixers clamp dt below
    at ``time_step_min`` (transformers' mixer does, whatever ``time_step_limit`` says)."""
    names = raw.get("layers_block_type") or raw.get("layer_types")
    if names is None and raw.get("hybrid_override_pattern") is not None:
        legend = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
        names = [legend.get(ch, ch) for ch in raw["hybrid_override_pattern"]]
    kinds = tuple({"linear_attention": MAMBA, "mamba": MAMBA, "full_attention": ATTENTION, "attention": ATTENTION,
                   "mlp": FFN, "moe": MOE}.get(n, "") for n in names or ())
    if not kinds or "" in kinds:
        raise InputError("layers_block_type", f"{names}: 'linear_attention', 'full_attention', 'mlp' or 'moe' "
                                              "per layer")
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if raw.get(key, want) != want:
            raise InputError(key, f"{raw[key]!r} not supported (graphrt's Nemotron-H layers use {want})")
    if raw.get("moe_latent_size") is not None:
        raise InputError("moe_latent_size", f"{raw['moe_latent_size']}: latent expert projections are not "
                                            "implemented in graphrt's Nemotron-H (null only)")
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    m_heads, m_head_dim = int(raw.get("mamba_num_heads", 128)), int(raw.get("mamba_head_dim", 64))
    eps = float(raw.get("layer_norm_epsilon", 1e-5))
    experts = int(raw.get("n_routed_experts") or raw.get("num_local_experts") or 0)
    groups = int(raw.get("n_group") or 1)
    if MOE in kinds and (experts % groups or experts // groups < 2):
        raise InputError("n_group", f"{groups} expert groups of {experts} experts: each group needs 2+ experts")
    return dict(layer_kinds=kinds, rms_norm_eps=eps, num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                attention_bias=bool(raw.get("attention_bias", False)),
                mamba_heads=m_heads, mamba_head_dim=m_head_dim, mamba_state=int(raw.get("ssm_state_size", 128)),
                mamba_groups=int(raw.get("n_groups", 8)), conv_kernel=int(raw.get("conv_kernel", 4)),
                mamba_intermediate=m_heads * m_head_dim, chunk_size=int(raw.get("chunk_size", 128)),
                conv_bias=bool(raw.get("use_conv_bias", True)), mamba_bias=bool(raw.get("use_bias", False)),
                time_step_limit=(float(raw.get("time_step_min", 0.001)), math.inf), mamba_norm_eps=eps,
                mlp="nemotron_h", activation="relu2", intermediate_size=int(raw.get("intermediate_size", 21504)),
                shared_intermediate_size=int(raw.get("moe_shared_expert_intermediate_size", 7688)),
                num_experts=experts, num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)),
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)), expert_groups=groups,
                topk_groups=int(raw.get("topk_group") or 1))


def _falcon_h1(raw: dict[str, Any]) -> dict[str, Any]:
    """Falcon-H1's fields: every layer a Mamba2 mixer with attention beside it, ``mamba_d_ssm``
    channels (else ``mamba_expand * hidden``), the gated norm's two options, every µP multiplier."""
    layers, hidden, heads = int(raw["num_hidden_layers"]), int(raw["hidden_size"]), int(raw["num_attention_heads"])
    if raw.get("hidden_act", "silu") != "silu":
        raise InputError("hidden_act", f"{raw['hidden_act']!r} not supported (graphrt's Falcon-H1 layers use silu)")
    inner = raw.get("mamba_d_ssm")
    inner = int(inner) if inner is not None else int(raw.get("mamba_expand", 2)) * hidden
    m_heads = int(raw.get("mamba_n_heads", 128))
    m_head_dim = int(raw.get("mamba_d_head") or inner // m_heads)
    if m_heads * m_head_dim != inner:
        raise InputError("mamba_n_heads", f"{m_heads} heads of {m_head_dim} != mamba_d_ssm {inner}")
    scales = tuple(float(v) for v in raw.get("ssm_multipliers") or (1.0,) * 5)
    mlp_scales = tuple(float(v) for v in raw.get("mlp_multipliers") or (1.0, 1.0))
    if len(scales) != 5 or len(mlp_scales) != 2:
        raise InputError("ssm_multipliers", f"{scales} / mlp_multipliers {mlp_scales}: 5 and 2 values")
    gate = ("gate" if not raw.get("mamba_rms_norm", False) else
            "gate_after_norm" if raw.get("mamba_norm_before_gate", True) else "norm_gated")
    eps = float(raw.get("rms_norm_eps", 1e-5))
    return dict(layer_kinds=(MAMBA,) * layers, mamba_attention_layers=tuple(range(layers)), rms_norm_eps=eps,
                num_attention_heads=heads, num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                attention_bias=bool(raw.get("attention_bias", False)), rope_theta=_rope_theta(raw),
                rotary_dim=int(raw.get("head_dim") or hidden // heads),
                mamba_heads=m_heads, mamba_head_dim=m_head_dim, mamba_state=int(raw.get("mamba_d_state", 256)),
                mamba_groups=int(raw.get("mamba_n_groups", 1)), conv_kernel=int(raw.get("mamba_d_conv", 4)),
                mamba_intermediate=inner, chunk_size=int(raw.get("mamba_chunk_size", 256)),
                conv_bias=bool(raw.get("mamba_conv_bias", True)), mamba_bias=bool(raw.get("mamba_proj_bias", False)),
                time_step_limit=_limit(raw), mamba_norm_eps=eps, mamba_gate=gate,
                mamba_in_scale=float(raw.get("ssm_in_multiplier", 1.0)),
                mamba_proj_scales=() if scales == (1.0,) * 5 else scales,
                ssm_out_multiplier=float(raw.get("ssm_out_multiplier", 1.0)),
                attention_in_multiplier=float(raw.get("attention_in_multiplier", 1.0)),
                attention_out_multiplier=float(raw.get("attention_out_multiplier", 1.0)),
                key_multiplier=float(raw.get("key_multiplier", 1.0)), mlp="falcon_h1",
                intermediate_size=int(raw.get("intermediate_size", 0)), mlp_multipliers=mlp_scales,
                embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
                lm_head_multiplier=float(raw.get("lm_head_multiplier", 1.0)))



def _zamba2(raw: dict[str, Any]) -> dict[str, Any]:
    """Zamba2's fields: every layer a Mamba2 mixer (``mamba_expand * hidden`` channels, dt clamped
    at ``time_step_min``, its gated norm's epsilon fixed at 1e-5); the ``hybrid`` layers (of
    ``layers_block_type``) run shared block ``k % num_mem_blocks`` at their k-th use first: attention
    over ``[hidden, embeddings]`` (heads of ``2 * hidden / heads``, scaled by ``(head_dim / 2) ** -0.5``,
    rotary with ``use_mem_rope``) and a gated MLP (``hidden_act``)."""
    layers, hidden, heads = int(raw["num_hidden_layers"]), int(raw["hidden_size"]), int(raw["num_attention_heads"])
    names = list(raw.get("layers_block_type") or [])
    kinds = [{"mamba": MAMBA, "linear_attention": MAMBA, "hybrid": "hybrid"}.get(n, "") for n in names]
    if len(kinds) != layers or "" in kinds:
        raise InputError("layers_block_type", f"{names}: 'mamba' (or 'linear_attention') or 'hybrid' per layer "
                                              f"({layers})")
    act = raw.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise InputError("hidden_act", f"{act!r} is not one of {list(ACTIVATIONS)}")
    inner = int(raw.get("mamba_expand", 2)) * hidden
    m_heads = int(raw.get("n_mamba_heads", 8))
    head_dim = 2 * hidden // heads
    rope = bool(raw.get("use_mem_rope", False))
    return dict(layer_kinds=(MAMBA,) * layers, mamba_attention_layers=tuple(i for i, k in enumerate(kinds)
                                                                            if k == "hybrid"),
                shared_blocks=int(raw.get("num_mem_blocks", 1)),
                shared_attention_adapters=bool(raw.get("use_shared_attention_adapter", False)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)), num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads), head_dim=head_dim,
                attention_scale=(head_dim / 2) ** -0.5, rope_theta=_rope_theta(raw) if rope else None,
                rotary_dim=head_dim if rope else 0, mamba_heads=m_heads, mamba_head_dim=inner // m_heads,
                mamba_state=int(raw.get("mamba_d_state", 64)), mamba_groups=int(raw.get("mamba_ngroups", 1)),
                conv_kernel=int(raw.get("mamba_d_conv", 4)), mamba_intermediate=inner,
                chunk_size=int(raw.get("chunk_size", 256)), conv_bias=True,
                mamba_bias=bool(raw.get("add_bias_linear", False)),
                time_step_limit=(float(raw.get("time_step_min", 0.001)), math.inf), mamba_norm_eps=1e-5,
                mlp="zamba2", activation=act, intermediate_size=int(raw.get("intermediate_size") or 4 * hidden))


__all__ = ["ATTENTION", "DELTA", "FFN", "HYBRID_ARCHITECTURES", "HybridConfig", "LIGHTNING", "MAMBA", "MAMBA1",
           "MAMBA2_JAX_ARCHITECTURES", "MOE", "RG_LRU", "SHORT_CONV", "TORCH_HYBRID_ARCHITECTURES"]
