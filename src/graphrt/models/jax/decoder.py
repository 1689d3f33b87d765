"""JAX reference Llama / Mistral / Qwen3 decoder over a paged KV cache, jit-able with static shapes.

Plain functions over the params pytree of :mod:`graphrt.models.jax.loader`; layers run under
``jax.lax.scan`` with the KV cache carried and scattered into, so a jitted ``forward`` donates it.

KV cache: ``[num_layers, 2 (k, v), num_blocks * block_size + 1, num_kv_heads, head_dim]``; the
last row is the trash row padded tokens write. fp8 caches store value / scale, saturated, and read
stored * scale (per-tensor ``kv_scales``, as the torch kernels). The attention is graphrt's JAX
kernel (:mod:`graphrt.layers.jax.paged_attention`); on TPUs the cache may use the Pallas page
layout instead (:mod:`graphrt.layers.jax.pallas_attention`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from graphrt.layers.jax.paged_attention import AttentionMetadata, reference_attend
from graphrt.models.hf_config import DecoderConfig

Params = dict[str, Any]


def init_kv_cache(config: DecoderConfig, num_blocks: int, block_size: int, dtype: Any) -> jax.Array:
    """A zeroed paged KV cache with ``num_blocks`` blocks of ``block_size`` rows plus one trash row
    (``dtype``: the weights' or the KV cache's own, fp8 included)."""
    shape = (config.num_hidden_layers, 2, num_blocks * block_size + 1,
             config.num_key_value_heads, config.head_dim)
    return jnp.zeros(shape, dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 and cast back before the weight (as HF)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rotary_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """Default rotary tables for ``positions`` [T]: float32 cos, sin of shape [T, head_dim]."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` [T, heads, D] with HF's rotate_half layout (first half, second half)."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def _layer(x: jax.Array, kv_cache: jax.Array, layer_idx: jax.Array, window: Any, lp: Params,
           positions: jax.Array, cos: jax.Array, sin: jax.Array, write_rows: jax.Array, meta: AttentionMetadata,
           config: DecoderConfig, attend: Callable[..., Any]) -> tuple[jax.Array, jax.Array]:
    """One decoder layer; ``attend`` writes the K/V into layer ``layer_idx``, then attends."""
    num_tokens = x.shape[0]
    d, eps = config.head_dim, config.rms_norm_eps
    h = rms_norm(x, lp["input_norm"], eps)
    q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
    if config.attention_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(num_tokens, config.num_attention_heads, d)
    k = k.reshape(num_tokens, config.num_key_value_heads, d)
    v = v.reshape(num_tokens, config.num_key_value_heads, d)
    if config.qk_norm:
        q, k = rms_norm(q, lp["q_norm"], eps), rms_norm(k, lp["k_norm"], eps)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    attn, kv_cache = attend(q, k, v, kv_cache, layer_idx, window, positions, meta, write_rows)
    attn = attn.reshape(num_tokens, config.q_size) @ lp["wo"]
    if config.attention_bias:
        attn = attn + lp["bo"]
    x = x + attn
    h = rms_norm(x, lp["post_norm"], eps)
    x = x + (jax.nn.silu(h @ lp["w_gate"]) * (h @ lp["w_up"])) @ lp["w_down"]
    return x, kv_cache


def forward(params: Params, kv_cache: jax.Array, input_ids: jax.Array, positions: jax.Array,
            meta: AttentionMetadata, *, config: DecoderConfig, block_size: int,
            kv_scales: tuple[float, float] = (1.0, 1.0), attention: Any = None) -> tuple[jax.Array, jax.Array]:
    """Run the decoder on ``T`` flattened tokens; returns (final-normed hidden [T, H], new kv_cache).

    Jit with ``static_argnames=("config", "block_size")`` (plus ``"kv_scales"`` / ``"attention"``
    where given) and ``donate_argnames=("kv_cache",)``. Padded tokens write only the trash row;
    tokens of a request with seq_len 0, or past ``query_start_loc[-1]``, get zero attention.
    ``attention``: None for this module's layout, or a hashable object with ``trash_row`` and
    ``layer_attention`` (:class:`~graphrt.layers.jax.pallas_attention.PallasAttention`).
    """
    layers = config.num_hidden_layers
    if attention is None:
        trash_row = kv_cache.shape[2] - 1
        attend = functools.partial(reference_attend, block_size=block_size, kv_scales=kv_scales)
    else:
        trash_row = attention.trash_row(kv_cache, layers, block_size)
        attend = attention.layer_attention(config, block_size, kv_scales)
    write_rows = jnp.where(meta.slot_mapping < 0, trash_row, meta.slot_mapping).astype(jnp.int32)
    cos, sin = rotary_cos_sin(positions, config.head_dim, config.rope_theta)
    x = params["embed"][input_ids]

    def step(carry: tuple[jax.Array, jax.Array],
             xs: tuple[jax.Array, Any, Params]) -> tuple[tuple[jax.Array, jax.Array], None]:
        x, cache = carry
        layer_idx, window, lp = xs
        return _layer(x, cache, layer_idx, window, lp, positions, cos, sin, write_rows, meta,
                      config, attend), None

    layer_ids = jnp.arange(layers, dtype=jnp.int32)
    # Each layer's window, scanned with its weights; None (no layer slides): no window mask at all.
    sliding = tuple(getattr(config, "sliding_windows", ()))
    windows = jnp.asarray(sliding, jnp.int32) if any(sliding) else None
    (x, kv_cache), _ = jax.lax.scan(step, (x, kv_cache), (layer_ids, windows, params["layers"]))
    return rms_norm(x, params["norm"], config.rms_norm_eps), kv_cache


def compute_logits(params: Params, hidden: jax.Array, *, config: DecoderConfig) -> jax.Array:
    """Float32 logits [N, V] for final-normed ``hidden`` [N, H] (tied models use the embedding)."""
    if config.tie_word_embeddings or "lm_head" not in params:
        return jnp.einsum("nh,vh->nv", hidden, params["embed"], preferred_element_type=jnp.float32)
    return jnp.einsum("nh,hv->nv", hidden, params["lm_head"], preferred_element_type=jnp.float32)
