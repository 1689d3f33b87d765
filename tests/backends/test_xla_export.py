"""graphrt's XLA programs exported with ``jax.export`` for cpu, cuda and tpu at once (no device of
the last two needed): serialized, reloaded and run on this CPU, they equal the compiled
executables the runner steps with (issue 41)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytest.importorskip("flatbuffers", reason="jax.export serializes with flatbuffers (graphrt[jax] and [dev] install it)")

import graphrt  # noqa: E402
from graphrt.backends.xla.batch import SamplingMetadata, XlaBatch  # noqa: E402
from graphrt.backends.xla.export import EXPORT_PLATFORMS, export_programs  # noqa: E402
from graphrt.core.dispatch import BatchDescriptor, SamplerKey  # noqa: E402
from graphrt.core.graph_modes import RuntimeMode  # noqa: E402
from support.hf_models import tiny_hf_model_dir  # noqa: E402

LIMITS = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, block_size=4,
              precompile_token_paddings=[16], precompile_bs_paddings=[2])
BS = LIMITS["block_size"]


def step_batch(key: BatchDescriptor, width: int, vocab: int) -> XlaBatch:
    """A padded step of ``key``: two requests (a decode key: one token each at positions 5 and 2;
    a mixed key: prompts of 6 and 3 tokens, the rest padding) over blocks 1.. of a table ``width``
    wide."""
    rng = np.random.default_rng(0)
    t, r = key.num_tokens, key.num_reqs
    lens = [6, 3] if not key.uniform_decode else [6, 3][:r]
    q = [1] * r if key.uniform_decode else lens
    table = (1 + np.arange(r * width, dtype=np.int32)).reshape(r, width)
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    positions = np.zeros(t, np.int32)
    slots = np.full(t, -1, np.int32)
    for i in range(r):
        pos = np.arange(lens[i] - q[i], lens[i])
        positions[qsl[i]:qsl[i + 1]] = pos
        slots[qsl[i]:qsl[i + 1]] = table[i, pos // BS] * BS + pos % BS
    i32 = np.int32
    return XlaBatch(rng.integers(3, vocab, t).astype(i32), positions, slots, qsl, np.asarray(lens, i32),
                    np.full(r, -1, i32), table, t, r, key.uniform_decode)


def test_programs_export_for_three_platforms_and_reload_equal_on_cpu():
    runner = graphrt.ModelRunner(str(tiny_hf_model_dir("qwen3")), backend="xla", num_kv_blocks=40,
                                 progress=False, **LIMITS)
    ex, vocab = runner.executor, runner.vocab_size
    exported = export_programs(ex)
    forward = {k for _, k in runner.cache}
    assert set(exported) == forward | set(runner.sampler_cache) and len(forward) == 2
    rng = np.random.default_rng(1)
    # Some KV already there: a step's attention reads it.
    kv = jnp.asarray(rng.standard_normal(ex.kv_cache.shape), ex.kv_cache.dtype)
    for key, art in exported.items():
        assert art.platforms == EXPORT_PLATFORMS
        reloaded = jax.export.deserialize(art.serialize())
        if isinstance(key, BatchDescriptor):
            entry = runner.cache.lookup((RuntimeMode.FULL, key))
            batch = step_batch(key, entry.shapes[-1][1], vocab)
            future = (np.zeros(ex.programs.max_reqs, np.int32), np.full(key.num_reqs, -1, np.int32))
            want = entry.executable(ex.weights, jnp.array(kv, copy=True), batch, *future)
            got = reloaded.call(ex.weights, kv, batch, *future)
            logits, cache = np.asarray(got[0]), np.asarray(got[2])
            np.testing.assert_allclose(logits, np.asarray(want[0]), rtol=1e-5, atol=1e-5, err_msg=str(key))
            np.testing.assert_allclose(cache, np.asarray(want[2]), rtol=1e-5, atol=1e-5, err_msg=str(key))
            assert np.abs(cache - np.asarray(kv)).max() > 0          # the step wrote its K / V
        else:
            entry = runner.sampler_cache.lookup(key)
            assert isinstance(key, SamplerKey)
            logits = rng.standard_normal((key.num_reqs, vocab)).astype(np.float32)
            args = (logits,) if key.greedy else (logits, SamplingMetadata(
                np.full(key.num_reqs, 0.8, np.float32), np.full(key.num_reqs, 20, np.int32),
                np.full(key.num_reqs, 0.9, np.float32), np.arange(2 * key.num_reqs, dtype=np.uint32).reshape(-1, 2),
                np.arange(key.num_reqs, dtype=np.uint32), np.zeros(key.num_reqs, np.float32)))
            if key.logprobs:
                args = (logits, np.zeros(ex.programs.max_reqs, np.int32))
            for got, want in zip(jax.tree_util.tree_leaves(reloaded.call(*args)),
                                 jax.tree_util.tree_leaves(entry.executable(*args))):
                np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6, err_msg=str(key))
