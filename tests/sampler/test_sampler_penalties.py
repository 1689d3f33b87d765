"""Repetition / presence / frequency penalties (vLLM's meanings) and min-p, end to end.

* ``graphrt.LLM`` greedy runs with penalties: every token is the argmax of transformers' logits
  for the sequence, penalised from the prompt and the tokens generated so far (the reference in
  tests/support/sampler_reference.py), on ``eager``, ``cpu`` with the penalised graphs captured at
  warm-up (``enable_penalties``) and ``cpu`` without them (the sampler then runs eagerly); with
  chunked prefill, prefix-cache hits, and preemption with recomputation.
* The device counts equal a recount of every request's tokens after any schedule (hypothesis:
  chunked prefills, decodes, a prefix already computed, a recomputation, rows lent again).
* ``PenaltyState.apply`` equals the reference; random rows draw from the penalised distribution.
* Bad values are refused naming the field and the row; the xla backend refuses penalties
  before any KV byte changes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphrt
from graphrt import InputError, ModelRunner, SamplingParams
from graphrt.backends.torch.sampling.penalties import PenaltyState
from graphrt.backends.torch.sampling.sampler import SamplerState
from graphrt.core.numerics import tolerance
from graphrt.core.sampling.batch import SamplingBatch
from support.hf_models import hf_logits, load_hf_model, random_prompts, tiny_hf_model_dir
from support.sampler_reference import chi_square_pvalue, filtered_probs, penalised_logits
from support.fast_subset import examples

#: Repetition alone hides what presence / frequency do (it already demotes every seen token), so
#: a second set promotes repeats (negative presence) and demotes them by count.
PENALTIES = {"repetition": dict(repetition_penalty=1.6, presence_penalty=0.3, frequency_penalty=0.2),
             "presence/frequency": dict(presence_penalty=-1.5, frequency_penalty=1.0)}
MAX_TOKENS = 8
TIE_TOLERANCE = 1e-4
LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4,
              cudagraph_capture_sizes=[4, 8, 32])
#: Chunked (45 > 32), more prompts than slots, and two prompts sharing a 16-token prefix (a
#: prefix-cache hit: the second starts with tokens it never scheduled).
PROMPTS = random_prompts((3, 9, 45, 17, 5), seed=0)
PROMPTS.append(PROMPTS[3][:16] + [7, 9])


def assert_penalised_greedy(hf_model, outputs, prompts, params: SamplingParams) -> int:
    """Every token is an argmax of the penalised HF logits; returns how many differ from the
    plain argmax (the penalties must matter)."""
    changed = 0
    for out, prompt in zip(outputs, prompts):
        seq = prompt + out.token_ids
        ref = hf_logits(hf_model, seq[:-1]).numpy()
        for j, tok in enumerate(out.token_ids):
            raw = ref[len(prompt) - 1 + j][None]
            row = penalised_logits(raw, [prompt], [out.token_ids[:j]], np.float32([params.repetition_penalty]),
                                   np.float32([params.presence_penalty]), np.float32([params.frequency_penalty]))[0]
            assert row[tok] >= row.max() - TIE_TOLERANCE, (
                f"prompt of {len(prompt)} tokens, token {j}: chose {tok} ({row[tok]:.5f}), penalised argmax "
                f"{int(row.argmax())} ({row.max():.5f}); tokens so far {out.token_ids[:j + 1]}")
            changed += int(raw[0].argmax() != row.argmax())
    return changed


@pytest.fixture(scope="module")
def hf_model():
    return load_hf_model(tiny_hf_model_dir("qwen3"))


RUNS = {"eager": ("eager", {}), "cpu graphs": ("cpu", {"enable_penalties": True}), "cpu eager sampler": ("cpu", {}),
        "cpu preempted": ("cpu", {"enable_penalties": True, "num_kv_blocks": 14, "schedule_conservativeness": 0.0})}


@pytest.mark.parametrize("run, penalties", [(run, "repetition") for run in RUNS]
                         + [("eager", "presence/frequency"), ("cpu graphs", "presence/frequency")])
def test_penalised_greedy_tokens_match_transformers(hf_model, run, penalties):
    backend, extra = RUNS[run]
    prompts = PROMPTS if "preempted" not in run else random_prompts((18, 22, 26, 30, 20, 24, 28, 19), seed=1)
    llm = graphrt.LLM(str(tiny_hf_model_dir("qwen3")), backend=backend, **{**LIMITS, **extra})
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **PENALTIES[penalties])
    shared_bytes = llm.runner.executor.sampler_buffer_bytes
    outputs = llm.generate(prompts, params)
    if "enable_penalties" not in extra:     # the first penalised batch made the penalty state: reported
        assert llm.runner.executor.sampler_buffer_bytes > shared_bytes
    assert assert_penalised_greedy(hf_model, outputs, prompts, params) > 0, "no token changed: penalties ignored?"
    stats = llm.stats
    if "preempted" in run:
        assert stats["preemptions"] > 0
    if run == "cpu graphs" or "preempted" in run:
        assert llm.runner.sampler_stats.eager_steps == 0, "the penalised sampler graphs were captured"
    if run == "cpu eager sampler":
        assert llm.runner.sampler_stats.eager_steps > 0
    if "preempted" not in run:
        assert outputs[-1].num_cached_tokens > 0, "the last prompt starts after a cached prefix"


# ---- the counts -------------------------------------------------------------------------------

VOCAB = 50


@st.composite
def schedules(draw):
    """Requests (prompt length, total length, a computed prefix it starts after, whether it is
    recomputed from 0 once its prompt is in) and the most tokens a request schedules per step."""
    reqs = []
    for _ in range(draw(st.integers(1, 4))):
        prompt = draw(st.integers(1, 12))
        reqs.append((prompt, prompt + draw(st.integers(0, 6)), draw(st.sampled_from([0, 0, min(4, prompt)])),
                     draw(st.booleans())))
    return reqs, draw(st.integers(1, 6))


@settings(max_examples=examples(60), deadline=None)
@given(plan=schedules(), seed=st.integers(0, 2**16))
def test_device_counts_equal_a_recount_of_every_token(plan, seed):
    """After every step, a request's row holds the output-token counts and the prompt-or-output
    occurrences of every position it has reached (the tokens at a position never change)."""
    reqs, chunk = plan
    n = len(reqs)
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (n, 24)).astype(np.int32)
    state = PenaltyState(n, VOCAB, 64, torch.device("cpu"), pin_memory=False)
    done = np.array([start for _, _, start, _ in reqs], np.int64)
    reach = done.copy()
    again = [r[3] for r in reqs]
    while True:
        live = [i for i in range(n) if done[i] < reqs[i][1]]
        if not live:
            break
        scheduled = np.array([min(chunk, reqs[i][1] - done[i]) for i in live], np.int64)
        batch = SamplingBatch(np.zeros(len(live), np.float32), np.full(len(live), VOCAB),
                              np.ones(len(live), np.float32), [None] * len(live), live,
                              repetition_penalty=np.full(len(live), 1.5, np.float32),
                              prompt_lens=[reqs[i][0] for i in live])
        step = state.ledger.plan(batch, tokens, np.array(live), done[live], scheduled, len(live))
        ids = np.concatenate([tokens[i, done[i]:done[i] + s] for i, s in zip(live, scheduled)])
        state.update(step, torch.from_numpy(ids))
        for j, (i, s) in enumerate(zip(live, scheduled)):
            done[i] += s
            reach[i] = max(reach[i], done[i])
            slot, prompt = int(step.row_slots[j]), reqs[i][0]
            np.testing.assert_array_equal(state.counts[slot].numpy(),
                                          np.bincount(tokens[i, prompt:reach[i]], minlength=VOCAB), err_msg="output")
            np.testing.assert_array_equal(state.seen[slot].numpy(),
                                          np.bincount(tokens[i, :reach[i]], minlength=VOCAB), err_msg="seen")
            if again[i] and done[i] >= prompt:           # preempted: recomputed from position 0
                again[i], done[i] = False, 0
    assert not state.counts[0].any() and not state.seen[0].any(), "row 0 stays zero"


def test_rows_are_lent_again_and_rebuilt_from_the_table():
    """Three requests, two rows: the least recently used loses its row and is rebuilt."""
    tokens = np.arange(3 * 10, dtype=np.int32).reshape(3, 10) % VOCAB
    state = PenaltyState(2, VOCAB, 32, torch.device("cpu"), pin_memory=False)

    def step(i: int, computed: int, scheduled: int):
        batch = SamplingBatch(np.float32([0.0]), np.int64([VOCAB]), np.float32([1.0]), [None], [i],
                              frequency_penalty=[1.0], prompt_lens=[3])
        s = state.ledger.plan(batch, tokens, np.array([i]), np.array([computed]), np.array([scheduled]), 1)
        state.update(s, torch.from_numpy(tokens[i, computed:computed + scheduled].copy()))
        return int(s.row_slots[0])

    assert step(0, 0, 5) != step(1, 0, 5)
    slot = step(2, 0, 6)                       # takes request 0's row
    np.testing.assert_array_equal(state.counts[slot].numpy(), np.bincount(tokens[2, 3:6], minlength=VOCAB))
    slot = step(0, 5, 1)                       # request 0 comes back: rebuilt from the table
    np.testing.assert_array_equal(state.counts[slot].numpy(), np.bincount(tokens[0, 3:6], minlength=VOCAB))
    np.testing.assert_array_equal(state.seen[slot].numpy(), np.bincount(tokens[0, :6], minlength=VOCAB))


def test_apply_equals_the_reference():
    rng = np.random.default_rng(0)
    rows, vocab = 5, 300
    state = PenaltyState(rows, vocab, 8, torch.device("cpu"), pin_memory=False)
    prompt = [rng.integers(0, vocab, 20).tolist() for _ in range(rows)]
    output = [rng.integers(0, vocab, 30).tolist() for _ in range(rows)]
    rep, pres, freq = (rng.uniform(0.5, 2, rows).astype(np.float32), rng.uniform(-2, 2, rows).astype(np.float32),
                       rng.uniform(-2, 2, rows).astype(np.float32))
    for i in range(rows):
        state.counts[i + 1] = torch.from_numpy(np.bincount(output[i], minlength=vocab).astype(np.float32))
        state.seen[i + 1] = torch.from_numpy((np.bincount(prompt[i] + output[i], minlength=vocab)).astype(np.float32))
    state.static["params"][:, :rows] = torch.from_numpy(np.stack([rep, pres, freq]))
    state.static["slots"][:rows] = torch.arange(1, rows + 1)
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    x = torch.from_numpy(logits.copy())
    state.apply(x, torch.zeros(rows, vocab))
    tol = tolerance("float32")
    np.testing.assert_allclose(x.numpy(), penalised_logits(logits, prompt, output, rep, pres, freq),
                               rtol=tol.rtol, atol=tol.atol)


def test_random_rows_draw_from_the_penalised_distribution():
    vocab, draws = 40, 20_000
    row = (np.random.default_rng(3).standard_normal(vocab) * 1.2).astype(np.float32)
    prompt, output = [1, 2, 3, 5], [5, 5, 8, 13]
    sampler = SamplerState(draws, vocab, torch.device("cpu"), pin_memory=False, max_tokens=8 * draws)
    batch = SamplingBatch(np.full(draws, 0.9, np.float32), np.full(draws, 12), np.full(draws, 0.95, np.float32),
                          [None] * draws, list(range(draws)), min_p=np.full(draws, 0.02, np.float32),
                          repetition_penalty=np.full(draws, 1.5, np.float32),
                          presence_penalty=np.full(draws, 0.5, np.float32),
                          frequency_penalty=np.full(draws, 0.25, np.float32), prompt_lens=np.full(draws, 4))
    state = sampler.penalty_state()
    seq = np.array([prompt + output] * draws, np.int32)
    step = state.ledger.plan(batch, seq, np.arange(draws), np.zeros(draws, np.int64), np.full(draws, 8), draws)
    state.write(batch, step, draws, draws)
    state.update(step, torch.from_numpy(seq.reshape(-1)))
    sampler.write(batch, draws, draws)
    logits = torch.from_numpy(row).expand(draws, vocab).contiguous()
    sampler.compute(logits, draws, greedy=False, penalties=True)
    pen = penalised_logits(row[None], [prompt], [output], np.float32([1.5]), np.float32([0.5]), np.float32([0.25]))[0]
    probs = filtered_probs(pen, 0.9, 12, 0.95, 0.02)
    counts = np.bincount(sampler.tokens[:draws].numpy(), minlength=vocab)
    assert set(np.flatnonzero(counts).tolist()) == set(np.flatnonzero(probs).tolist())
    assert chi_square_pvalue(counts, probs) > 1e-3


# ---- validation ---------------------------------------------------------------------------------

def _batch(**change) -> SamplingBatch:
    args = dict(temperature=np.float32([0.7, 1.0]), top_k=np.int64([5, 5]), top_p=np.float32([1, 1]),
                seeds=[None, None], request_ids=[1, 2])
    args.update(change)
    return SamplingBatch(**args)


BAD = {
    "min_p above 1": (dict(min_p=[0.1, 1.5]), "min_p[1]", "[0, 1]"),
    "negative min_p": (dict(min_p=[-0.1, 0.0]), "min_p[0]", "[0, 1]"),
    "NaN min_p": (dict(min_p=[np.nan, 0.0]), "min_p[0]", "nan"),
    "min_p too short": (dict(min_p=[0.1]), "min_p", "1 rows"),
    "zero repetition": (dict(repetition_penalty=[1.0, 0.0], prompt_lens=[1, 1]), "repetition_penalty[1]", "[0.01, 100]"),
    "inf repetition": (dict(repetition_penalty=[np.inf, 1.0], prompt_lens=[1, 1]), "repetition_penalty[0]", "[0.01, 100]"),
    "presence 3": (dict(presence_penalty=[0.0, 3.0], prompt_lens=[1, 1]), "presence_penalty[1]", "[-2, 2]"),
    "frequency -2.5": (dict(frequency_penalty=[-2.5, 0.0], prompt_lens=[1, 1]), "frequency_penalty[0]", "[-2, 2]"),
    "string presence": (dict(presence_penalty=["a", "b"], prompt_lens=[1, 1]), "presence_penalty", "real number"),
    "no prompt_lens": (dict(frequency_penalty=[0.5, 0.0]), "prompt_lens", "penalty"),
    "negative prompt_lens": (dict(frequency_penalty=[0.5, 0.0], prompt_lens=[3, -1]), "prompt_lens[1]", ">= 0"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_filter_columns_are_refused(kind):
    change, field, fragment = BAD[kind]
    with pytest.raises(InputError) as err:
        _batch(**change)
    assert err.value.field == field and fragment in str(err.value), str(err.value)


@pytest.mark.parametrize("kwargs, field", [({"min_p": 1.01}, "min_p"), ({"min_p": -0.5}, "min_p"),
                                           ({"repetition_penalty": -1.0}, "repetition_penalty"),
                                           ({"presence_penalty": 2.01}, "presence_penalty"),
                                           ({"frequency_penalty": float("nan")}, "frequency_penalty"),
                                           ({"min_p": True}, "min_p")])
def test_bad_params_are_refused(kwargs, field):
    with pytest.raises(InputError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field


def test_neutral_columns_cost_nothing():
    b = _batch(min_p=[0.0, 0.0], repetition_penalty=[1.0, 1.0], presence_penalty=[0.0, 0.0])
    assert b.min_p is None and b.penalties is None and not b.penalized


def test_xla_refuses_penalties_before_touching_the_kv_cache():
    pytest.importorskip("jax")
    runner = ModelRunner(str(tiny_hf_model_dir("qwen3")), backend="xla", max_num_seqs=2, max_num_batched_tokens=8,
                         max_model_len=16, block_size=4, num_kv_blocks=9, precompile_token_paddings=[8],
                         precompile_bs_paddings=[2], progress=False, warmup=False)
    tokens = np.ones((2, 16), np.int32)
    blocks = np.arange(1, 9, dtype=np.int32).reshape(2, 4)
    before = np.asarray(runner.executor.kv_cache).tobytes()
    batch = _batch(repetition_penalty=[1.2, 1.0], prompt_lens=[3, 3])
    with pytest.raises(InputError) as err:
        runner.execute(token_ids=tokens, block_table=blocks, req_rows=np.array([0, 1], np.int32),
                       num_computed_tokens=np.zeros(2, np.int32), num_scheduled_tokens=np.full(2, 3, np.int32),
                       sampling=batch)
    assert err.value.field == "repetition_penalty"
    assert np.asarray(runner.executor.kv_cache).tobytes() == before


def test_xla_refuses_enable_penalties_at_construction():
    pytest.importorskip("jax")
    with pytest.raises(graphrt.ConfigError, match="enable_penalties"):
        ModelRunner(str(tiny_hf_model_dir("qwen3")), backend="xla", max_num_seqs=2, max_num_batched_tokens=8,
                    max_model_len=16, block_size=4, num_kv_blocks=9, enable_penalties=True, progress=False,
                    warmup=False)
