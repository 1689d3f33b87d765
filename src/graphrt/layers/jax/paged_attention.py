"""graphrt's paged attention in JAX: the reference kernel of the XLA backend's decoders.

The step's layout (:class:`AttentionMetadata`), the KV write through ``slot_mapping`` (the last
row of each layer is the trash row padded tokens write), and causal attention through
``block_table`` and ``seq_lens``: each token gathers its request's block-table columns only, so
what is gathered is bounded by the key's context (its table width), never by the cache. fp8
caches store value / scale, saturated, and read stored * scale (per-tensor ``kv_scales``, as the
torch kernels). graphrt's JAX decoder (``models/jax/decoder.py``) and hybrid
(``models/jax/hybrid.py``) call it; on TPUs the Pallas kernel (``pallas_attention``) may run
instead, chosen once (``attention.choose_xla_attention``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.export
import jax.numpy as jnp

from graphrt.core.attention_decl import CONTEXT_VALUE, FLOAT_KV_DTYPES, FP8_KV_DTYPES as FP8_KV_NAMES, AttentionDeclarations


class XlaPagedAttention(AttentionDeclarations):
    """What graphrt's JAX kernels declare (the reference one here and Pallas): they attend over
    every column of the block table they are given, so they key ``max_seq_len`` (context
    buckets); float and fp8 caches. A JAX model that declares no attention of its own gets it."""

    name = "jax-paged"
    kv_cache_dtypes = FLOAT_KV_DTYPES + FP8_KV_NAMES

    def keyed_host_values(self, device: Any, dtype: Any) -> tuple[str, ...]:
        return (CONTEXT_VALUE,)


class AttentionMetadata(NamedTuple):
    """Per-step batch layout, a pytree of arrays only (static values travel separately).

    ``slot_mapping`` int32 [T] (negative: padded token); ``query_start_loc`` int32 [R+1],
    non-decreasing; ``seq_lens`` int32 [R] (0: padded request); ``block_table`` int32 [R, B]
    (padded entries 0).
    """

    slot_mapping: jax.Array
    query_start_loc: jax.Array
    seq_lens: jax.Array
    block_table: jax.Array


# Serializable in a jax.export artifact's calling convention (a program that takes or returns it).
jax.export.register_namedtuple_serialization(AttentionMetadata, serialized_name="graphrt.AttentionMetadata")

#: The fp8 KV-cache dtypes the decoder quantizes to with a scale.
FP8_KV_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def token_request_index(query_start_loc: jax.Array, num_tokens: int) -> jax.Array:
    """Request index of every token: the last r with ``query_start_loc[r] <= t``, clipped to [0, R-1]."""
    num_reqs = query_start_loc.shape[0] - 1
    t = jnp.arange(num_tokens, dtype=query_start_loc.dtype)
    req = jnp.searchsorted(query_start_loc, t, side="right") - 1
    return jnp.clip(req, 0, num_reqs - 1).astype(jnp.int32)


def quantize_kv(x: jax.Array, cache_dtype: Any, scale: float = 1.0) -> jax.Array:
    """``x`` as stored in a cache of ``cache_dtype``: fp8 stores x / scale, saturated."""
    if jnp.dtype(cache_dtype) not in FP8_KV_DTYPES:
        return x.astype(cache_dtype)
    limit = float(jnp.finfo(cache_dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(cache_dtype)


def _write_each_row(layer_idx: jax.Array, rows: jax.Array, cache: jax.Array, kv: jax.Array) -> jax.Array:
    """``cache`` with ``kv`` [T, 2, Hkv, D] stored at layer ``layer_idx``'s ``rows`` [T], one
    in-place dynamic-update-slice per token."""
    zero = jnp.zeros((), jnp.int32)

    def one(t: jax.Array, cache: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice(cache, kv[t][None, :, None], (layer_idx, zero, rows[t], zero, zero))
    return jax.lax.fori_loop(0, rows.shape[0], one, cache)


def write_kv_rows(cache: jax.Array, layer_idx: jax.Array, rows: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``cache`` ``[layers, 2, rows, Hkv, D]`` with ``k`` / ``v`` [T, Hkv, D] (in its dtype) stored at
    layer ``layer_idx``'s ``rows`` [T]: the KV write.

    A cache of a float narrower than 32 bits (bfloat16, float16, fp8) is written on XLA:CPU one
    token at a time with dynamic-update-slice: XLA:CPU's float normalization widens a scatter of
    such a float to float32 over its whole operand, so each layer's write made float32 copies of
    the whole cache (temp memory 4x the cache: it grew with ``num_blocks``). Other platforms, and
    float32 caches, scatter as before (``lax.platform_dependent``: decided when the program is
    lowered for its platform)."""
    dtype = jnp.dtype(cache.dtype)

    def scatter(cache: jax.Array, kv: jax.Array) -> jax.Array:
        return cache.at[layer_idx, :, rows].set(kv)
    kv = jnp.stack([k, v], axis=1)              # [T, 2, Hkv, D]
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize >= 4:
        return scatter(cache, kv)
    return jax.lax.platform_dependent(cache, kv, cpu=functools.partial(_write_each_row, layer_idx, rows),
                                      default=scatter)


def dequantize_kv(stored: jax.Array, dtype: Any, scale: float = 1.0) -> jax.Array:
    """Stored K/V rows as ``dtype`` values (fp8: stored * scale, in float32 first)."""
    if stored.dtype not in FP8_KV_DTYPES:
        return stored.astype(dtype)
    return (stored.astype(jnp.float32) * scale).astype(dtype)


def paged_attention(q: jax.Array, layer_k: jax.Array, layer_v: jax.Array, positions: jax.Array,
                    meta: AttentionMetadata, block_size: int, sliding_window: Any = 0,
                    kv_scales: tuple[float, float] = (1.0, 1.0), attention_chunk: int = 0) -> jax.Array:
    """Causal attention of ``q`` [T, Hq, D] over one layer's paged cache ``layer_k/v`` [rows, Hkv, D].

    Token t reads keys j < seq_len, j <= positions[t] and, with ``sliding_window`` W > 0 (int or
    traced), j > positions[t] - W; with ``attention_chunk`` C > 0 (chunked local attention, a
    static int), j >= (positions[t] // C) * C; zeros where none is visible. fp8: stored * ``kv_scales``.
    """
    return _attend_rows(q, lambda rows: (layer_k[rows], layer_v[rows]), layer_k.shape[1], positions, meta,
                        block_size, sliding_window, kv_scales, attention_chunk)


def cache_paged_attention(q: jax.Array, kv_cache: jax.Array, layer_idx: jax.Array, positions: jax.Array,
                          meta: AttentionMetadata, block_size: int, sliding_window: Any = 0,
                          kv_scales: tuple[float, float] = (1.0, 1.0), attention_chunk: int = 0) -> jax.Array:
    """:func:`paged_attention` over layer ``layer_idx`` of the whole cache ``[layers, 2, rows, Hkv,
    D]``, gathering the rows of the step's block-table columns straight from the cache: no slice
    of the layer is made (XLA:CPU materialized one for a bfloat16 cache, a copy that grew with
    ``num_blocks``), so temp memory is bounded by the tokens and the key's context."""
    def read(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
        return kv_cache[layer_idx, 0, rows], kv_cache[layer_idx, 1, rows]
    return _attend_rows(q, read, kv_cache.shape[3], positions, meta, block_size, sliding_window, kv_scales,
                        attention_chunk)


def _attend_rows(q: jax.Array, read: Callable[[jax.Array], tuple[jax.Array, jax.Array]], num_kv_heads: int,
                 positions: jax.Array, meta: AttentionMetadata, block_size: int, sliding_window: Any,
                 kv_scales: tuple[float, float], attention_chunk: int = 0) -> jax.Array:
    """:func:`paged_attention` with the stored K / V rows ``[T, S, Hkv, D]`` of row indices
    ``[T, S]`` given by ``read``: each token's request's block-table columns only, so what is
    gathered is bounded by the key's context (its table width), never by the cache."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    req = token_request_index(meta.query_start_loc, num_tokens)
    blocks = meta.block_table[req]  # [T, B]
    ctx_len = blocks.shape[1] * block_size
    rows = (blocks[:, :, None] * block_size + jnp.arange(block_size, dtype=blocks.dtype)).reshape(
        num_tokens, ctx_len)
    j = jnp.arange(ctx_len, dtype=jnp.int32)[None, :]
    in_batch = jnp.arange(num_tokens, dtype=jnp.int32) < meta.query_start_loc[-1]
    visible = ((j < meta.seq_lens[req][:, None]) & (j <= positions[:, None])
               & in_batch[:, None])  # [T, S]
    if not isinstance(sliding_window, int) or sliding_window:
        visible = visible & ((sliding_window <= 0) | (j > positions[:, None] - sliding_window))
    if attention_chunk:
        visible = visible & (j >= (positions[:, None] // attention_chunk) * attention_chunk)
    stored_k, stored_v = read(rows)
    k = dequantize_kv(stored_k, q.dtype, kv_scales[0])  # [T, S, Hkv, D]
    v = jnp.where(visible[:, :, None, None], dequantize_kv(stored_v, q.dtype, kv_scales[1]), 0)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("tkgd,tskd->tkgs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (head_dim ** -0.5)
    mask = visible[:, None, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0)), 0.0)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = (probs / jnp.where(denom > 0, denom, 1.0)).astype(v.dtype)
    out = jnp.einsum("tkgs,tskd->tkgd", probs, v)
    return out.reshape(num_tokens, num_heads, head_dim)


def reference_attend(q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: jax.Array, layer_idx: jax.Array,
                      window: Any, positions: jax.Array, meta: AttentionMetadata, write_rows: jax.Array, *,
                      block_size: int, kv_scales: tuple[float, float]) -> tuple[jax.Array, jax.Array]:
    """Write this step's K/V into layer ``layer_idx`` of the reference-layout cache, then attend
    (over its sliding ``window``: None / 0 none): (attention [T, Hq, D], new cache)."""
    kv_cache = write_kv_rows(kv_cache, layer_idx, write_rows, quantize_kv(k, kv_cache.dtype, kv_scales[0]),
                             quantize_kv(v, kv_cache.dtype, kv_scales[1]))
    attn = cache_paged_attention(q, kv_cache, layer_idx, positions, meta, block_size,
                                 0 if window is None else window, kv_scales)
    return attn, kv_cache


__all__ = ["AttentionMetadata", "FP8_KV_DTYPES", "cache_paged_attention", "dequantize_kv", "paged_attention",
           "quantize_kv", "reference_attend", "token_request_index", "write_kv_rows", "XlaPagedAttention"]
