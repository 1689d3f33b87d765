"""Hybrid decoders in JAX (docs/hybrid.md): Mamba2, Granite-4-H, Qwen3-Next, Mamba, Falcon-Mamba,
LFM2, Jamba, RecurrentGemma, MiniMax, Nemotron-H, Falcon-H1 and Zamba2 over graphrt's paged KV
cache and recurrent-state cache, for the xla backend.

Params are the checkpoint's tensors by their transformers names (a flat dict; layers differ in
kind, so they are not stacked). :func:`forward` follows :class:`graphrt.backends.xla.programs.XlaModel`'s
signature with a cache pytree ``(kv, states)``: ``kv [attention layers, 2, rows, kv_heads,
head_dim]`` (empty for a model without attention) and per recurrent layer its state arrays
``[slots + 1, C, ...]`` (two; one for LFM2's short convolutions and MiniMax's lightning
attention); the step's ``state_slots`` and its uniform-decode form come as keywords.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from graphrt.core.kv_spec import KVCacheSpec
from graphrt.core.state_spec import StateSpec
from graphrt.models.hybrid_config import (ATTENTION, DELTA, FFN, LIGHTNING, MAMBA, MAMBA1, MOE, RG_LRU, SHORT_CONV,
                                          HybridConfig)
from graphrt.layers.jax import recurrent as rec
from graphrt.layers.jax.paged_attention import AttentionMetadata, cache_paged_attention, write_kv_rows
from graphrt.models.jax.loader import flat_linear as _linear, flat_param as _get, read_flat_params
from graphrt.models.jax.decoder import apply_rotary, rms_norm, rotary_cos_sin

Params = dict[str, Any]


@dataclass(frozen=True)
class _Names:
    """Where an architecture keeps its tensors: ``blocks`` models (Mamba, Mamba2, Nemotron-H) are
    blocks of a norm and a mixer (named ``mixer``); the others decoder layers of a mixer and an MLP."""

    root: str = "model"
    embed: str = "embed_tokens"
    final_norm: str = "norm"
    input_norm: str = "input_layernorm"
    post_norm: str = "post_attention_layernorm"
    attention: str = "self_attn"
    out_proj: str = "o_proj"
    q_norm: str = "q_norm"
    k_norm: str = "k_norm"
    blocks: bool = False


_BACKBONE = _Names(root="backbone", embed="embeddings", final_norm="norm_f", input_norm="norm", blocks=True)
_NAMES = {"Mamba2ForCausalLM": _BACKBONE, "MambaForCausalLM": _BACKBONE, "FalconMambaForCausalLM": _BACKBONE,
          "Lfm2ForCausalLM": _Names(final_norm="embedding_norm", input_norm="operator_norm", post_norm="ffn_norm",
                                    out_proj="out_proj", q_norm="q_layernorm", k_norm="k_layernorm"),
          "JambaForCausalLM": _Names(final_norm="final_layernorm", post_norm="pre_ff_layernorm"),
          "RecurrentGemmaForCausalLM": _Names(final_norm="final_norm", input_norm="temporal_pre_norm",
                                              post_norm="channel_pre_norm", attention="temporal_block")}
#: Each recurrent kind's module in a decoder layer (backbone blocks: ``mixer``).
_MIXER_NAMES = {DELTA: "linear_attn", SHORT_CONV: "conv", RG_LRU: "temporal_block", LIGHTNING: "self_attn"}
#: The state arrays of each layer kind that is not attention (others: two; Nemotron-H's
#: feed-forward layers: none).
_STATE_ARRAYS = {SHORT_CONV: 1, LIGHTNING: 1, FFN: 0, MOE: 0}
#: RecurrentGemma's activations (``HybridConfig.activation``, transformers' names).
_ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
                "gelu": lambda x: jax.nn.gelu(x, approximate=False), "silu": jax.nn.silu, "relu": jax.nn.relu}


@dataclass(frozen=True)
class JaxHybridConfig:
    """What the xla backend reads of a hybrid model's config (``JaxModelConfig``): the KV cache of
    its attention layers only (``num_hidden_layers`` is their count, 0 for a pure Mamba2), and
    the whole architecture in ``hybrid``."""

    hybrid: HybridConfig
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    num_attention_heads: int
    max_position_embeddings: int
    eos_token_id: tuple[int, ...]
    intermediate_size: int = 0
    state_layers: int = 0

    @classmethod
    def of(cls, c: HybridConfig) -> "JaxHybridConfig":
        return cls(c, c.vocab_size, c.hidden_size, len(c.attention_layer_ids), max(c.num_key_value_heads, 1),
                   max(c.head_dim, 1), max(c.num_attention_heads, 1), c.max_position_embeddings, c.eos_token_id,
                   c.intermediate_size, len(c.state_layer_ids))

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.hybrid.kv_cache_spec()

    def state_spec(self) -> StateSpec:
        return self.hybrid.state_spec()


def load_hybrid_params(model_dir: str | os.PathLike, config: HybridConfig, dtype: Any) -> Params:
    """Every checkpoint tensor, by name, as a ``dtype`` array (the forward reads what it needs; a
    missing one is an InputError naming it, at trace time)."""
    params = read_flat_params(model_dir, dtype)
    params.update({name: jnp.asarray(rate) for name, rate in _lightning_slopes(config).items()
                   if name not in params})
    return params


def _lightning_slopes(c: HybridConfig) -> dict[str, np.ndarray]:
    """Each lightning attention layer's per-head decay rates, as transformers computes its
    ``slope_rate`` buffer (for a checkpoint that does not store it): ``base ** (h + 1)`` with
    ``base = 2 ** (-8 / heads)``, scaled down linearly with the layer's depth."""
    heads, layers = c.num_attention_heads, c.num_hidden_layers
    base = 1.0 / (2.0 ** (8.0 / max(heads, 1)))
    rates = base ** np.arange(1, heads + 1, dtype=np.float32)
    return {f"model.layers.{i}.self_attn.slope_rate": (rates * (1 - i / (layers - 1 + 1e-5) + 1e-5)).astype(np.float32)
            for i, kind in enumerate(c.layer_kinds) if kind == LIGHTNING}


def _norm(p: Params, name: str, x: jax.Array, c: HybridConfig, eps: float | None = None) -> jax.Array:
    eps = c.rms_norm_eps if eps is None else eps
    if not c.zero_centered_norm:
        return rms_norm(x, _get(p, name), eps)
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return (h * (1.0 + _get(p, name).astype(jnp.float32))).astype(x.dtype)


def _mamba(p: Params, pre: str, h: jax.Array, caches: tuple[jax.Array, jax.Array], sm: rec.StateMeta,
           c: HybridConfig, s: dict[str, int]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    t = h.shape[0]
    proj = _linear(p, f"{pre}.in_proj", h * c.mamba_in_scale if c.mamba_in_scale != 1.0 else h)
    if c.mamba_proj_scales:                          # Falcon-H1's µP vector over z | x | B | C | dt
        widths = (c.mamba_intermediate,) * 2 + (c.mamba_groups * c.mamba_state,) * 2 + (c.mamba_heads,)
        proj = proj * jnp.repeat(jnp.asarray(c.mamba_proj_scales, proj.dtype), np.asarray(widths),
                                 total_repeat_length=proj.shape[-1])
    gate, xbc, dt = jnp.split(proj, [c.mamba_intermediate, c.mamba_intermediate + c.conv_dim], axis=-1)
    conv, ssm = caches
    xbc, window = rec.causal_conv1d(xbc, _get(p, f"{pre}.conv1d.weight")[:, 0], p.get(f"{pre}.conv1d.bias"),
                                    rec.read_states(conv, sm), sm, s["checkpoints"])
    g, n = c.mamba_groups, c.mamba_state
    x, B, C = jnp.split(xbc, [c.mamba_intermediate, c.mamba_intermediate + g * n], axis=-1)
    dt = jnp.clip(jax.nn.softplus(dt.astype(jnp.float32) + _get(p, f"{pre}.dt_bias").astype(jnp.float32)),
                  *c.time_step_limit)
    y, states = rec.ssd_scan(x.reshape(t, c.mamba_heads, c.mamba_head_dim), dt,
                             -jnp.exp(_get(p, f"{pre}.A_log").astype(jnp.float32)), B.reshape(t, g, n),
                             C.reshape(t, g, n), _get(p, f"{pre}.D"), rec.read_states(ssm, sm), sm,
                             chunk_size=c.chunk_size, checkpoints=s["checkpoints"], uniform=s["uniform"])
    y, z = y.reshape(t, -1), jax.nn.silu(gate.astype(jnp.float32))
    if c.mamba_gate == "gate":                       # Falcon-H1 without its norm
        y = (y * z).astype(h.dtype)
    else:
        grouped = (y * z if c.mamba_gate == "norm_gated" else y).reshape(t, g, -1)
        grouped = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + c.mamba_norm_eps)
        y = _get(p, f"{pre}.norm.weight") * grouped.reshape(t, -1).astype(h.dtype)
        y = (y * z).astype(h.dtype) if c.mamba_gate == "gate_after_norm" else y
    return _linear(p, f"{pre}.out_proj", y), (rec.write_states(conv, sm, window), rec.write_states(ssm, sm, states))


def _rms(x: jax.Array, eps: float) -> jax.Array:
    """An RMS norm without weight, in float32, in ``x``'s dtype (Falcon-Mamba's dt / B / C norms)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _mamba1(p: Params, pre: str, h: jax.Array, caches: tuple[jax.Array, ...], sm: rec.StateMeta,
            c: HybridConfig, s: dict[str, int]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Mamba / Falcon-Mamba / Jamba's mixer: the causal convolution and the selective scan of the
    step's requests over their (conv, ssm) states."""
    x, gate = jnp.split(_linear(p, f"{pre}.in_proj", h), 2, axis=-1)
    conv, ssm = caches
    x, window = rec.causal_conv1d(x, _get(p, f"{pre}.conv1d.weight")[:, 0], p.get(f"{pre}.conv1d.bias"),
                                  rec.read_states(conv, sm), sm, s["checkpoints"])
    dt, B, C = jnp.split(x @ _get(p, f"{pre}.x_proj.weight").T, [c.dt_rank, c.dt_rank + c.mamba_state], axis=-1)
    if c.scan_norm != "none":
        dt, B, C = (_rms(v, c.scan_norm_eps) for v in (dt, B, C))
    if c.scan_norm == "weighted":
        dt, B, C = (_get(p, f"{pre}.{n}_layernorm.weight") * v for n, v in (("dt", dt), ("b", B), ("c", C)))
    dt = jax.nn.softplus((dt @ _get(p, f"{pre}.dt_proj.weight").T).astype(jnp.float32)
                         + _get(p, f"{pre}.dt_proj.bias").astype(jnp.float32))
    y, states = rec.selective_scan(x, dt, -jnp.exp(_get(p, f"{pre}.A_log").astype(jnp.float32)), B, C,
                                   _get(p, f"{pre}.D"), rec.read_states(ssm, sm), sm, checkpoints=s["checkpoints"],
                                   uniform=s["uniform"])
    y = (y * jax.nn.silu(gate.astype(jnp.float32))).astype(h.dtype)
    return _linear(p, f"{pre}.out_proj", y), (rec.write_states(conv, sm, window), rec.write_states(ssm, sm, states))


def _short_conv(p: Params, pre: str, h: jax.Array, caches: tuple[jax.Array, ...], sm: rec.StateMeta,
                c: HybridConfig, s: dict[str, int]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """LFM2's gated short convolution: ``out_proj(C * conv(B * x))``, no activation."""
    B, C, x = jnp.split(_linear(p, f"{pre}.in_proj", h), 3, axis=-1)
    (conv,) = caches
    out, window = rec.causal_conv1d(B * x, _get(p, f"{pre}.conv.weight")[:, 0], p.get(f"{pre}.conv.bias"),
                                    rec.read_states(conv, sm), sm, s["checkpoints"], activation=False)
    return _linear(p, f"{pre}.out_proj", C * out), (rec.write_states(conv, sm, window),)


def _rg_lru(p: Params, pre: str, h: jax.Array, caches: tuple[jax.Array, ...], sm: rec.StateMeta,
            c: HybridConfig, s: dict[str, int]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """RecurrentGemma's recurrent block: ``linear_out(rg_lru(conv(linear_x h)) * act(linear_y h))``;
    the RG-LRU gates per block of channels, the recurrence reset at a request's first position."""
    conv, lru = caches
    y = _ACTIVATIONS[c.activation](_linear(p, f"{pre}.linear_y", h))
    x, window = rec.causal_conv1d(_linear(p, f"{pre}.linear_x", h), _get(p, f"{pre}.conv_1d.weight")[:, 0],
                                  p.get(f"{pre}.conv_1d.bias"), rec.read_states(conv, sm), sm, s["checkpoints"],
                                  activation=False)
    t, width = x.shape
    g = f"{pre}.rg_lru"
    blocks = x.reshape(t, c.num_attention_heads, -1)

    def gate(name: str) -> jax.Array:
        out = jnp.einsum("thi,hij->thj", blocks, _get(p, f"{g}.{name}_gate_weight")) + _get(p, f"{g}.{name}_gate_bias")
        return jax.nn.sigmoid(out).reshape(t, width)

    log_a = -8.0 * gate("recurrent").astype(jnp.float32) * jax.nn.softplus(
        _get(p, f"{g}.recurrent_param").astype(jnp.float32))
    reset = ((sm.token_index == 0) & ~sm.has_initial[sm.token_req])[:, None]
    a = jnp.where(reset, 0.0, jnp.exp(log_a))
    scale = jnp.where(reset, 1.0, jnp.sqrt(1.0 - jnp.exp(2.0 * log_a)))
    b = x * gate("input") * scale.astype(x.dtype)
    out, states = rec.rg_lru_scan(a, b, rec.read_states(lru, sm), sm, checkpoints=s["checkpoints"],
                                  uniform=s["uniform"])
    return (_linear(p, f"{pre}.linear_out", out.astype(h.dtype) * y),
            (rec.write_states(conv, sm, window), rec.write_states(lru, sm, states)))


def _lightning(p: Params, pre: str, h: jax.Array, caches: tuple[jax.Array, ...], sm: rec.StateMeta,
               c: HybridConfig, s: dict[str, int]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """MiniMax's lightning attention: ``q, k, v = act(qkv_proj h)`` (q | k | v in each head's
    slice), the decayed linear attention per head over the request's ``[heads, d, d]`` state, an
    RMS norm over every head's output, the gate ``sigmoid(output_gate h)``, ``out_proj``."""
    t, heads, d = h.shape[0], c.num_attention_heads, c.head_dim
    qkv = _ACTIVATIONS[c.activation](_linear(p, f"{pre}.qkv_proj", h)).reshape(t, heads, 3 * d)
    q, k, v = jnp.split(qkv, 3, axis=-1)
    (kv,) = caches
    y, states = rec.lightning_attention(q, k, v, _get(p, f"{pre}.slope_rate").reshape(-1), rec.read_states(kv, sm), sm,
                                        chunk_size=c.chunk_size, checkpoints=s["checkpoints"], uniform=s["uniform"])
    y = rms_norm(y.astype(h.dtype).reshape(t, -1), _get(p, f"{pre}.norm.weight"), c.mamba_norm_eps)
    return _linear(p, f"{pre}.out_proj", jax.nn.sigmoid(_linear(p, f"{pre}.output_gate", h)) * y), \
        (rec.write_states(kv, sm, states),)


def _delta(p: Params, pre: str, h: jax.Array, caches: tuple[jax.Array, jax.Array], sm: rec.StateMeta,
           c: HybridConfig, s: dict[str, int]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    t = h.shape[0]
    hk, hv, dk, dv = c.delta_key_heads, c.delta_value_heads, c.delta_key_dim, c.delta_value_dim
    per = hv // hk
    qkvz = _linear(p, f"{pre}.in_proj_qkvz", h).reshape(t, hk, 2 * dk + 2 * per * dv)
    q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + per * dv], axis=-1)
    b, a = jnp.split(_linear(p, f"{pre}.in_proj_ba", h).reshape(t, hk, 2 * per), [per], axis=-1)
    qkv = jnp.concatenate([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], axis=-1)
    conv, delta = caches
    mixed, window = rec.causal_conv1d(qkv, _get(p, f"{pre}.conv1d.weight")[:, 0], None, rec.read_states(conv, sm),
                                      sm, s["checkpoints"])
    q, k, v = jnp.split(mixed, [hk * dk, 2 * hk * dk], axis=-1)
    g = -jnp.exp(_get(p, f"{pre}.A_log").astype(jnp.float32)) * jax.nn.softplus(
        a.reshape(t, hv).astype(jnp.float32) + _get(p, f"{pre}.dt_bias").astype(jnp.float32))
    y, states = rec.gated_delta_rule(q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv), g,
                                     jax.nn.sigmoid(b.reshape(t, hv).astype(jnp.float32)), rec.read_states(delta, sm),
                                     sm, chunk_size=c.chunk_size, checkpoints=s["checkpoints"], uniform=s["uniform"])
    y = y.astype(h.dtype).reshape(-1, dv).astype(jnp.float32)
    y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + c.mamba_norm_eps)
    y = (_get(p, f"{pre}.norm.weight") * y.astype(h.dtype)) * jax.nn.silu(z.reshape(-1, dv).astype(jnp.float32))
    return (_linear(p, f"{pre}.out_proj", y.astype(h.dtype).reshape(t, -1)),
            (rec.write_states(conv, sm, window), rec.write_states(delta, sm, states)))


def _attention(p: Params, pre: str, h: jax.Array, positions: jax.Array, kv: jax.Array, index: int,
               meta: AttentionMetadata, c: HybridConfig, block_size: int, use: int = -1) -> tuple[jax.Array, jax.Array]:
    """One attention layer over the paged cache (``use``: Zamba2's use of a shared block, whose
    q / k / v adapters it adds)."""
    t, hd = h.shape[0], c.head_dim
    gate = None
    if c.attention_output_gate:
        q, gate = jnp.split(_linear(p, f"{pre}.q_proj", h).reshape(t, c.num_attention_heads, 2 * hd), 2, axis=-1)
        gate = gate.reshape(t, -1)
    else:
        q = _linear(p, f"{pre}.q_proj", h).reshape(t, c.num_attention_heads, hd)
    k = _linear(p, f"{pre}.k_proj", h).reshape(t, c.num_key_value_heads, hd)
    v = _linear(p, f"{pre}.v_proj", h).reshape(t, c.num_key_value_heads, hd)
    k = k * c.key_multiplier if c.key_multiplier != 1.0 else k          # Falcon-H1
    if use >= 0 and c.shared_attention_adapters:
        q, k, v = (x + _adapter(p, f"{pre}.linear_{n}_adapter_list.{use}", h).reshape(x.shape)
                   for n, x in (("q", q), ("k", k), ("v", v)))
    names = _NAMES.get(c.architecture, _Names())
    if c.qk_norm:
        q, k = _norm(p, f"{pre}.{names.q_norm}.weight", q, c), _norm(p, f"{pre}.{names.k_norm}.weight", k, c)
    if c.rope_theta is not None and c.rotary_dim:
        cos, sin = rotary_cos_sin(positions, c.rotary_dim, c.rope_theta)
        r = c.rotary_dim
        q = jnp.concatenate([apply_rotary(q[..., :r], cos, sin), q[..., r:]], axis=-1)
        k = jnp.concatenate([apply_rotary(k[..., :r], cos, sin), k[..., r:]], axis=-1)
    if c.attention_scale is not None:                 # paged_attention scales by head_dim ** -0.5
        q = q * (c.attention_scale * hd ** 0.5)
    rows = jnp.where(meta.slot_mapping < 0, kv.shape[2] - 1, meta.slot_mapping)
    kv = write_kv_rows(kv, jnp.asarray(index, jnp.int32), rows.astype(jnp.int32), k.astype(kv.dtype),
                       v.astype(kv.dtype))
    out = cache_paged_attention(q, kv, index, positions, meta, block_size,
                                sliding_window=c.sliding_window).reshape(t, -1)
    if gate is not None:
        out = out * jax.nn.sigmoid(gate)
    return _linear(p, f"{pre}.{names.out_proj}", out), kv


def _minimax_experts(p: Params, pre: str, x: jax.Array, c: HybridConfig) -> jax.Array:
    """MiniMax's experts (Mixtral's): softmax over the router's logits, the top k renormalised;
    every expert computed for every token (static shapes), the unrouted ones weighted 0."""
    moe = f"{pre}.block_sparse_moe"
    probs = jax.nn.softmax((x @ _get(p, f"{moe}.gate.weight").T).astype(jnp.float32), axis=-1)
    top, index = jax.lax.top_k(probs, c.num_experts_per_tok)
    top = top / jnp.sum(top, axis=-1, keepdims=True)
    weights = jnp.zeros_like(probs).at[jnp.arange(x.shape[0])[:, None], index].set(top).astype(x.dtype)
    act = _ACTIVATIONS[c.activation]
    out = jnp.zeros_like(x)
    for e in range(c.num_experts):
        ex = f"{moe}.experts.{e}"
        up = act(_linear(p, f"{ex}.w1", x)) * _linear(p, f"{ex}.w3", x)
        out = out + weights[:, e:e + 1] * _linear(p, f"{ex}.w2", up)
    return out


def _residual(c: HybridConfig, part: str, x: jax.Array, h: jax.Array, out: jax.Array) -> jax.Array:
    """The stream after a layer's ``part`` (a layer kind or "mlp") whose input ``x`` was normed
    to ``h``: ``x + out * residual_multiplier``, or MiniMax's ``alpha * h + beta * out``."""
    if not c.residual_factors:
        return x + out * c.residual_multiplier
    alpha, beta = next((a, b) for name, a, b in c.residual_factors if name == part)
    return h * alpha + out * beta


def _mlp(p: Params, pre: str, x: jax.Array, c: HybridConfig, layer: int) -> jax.Array:
    if c.mlp == "minimax":
        return _minimax_experts(p, pre, x, c)
    if c.mlp == "falcon_h1":
        return _falcon_h1_mlp(p, f"{pre}.feed_forward", x, c)
    if c.mlp == "granite":
        gate, up = jnp.split(_linear(p, f"{pre}.shared_mlp.input_linear", x), 2, axis=-1)
        out = _linear(p, f"{pre}.shared_mlp.output_linear", jax.nn.silu(gate) * up)
        if c.num_experts:
            logits = (x @ _get(p, f"{pre}.block_sparse_moe.router.layer.weight").T).astype(jnp.float32)
            top, index = jax.lax.top_k(logits, c.num_experts_per_tok)
            weights = jnp.zeros_like(logits).at[jnp.arange(x.shape[0])[:, None], index].set(
                jax.nn.softmax(top, axis=-1)).astype(x.dtype)
            gu = jnp.einsum("th,eih->tei", x, _get(p, f"{pre}.block_sparse_moe.input_linear.weight"))
            g, u = jnp.split(gu, 2, axis=-1)
            experts = jnp.einsum("tei,ehi->teh", jax.nn.silu(g) * u, _get(p, f"{pre}.block_sparse_moe.output_linear.weight"))
            out = jnp.einsum("te,teh->th", weights, experts) + out
        return out
    if c.mlp == "lfm2":
        ff = f"{pre}.feed_forward"
        return _linear(p, f"{ff}.w2", jax.nn.silu(_linear(p, f"{ff}.w1", x)) * _linear(p, f"{ff}.w3", x))

    def mlp(name: str) -> jax.Array:
        return _linear(p, f"{name}.down_proj", jax.nn.silu(_linear(p, f"{name}.gate_proj", x)) * _linear(p, f"{name}.up_proj", x))

    if c.mlp == "recurrent_gemma":
        m = f"{pre}.mlp_block"
        return _linear(p, f"{m}.down_proj", _ACTIVATIONS[c.activation](_linear(p, f"{m}.gate_proj", x))
                       * _linear(p, f"{m}.up_proj", x))
    if c.mlp == "jamba":
        ff = f"{pre}.feed_forward"
        if layer not in c.moe_layers:
            return mlp(ff)
        # softmax over the router's logits, the top k weights left unnormalised; every expert
        # computed for every token (static shapes), the unrouted ones weighted 0
        probs = jax.nn.softmax((x @ _get(p, f"{ff}.router.weight").T).astype(jnp.float32), axis=-1)
        top, index = jax.lax.top_k(probs, c.num_experts_per_tok)
        weights = jnp.zeros_like(probs).at[jnp.arange(x.shape[0])[:, None], index].set(top).astype(x.dtype)
        return sum(weights[:, e:e + 1] * mlp(f"{ff}.experts.{e}") for e in range(c.num_experts))

    probs = jax.nn.softmax((x @ _get(p, f"{pre}.mlp.gate.weight").T).astype(jnp.float32), axis=-1)
    top, index = jax.lax.top_k(probs, c.num_experts_per_tok)
    if c.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    weights = jnp.zeros_like(probs).at[jnp.arange(x.shape[0])[:, None], index].set(top).astype(x.dtype)
    out = jax.nn.sigmoid(_linear(p, f"{pre}.mlp.shared_expert_gate", x)) * mlp(f"{pre}.mlp.shared_expert")
    for e in range(c.num_experts):
        out = out + weights[:, e:e + 1] * mlp(f"{pre}.mlp.experts.{e}")
    return out


#: The recurrent mixer of each layer kind.
_MIXERS = {MAMBA: _mamba, DELTA: _delta, MAMBA1: _mamba1, SHORT_CONV: _short_conv, RG_LRU: _rg_lru,
           LIGHTNING: _lightning}


# ---- Nemotron-H and Falcon-H1 (Mamba2 hybrids) ---------------------------------------------------

_NAMES.update({"NemotronHForCausalLM": _Names(root="backbone", embed="embeddings", final_norm="norm_f",
                                              input_norm="norm", attention="mixer", blocks=True),
               "FalconH1ForCausalLM": _Names(final_norm="final_layernorm", post_norm="pre_ff_layernorm")})
_ACTIVATIONS["relu2"] = lambda x: jnp.square(jax.nn.relu(x))


def _nemotron_mlp(p: Params, pre: str, h: jax.Array, caches: tuple[jax.Array, ...], sm: rec.StateMeta,
                  c: HybridConfig, s: dict[str, int]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Nemotron-H's MLP block: ``down(relu(up x)²)``, no gate, no state."""
    return _linear(p, f"{pre}.down_proj", _ACTIVATIONS[c.activation](_linear(p, f"{pre}.up_proj", h))), ()


def _expert_weights(p: Params, pre: str, name: str, experts: int) -> jax.Array:
    """``[E, out, in]``: the checkpoint's stacked tensor, or its per-expert ones stacked."""
    if f"{pre}.experts.{name}" in p:
        return p[f"{pre}.experts.{name}"]
    return jnp.stack([_get(p, f"{pre}.experts.{e}.{name}.weight") for e in range(experts)])


def _nemotron_moe(p: Params, pre: str, h: jax.Array, caches: tuple[jax.Array, ...], sm: rec.StateMeta,
                  c: HybridConfig, s: dict[str, int]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Nemotron-H's experts block: sigmoid scores (plus the correction bias for the choice) in
    ``expert_groups`` groups, the top groups by their two best scores, the top k experts of them
    weighted by their scores (normalised, times ``routed_scaling_factor``); relu² experts computed
    densely (static shapes, unrouted ones weighted 0), plus the shared expert."""
    t, e = h.shape[0], c.num_experts
    scores = jax.nn.sigmoid(h.astype(jnp.float32) @ _get(p, f"{pre}.gate.weight").astype(jnp.float32).T)
    choice = scores + p.get(f"{pre}.gate.e_score_correction_bias", jnp.zeros((e,))).astype(jnp.float32)
    rows = jnp.arange(t)[:, None]
    if c.expert_groups > 1:
        best = jax.lax.top_k(choice.reshape(t, c.expert_groups, -1), 2)[0].sum(-1)
        keep = jnp.zeros_like(best).at[rows, jax.lax.top_k(best, c.topk_groups)[1]].set(1.0)
        choice = jnp.where(jnp.repeat(keep, e // c.expert_groups, axis=1) > 0, choice, -jnp.inf)
    index = jax.lax.top_k(choice, c.num_experts_per_tok)[1]
    top = jnp.take_along_axis(scores, index, axis=1)
    if c.norm_topk_prob:
        top = top / (jnp.sum(top, axis=-1, keepdims=True) + 1e-20)
    weights = jnp.zeros_like(scores).at[rows, index].set(top * c.routed_scaling_factor)
    act = _ACTIVATIONS[c.activation]
    hidden = act(jnp.einsum("th,eih->tei", h, _expert_weights(p, pre, "up_proj", e)))
    experts = jnp.einsum("tei,ehi->teh", hidden, _expert_weights(p, pre, "down_proj", e))
    out = jnp.einsum("te,teh->th", weights, experts.astype(jnp.float32)).astype(h.dtype)
    return out + _nemotron_mlp(p, f"{pre}.shared_experts", h, caches, sm, c, s)[0], ()


def _falcon_h1_mlp(p: Params, ff: str, x: jax.Array, c: HybridConfig) -> jax.Array:
    """Falcon-H1's SwiGLU with its two multipliers: ``down(up x * silu(gate_mult * gate x)) * down_mult``."""
    gate_scale, down_scale = c.mlp_multipliers
    y = _linear(p, f"{ff}.up_proj", x) * jax.nn.silu(_linear(p, f"{ff}.gate_proj", x) * gate_scale)
    return _linear(p, f"{ff}.down_proj", y) * down_scale


_MIXERS.update({FFN: _nemotron_mlp, MOE: _nemotron_moe})
_NAMES["Zamba2ForCausalLM"] = _Names(final_norm="final_layernorm")


def _adapter(p: Params, name: str, x: jax.Array) -> jax.Array:
    """Zamba2's per-use adapter ``up(down x)``; where the checkpoint has none for a use (a block's
    list holds transformers' ``nn.Identity`` at other blocks' uses), ``x`` itself."""
    if f"{name}.0.weight" not in p:
        return x
    return _linear(p, f"{name}.1", _linear(p, f"{name}.0", x))


def _zamba2_layer(p: Params, i: int, x: jax.Array, embeds: jax.Array, positions: jax.Array, kv: jax.Array, a: int,
                  caches: tuple[jax.Array, ...], meta: AttentionMetadata, sm: rec.StateMeta, c: HybridConfig,
                  s: dict[str, int], block_size: int) -> tuple[jax.Array, jax.Array, int, tuple[jax.Array, ...]]:
    """Zamba2's layer ``i``: a hybrid layer's k-th use of shared block ``k % shared_blocks`` (the
    weights of the layer that first used it: tied) -- attention (KV layer ``a``, the use's
    adapters) on the normed ``[x, embeddings]``, its gated MLP, the layer's ``linear`` -- added to
    the Mamba2 mixer's input; the mixer's output added to ``x``. Returns (x, kv, next a, states)."""
    pre = f"model.layers.{i}"
    if i in c.mamba_attention_layers:
        use = c.mamba_attention_layers.index(i)
        blk = f"model.layers.{c.mamba_attention_layers[use % c.shared_blocks]}.shared_transformer"
        h = _norm(p, f"{blk}.input_layernorm.weight", jnp.concatenate([x, embeds], axis=-1), c)
        out, kv = _attention(p, f"{blk}.self_attn", h, positions, kv, a, meta, c, block_size, use=use)
        h = _norm(p, f"{blk}.pre_ff_layernorm.weight", out, c)
        ff = f"{blk}.feed_forward"
        gate_up = _linear(p, f"{ff}.gate_up_proj", h) + _adapter(p, f"{ff}.gate_up_proj_adapter_list.{use}", h)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        shared = _linear(p, f"{pre}.linear", _linear(p, f"{ff}.down_proj", _ACTIVATIONS[c.activation](gate) * up))
        pre, a = f"{pre}.mamba_decoder", a + 1
        h = _norm(p, f"{pre}.input_layernorm.weight", x + shared, c)
    else:
        h = _norm(p, f"{pre}.input_layernorm.weight", x, c)
    out, caches = _mamba(p, f"{pre}.mamba", h, caches, sm, c, s)
    return x + out, kv, a, caches


def forward(params: Params, cache: Any, input_ids: jax.Array, positions: jax.Array, meta: AttentionMetadata, *,
            config: JaxHybridConfig, block_size: int, state_slots: jax.Array, uniform: int, num_slots: int,
            checkpoints: int) -> tuple[jax.Array, Any]:
    """The model on ``T`` flattened tokens: (final-normed hidden ``[T, H]``, new cache ``(kv, states)``).
    ``uniform`` (static): q > 0 when every request schedules q tokens (the recurrent form)."""
    c = config.hybrid
    kv, states = cache
    states = list(states)
    t = input_ids.shape[0]
    sm = rec.state_meta(meta.query_start_loc, meta.seq_lens, state_slots, t, num_slots=num_slots,
                        checkpoints=checkpoints)
    s = {"checkpoints": checkpoints, "uniform": uniform if uniform and t == state_slots.shape[0] * uniform else 0}
    names = _NAMES.get(c.architecture, _Names())
    backbone = names.blocks
    x = _get(params, f"{names.root}.{names.embed}.weight")[input_ids]
    x = x * c.embedding_multiplier if c.embedding_multiplier != 1.0 else x
    embeds = x
    a = o = 0                                        # attention layers, state arrays so far
    for i, kind in enumerate(c.layer_kinds):
        pre = f"{names.root}.layers.{i}"
        if c.shared_blocks:                          # Zamba2
            x, kv, a, states[o:o + 2] = _zamba2_layer(params, i, x, embeds, positions, kv, a, tuple(states[o:o + 2]),
                                                      meta, sm, c, s, block_size)
            o += 2
            continue
        h = _norm(params, f"{pre}.{names.input_norm}.weight", x, c)
        if kind == ATTENTION:
            out, kv = _attention(params, f"{pre}.{names.attention}", h, positions, kv, a, meta, c, block_size)
            a += 1
        else:
            mixer = _MIXERS[kind]
            name = f"{pre}.mixer" if backbone else f"{pre}.{_MIXER_NAMES.get(kind, 'mamba')}"
            n = _STATE_ARRAYS.get(kind, 2)
            out, arrays = mixer(params, name, h, tuple(states[o:o + n]), sm, c, s)
            states[o:o + n] = arrays
            o += n
            if i in c.mamba_attention_layers:         # Falcon-H1: attention beside the mixer, on the same input
                att, kv = _attention(params, f"{pre}.{names.attention}", h * c.attention_in_multiplier, positions,
                                     kv, a, meta, c, block_size)
                out = out * c.ssm_out_multiplier + att * c.attention_out_multiplier
                a += 1
        x = _residual(c, kind, x, h, out)
        if backbone:
            continue
        h = _norm(params, f"{pre}.{names.post_norm}.weight", x, c)
        x = _residual(c, "mlp", x, h, _mlp(params, pre, h, c, i))
    return _norm(params, f"{names.root}.{names.final_norm}.weight", x, c), (kv, tuple(states))


def compute_logits(params: Params, hidden: jax.Array, *, config: JaxHybridConfig) -> jax.Array:
    """float32 logits ``[N, V]`` (Granite divides by ``logits_scaling``; RecurrentGemma soft-caps;
    Falcon-H1 multiplies by ``lm_head_multiplier``)."""
    c = config.hybrid
    head = params.get("lm_head.weight")
    if head is None or c.tie_word_embeddings:
        names = _NAMES.get(c.architecture, _Names())
        head = params[f"{names.root}.{names.embed}.weight"]
    logits = (hidden @ head.T).astype(jnp.float32)
    if c.logits_soft_cap > 0:
        logits = jnp.tanh(logits / c.logits_soft_cap) * c.logits_soft_cap
    logits = logits * c.lm_head_multiplier if c.lm_head_multiplier != 1.0 else logits      # Falcon-H1
    return logits / c.logits_scaling if c.logits_scaling != 1.0 else logits


__all__ = ["JaxHybridConfig", "compute_logits", "forward", "load_hybrid_params"]
