"""Llama 4's text decoder in JAX (``Llama4ForCausalLM``) over graphrt's paged KV cache, for the
xla backend (docs/xla.md, "Llama 4").

Its layers differ one from another (:class:`~graphrt.models.llama4_config.Llama4Config`):
chunked local attention with interleaved rotary and an L2 norm of q and k, or NoPE attention
over the whole context with the query temperature of each token's position; experts with a
shared expert, or a dense SwiGLU. So params are the checkpoint's tensors by their transformers
names (a flat dict, not stacked layers), as in ``models/jax/hybrid.py``; no recurrent state.
:func:`forward` follows :class:`graphrt.backends.xla.programs.XlaModel`'s signature over the
cache ``[layers, 2, rows, kv_heads, head_dim]``.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from graphrt.layers.jax.paged_attention import AttentionMetadata, cache_paged_attention, write_kv_rows
from graphrt.models.jax.loader import flat_linear as _linear, flat_param as _get, read_flat_params
from graphrt.models.jax.decoder import rms_norm
from graphrt.models.llama4_config import Llama4Config

Params = dict[str, Any]

_ACTIVATIONS = {"silu": jax.nn.silu, "gelu": lambda x: jax.nn.gelu(x, approximate=False),
                "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True), "relu": jax.nn.relu}


def load_llama4_params(model_dir: str | os.PathLike, dtype: Any) -> Params:
    """Every checkpoint tensor, by name, as a ``dtype`` array (a missing one the forward reads is
    an InputError naming it, at trace time)."""
    return read_flat_params(model_dir, dtype)


def interleaved_rotary(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """``x [T, heads, D]`` rotated as Llama 4 does: features ``(2j, 2j + 1)`` a complex number
    turned by ``positions * inv_freq[j]``, in float32, back in ``x``'s dtype."""
    d = x.shape[-1]
    angle = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], d // 2, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    return jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1).reshape(x.shape).astype(x.dtype)


def _l2(x: jax.Array, eps: float) -> jax.Array:
    """The RMS norm without weight (transformers' ``Llama4TextL2Norm``), float32 inside."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _attention(p: Params, pre: str, h: jax.Array, positions: jax.Array, kv: jax.Array, layer: int,
               meta: AttentionMetadata, c: Llama4Config, block_size: int) -> tuple[jax.Array, jax.Array]:
    t, d = h.shape[0], c.head_dim
    q = _linear(p, f"{pre}.q_proj", h).reshape(t, c.num_attention_heads, d)
    k = _linear(p, f"{pre}.k_proj", h).reshape(t, c.num_key_value_heads, d)
    v = _linear(p, f"{pre}.v_proj", h).reshape(t, c.num_key_value_heads, d)
    if c.rope_layers[layer]:
        q, k = interleaved_rotary(q, positions, c.inv_freq()), interleaved_rotary(k, positions, c.inv_freq())
        if c.qk_norm:
            q, k = _l2(q, c.rms_norm_eps), _l2(k, c.rms_norm_eps)
    elif c.temperature is not None:            # NoPE: the query temperature at each token's position
        floor_scale, attn_scale = c.temperature
        scale = jnp.log1p(jnp.floor((positions.astype(jnp.float32) + 1.0) / floor_scale)) * attn_scale + 1.0
        q = (q * scale[:, None, None]).astype(q.dtype)
    rows = jnp.where(meta.slot_mapping < 0, kv.shape[2] - 1, meta.slot_mapping)
    kv = write_kv_rows(kv, jnp.asarray(layer, jnp.int32), rows.astype(jnp.int32), k.astype(kv.dtype),
                       v.astype(kv.dtype))
    chunk = c.attention_chunk if layer in c.chunked_layers else 0
    out = cache_paged_attention(q, kv, layer, positions, meta, block_size, attention_chunk=chunk)
    return _linear(p, f"{pre}.o_proj", out.reshape(t, -1)), kv


def _swiglu(p: Params, pre: str, x: jax.Array, c: Llama4Config) -> jax.Array:
    return _linear(p, f"{pre}.down_proj", _ACTIVATIONS[c.activation](_linear(p, f"{pre}.gate_proj", x))
                   * _linear(p, f"{pre}.up_proj", x))


def _experts(p: Params, pre: str, x: jax.Array, c: Llama4Config) -> jax.Array:
    """The shared expert plus every expert on its input scaled by ``sigmoid`` of the token's
    router logit where the expert is in its top k (0 elsewhere: an expert's output is 0 on a
    zero input); every expert computed for every token (static shapes)."""
    logits = x @ _get(p, f"{pre}.router.weight").T
    top, index = jax.lax.top_k(logits, c.num_experts_per_tok)
    scores = jnp.full(logits.shape, -jnp.inf, logits.dtype).at[jnp.arange(x.shape[0])[:, None], index].set(top)
    scores = jax.nn.sigmoid(scores.astype(jnp.float32)).astype(x.dtype)        # [T, E]
    routed = scores.T[:, :, None] * x[None]                                       # [E, T, H]
    gate, up = jnp.split(jnp.einsum("eth,ehi->eti", routed, _get(p, f"{pre}.experts.gate_up_proj")), 2, axis=-1)
    out = jnp.einsum("eti,eih->th", up * _ACTIVATIONS[c.activation](gate), _get(p, f"{pre}.experts.down_proj"))
    return _swiglu(p, f"{pre}.shared_expert", x, c) + out


def forward(params: Params, kv: jax.Array, input_ids: jax.Array, positions: jax.Array, meta: AttentionMetadata, *,
            config: Llama4Config, block_size: int) -> tuple[jax.Array, jax.Array]:
    """The model on ``T`` flattened tokens: (final-normed hidden ``[T, H]``, new KV cache)."""
    c = config
    x = _get(params, "model.embed_tokens.weight")[input_ids]
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}"
        h = rms_norm(x, _get(params, f"{pre}.input_layernorm.weight"), c.rms_norm_eps)
        out, kv = _attention(params, f"{pre}.self_attn", h, positions, kv, i, meta, c, block_size)
        x = x + out
        h = rms_norm(x, _get(params, f"{pre}.post_attention_layernorm.weight"), c.rms_norm_eps)
        ff = f"{pre}.feed_forward"
        x = x + (_experts(params, ff, h, c) if i in c.moe_layers else _swiglu(params, ff, h, c))
    return rms_norm(x, _get(params, "model.norm.weight"), c.rms_norm_eps), kv


def compute_logits(params: Params, hidden: jax.Array, *, config: Llama4Config) -> jax.Array:
    """float32 logits ``[N, V]`` (the embeddings where the head is tied or absent)."""
    head = params.get("lm_head.weight")
    if head is None or config.tie_word_embeddings:
        head = _get(params, "model.embed_tokens.weight")
    return (hidden @ head.T).astype(jnp.float32)


__all__ = ["compute_logits", "forward", "interleaved_rotary", "load_llama4_params"]
