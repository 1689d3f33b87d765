"""A GPT-NeoX-shaped JAX model with a config class of its own, as a user would bring it to the
xla backend: LayerNorm with biases, a fused qkv projection, partial rotary embeddings (the
first ``rotary_dims`` of each head), a parallel residual (attention and MLP both read the
layer's input), GELU, untied output embedding.

Two forwards over the same params: ``forward`` runs a padded step over graphrt's paged KV cache
(the signature of :class:`graphrt.backends.xla.programs.XlaModel`'s ``forward``), written here
without graphrt's decoder; ``reference_logits`` is the plain causal forward of one whole
sequence, no cache, the oracle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class NeoXConfig:
    """The model's own config: no ``architecture``, no ``rms_norm_eps``, no ``rope_theta``."""

    vocab_size: int = 96
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 64
    rotary_pct: float = 0.5
    rotary_emb_base: float = 10000.0
    layer_norm_eps: float = 1e-5
    max_position_embeddings: int = 128
    eos_token_id: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.rotary_pct)


def init_params(cfg: NeoXConfig, seed: int = 0) -> dict[str, Any]:
    """Random float32 weights (scaled so activations stay O(1))."""
    rng = np.random.default_rng(seed)
    h, f = cfg.hidden_size, cfg.intermediate_size

    def w(*shape: int, scale: float = 0.2) -> jnp.ndarray:
        return jnp.asarray(rng.normal(0.0, scale, shape), jnp.float32)

    n = cfg.num_hidden_layers                   # per-layer weights stacked on a leading axis
    layers = {"ln1_w": 1.0 + w(n, h, scale=0.1), "ln1_b": w(n, h, scale=0.1), "ln2_w": 1.0 + w(n, h, scale=0.1),
              "ln2_b": w(n, h, scale=0.1), "qkv_w": w(n, h, 3 * h), "qkv_b": w(n, 3 * h, scale=0.05),
              "dense_w": w(n, h, h), "dense_b": w(n, h, scale=0.05), "fc_in_w": w(n, h, f),
              "fc_in_b": w(n, f, scale=0.05), "fc_out_w": w(n, f, h), "fc_out_b": w(n, h, scale=0.05)}
    return {"embed_in": w(cfg.vocab_size, h, scale=1.0), "layers": layers, "final_ln_w": 1.0 + w(h, scale=0.1),
            "final_ln_b": w(h, scale=0.1), "embed_out": w(h, cfg.vocab_size)}


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * weight + bias


def partial_rotary(x: jax.Array, positions: jax.Array, cfg: NeoXConfig) -> jax.Array:
    """NeoX's rotary on the first ``rotary_dims`` of each head ``x [T, heads, D]``; the rest passes."""
    r = cfg.rotary_dims
    inv_freq = 1.0 / (cfg.rotary_emb_base ** (np.arange(0, r, 2, dtype=np.float32) / r))
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb)[:, None, :], jnp.sin(emb)[:, None, :]
    rot, rest = x[..., :r], x[..., r:]
    rotated = jnp.concatenate([-rot[..., r // 2:], rot[..., :r // 2]], axis=-1)
    return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)


Attend = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


def _layers(params: dict[str, Any], x: jax.Array, positions: jax.Array, cfg: NeoXConfig,
            attend: Attend) -> jax.Array:
    """Every layer with a parallel residual: x + attention(ln1(x)) + mlp(ln2(x))."""
    t, heads, d = x.shape[0], cfg.num_attention_heads, cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        lp = {name: value[i] for name, value in params["layers"].items()}
        h = layer_norm(x, lp["ln1_w"], lp["ln1_b"], cfg.layer_norm_eps)
        qkv = (h @ lp["qkv_w"] + lp["qkv_b"]).reshape(t, heads, 3 * d)     # NeoX: per head q | k | v
        q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
        q, k = partial_rotary(q, positions, cfg), partial_rotary(k, positions, cfg)
        attn = attend(i, q, k, v).reshape(t, heads * d) @ lp["dense_w"] + lp["dense_b"]
        m = layer_norm(x, lp["ln2_w"], lp["ln2_b"], cfg.layer_norm_eps)
        mlp = jax.nn.gelu(m @ lp["fc_in_w"] + lp["fc_in_b"], approximate=False) @ lp["fc_out_w"] + lp["fc_out_b"]
        x = x + attn + mlp
    return layer_norm(x, params["final_ln_w"], params["final_ln_b"], cfg.layer_norm_eps)


def _softmax_attend(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
    """``q [T, H, D]`` over ``k, v [T, S, H, D]`` (per token) where ``visible [T, S]``; zeros where none is.
    Rows not visible are masked out of ``v`` too: stale cache rows may hold anything, NaN included,
    and ``0 * NaN`` would leak it."""
    v = jnp.where(visible[:, :, None, None], v, 0.0)
    scores = jnp.einsum("thd,tshd->ths", q, k) * (q.shape[-1] ** -0.5)
    scores = jnp.where(visible[:, None, :], scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.where(visible[:, None, :], jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    probs = probs / jnp.maximum(probs.sum(-1, keepdims=True), 1e-30)
    return jnp.einsum("ths,tshd->thd", probs, v)


def forward(params: dict[str, Any], kv_cache: jax.Array, input_ids: jax.Array, positions: jax.Array,
            meta: Any, *, config: NeoXConfig, block_size: int) -> tuple[jax.Array, jax.Array]:
    """One padded step over the paged cache ``[layers, 2, rows, heads, D]``: each layer writes its
    K / V at ``meta.slot_mapping`` (negative: the trash row), then each token attends to its
    request's rows ``j < seq_len``, ``j <= position`` through ``meta.block_table``."""
    return _paged(params, kv_cache, params["embed_in"][input_ids], positions, meta, config, block_size)


def embeds_forward(params: dict[str, Any], kv_cache: jax.Array, input_ids: jax.Array, positions: jax.Array,
                   meta: Any, *, config: NeoXConfig, block_size: int,
                   extra: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """:func:`forward` of a model that declares a per-token extra input ``embeds [T, hidden]``,
    added to the token embeddings (what multimodal embeddings look like to graphrt)."""
    x = params["embed_in"][input_ids] + extra["embeds"]
    return _paged(params, kv_cache, x, positions, meta, config, block_size)


def _paged(params: dict[str, Any], kv_cache: jax.Array, x: jax.Array, positions: jax.Array, meta: Any,
           config: NeoXConfig, block_size: int) -> tuple[jax.Array, jax.Array]:
    trash = kv_cache.shape[2] - 1
    slots = jnp.where(meta.slot_mapping < 0, trash, meta.slot_mapping)
    t = x.shape[0]
    num_reqs = meta.seq_lens.shape[0]
    req = jnp.clip(jnp.searchsorted(meta.query_start_loc, jnp.arange(t), side="right") - 1, 0, num_reqs - 1)
    blocks = meta.block_table[req]                                          # [T, B]
    rows = (blocks[:, :, None] * block_size + jnp.arange(block_size)).reshape(t, -1)
    j = jnp.arange(rows.shape[1])[None, :]
    visible = ((j < meta.seq_lens[req][:, None]) & (j <= positions[:, None])
               & (jnp.arange(t) < meta.query_start_loc[-1])[:, None])
    cache = [kv_cache]

    def attend(i: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        kv = cache[0].at[i, 0, slots].set(k).at[i, 1, slots].set(v)
        cache[0] = kv
        return _softmax_attend(q, kv[i, 0][rows], kv[i, 1][rows], visible)

    hidden = _layers(params, x, positions, config, attend)
    return hidden, cache[0]


def compute_logits(params: dict[str, Any], hidden: jax.Array, *, config: NeoXConfig) -> jax.Array:
    return (hidden @ params["embed_out"]).astype(jnp.float32)


def reference_logits(params: dict[str, Any], cfg: NeoXConfig, tokens: list[int],
                     embeds: np.ndarray | None = None) -> np.ndarray:
    """Plain causal forward of one whole sequence (no cache, no paging): logits ``[S, V]``;
    ``embeds [S, hidden]`` added to the token embeddings when given."""
    ids = jnp.asarray(tokens, jnp.int32)
    add = jnp.zeros((len(tokens), cfg.hidden_size), jnp.float32) if embeds is None else jnp.asarray(embeds)
    return np.asarray(_reference(params, ids, cfg, add))


@functools.partial(jax.jit, static_argnums=2)
def _reference(params: dict[str, Any], ids: jax.Array, cfg: NeoXConfig, embeds: jax.Array) -> jax.Array:
    s = ids.shape[0]
    positions = jnp.arange(s)
    causal = jnp.arange(s)[None, :] <= jnp.arange(s)[:, None]

    def attend(i: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return _softmax_attend(q, jnp.broadcast_to(k, (s,) + k.shape), jnp.broadcast_to(v, (s,) + v.shape), causal)

    hidden = _layers(params, params["embed_in"][ids] + embeds, positions, cfg, attend)
    return compute_logits(params, hidden, config=cfg)
