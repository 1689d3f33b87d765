"""graphrt.LLM under faults and threads: no wedged engine, no lost or stolen outputs.

Faults are injected at every stage of a step -- scheduling (the block allocator), the table
writes, before the forward, inside the forward (on xla: inside the executable, after it has
consumed the donated KV cache), in the sampler, and after sampling -- on the ``cpu`` and
``xla`` backends. After each, the engine must hold no request and no block, and the next
``generate`` must give the tokens a fresh engine gives (greedy). Also: a poisoned request
does not poison later calls, the step API sees failed requests, a call never takes another
call's outputs, a lost XLA KV cache is re-created and its requests recomputed, and two
threads calling ``generate`` at once both get their own, correct outputs.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np
import pytest

import graphrt
from graphrt import SamplingParams
from graphrt.core.errors import GenerationError, KVCacheLostError
from support.hf_models import random_prompts, tiny_hf_model_dir

#: Not the other test files' 128: an xla engine here compiles other samplers than theirs, so
#: JAX's in-process compile cache does not make their compiles look free (test_xla_backend).
VOCAB = 96
MODEL = dict(arch="qwen3", vocab_size=VOCAB)
LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4,
              num_kv_blocks=32)          # 31 usable blocks for 4 rows of up to 12: preemptions too
BACKEND_ARGS = {"cpu": dict(cudagraph_capture_sizes=[4, 8, 32]),
                "xla": dict(precompile_token_paddings=[32], precompile_bs_paddings=[4])}   # one program
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
POISON = SamplingParams(max_tokens=6, ignore_eos=True, seed=1234)   # the fake runner fails on it


#: Twelve prompts, two longer than the token budget (chunked prefill), and five more.
PROMPTS = random_prompts((3, 9, 1, 17, 5, 33, 2, 12, 7, 20, 4, 40), seed=1, vocab=VOCAB)
MORE = random_prompts((6, 1, 35, 11, 4), seed=2, vocab=VOCAB)


class InjectedFault(RuntimeError):
    """The fault the tests inject."""


class Fault:
    """Wraps a callable so that its ``at``-th call raises (before or after calling through)."""

    def __init__(self, at: int, *, after: bool = False, exc: type[BaseException] = InjectedFault) -> None:
        self.at, self.after, self.exc, self.calls = at, after, exc, 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            hit = self.calls == self.at
            if hit and not self.after:
                raise self.exc(f"injected before call {self.calls}")
            out = fn(*args, **kwargs)
            if hit:
                raise self.exc(f"injected after call {self.calls}")
            return out
        return wrapper


def forward_entries(llm: graphrt.LLM) -> list[Any]:
    """The xla engine's compiled forward executables (XlaEntry objects, in the runner's cache)."""
    cache = llm.runner.cache
    return [cache.lookup(k) for k in cache]


def step_method(llm: graphrt.LLM) -> str:
    """The runner method the engine's steps call: xla overlaps its steps (execute_async)."""
    return "execute_async" if llm.overlap else "execute"


def inject(mp: pytest.MonkeyPatch, llm: graphrt.LLM, stage: str, fault: Fault) -> None:
    """Make ``fault`` fire at ``stage`` of the engine's steps."""
    runner, executor = llm.runner, llm.runner.executor
    if stage == "schedule":
        mp.setattr(llm.allocator, "allocate", fault.wrap(llm.allocator.allocate))
    elif stage == "tables":
        mp.setattr(llm.loop, "_step_inputs", fault.wrap(llm.loop._step_inputs))   # writes the tables
    elif stage == "before_forward":
        mp.setattr(runner, step_method(llm), fault.wrap(getattr(runner, step_method(llm))))
    elif stage == "forward" and runner.backend.name == "xla":
        fault.after = True               # the executable has consumed the donated KV cache
        for entry in forward_entries(llm):
            mp.setattr(entry, "executable", fault.wrap(entry.executable))
    elif stage == "forward":
        fault.after = True               # the KV cache has been written
        mp.setattr(executor, "run", fault.wrap(executor.run))
    elif stage == "sampler":
        mp.setattr(executor, "sample", fault.wrap(executor.sample))
    elif stage == "after_sampling":
        mp.setattr(llm.loop, "_stop_reason", fault.wrap(llm.loop._stop_reason))
    else:
        raise ValueError(stage)


@pytest.fixture(scope="module", params=["cpu", "xla"])
def backend(request) -> str:
    if request.param == "xla":
        pytest.importorskip("jax")
    return request.param


@pytest.fixture(scope="module")
def engine(backend):
    """A module-wide engine and what it generated while fresh (the reference)."""
    llm = graphrt.LLM(str(tiny_hf_model_dir(**MODEL)), backend=backend, **LIMITS, **BACKEND_ARGS[backend])
    ref = {tuple(p): o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY))}
    ref.update((tuple(p), o.token_ids) for p, o in zip(MORE, llm.generate(MORE, GREEDY)))
    return llm, ref


def assert_clean(llm: graphrt.LLM) -> None:
    """Nothing queued, running or awaiting delivery; every block back."""
    assert not llm.has_unfinished()
    assert not llm.scheduler.running and not llm.scheduler.waiting
    assert llm.allocator.num_used == 0 and llm.allocator.num_free == llm.allocator.capacity
    assert not llm.loop.requests and not llm._owners


def assert_serves(llm: graphrt.LLM, ref: dict) -> None:
    """The next generate gives a fresh engine's tokens and leaves nothing behind."""
    outs = llm.generate(MORE, GREEDY)
    assert [o.token_ids for o in outs] == [ref[tuple(p)] for p in MORE]
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
    assert_clean(llm)


STAGES = ["schedule", "tables", "before_forward", "forward", "sampler", "after_sampling"]


@pytest.mark.parametrize("at", [1, 9])
@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_at_any_stage_fails_only_that_call_and_the_next_call_is_correct(engine, stage, at):
    llm, ref = engine
    resets = llm.stats["kv_cache_resets"]
    with pytest.MonkeyPatch.context() as mp:
        fault = Fault(at)
        inject(mp, llm, stage, fault)
        with pytest.raises(GenerationError) as err:
            llm.generate(PROMPTS, GREEDY)
    assert fault.calls >= at, "the fault never fired"
    assert isinstance(err.value.__cause__, InjectedFault) or isinstance(err.value.__cause__.__cause__,
                                                                        InjectedFault)
    outs = err.value.outputs
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert len({o.request_id for o in outs}) == len(PROMPTS)
    reasons = {o.finish_reason for o in outs}
    assert reasons <= {"length", "error", "abort"}
    assert ("error" in reasons) == (stage != "schedule"), reasons   # a scheduling fault fails no step
    for o in outs:
        want = ref[tuple(o.prompt_token_ids)]
        if o.finish_reason == "length":
            assert o.token_ids == want and o.error is None
        else:
            assert o.token_ids == want[:len(o.token_ids)] and o.error, o
    assert_clean(llm)
    if stage == "forward" and llm.runner.backend.name == "xla":
        assert llm.stats["kv_cache_resets"] == resets + 1
        assert isinstance(err.value.__cause__, KVCacheLostError)
        assert not llm.runner.executor.kv_cache.is_deleted()
    assert_serves(llm, ref)


def test_a_poisoned_request_does_not_poison_later_calls(engine):
    """Repro: a request whose step always fails stayed queued, so every later generate() raised."""
    llm, ref = engine
    with pytest.MonkeyPatch.context() as mp:
        execute = getattr(llm.runner, step_method(llm))

        def poisoned(**kwargs):
            if 1234 in kwargs["sampling"].seeds:
                raise InjectedFault("poisoned request in the step")
            return execute(**kwargs)
        mp.setattr(llm.runner, step_method(llm), poisoned)
        with pytest.raises(GenerationError, match="poisoned request") as err:
            llm.generate([MORE[0], PROMPTS[0]], [GREEDY, POISON])
        assert err.value.outputs[1].finish_reason == "error"
        assert "InjectedFault: poisoned request" in err.value.outputs[1].error
        assert_clean(llm)
        assert_serves(llm, ref)                     # while the poison is still armed

        # The step API sees the failed request and its loop ends.
        good, bad = llm.add_request(MORE[1], GREEDY), llm.add_request(PROMPTS[1], POISON)
        done = {}
        for _ in range(100):
            done.update((o.request_id, o) for o in llm.step())
            if not llm.has_unfinished():
                break
        assert done[bad].finish_reason == "error" and "poisoned" in done[bad].error
        assert done[good].finish_reason in ("length", "error")
        assert_clean(llm)


def test_a_failed_generate_leaves_no_orphans_for_the_next_call(engine):
    """Repro: after a fault at step 9 of generate(12), the next generate(5) ran the 12 orphans
    to completion and threw their outputs away."""
    llm, ref = engine
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm.runner, step_method(llm), Fault(9).wrap(getattr(llm.runner, step_method(llm))))
        with pytest.raises(GenerationError):
            llm.generate(PROMPTS, GREEDY)
    assert_clean(llm)
    seen: set[int] = set()
    with pytest.MonkeyPatch.context() as mp:
        execute = getattr(llm.runner, step_method(llm))

        def recording(**kwargs):
            seen.update(kwargs["sampling"].request_ids)
            return execute(**kwargs)
        mp.setattr(llm.runner, step_method(llm), recording)
        outs = llm.generate(MORE, GREEDY)
    assert seen == {o.request_id for o in outs}, "the next call ran requests that were not its own"
    assert [o.token_ids for o in outs] == [ref[tuple(p)] for p in MORE]


def test_generate_keeps_step_api_outputs_for_step(engine):
    """A request added with add_request and finished by a generate() call is handed to step()."""
    llm, ref = engine
    rid = llm.add_request(PROMPTS[3], GREEDY)           # 17 tokens: done before the 35-token one
    outs = llm.generate([MORE[2], MORE[0]], GREEDY)
    assert [o.token_ids for o in outs] == [ref[tuple(MORE[2])], ref[tuple(MORE[0])]]
    assert rid not in {o.request_id for o in outs}
    got = []
    while llm.has_unfinished():
        got += llm.step()
    assert [(o.request_id, o.token_ids) for o in got] == [(rid, ref[tuple(PROMPTS[3])])]
    assert_clean(llm)


def test_keyboard_interrupt_in_a_step_aborts_the_call_and_the_engine_serves(engine):
    llm, ref = engine
    with pytest.MonkeyPatch.context() as mp:
        inject(mp, llm, "forward", Fault(4, exc=KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, GREEDY)
    assert_clean(llm)
    assert_serves(llm, ref)


def test_abort_request_frees_its_blocks(engine):
    llm, ref = engine
    keep, drop = llm.add_request(MORE[0], GREEDY), llm.add_request(PROMPTS[5], GREEDY)
    llm.step()
    out = llm.abort_request(drop)
    assert out.finish_reason == "abort" and out.request_id == drop
    assert llm.abort_request(drop) is None
    got = []
    while llm.has_unfinished():
        got += llm.step()
    assert [(o.request_id, o.token_ids) for o in got] == [(keep, ref[tuple(MORE[0])])]
    assert_clean(llm)


def test_a_generate_request_aborted_mid_call_comes_back_as_aborted(engine):
    llm, ref = engine
    steps: list[list[int]] = []
    aborted = []
    with pytest.MonkeyPatch.context() as mp:
        execute = getattr(llm.runner, step_method(llm))

        def aborting(**kwargs):             # during step 2, abort the call's first request
            steps.append(list(kwargs["sampling"].request_ids))
            tokens = execute(**kwargs)
            if len(steps) == 2:
                aborted.append(llm.abort_request(min(steps[0])))
            return tokens
        mp.setattr(llm.runner, step_method(llm), aborting)
        outs = llm.generate(MORE, GREEDY)
    assert aborted[0].finish_reason == "abort" and aborted[0].request_id in steps[1]
    assert outs[0] == aborted[0] and outs[0].error == "aborted by abort_request()"
    assert [o.token_ids for o in outs[1:]] == [ref[tuple(p)] for p in MORE[1:]]
    assert_clean(llm)


def test_two_threads_generating_at_once_each_get_their_own_correct_outputs(engine):
    """Repro: two threads calling generate() broke the engine (each step handed one thread's
    outputs to the other, which threw them away; the scheduler was mutated concurrently)."""
    llm, ref = engine
    work = {"a": PROMPTS[:6], "b": PROMPTS[6:] + MORE[:2], "c": MORE[2:]}
    results: dict[str, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(work) + 2)      # the generate threads, the step thread, this one

    def generate(name: str) -> None:
        try:
            start.wait(timeout=60)
            for _ in range(2):
                results.setdefault(name, []).append(llm.generate(work[name], GREEDY))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def step_api() -> None:
        try:
            start.wait(timeout=60)
            ids = [llm.add_request(p, GREEDY) for p in MORE[:3]]
            got = {}
            for _ in range(500):
                got.update((o.request_id, o) for o in llm.step())
                if len(got) == len(ids):
                    break
            results["step"] = [got[i] for i in ids if i in got]
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=generate, args=(n,), daemon=True) for n in work]
    threads.append(threading.Thread(target=step_api, daemon=True))
    for t in threads:
        t.start()
    start.wait(timeout=60)
    deadline = time.monotonic() + 240
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    for name, prompts in work.items():
        for outs in results[name]:
            assert [o.prompt_token_ids for o in outs] == prompts
            assert [o.token_ids for o in outs] == [ref[tuple(p)] for p in prompts]
    assert [o.token_ids for o in results["step"]] == [ref[tuple(p)] for p in MORE[:3]]
    assert_clean(llm)


# ---- xla: a lost KV cache ------------------------------------------------------------------


@pytest.fixture
def xla_engine(engine):
    """The xla engine (tests using it run with ``backend`` parametrized to xla only)."""
    return engine


xla_only = pytest.mark.parametrize("backend", ["xla"], indirect=True)


@xla_only
def test_xla_runner_recreates_a_consumed_kv_cache_and_says_so(xla_engine):
    """Repro: a fault after the executable consumed the donated cache left the runner broken
    for good ("Buffer has been deleted or donated")."""
    llm, ref = xla_engine
    executor = llm.runner.executor
    with pytest.MonkeyPatch.context() as mp:
        inject(mp, llm, "forward", Fault(1))
        rid = llm.add_request(MORE[0], GREEDY)
        outs = llm.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, "error")]
    assert "KVCacheLostError" in outs[0].error and "injected after call 1" in outs[0].error
    assert not executor.kv_cache.is_deleted()
    assert np.all(np.asarray(executor.kv_cache) == 0)
    assert_serves(llm, ref)
    # A cache deleted behind the runner's back is found and re-created, too.
    executor.kv_cache.delete()
    assert executor.recover_kv_cache() and not executor.kv_cache.is_deleted()
    assert not executor.recover_kv_cache()
    assert_serves(llm, ref)


@xla_only
def test_xla_requests_that_lost_their_kv_are_recomputed(xla_engine):
    """A's KV is computed; the next step runs only B (the token budget goes to B's prefill) and
    fails after donation: B finishes with an error, A is recomputed and its tokens are right."""
    llm, ref = xla_engine
    a = llm.add_request(MORE[0], GREEDY)
    assert llm.step() == []                                 # A prefilled, first token sampled
    recomputed = llm.stats["recomputed"]
    with pytest.MonkeyPatch.context() as mp:
        inject(mp, llm, "forward", Fault(1))
        b = llm.add_request(PROMPTS[11], GREEDY)          # 40 tokens: takes the whole budget
        outs = llm.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(b, "error")]
    assert llm.stats["recomputed"] == recomputed + 1
    got = []
    while llm.has_unfinished():
        got += llm.step()
    assert [(o.request_id, o.token_ids) for o in got] == [(a, ref[tuple(MORE[0])])]
    assert_clean(llm)


@xla_only
def test_xla_runner_call_that_loses_the_kv_cache_raises_kv_cache_lost(xla_engine):
    """Straight through ModelRunner.execute: KVCacheLostError (the fault as its cause), and the
    same step then runs again on the re-created cache with the same logits."""
    llm, ref = xla_engine
    prompt = MORE[0]
    tokens = np.zeros((LIMITS["max_num_seqs"], LIMITS["max_model_len"]), np.int32)
    tokens[0, :len(prompt)] = prompt
    blocks = np.zeros((LIMITS["max_num_seqs"], LIMITS["max_model_len"] // LIMITS["block_size"]), np.int32)
    blocks[0, :2] = [1, 2]
    step = dict(token_ids=tokens, block_table=blocks, req_rows=np.array([0], np.int32),
                num_computed_tokens=np.array([0], np.int32),
                num_scheduled_tokens=np.array([len(prompt)], np.int32))
    llm.runner.execute(**step)
    before = llm.runner.outputs.logits()
    with pytest.MonkeyPatch.context() as mp:
        inject(mp, llm, "forward", Fault(1))
        with pytest.raises(KVCacheLostError, match="re-created zeroed") as err:
            llm.runner.execute(**step)
    assert isinstance(err.value, graphrt.GraphrtError) and isinstance(err.value.__cause__, InjectedFault)
    assert err.value.request_ids == ()
    llm.runner.execute(**step)
    np.testing.assert_array_equal(llm.runner.outputs.logits(), before)
    assert_serves(llm, ref)
