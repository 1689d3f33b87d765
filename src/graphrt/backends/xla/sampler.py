"""The XLA sampler: greedy, temperature, top-k, top-p and min-p, jitted apart from the forward.

The torch sampler's rules (docs/sampling.md): thresholds on ``P = exp((logits - max) / T)``,
top-k from ``lax.top_k`` of ``defaults.SAMPLER_TOP_K_CANDIDATES`` (``wide``: counted), top-p by
bisection over ``P``'s float32 bits. Gumbel-max with one threefry key per row (seed folded with
its ``steps``), so a seeded request's draw depends only on its seed and tokens sampled."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from graphrt.core import defaults
from graphrt.backends.xla.batch import SamplingMetadata

_ONE_BITS = 0x3F800000          # float32 1.0: every probability's bits are at most this


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """Argmax per row (int32 ``[R]``)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _row_noise(seed: jax.Array, step: jax.Array, vocab: int) -> jax.Array:
    key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), step)
    return jax.random.gumbel(key, (vocab,), jnp.float32)


def bisect_threshold(probs: jax.Array, target: jax.Array, count: bool) -> jax.Array:
    """Per row of ``probs`` ``[R, V]`` (values in [0, 1]) the largest ``t`` with
    ``sum(w[probs >= t]) >= target`` (``w``: ``probs``, or 1 with ``count``), ``target`` ``[R]``:
    a bisection over float32 bit patterns, exact after 30 iterations. ``[R]`` float32."""
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)
    target = jnp.maximum(target, jnp.finfo(jnp.float32).smallest_subnormal)
    weights = jnp.ones_like(probs) if count else probs

    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo + 1) // 2
        reach = jnp.sum(jnp.where(bits >= mid[:, None], weights, 0.0), axis=-1) >= target
        return jnp.where(reach, mid, lo), jnp.where(reach, hi, mid - 1)

    rows = probs.shape[0]
    bounds = (jnp.zeros(rows, jnp.int32), jnp.full(rows, _ONE_BITS, jnp.int32))
    lo, _ = jax.lax.fori_loop(0, defaults.SAMPLER_PROB_BITS, step, bounds)
    return jax.lax.bitcast_convert_type(lo, jnp.float32)


def filter_threshold(probs: jax.Array, meta: SamplingMetadata, candidates: int, wide: bool) -> jax.Array:
    """Per row the probability a kept token reaches: top-k, min-p, then top-p on what they keep."""
    vocab = probs.shape[-1]
    c = min(candidates, vocab)
    k = jnp.clip(meta.top_k, 1, vocab)
    top, _ = jax.lax.top_k(probs, c)
    tau = jnp.take_along_axis(top, (jnp.minimum(k, c) - 1)[:, None], axis=-1)[:, 0]
    tau = jnp.where(k >= vocab, 0.0, tau)
    if wide and c < vocab:
        kth = bisect_threshold(probs, k.astype(jnp.float32), count=True)
        tau = jnp.where((k > c) & (k < vocab), kth, tau)
    if meta.min_p is not None:
        tau = jnp.maximum(tau, meta.min_p)
    mass = jnp.sum(jnp.where(probs >= tau[:, None], probs, 0.0), axis=-1)
    nucleus = bisect_threshold(probs, meta.top_p * mass, count=False)
    return jnp.where(meta.top_p < 1.0, jnp.maximum(tau, nucleus), tau)


def sample_tokens(logits: jax.Array, meta: SamplingMetadata, *, wide: bool = False,
                  candidates: int | None = None) -> jax.Array:
    """One token per row of ``logits`` ``[R, V]`` under ``meta``'s per-row parameters (int32 ``[R]``);
    ``wide``: exact for a top_k past the ``candidates`` (``defaults.SAMPLER_TOP_K_CANDIDATES``)."""
    min_t = defaults.SAMPLER_MIN_TEMPERATURE
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1)
    t = jnp.maximum(meta.temperature, min_t)[:, None]
    # Shifted by the row's max before dividing: ``logits / t`` overflowed to inf for large
    # logits at a small temperature (ties among infs, not the most likely token); these are
    # <= 0 (the max exactly 0), and -inf only where the probability is 0.
    scaled = (logits - jnp.max(logits, axis=-1, keepdims=True)) / t
    probs = jnp.exp(scaled)
    tau = filter_threshold(probs, meta, defaults.SAMPLER_TOP_K_CANDIDATES if candidates is None else candidates,
                           wide)
    filtered = jnp.where(probs >= tau[:, None], scaled, -jnp.inf)
    noise = jax.vmap(_row_noise, in_axes=(0, 0, None))(meta.seeds, meta.steps, vocab)
    sampled = jnp.argmax(filtered + noise, axis=-1)
    return jnp.where(meta.temperature < min_t, greedy, sampled).astype(jnp.int32)


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int) -> tuple[jax.Array, ...]:
    """Per row of ``logits`` ``[N, V]``: the logprob of ``tokens[i]`` under ``log_softmax`` in
    float32, its rank (1 + tokens more likely) and the ``k`` largest logprobs with their ids,
    descending (the torch sampler's :func:`~graphrt.backends.torch.sampling.sampler.token_logprobs`)."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens.astype(jnp.int32)[:, None], axis=-1)
    ranks = jnp.sum(logprobs > chosen, axis=-1) + 1
    top, ids = jax.lax.top_k(logprobs, k)
    return chosen[:, 0], ranks.astype(jnp.int32), top, ids.astype(jnp.int32)


def sampled_logprobs(k: int):
    """The logprobs program of a sampler step: ``(logits [R, V], tokens [max_reqs])`` -- the
    sampler's padded output -- to :func:`token_logprobs` of the first ``R`` tokens."""
    def logprobs(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, ...]:
        return token_logprobs(logits, tokens[:logits.shape[0]], k)
    return logprobs
