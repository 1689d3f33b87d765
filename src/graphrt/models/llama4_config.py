"""What graphrt's JAX Llama 4 text model reads of a ``Llama4ForCausalLM`` ``config.json``.

Llama 4's layers differ one from another (docs/xla.md, "Llama 4"): ``chunked_attention``
layers attend within chunks of ``attention_chunk_size`` tokens (a token at p sees (p // C) * C
.. p) with interleaved rotary (pairs of adjacent features) and, with ``use_qk_norm``, an L2 norm
of q and k after it; the others (``no_rope_layers[i] == 0``) are NoPE layers attending to the
whole context, their queries scaled by ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))``
at position p (``attn_temperature_tuning``); the MLP is experts with a shared expert in
``moe_layers`` (sigmoid of the top-k router logits scaling each expert's input) and a SwiGLU of
``intermediate_size_mlp`` elsewhere. graphrt's torch models do not implement it (the torch
backends run transformers' model through the Transformers backend); the xla backend runs
``models/jax/llama4.py``. Framework-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphrt.core.errors import InputError
from graphrt.core.kv_spec import KVCacheGroup, KVCacheSpec

#: The architectures of the Llama 4 text model (graphrt's JAX model only).
LLAMA4_ARCHITECTURES = ("Llama4ForCausalLM",)
#: The MLP activations graphrt's Llama 4 implements (transformers' names).
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class Llama4Config:
    """A Llama 4 text decoder as graphrt's JAX model sees it (module docstring); it has the
    members the xla backend reads (``JaxModelConfig``)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int              # each expert's and the shared expert's width
    intermediate_size_mlp: int          # the dense layers' SwiGLU width
    rms_norm_eps: float
    rope_theta: float
    #: Llama 3's rotary scaling (``rope_type`` "llama3", as Llama 4's checkpoints set it):
    #: ``(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)``; None: default.
    rope_scaling: tuple[float, float, float, int] | None
    rope_layers: tuple[bool, ...]       # per layer: rotary (and the q / k L2 norm) or NoPE
    chunked_layers: tuple[int, ...]     # the layers attending within chunks
    attention_chunk: int
    qk_norm: bool
    temperature: tuple[float, float] | None     # NoPE layers' (floor_scale, attn_scale); None: no tuning
    moe_layers: tuple[int, ...]
    num_experts: int
    num_experts_per_tok: int
    activation: str
    attention_bias: bool
    tie_word_embeddings: bool
    torch_dtype: str
    max_position_embeddings: int
    eos_token_id: tuple[int, ...]

    def inv_freq(self) -> np.ndarray:
        """The rotary frequencies ``[head_dim / 2]`` (float32) as transformers computes them:
        ``theta ** (-2j / head_dim)``; with Llama 3's scaling the long wavelengths divided by
        ``factor``, the middle ones smoothly between."""
        d = self.head_dim
        inv = (1.0 / (np.float32(self.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))))
        inv = inv.astype(np.float32)
        if self.rope_scaling is None:
            return inv
        factor, low, high, old = self.rope_scaling
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > old / low, inv / np.float32(factor), inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    def kv_cache_spec(self) -> KVCacheSpec:
        """One group of the chunked layers (their chunk), one of the others."""
        chunked = tuple(i for i in range(self.num_hidden_layers) if i in self.chunked_layers)
        full = tuple(i for i in range(self.num_hidden_layers) if i not in self.chunked_layers)
        groups = [KVCacheGroup(ids, self.num_key_value_heads, self.head_dim, attention_chunk=chunk)
                  for ids, chunk in ((chunked, self.attention_chunk), (full, 0)) if ids]
        return KVCacheSpec(tuple(groups))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Llama4Config":
        """The config of a ``config.json``'s fields, transformers' defaults where it omits one
        (InputError naming a field graphrt does not implement)."""
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in LLAMA4_ARCHITECTURES), None)
        if arch is None:
            raise InputError("architectures", f"{archs} is not one of {list(LLAMA4_ARCHITECTURES)}")
        layers, hidden = int(raw["num_hidden_layers"]), int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type"))
        if kind not in (None, "default", "llama3"):
            raise InputError("rope_parameters", f"{rope} not supported (graphrt's JAX Llama 4 runs default or "
                                                "llama3 rotary)")
        scaling = None
        if kind == "llama3":
            try:
                scaling = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                           int(rope.get("original_max_position_embeddings") or raw["max_position_embeddings"]))
            except KeyError as exc:
                raise InputError("rope_parameters", f"{rope}: llama3 rotary needs {exc.args[0]!r}") from None
        uses_rope = raw.get("no_rope_layers") or [int((i + 1) % int(raw.get("no_rope_layer_interval", 4)) != 0)
                                                   for i in range(layers)]
        chunk = raw.get("attention_chunk_size", 8192)
        types = raw.get("layer_types") or ["chunked_attention" if r and chunk is not None else "full_attention"
                                           for r in uses_rope]
        if len(uses_rope) != layers or len(types) != layers:
            raise InputError("layer_types", f"{len(types)} layer types and {len(uses_rope)} no_rope_layers for "
                                            f"{layers} layers")
        if any(t not in ("chunked_attention", "full_attention") for t in types):
            raise InputError("layer_types", f"{types}: 'chunked_attention' or 'full_attention' per layer")
        chunked = tuple(i for i, t in enumerate(types) if t == "chunked_attention")
        if chunked and not (isinstance(chunk, int) and chunk > 0):
            raise InputError("attention_chunk_size", f"{chunk!r}, but layers {list(chunked)} are chunked: a positive "
                                                     "int")
        act = raw.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise InputError("hidden_act", f"{act!r} is not one of {list(ACTIVATIONS)}")
        step = int(raw.get("interleave_moe_layer_step", 1))
        moe = raw.get("moe_layers")
        moe = list(range(step - 1, layers, step)) if moe is None else moe
        eos = raw.get("eos_token_id", 2)
        return cls(architecture=arch, vocab_size=int(raw["vocab_size"]), hidden_size=hidden, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                   head_dim=int(raw.get("head_dim") or hidden // heads),
                   intermediate_size=int(raw.get("intermediate_size", 8192)),
                   intermediate_size_mlp=int(raw.get("intermediate_size_mlp", 16384)),
                   rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
                   rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 500000.0))),
                   rope_scaling=scaling, rope_layers=tuple(bool(r) for r in uses_rope), chunked_layers=chunked,
                   attention_chunk=int(chunk) if chunked else 0, qk_norm=bool(raw.get("use_qk_norm", True)),
                   temperature=((float(raw.get("floor_scale", 8192)), float(raw.get("attn_scale", 0.1)))
                                if raw.get("attn_temperature_tuning", True) else None),
                   moe_layers=tuple(int(i) for i in moe), num_experts=int(raw.get("num_local_experts", 16)),
                   num_experts_per_tok=int(raw.get("num_experts_per_tok", 1)), activation=act,
                   attention_bias=bool(raw.get("attention_bias", False)),
                   tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                   torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                   max_position_embeddings=int(raw.get("max_position_embeddings") or 4096 * 32),
                   eos_token_id=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)))


__all__ = ["LLAMA4_ARCHITECTURES", "Llama4Config"]
