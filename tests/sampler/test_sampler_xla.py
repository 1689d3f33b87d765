"""The XLA sampler's thresholds: the same distribution as the sort-based sampler (chi-square and
exact support per filter, tests/support/sampler_reference.py), an exact bisection (hypothesis), and no
sort of the vocabulary in its program."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from graphrt.backends.xla.batch import SamplingMetadata  # noqa: E402
from graphrt.backends.xla.sampler import bisect_threshold, sample_tokens  # noqa: E402
from support.sampler_reference import chi_square_pvalue, filtered_probs  # noqa: E402
from support.fast_subset import examples
from test_sampler_filters import ALPHA, CASES, VOCAB, _logits  # noqa: E402

DRAWS = 20_000


def _meta(rows: int, t: float, k: int, p: float, mp: float, seed: int = 0) -> SamplingMetadata:
    seeds = np.random.default_rng(seed).integers(0, 2**32, (rows, 2), dtype=np.uint32)
    return SamplingMetadata(jnp.full(rows, t, jnp.float32), jnp.full(rows, VOCAB if k < 0 else k, jnp.int32),
                            jnp.full(rows, p, jnp.float32), jnp.asarray(seeds), jnp.zeros(rows, jnp.uint32),
                            jnp.full(rows, mp, jnp.float32))


@pytest.mark.parametrize("case", list(CASES))
def test_xla_draws_follow_the_sort_based_distribution(case):
    scale, t, k, p, mp, cands = CASES[case]
    row = _logits(scale)
    sample = jax.jit(lambda logits, meta: sample_tokens(logits, meta, wide=cands is not None, candidates=cands))
    tokens = np.asarray(sample(jnp.broadcast_to(jnp.asarray(row), (DRAWS, VOCAB)), _meta(DRAWS, t, k, p, mp)))
    probs = filtered_probs(row, t, k, p, mp)
    counts = np.bincount(tokens, minlength=VOCAB)
    assert set(np.flatnonzero(counts).tolist()) == set(np.flatnonzero(probs).tolist()), f"{case}: support"
    assert chi_square_pvalue(counts, probs) > ALPHA, f"{case}: chi-square rejects the sort-based distribution"


def test_xla_greedy_rows_are_the_argmax():
    logits = jnp.asarray(np.random.default_rng(3).standard_normal((8, 300)).astype(np.float32) * 4)
    meta = _meta(8, 1.0, 20, 0.9, 0.05)
    meta = SamplingMetadata(jnp.asarray([0.0, 1.0] * 4, jnp.float32), *[getattr(meta, f) for f in
                                                                        ("top_k", "top_p", "seeds", "steps", "min_p")])
    out = np.asarray(jax.jit(sample_tokens)(logits, meta))
    np.testing.assert_array_equal(out[::2], np.asarray(jnp.argmax(logits, axis=-1))[::2])


PROBS = hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 200)),
                   elements=st.sampled_from([0.0, 1.0, 0.5, 1e-30, 1e-45]) | st.floats(0, 1, width=32))


@settings(max_examples=examples(60), deadline=None)
@given(probs=PROBS, data=st.data())
def test_xla_bisection_finds_the_exact_kth_largest(probs, data):
    rows, vocab = probs.shape
    k = data.draw(hnp.arrays(np.int64, (rows,), elements=st.integers(1, vocab)))
    got = np.asarray(bisect_threshold(jnp.asarray(probs), jnp.asarray(k, jnp.float32), count=True))
    np.testing.assert_array_equal(got, np.sort(probs, axis=1)[:, ::-1][np.arange(rows), k - 1])


def test_an_xla_runner_compiles_the_wide_sampler_on_first_use(monkeypatch):
    """A batch with a top_k past the candidates gets the wide program (compiled when first
    asked: XLA has no eager path) and only top-k tokens."""
    from graphrt import ModelRunner
    from graphrt.core import defaults
    from graphrt.core.sampling.batch import SamplingBatch
    from support.hf_models import tiny_hf_model_dir

    monkeypatch.setattr(defaults, "SAMPLER_TOP_K_CANDIDATES", 8)
    runner = ModelRunner(str(tiny_hf_model_dir("qwen3")), backend="xla", max_num_seqs=4, max_num_batched_tokens=16,
                         max_model_len=32, block_size=4, num_kv_blocks=33, precompile_token_paddings=[16],
                         precompile_bs_paddings=[4], progress=False)
    assert not any(k.wide_top_k for k in runner.sampler_cache)
    k = 20
    batch = SamplingBatch(np.full(4, 1.5, np.float32), np.full(4, k), np.ones(4, np.float32), [None] * 4, [1, 2, 3, 4])
    tokens = np.random.default_rng(0).integers(0, runner.vocab_size, (4, 32)).astype(np.int32)
    out = runner.execute(token_ids=tokens, block_table=np.arange(1, 33, dtype=np.int32).reshape(4, 8),
                         req_rows=np.arange(4, dtype=np.int32), num_computed_tokens=np.zeros(4, np.int32),
                         num_scheduled_tokens=np.full(4, 3, np.int32), sampling=batch)
    logits = runner.executor.logits(4)
    for i in range(4):
        assert logits[i, out[i]] >= np.sort(logits[i])[::-1][k - 1], f"row {i}: outside the top {k}"
    assert any(key.wide_top_k for key in runner.sampler_cache), "the wide sampler was compiled and used"



def _primitives(fn, *args) -> tuple[set[str], list[int]]:
    """The primitive names in ``fn``'s jaxpr (loops' bodies included) and every ``top_k``'s k."""
    import re

    text = str(jax.make_jaxpr(fn)(*args))
    return set(re.findall(r"= ([a-z_]+)\[", text)) | set(re.findall(r"= ([a-z_]+) ", text)), \
        [int(k) for k in re.findall(r"top_k\[[^\]]*\bk=(\d+)", text)]


@pytest.mark.parametrize("wide", [False, True])
def test_the_xla_sampler_sorts_nothing(wide):
    """No ``sort`` primitive (``jnp.argsort`` lowers to it) in the sampler's program, and
    ``top_k`` only of the candidates, whatever the vocabulary."""
    from graphrt.core import defaults

    cands = defaults.SAMPLER_TOP_K_CANDIDATES
    logits = jnp.zeros((3, 4 * cands), jnp.float32)
    names, ks = _primitives(lambda x, m: sample_tokens(x, m, wide=wide), logits, _meta(3, 0.8, 50, 0.9, 0.05))
    assert "sort" not in names and "argmax" in names, sorted(names)
    assert ks and max(ks) <= cands
    names, _ = _primitives(lambda x: jnp.argsort(x, axis=-1), logits)
    assert "sort" in names, "the check can fail"
