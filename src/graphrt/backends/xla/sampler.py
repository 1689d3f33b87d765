"""The XLA sampler: greedy, temperature, top-k and top-p, jitted apart from the forward.

Same rules as the torch sampler (:mod:`graphrt.backends.torch.sampler`): top-p keeps the smallest prefix of
the top-k-renormalised distribution whose mass reaches ``top_p`` (always the first token),
and rows below the minimum temperature are greedy. Drawing uses the Gumbel-max trick
(``argmax(logits + Gumbel)``, the log form of the exponential race the torch sampler uses)
with one threefry key per row: the row's raw ``seeds`` folded with its ``steps`` counter, so a
seeded request's draw depends on nothing but its seed and how many tokens it has sampled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from graphrt.core import defaults
from graphrt.backends.xla.batch import SamplingMetadata


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """Argmax per row (int32 ``[R]``)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _row_noise(seed: jax.Array, step: jax.Array, vocab: int) -> jax.Array:
    key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), step)
    return jax.random.gumbel(key, (vocab,), jnp.float32)


def sample_tokens(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """One token per row of ``logits`` ``[R, V]`` under ``meta``'s per-row parameters (int32 ``[R]``)."""
    min_t = defaults.SAMPLER_MIN_TEMPERATURE
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(meta.temperature, min_t)[:, None]
    desc = jnp.flip(jnp.sort(scaled, axis=-1), axis=-1)
    ranks = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    in_top_k = ranks < jnp.clip(meta.top_k, 1, vocab)[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_top_k & (mass_before < meta.top_p[:, None])
    kept = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.take_along_axis(desc, (kept - 1)[:, None], axis=-1)
    filtered = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    noise = jax.vmap(_row_noise, in_axes=(0, 0, None))(meta.seeds, meta.steps, vocab)
    sampled = jnp.argmax(filtered + noise, axis=-1)
    return jnp.where(meta.temperature < min_t, greedy, sampled).astype(jnp.int32)


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int) -> tuple[jax.Array, ...]:
    """Per row of ``logits`` ``[N, V]``: the logprob of ``tokens[i]`` under ``log_softmax`` in
    float32, its rank (1 + tokens more likely) and the ``k`` largest logprobs with their ids,
    descending (the torch sampler's :func:`~graphrt.backends.torch.sampler.token_logprobs`)."""
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
