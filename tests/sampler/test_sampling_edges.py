"""Sampling parameters at the edges of what is accepted (issue 46, item 4).

* Every numeric field's bounds: the extremes inside are accepted, the values just outside
  refused with an ``InputError`` naming the field (and a batch's row) and the bound, by
  ``SamplingParams`` and by the ``SamplingBatch`` ``ModelRunner.execute`` takes.
  ``repetition_penalty`` is bounded to ``[0.01, 100]`` (1e20 and 1e-38 were accepted and gave
  inf / NaN logits).
* Hypothesis, torch (with penalties) and XLA: for any accepted parameters and any finite
  logits, the penalised logits and the logprobs are finite, and the sampled token is a valid
  id whose probability is not 0 (greedy rows: the penalised argmax).
* Through ``ModelRunner.execute`` (eager and xla) and ``graphrt.LLM`` on a model whose logits
  are ~1e37: the largest repetition penalty still never picks the penalised token when another
  is better (``x * r / r**2`` overflowed), the smallest sampled temperature picks the argmax
  (XLA's ``logits / T`` overflowed to ties), and the logprobs stay finite.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import graphrt
from graphrt import InputError, ModelRunner, SamplingParams
from graphrt.backends.torch.sampling.sampler import SamplerState
from graphrt.core import defaults
from graphrt.core.sampling.batch import SAMPLING_MAX_TEMPERATURE, SamplingBatch
from graphrt.core.sampling.columns import SAMPLING_MAX_REPETITION_PENALTY, SAMPLING_MIN_REPETITION_PENALTY
from support.fast_subset import examples
from support.hf_models import hf_logits, load_hf_model, make_tiny_hf_model, random_prompts

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).smallest_subnormal)
REP_MIN = float(np.float32(SAMPLING_MIN_REPETITION_PENALTY))
REP_MAX = float(np.float32(SAMPLING_MAX_REPETITION_PENALTY))
MIN_T = defaults.SAMPLER_MIN_TEMPERATURE
T_MAX = SAMPLING_MAX_TEMPERATURE
#: ``exp(-104)`` is 0 in float32: a token further than ``104 * T`` below the best has probability 0.
EXP_ZERO = 104.0

#: field -> (accepted extremes, refused values just outside, a fragment of the bound's text)
EDGES = {
    "temperature": ([0.0, F32_TINY, MIN_T, T_MAX], [-F32_TINY, 1000000.1, F32_MAX, float("nan"), float("inf")],
                    "[0, 1e+06]"),
    "top_p": ([F32_TINY, 1.0], [0.0, 1.0000001, float("nan")], "(0, 1]"),
    "top_k": ([-1, 1, 2**31 - 1], [0, -2, 2**31], "-1 (disabled) or in [1, 2147483647]"),
    "min_p": ([0.0, F32_TINY, 1.0], [-F32_TINY, 1.0000001, float("nan")], "[0, 1]"),
    "repetition_penalty": ([REP_MIN, 1.0, REP_MAX], [0.0099, 100.01, 1e20, 1e-38, 0.0, float("nan"), float("inf")],
                           "[0.01, 100]"),
    "presence_penalty": ([-2.0, 2.0], [-2.0001, 2.0001, float("nan")], "[-2, 2]"),
    "frequency_penalty": ([-2.0, 2.0], [-2.0001, 2.0001, float("nan")], "[-2, 2]"),
}
EDGE_CASES = [(f, v, ok) for f, (good, bad, _) in EDGES.items() for ok, vs in ((True, good), (False, bad)) for v in vs]


def _batch(field: str, value) -> SamplingBatch:
    """A 2-row batch whose row 1 holds ``value`` in ``field`` (row 0 neutral)."""
    cols = dict(temperature=[1.0, 1.0], top_k=[-1, -1], top_p=[1.0, 1.0])
    extra = {}
    if field in cols:
        cols[field] = [cols[field][0], value]
    else:
        neutral = {"min_p": 0.0, "repetition_penalty": 1.0}.get(field, 0.0)
        extra = {field: [neutral, value], "prompt_lens": [1, 1]}
    return SamplingBatch(*cols.values(), [None, None], [0, 1], **extra)


@pytest.mark.parametrize("field, value, accepted", EDGE_CASES, ids=[f"{f}={v!r}" for f, v, _ in EDGE_CASES])
def test_each_bound_accepts_its_extremes_and_refuses_past_them_naming_the_field(field, value, accepted):
    text = EDGES[field][2]
    if accepted:
        SamplingParams(**{field: value})
        _batch(field, value)
        return
    with pytest.raises(InputError) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field and text in str(err.value), str(err.value)
    with pytest.raises(InputError) as err:
        _batch(field, value)
    assert err.value.field == f"{field}[1]" and text in str(err.value), str(err.value)


# ---- the property: finite values, a valid token of nonzero probability --------------------------

def _f32(lo: float, hi: float, *edges: float):
    return st.sampled_from(list(edges)) | st.floats(lo, hi, width=32)


FINITE_LOGITS = (st.sampled_from([0.0, -F32_MAX, F32_MAX, 1e37, -1e37, 1e30, -1e30, 3e36, 1.0])
                 | st.floats(-F32_MAX, F32_MAX, width=32) | st.floats(-50, 50, width=32))
TEMPERATURE = _f32(0.0, T_MAX, 0.0, F32_TINY, MIN_T * 0.99, MIN_T, 1.0, T_MAX)
TOP_P = _f32(F32_TINY, 1.0, F32_TINY, 1.0)
MIN_P = _f32(0.0, 1.0, 0.0, 1.0)
REPETITION = _f32(REP_MIN, REP_MAX, REP_MIN, REP_MAX, 1.0)
PENALTY = _f32(-2.0, 2.0, -2.0, 2.0, 0.0)


def penalised64(logits: np.ndarray, seq: np.ndarray, prompt_lens: np.ndarray, rep, pres, freq) -> np.ndarray:
    """vLLM's penalties in float64 (rows of ``seq`` are each request's tokens, the first
    ``prompt_lens`` its prompt), clamped to float32's finite range as the sampler clamps them."""
    x = logits.astype(np.float64)
    vocab = x.shape[1]
    for i in range(len(x)):
        counts = np.bincount(seq[i, prompt_lens[i]:], minlength=vocab)
        seen = np.bincount(seq[i], minlength=vocab) > 0
        r = float(rep[i])
        x[i] = np.where(seen, np.where(x[i] > 0, x[i] / r, x[i] * r), x[i])
        x[i] -= float(freq[i]) * counts + float(pres[i]) * (counts > 0)
    return np.clip(x, -F32_MAX, F32_MAX)


def assert_possible(tokens, pen: np.ndarray, temperature: np.ndarray, min_p: np.ndarray, slack: np.ndarray) -> None:
    """Each row's token is a valid id whose (penalised) probability is not 0 and min-p keeps:
    within ``T * min(EXP_ZERO, -log(min_p))`` of the row's best logit (greedy rows: the best),
    ``slack`` allowing for float32's rounding of the logits."""
    n, vocab = pen.shape
    for i, tok in enumerate(np.asarray(tokens)[:n].tolist()):
        assert 0 <= tok < vocab, f"row {i}: token {tok} outside [0, {vocab})"
        t, mp = float(temperature[i]), float(min_p[i])
        kept = EXP_ZERO if mp == 0.0 else min(EXP_ZERO, -math.log(mp) + 1e-5)
        reach = 0.0 if t < MIN_T else kept * t
        gap = pen[i].max() - pen[i, tok]
        assert gap <= reach + slack[i], (f"row {i}: token {tok} is {gap:.3g} below the best logit "
                                         f"{pen[i].max():.3g} at T={t!r}, min_p={mp!r}: not a possible token")


def _slack(logits: np.ndarray, rep) -> np.ndarray:
    """float32 rounding of a row's penalised logits, as a bound on their error."""
    scale = np.abs(logits.astype(np.float64)).max(axis=1) * np.maximum(rep, 1.0 / np.asarray(rep, np.float64))
    return np.minimum(1e-5 * (scale + 2.0 * logits.shape[1] + 2.0), F32_MAX)


def assert_finite_logprobs(logprobs, logits: np.ndarray) -> None:
    """The sampled tokens' logprobs are never NaN, and finite wherever the row's logits span
    less than float32's range (beyond it a log-probability is below float32's most negative)."""
    lp = np.asarray(logprobs)[:len(logits)]
    span = logits.astype(np.float64).max(axis=1) - logits.astype(np.float64).min(axis=1)
    assert not np.isnan(lp).any(), lp
    assert np.isfinite(lp[span < F32_MAX]).all() and (lp <= 0).all(), (lp, span)


@st.composite
def torch_cases(draw):
    n, vocab, length = draw(st.integers(1, 4)), draw(st.integers(2, 40)), draw(st.integers(1, 6))
    logits = draw(hnp.arrays(np.float32, (n, vocab), elements=FINITE_LOGITS))
    seq = draw(hnp.arrays(np.int64, (n, length), elements=st.integers(0, vocab - 1)))
    cols = {name: draw(hnp.arrays(np.float32, (n,), elements=strategy)) for name, strategy in
            (("temperature", TEMPERATURE), ("top_p", TOP_P), ("min_p", MIN_P), ("repetition_penalty", REPETITION),
             ("presence_penalty", PENALTY), ("frequency_penalty", PENALTY))}
    top_k = draw(hnp.arrays(np.int64, (n,), elements=st.sampled_from([-1, 1, 2**31 - 1]) | st.integers(1, vocab)))
    prompt_lens = draw(hnp.arrays(np.int64, (n,), elements=st.integers(0, length)))
    return logits, seq, cols, top_k, prompt_lens, draw(st.integers(0, 2**32))


@settings(max_examples=examples(150), deadline=None)
@given(case=torch_cases())
@example(case=(np.float32([[1e37, 2e36, -1e37]]), np.int64([[0]]),       # x * r overflowed: inf, then NaN
               {"temperature": np.float32([0.0]), "top_p": np.float32([1.0]), "min_p": np.float32([0.0]),
                "repetition_penalty": np.float32([REP_MAX]), "presence_penalty": np.float32([0.0]),
                "frequency_penalty": np.float32([0.0])}, np.int64([-1]), np.int64([1]), 0))
def test_torch_sampler_values_stay_finite_and_tokens_possible_for_any_accepted_params(case):
    logits, seq, cols, top_k, prompt_lens, seed = case
    n, vocab = logits.shape
    batch = SamplingBatch(cols["temperature"], top_k, cols["top_p"], [seed] * n, list(range(n)), [0] * n,
                          min_p=cols["min_p"], repetition_penalty=cols["repetition_penalty"],
                          presence_penalty=cols["presence_penalty"], frequency_penalty=cols["frequency_penalty"],
                          prompt_lens=prompt_lens)
    sampler = SamplerState(n, vocab, torch.device("cpu"), pin_memory=False, max_logprobs=1, max_tokens=seq.size)
    x = torch.from_numpy(logits)
    if batch.penalized:
        sampler.plan_penalties(batch, seq.astype(np.int32), np.arange(n), np.zeros(n, np.int64),
                               np.full(n, seq.shape[1]), n)
        sampler.fold_penalties(batch, n, n, torch.from_numpy(seq.reshape(-1)))
        pen = x.clone()
        sampler.penalties.apply(pen, torch.zeros(n, vocab))
        assert torch.isfinite(pen).all(), f"penalised logits {pen}"
    if not batch.all_greedy:
        sampler.write(batch, n, n)
    sampler.compute(x, n, greedy=batch.all_greedy, wide=True, penalties=batch.penalized)
    sampler.compute_logprobs(x, n)
    ref = penalised64(logits, seq, prompt_lens, cols["repetition_penalty"], cols["presence_penalty"],
                      cols["frequency_penalty"]) if batch.penalized else logits.astype(np.float64)
    assert_possible(sampler.tokens, ref, cols["temperature"], cols["min_p"], _slack(logits, cols["repetition_penalty"]))
    assert_finite_logprobs(sampler.logprobs[0], logits)


XLA_ROWS, XLA_VOCAB = 4, 48


@st.composite
def xla_cases(draw):
    shape = (XLA_ROWS,)
    logits = draw(hnp.arrays(np.float32, (XLA_ROWS, XLA_VOCAB), elements=FINITE_LOGITS))
    temperature, top_p, min_p = (draw(hnp.arrays(np.float32, shape, elements=s)) for s in (TEMPERATURE, TOP_P, MIN_P))
    top_k = draw(hnp.arrays(np.int64, shape, elements=st.sampled_from([-1, 2**31 - 1]) | st.integers(1, XLA_VOCAB)))
    return logits, temperature, top_k, top_p, min_p, draw(st.integers(0, 2**32))


@pytest.fixture(scope="module")
def xla_sampler():
    jax = pytest.importorskip("jax")
    from graphrt.backends.xla.sampler import sample_tokens, token_logprobs

    def run(logits, meta):
        tokens = sample_tokens(logits, meta, wide=True)
        return tokens, token_logprobs(logits, tokens, 1)[0]
    return jax.jit(run)


@settings(max_examples=examples(100), deadline=None)
@given(case=xla_cases())
@example(case=(np.float32([[1e34, 3e34, -1.0, 2e34] * (XLA_VOCAB // 4)] * XLA_ROWS),   # logits / T overflowed: ties
               np.float32([MIN_T, 1.0, MIN_T * 2, T_MAX]), np.int64([-1] * XLA_ROWS), np.ones(XLA_ROWS, np.float32),
               np.zeros(XLA_ROWS, np.float32), 0))
def test_xla_sampler_values_stay_finite_and_tokens_possible_for_any_accepted_params(xla_sampler, case):
    import jax.numpy as jnp
    from graphrt.backends.xla.batch import SamplingMetadata

    logits, temperature, top_k, top_p, min_p, seed = case
    batch = SamplingBatch(temperature, top_k, top_p, [None] * XLA_ROWS, list(range(XLA_ROWS)), min_p=min_p)
    seeds = np.random.default_rng(seed).integers(0, 2**32, (XLA_ROWS, 2), dtype=np.uint32)
    k = np.minimum(batch.top_k, XLA_VOCAB).astype(np.int32)
    meta = SamplingMetadata(jnp.asarray(batch.temperature), jnp.asarray(k), jnp.asarray(batch.top_p),
                            jnp.asarray(seeds), jnp.zeros(XLA_ROWS, jnp.uint32), jnp.asarray(min_p))
    tokens, logprobs = xla_sampler(jnp.asarray(logits), meta)
    ones = np.ones(XLA_ROWS, np.float32)
    assert_possible(np.asarray(tokens), logits.astype(np.float64), temperature, min_p, _slack(logits, ones))
    assert_finite_logprobs(np.asarray(logprobs), logits)


# ---- through the public API, on a model whose logits are ~1e37 ---------------------------------------

LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32, block_size=4)
#: Row 0's prompt holds a token whose logit times 100 overflows float32 (checked in the test).
PROMPTS = [random_prompts((3, 3, 3, 3), seed=5)[i] for i in (1, 3, 0, 2)]


@pytest.fixture(scope="module")
def huge_logits_dir(tmp_path_factory) -> str:
    """The tiny Qwen3 with its lm_head scaled by 1e37: logits of +-3e37, a float32 product
    by 100 overflows (real models never come near; the arithmetic must not care)."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_hf_model(tmp_path_factory.mktemp("huge"))
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 1e37
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def _step(runner: ModelRunner, batch: SamplingBatch):
    tokens = np.zeros((4, 32), np.int32)
    tokens[:, :3] = PROMPTS
    return runner.execute(token_ids=tokens, block_table=np.arange(1, 33, dtype=np.int32).reshape(4, 8),
                          req_rows=np.arange(4, dtype=np.int32), num_computed_tokens=np.zeros(4, np.int32),
                          num_scheduled_tokens=np.full(4, 3, np.int32), sampling=batch)


#: backend -> the step's rows: (temperature, top_p, min_p, repetition_penalty), logprobs asked by all
RUNNER_ROWS = {
    "eager": [(0.0, 1.0, 0.0, REP_MAX), (0.0, 1.0, 0.0, REP_MIN), (MIN_T, 1.0, 0.0, REP_MAX), (T_MAX, 1.0, 1.0, 1.0)],
    "xla": [(0.0, 1.0, 0.0, 1.0), (F32_TINY, 1.0, 0.0, 1.0), (MIN_T, 1.0, 0.0, 1.0), (T_MAX, F32_TINY, 1.0, 1.0)],
}


@pytest.mark.parametrize("backend", list(RUNNER_ROWS))
def test_runner_edges_pick_the_right_token_with_finite_logprobs(backend, huge_logits_dir):
    """Greedy rows at the largest and smallest repetition penalty take the penalised argmax; the
    smallest sampled temperature, and the largest with min_p=1 (only the best is kept), take
    the argmax; every logprob is finite."""
    if backend == "xla":
        pytest.importorskip("jax")
    extra = dict(precompile_token_paddings=[16], precompile_bs_paddings=[4]) if backend == "xla" else {}
    runner = ModelRunner(huge_logits_dir, backend=backend, num_kv_blocks=33, progress=False, **LIMITS, **extra)
    t, p, mp, r = (np.float32(c) for c in zip(*RUNNER_ROWS[backend]))
    penalties = dict(repetition_penalty=r, prompt_lens=np.full(4, 3)) if backend == "eager" else {}
    out = _step(runner, SamplingBatch(t, np.full(4, -1), p, [7, 8, 9, 10], [0, 1, 2, 3], [1] * 4, min_p=mp,
                                      **penalties))
    logits = runner.executor.logits(4)
    seq = np.array(PROMPTS, np.int64)
    pen = penalised64(logits, seq, np.full(4, 3), r, np.zeros(4), np.zeros(4))
    if backend == "eager":     # the case overflowed x * r before (the seen logit past F32_MAX / r)
        seen = logits[0, PROMPTS[0]]
        assert float(seen.max()) * REP_MAX > F32_MAX and pen[0].argmax() not in PROMPTS[0]
    np.testing.assert_array_equal(out.token_ids, pen.argmax(axis=1), err_msg=f"logits max {logits.max(axis=1)}")
    assert np.isfinite(out.logprobs.logprobs).all() and np.isfinite(out.logprobs.top_logprobs).all()


def test_llm_edges_pick_the_penalised_argmax_with_finite_logprobs(huge_logits_dir):
    """graphrt.LLM, greedy at the largest and smallest repetition penalty: every token is the
    argmax of transformers' logits penalised by the prompt and the tokens so far; the smallest
    sampled temperature and min_p=1 give the unpenalised greedy tokens; logprobs finite."""
    hf = load_hf_model(huge_logits_dir)
    llm = graphrt.LLM(huge_logits_dir, backend="eager", **LIMITS)
    prompts = [PROMPTS[0]] * 5
    base = dict(max_tokens=4, ignore_eos=True, logprobs=1)
    params = [SamplingParams(repetition_penalty=REP_MAX, **base), SamplingParams(repetition_penalty=REP_MIN, **base),
              SamplingParams(temperature=MIN_T, seed=1, **base), SamplingParams(temperature=1.0, min_p=1.0, **base),
              SamplingParams(**base)]
    outputs = llm.generate(prompts, params)
    greedy = outputs[-1].token_ids
    for out, sp in zip(outputs[:2], params):
        seq = PROMPTS[0] + out.token_ids
        ref = hf_logits(hf, seq[:-1]).numpy()
        for j, tok in enumerate(out.token_ids):
            row = ref[len(PROMPTS[0]) - 1 + j][None]
            pen = penalised64(row, np.array([seq[:3 + j]]), np.array([3]), [sp.repetition_penalty], [0.0], [0.0])[0]
            assert pen[tok] >= pen.max() - 1e-4 * abs(pen.max()), (
                f"r={sp.repetition_penalty}, token {j}: chose {tok} ({pen[tok]:.4g}), best {pen.argmax()} "
                f"({pen.max():.4g})")
    assert outputs[2].token_ids == greedy and outputs[3].token_ids == greedy
    for out in outputs:
        values = [lp.logprob for step in out.logprobs for lp in step.values()]
        assert all(math.isfinite(v) for v in values), values
