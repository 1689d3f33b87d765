"""Overlap scheduling (issue 13): step n + 1 is scheduled and launched before step n's tokens
are on the host, and the tokens come out exactly as the plain loop's.

The xla engine overlaps by default (its executables are dispatched asynchronously); the torch
graph backends launch the same way (issue 25: a step's outputs travel to host slots behind an
event, future tokens are resolved on the device), and on ``cpu`` -- whose events complete at
once -- that code path runs when ``llm.overlap`` is set. One engine per backend serves both
loops -- ``llm.overlap`` is switched between generate calls, with nothing in flight -- so the
comparison runs the same graphs on the same shapes. The runner-level tests check future
tokens on the device (xla, cpu graphs, the CUDA adapter over a stand-in namespace) and on the
host (eager).
"""

from __future__ import annotations

import collections
import logging

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import graphrt
from graphrt import SamplingParams
from graphrt.core.errors import InputError
from graphrt.core.sampling.batch import sampling_batch
from graphrt.engine.loop import PLACEHOLDER_TOKEN, drop_unresolved
from graphrt.engine.request import Request
from support.hf_models import tiny_hf_model_dir
from support.loop_outputs import assert_same
from support.fast_subset import examples

VOCAB = 128
MODEL = dict(arch="qwen3", vocab_size=VOCAB)
#: Prompts up to 70 tokens against a 32-token budget (chunked prefill); 40 blocks of 4 tokens
#: for 8 requests with no admission estimate (preemption).
LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96, block_size=4,
              num_kv_blocks=40, schedule_conservativeness=0.0)


@pytest.fixture(scope="module", params=["xla", "cpu"])
def llm(request) -> graphrt.LLM:
    if request.param == "xla":
        pytest.importorskip("jax")
        # One token padding and one batch padding (the default grid is powers of two of both):
        # the tests compare the overlapped loop with the plain one on this same engine.
        engine = graphrt.LLM(str(tiny_hf_model_dir(**MODEL)), backend="xla", precompile_token_paddings=[32],
                             precompile_bs_paddings=[8], **LIMITS)
        assert engine.overlap, "the xla backend dispatches asynchronously: overlap is on by default"
        return engine
    engine = graphrt.LLM(str(tiny_hf_model_dir(**MODEL)), backend="cpu", cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32],
                         **LIMITS)
    assert engine.runner.executor.capabilities.async_execution, "the cpu graphs launch like cuda's"
    assert not engine.overlap, "but finish on return: overlap hides nothing, so it is off by default"
    return engine


class FutureSpy:
    """Counts the launched steps and the requests whose last token was a future token."""

    def __init__(self, mp: pytest.MonkeyPatch, llm: graphrt.LLM) -> None:
        self.steps = self.futures = 0
        self._launch = llm.runner.execute_async
        mp.setattr(llm.runner, "execute_async", self)

    def __call__(self, **kw):
        self.steps += 1
        if kw.get("future_rows") is not None:
            self.futures += int((np.asarray(kw["future_rows"]) >= 0).sum())
        return self._launch(**kw)


def generate(llm: graphrt.LLM, overlap: bool, prompts, params) -> list[tuple]:
    """One generate call from an empty prefix cache with the loop chosen; nothing stays in flight."""
    assert not llm.has_unfinished()
    llm.overlap = overlap
    llm.reset_prefix_cache()
    outs = llm.generate(prompts, params)
    assert not llm.has_unfinished() and llm.allocator.num_used == 0
    return [(o.token_ids, o.finish_reason, o.logprobs, o.prompt_logprobs) for o in outs]


def workload(seed: int, n: int = 16) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts sharing prefixes (the prefix cache), some longer than the budget, mixed
    lengths and stops, a few seeded random samplers, some asking for logprobs (one for prompt
    logprobs too)."""
    rng = np.random.default_rng(seed)
    stems = [rng.integers(3, VOCAB, 24).tolist() for _ in range(3)]
    prompts, params = [], []
    for i in range(n):
        tail = rng.integers(3, VOCAB, int(rng.integers(1, 47))).tolist()
        prompts.append((stems[i % 3] if i % 4 else []) + tail)
        sampled = i % 5 == 0
        params.append(SamplingParams(max_tokens=int(rng.integers(1, 25)), ignore_eos=bool(i % 3 == 0),
                                     temperature=0.8 if sampled else 0.0, seed=1000 + i if sampled else None,
                                     logprobs=i % 4 if i % 3 == 1 else None, prompt_logprobs=2 if i == 6 else None))
    return prompts, params


def test_overlap_gives_the_plain_loops_tokens_with_eos_preemption_chunks_and_the_prefix_cache(llm):
    prompts, params = workload(seed=0)
    probe = generate(llm, False, prompts, params)
    counts = collections.Counter(t for toks, *_ in probe for t in toks)
    eos = llm.eos_token_ids
    llm.eos_token_ids = frozenset({counts.most_common(1)[0][0]})   # a token the model does emit
    try:
        before = llm.stats
        ref = generate(llm, False, prompts, params)
        middle = llm.stats
        with pytest.MonkeyPatch.context() as mp:
            spy = FutureSpy(mp, llm)
            got = generate(llm, True, prompts, params)
        after = llm.stats
    finally:
        llm.eos_token_ids = eos
    assert_same(got, ref)
    reasons = collections.Counter(r for _, r, _, _ in ref)
    assert any(lp for _, _, lp, _ in ref) and any(p for _, _, _, p in ref), "logprobs were asked and given"
    assert reasons["stop"] > 0 and reasons["length"] > 0, reasons
    assert spy.steps > 0 and spy.futures > 0, "no step read a future token"
    for a, b in ((before, middle), (middle, after)):      # both loops preempted and hit the cache
        assert b["preemptions"] > a["preemptions"]
        assert b["prefix_cache_hit_tokens"] > a["prefix_cache_hit_tokens"]


@settings(max_examples=examples(5), deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 12))
def test_overlap_equals_the_plain_loop_on_random_streams(llm, seed, n):
    prompts, params = workload(seed, n)
    assert_same(generate(llm, True, prompts, params), generate(llm, False, prompts, params))


def test_a_synchronous_backend_runs_the_plain_loop_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="graphrt"):
        engine = graphrt.LLM(str(tiny_hf_model_dir(**MODEL)), backend="eager", max_num_seqs=2,
                             max_num_batched_tokens=16, max_model_len=32, num_kv_blocks=8)
    assert not engine.overlap
    assert "overlap scheduling needs a backend that dispatches asynchronously" in caplog.text
    quiet = graphrt.LLM(engine.runner.model, backend="eager", max_num_seqs=2, max_num_batched_tokens=16,
                        max_model_len=32, num_kv_blocks=8, disable_overlap_schedule=True)
    assert not quiet.overlap


# ---- the runner: future rows ------------------------------------------------------------
def future_rows_check(runner: graphrt.ModelRunner) -> None:
    """Two requests prefilled and decoded twice over: once with their real tokens in the table,
    once with placeholders (0) and ``future_rows``. Same shapes, so bit for bit the same."""
    width = runner.config.max_blocks_per_req
    tok = np.zeros((4, runner.config.max_model_len), np.int32)
    blocks = np.zeros((4, width), np.int32)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    for pair in ((0, 1), (2, 3)):
        for row, p in zip(pair, prompts):
            tok[row, :len(p)] = p
            blocks[row, :2] = [1 + 2 * row, 2 + 2 * row]
    lens = np.array([len(p) for p in prompts], np.int32)
    greedy = sampling_batch([SamplingParams()] * 2, [0, 1], runner.vocab_size)

    def step(rows, computed, scheduled, run=runner.execute, **kw):
        return run(token_ids=tok, block_table=blocks, req_rows=np.array(rows, np.int32),
                   num_computed_tokens=np.asarray(computed, np.int32),
                   num_scheduled_tokens=np.asarray(scheduled, np.int32), sampling=greedy, **kw)

    first = step([0, 1], [0, 0], lens)
    tok[[0, 1], lens] = first
    second = step([0, 1], lens, [1, 1])
    want = runner.outputs.logits()
    pending = step([2, 3], [0, 0], lens, run=runner.execute_async)
    with pytest.raises(InputError, match="future_rows"):
        step([2, 3], lens, [1, 1], future_rows=[0, 2])        # the last step had 2 requests
    with pytest.raises(InputError, match="future_rows"):
        step([2, 3], lens, [1, 1], future_rows=[0])
    pending = step([2, 3], [0, 0], lens, run=runner.execute_async)     # the refusals ran nothing
    tok[2, lens[0]] = first[0]                                  # one real id, one placeholder
    later = step([2, 3], lens, [1, 1], run=runner.execute_async, future_rows=[-1, 1])
    assert pending.result().tolist() == first.tolist()
    assert later.result().tolist() == second.tolist()
    np.testing.assert_array_equal(runner.outputs.logits(), want)
    step([2, 3], [0, 0], lens)                                  # a step that waited for its tokens
    again = step([2, 3], lens, [1, 1], run=runner.execute_async, future_rows=[-1, 1])
    assert again.result().tolist() == second.tolist()
    assert tok[3, lens[1]] == 0, "the table keeps its placeholder: the future token never went there"


def test_future_rows_resolve_on_the_device(llm):
    future_rows_check(llm.runner)
    llm.reset_prefix_cache()    # the check wrote blocks 1-8; nothing cached may refer to them


def small_runner(backend) -> graphrt.ModelRunner:
    return graphrt.ModelRunner(str(tiny_hf_model_dir(**MODEL)), backend=backend, max_num_seqs=4,
                               max_num_batched_tokens=16, max_model_len=32, num_kv_blocks=12,
                               cudagraph_capture_sizes=[2, 4, 8, 16], progress=False)


def test_future_rows_resolve_on_the_device_for_the_cpu_graphs():
    runner = small_runner("cpu")
    assert runner.executor.capabilities.async_execution and not runner.executor.capabilities.device_runs_ahead
    future_rows_check(runner)
    assert runner.last_step.mode is not graphrt.RuntimeMode.NONE, "the decode replayed a graph"


def test_future_rows_resolve_on_the_host_for_a_synchronous_backend():
    runner = small_runner("eager")
    assert not runner.executor.capabilities.async_execution
    future_rows_check(runner)


def test_the_cuda_adapter_launches_and_waits_only_for_each_steps_event():
    """The CUDA adapter's own code over a stand-in ``torch.cuda``: a launched step records its
    outputs' event and returns; only reading its tokens synchronizes, on that event alone."""
    from support.device_fakes import FakeCuda
    from graphrt.backends.torch.cuda import CudaGraphAPI, CudaGraphBackend

    class SimCuda(CudaGraphBackend):
        def __init__(self) -> None:
            super().__init__("cpu")
            self.fake = FakeCuda()

        def graph_api(self) -> CudaGraphAPI:
            return CudaGraphAPI(self.device, self.fake)

    backend = SimCuda()
    runner = small_runner(backend)
    assert runner.executor.capabilities.async_execution and runner.executor.capabilities.device_runs_ahead
    future_rows_check(runner)
    calls = backend.fake.calls
    del calls[:]
    tok = np.zeros((4, 32), np.int32)
    tok[0, :3] = [5, 6, 7]
    blocks = np.zeros((4, runner.config.max_blocks_per_req), np.int32)
    blocks[0, 0] = 1
    one = dict(token_ids=tok, block_table=blocks, req_rows=np.array([0], np.int32),
               num_computed_tokens=np.array([0], np.int32), num_scheduled_tokens=np.array([3], np.int32),
               sampling=sampling_batch([SamplingParams()], [0], runner.vocab_size))
    pending = runner.execute_async(**one)
    assert [c[0] for c in calls].count("event.record") == 1 and ("synchronize",) not in calls
    assert not any(c[0] == "event.synchronize" for c in calls), "the launch waited"
    event = next(c[1] for c in calls if c[0] == "event.record")
    tokens = pending.result()
    assert calls[-1] == ("event.synchronize", event)
    np.testing.assert_array_equal(tokens, runner.execute(**one))


def test_bad_overlap_flags_and_pending_tokens_are_refused():
    from graphrt.core.errors import ConfigError
    from graphrt.core.future_tokens import PendingTokens
    from graphrt.engine.loop import overlap_enabled

    with pytest.raises(ConfigError, match="disable_overlap_schedule"):
        overlap_enabled(None, "yes")
    with pytest.raises(InputError, match="exactly one"):
        PendingTokens()
    with pytest.raises(InputError, match="exactly one"):
        PendingTokens(lambda: np.zeros(1), np.zeros(1))
    assert PendingTokens(tokens=np.arange(3)).result().tolist() == [0, 1, 2]


def test_dropping_placeholders_keeps_the_known_token_count():
    """``Request.num_tokens`` is a plain attribute the loop keeps: forgetting a request's
    unresolved placeholders (its KV lost, recomputed) takes them off the count too."""
    req = Request(0, [1, 2, 3], SamplingParams(max_tokens=8), output_token_ids=[7, PLACEHOLDER_TOKEN, PLACEHOLDER_TOKEN])
    req.num_unresolved = 2
    assert req.num_tokens == 6
    drop_unresolved(req)
    assert req.output_token_ids == [7] and req.num_tokens == 4 == len(req.prompt_token_ids) + len(req.output_token_ids)
