"""graphrt.LLM's watchdog (issue 13, SGLang's ``watchdog_timeout``).

A forward hung in a Python loop (a pre-replay hook, a patched ``runner.execute``) is caught
within timeout + 1 s: ``generate`` raises GenerationError caused by WatchdogTimeout naming the
step's shape and key, ``step()`` returns the step's requests with "error" and then refuses,
the log has every thread's stack, and nothing stays queued or allocated. A hang inside one C
call raises only once that call returns (the documented limit). No thread without a timeout;
identical tokens with one; close() and garbage collection end the thread. The Watchdog
itself never lets its exception land outside an armed forward, and costs a few microseconds
per forward.
"""

from __future__ import annotations

import gc
import logging
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import graphrt
from graphrt import SamplingParams
from graphrt.core.errors import ConfigError, GenerationError, GraphrtError, WatchdogTimeout
from graphrt.engine.watchdog import NoWatchdog, Watchdog
from support.hf_models import tiny_hf_model_dir

#: No frozen heap (it checks that a dropped engine's collection joins its thread): tests/support/frozen_heap.py.
pytestmark = pytest.mark.live_heap

LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4,
              num_kv_blocks=32)
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
TIMEOUT = 0.5
THREAD = "graphrt-watchdog"
LOGGER = "graphrt.engine.watchdog"


def make(**kwargs) -> graphrt.LLM:
    return graphrt.LLM(str(tiny_hf_model_dir("qwen3")), backend="eager", **LIMITS, **kwargs)


def watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = make(watchdog_timeout=None)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def assert_clean(llm: graphrt.LLM) -> None:
    assert not llm.has_unfinished() and not llm.loop.requests
    assert llm.allocator.num_used == 0


class Hang:
    """A forward stuck in a Python loop until released (the watchdog's exception ends it)."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.release = threading.Event()

    def hang_in_forward(self, *args, **kwargs) -> None:
        self.started = time.monotonic()
        while not self.release.is_set():
            time.sleep(0.005)


def test_a_hung_forward_fails_generate_within_timeout_plus_one_second(reference, caplog):
    llm = make(watchdog_timeout=TIMEOUT)
    hang = Hang()
    bystander_go = threading.Event()

    def bystander_waits() -> None:
        bystander_go.wait(30)
    bystander = threading.Thread(target=bystander_waits, name="bystander")
    bystander.start()
    forward = llm.runner.executor.fwd          # the executor's forward object: its run hangs
    forward.run = lambda *args, _run=forward.run: (hang.hang_in_forward(), _run(*args))[1]
    try:
        with caplog.at_level(logging.ERROR, logger=LOGGER):
            with pytest.raises(GenerationError) as err:
                llm.generate(PROMPTS, GREEDY)
            raised = time.monotonic()
    finally:
        del forward.run
        bystander_go.set()
        bystander.join()
    assert hang.started is not None and raised - hang.started < TIMEOUT + 1.0
    assert raised - hang.started >= TIMEOUT * 0.9
    cause = err.value.__cause__
    assert isinstance(cause, WatchdogTimeout) and isinstance(cause, GraphrtError)
    msg = str(cause)
    assert "watchdog_timeout=0.5" in msg
    assert "step of 3 request(s)" in msg and "9 token(s)" in msg and "mixed" in msg   # 3 + 5 + 1
    d = llm.runner.dispatcher.dispatch(9, 3, False)
    assert f"mode {d.mode.name} key {d.key}" in msg and cause.step in msg
    outs = err.value.outputs
    assert [o.finish_reason for o in outs] == ["error"] * 3
    assert all(o.error.startswith("WatchdogTimeout: graphrt watchdog:") for o in outs)
    assert_clean(llm)
    # Every thread's stack, at ERROR, the hung frame in the stepping thread's.
    dump = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    assert "Every thread's stack" in dump and msg.split(":", 1)[1].strip()[:40] in dump
    for name in ("MainThread", THREAD, "bystander"):
        assert f"Thread '{name}'" in dump
    assert "hang_in_forward" in dump and "bystander_waits" in dump and "<- the timed-out forward" in dump
    assert llm.watchdog.num_fires == 1 and llm.stats["step_faults"] == 1

    # The engine refuses until reset(): nothing is queued by a refused call.
    with pytest.raises(GenerationError) as again:
        llm.generate(PROMPTS, GREEDY)
    assert isinstance(again.value.__cause__, WatchdogTimeout) and "refuses" in str(again.value.__cause__)
    assert [o.finish_reason for o in again.value.outputs] == ["abort"] * 3
    assert_clean(llm)
    llm.watchdog.reset()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert_clean(llm)
    llm.close()
    assert not llm.watchdog.alive


def test_the_step_api_gets_error_outputs_then_step_raises(reference, monkeypatch):
    llm = make(watchdog_timeout=TIMEOUT)
    hang = Hang()
    execute = llm.runner.execute
    monkeypatch.setattr(llm.runner, "execute", hang.hang_in_forward)
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    outs = llm.step()
    assert time.monotonic() - hang.started < TIMEOUT + 1.0
    assert sorted(o.request_id for o in outs) == ids
    assert all(o.finish_reason == "error" and "WatchdogTimeout" in o.error for o in outs)
    assert_clean(llm)
    later = llm.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(WatchdogTimeout, match="refuses to step"):
        llm.step()
    assert llm.has_unfinished()                 # refused before scheduling: still queued
    monkeypatch.setattr(llm.runner, "execute", execute)
    llm.watchdog.reset()
    done = {}
    while llm.has_unfinished():
        done.update((o.request_id, o) for o in llm.step())
    assert done[later].token_ids == reference[0] and done[later].finish_reason == "length"
    llm.close()


def test_a_hang_inside_one_c_call_raises_once_the_call_returns(monkeypatch, caplog):
    """The documented limit: the exception is raised at the next bytecode after the C call."""
    llm = make(watchdog_timeout=0.3)
    t0, wall0 = time.monotonic(), time.time()

    def one_long_c_call(**kwargs):
        time.sleep(1.2)                     # one C call: the async exception waits for it
        raise AssertionError("not reached: the watchdog's exception comes first")
    monkeypatch.setattr(llm.runner, "execute", one_long_c_call)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        with pytest.raises(GenerationError) as err:
            llm.generate(PROMPTS[:1], GREEDY)
    took = time.monotonic() - t0
    assert 1.2 <= took < 2.5
    assert isinstance(err.value.__cause__, WatchdogTimeout)
    fired = [r for r in caplog.records if "has not finished" in r.getMessage()]
    assert fired and fired[0].created - wall0 < 1.0      # logged at the deadline, not at the return
    llm.close()


def test_close_does_not_wait_for_a_forward_the_watchdog_found_hung(monkeypatch):
    """close() waits for a running step, but not for one the watchdog found hung (inside one C
    call, so its exception cannot land): it returns at once; the step then fails, and every later
    call says the engine is closed."""
    llm = make(watchdog_timeout=0.3)
    release, result = threading.Event(), {}

    def hung_in_one_c_call(**kwargs):
        release.wait(60)
        raise AssertionError("not reached: the watchdog's exception comes first")

    def generate() -> None:
        try:
            llm.generate(PROMPTS[:1], GREEDY)
        except GraphrtError as exc:
            result["error"] = exc

    monkeypatch.setattr(llm.runner, "execute", hung_in_one_c_call)
    thread = threading.Thread(target=generate)
    thread.start()
    deadline = time.monotonic() + 30
    while llm.watchdog.num_fires == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.watchdog.num_fires == 1
    start = time.monotonic()
    llm.close()
    assert time.monotonic() - start < 10.0        # not LLM_CLOSE_WAIT_S
    release.set()
    thread.join(30)
    assert isinstance(result["error"], GenerationError)
    assert isinstance(result["error"].__cause__, WatchdogTimeout)
    for call in (lambda: llm.generate(PROMPTS[:1], GREEDY), lambda: llm.add_request(PROMPTS[0]), llm.step):
        with pytest.raises(GraphrtError, match="closed"):
            call()


def test_no_watchdog_thread_when_disabled_and_identical_tokens_when_enabled(reference):
    # Sets, not counts: engines of earlier tests may be collected (their threads ending) meanwhile.
    def new_threads() -> set[threading.Thread]:
        return set(watchdog_threads()) - before

    before = set(watchdog_threads())
    for off in (None, 0):
        llm = make(watchdog_timeout=off)
        assert isinstance(llm.watchdog, NoWatchdog) and not new_threads()
        if off is None:
            assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
        llm.close()
    llm = make()                                 # the default: SGLang's 300 s
    assert isinstance(llm.watchdog, Watchdog) and llm.watchdog.timeout == 300.0
    (thread,) = new_threads()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert llm.watchdog.num_fires == 0 and llm.watchdog.count > 0
    llm.close()
    llm.close()                                  # idempotent
    assert not thread.is_alive() and not new_threads()
    llm = make(watchdog_timeout=10)
    (thread,) = new_threads()
    del llm
    gc.collect()
    deadline = time.monotonic() + 5
    while thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not thread.is_alive() and not new_threads()   # the engine's collection joined it


@pytest.mark.parametrize("kwargs", [dict(watchdog_action="explode"), dict(watchdog_timeout=-1.0),
                                    dict(watchdog_timeout=float("nan")), dict(watchdog_timeout="5")])
def test_bad_watchdog_arguments_are_refused(kwargs):
    with pytest.raises(ConfigError, match="watchdog_"):
        make(**kwargs)


def test_the_cli_flags():
    import argparse

    from graphrt.cli import add_engine_args, engine_kwargs
    parser = add_engine_args(argparse.ArgumentParser())
    got = engine_kwargs(parser.parse_args([]))
    assert got["watchdog_timeout"] == 300.0 and got["watchdog_action"] == "raise"
    got = engine_kwargs(parser.parse_args(["--watchdog-timeout", "2.5", "--watchdog-action", "kill"]))
    assert got["watchdog_timeout"] == 2.5 and got["watchdog_action"] == "kill"
    assert engine_kwargs(parser.parse_args(["--watchdog-timeout", "0"]))["watchdog_timeout"] == 0


def spin(seconds: float) -> None:
    """Run Python bytecode (where an asynchronous exception lands) for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def heartbeat_return(dog: Watchdog) -> None:
    """A forward's return as the engine's loop writes it: ``armed`` cleared, then disarm() only
    while a fire is being decided or happened for it (docs/architecture.md: no call per step)."""
    dog.armed = False
    if dog.deciding or dog.fired == dog.count:
        dog.disarm()


@pytest.mark.parametrize("returned", [Watchdog.disarm, heartbeat_return], ids=["disarm", "heartbeat"])
def test_the_exception_never_lands_outside_an_armed_forward(returned):
    """Forwards ending around the deadline: the exception is raised from inside the forward or
    when it returns (disarm(), or the heartbeat's test), never after that."""
    dog = Watchdog(0.02, poll_interval=0.002)
    rng = random.Random(0)
    fired = 0
    try:
        for i in range(60):
            dog.arm(i)
            try:
                try:
                    spin(rng.uniform(0.005, 0.06))
                finally:
                    returned(dog)
            except WatchdogTimeout:
                fired += 1
                dog.reset()
            spin(0.002)                     # a stray exception would fail the test here
    finally:
        dog.close()
    assert fired > 0 and dog.num_fires == fired
    assert not dog.alive


def test_a_pending_exception_is_drained_without_clearing_it_through_the_c_api(monkeypatch):
    """A fire whose exception is still pending when the forward returns (it was inside one C
    call) is drained by disarm() at a Python call, never by PyThreadState_SetAsyncExc(ident,
    NULL): before CPython 3.13 that leaves the eval breaker set for the rest of the process
    (a later hypothesis shrink in the same pytest process then ran >60 min instead of 7 s)."""
    from graphrt.engine import watchdog as module

    calls = []
    real = module._set_async_exc
    monkeypatch.setattr(module, "_set_async_exc",
                        lambda ident, exc: calls.append(exc) or real(ident, exc))
    dog = Watchdog(0.05, poll_interval=0.005)
    try:
        dog.arm(0)
        with pytest.raises(WatchdogTimeout) as err:
            try:
                time.sleep(0.4)             # one C call: the injected exception stays pending
            finally:
                heartbeat_return(dog)       # as the loop returns: the fire seen, disarm() raises
        assert err.value is dog.error       # disarm's own error, the pending one drained
        spin(0.01)                          # nothing left pending to land here
    finally:
        dog.close()
    assert dog.num_fires == 1 and len(calls) == 1 and calls[0] is not None


def test_arming_and_disarming_cost_microseconds():
    dog = Watchdog(300.0)
    n = 20000
    t0 = time.perf_counter()
    for i in range(n):
        dog.arm(i)
        dog.disarm()
    per = (time.perf_counter() - t0) / n
    dog.close()
    assert per < 10e-6, f"{per * 1e6:.2f} us per forward"


def test_watchdog_action_kill_sigkills_its_own_process(tmp_path):
    script = textwrap.dedent("""
        import logging, time
        from graphrt.engine.watchdog import Watchdog
        logging.basicConfig(level=logging.ERROR)
        dog = Watchdog(0.2, action="kill")
        dog.arm("a hung step")
        while True:
            time.sleep(0.01)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert "has not finished" in proc.stderr and "a hung step" in proc.stderr
    assert "Thread 'MainThread'" in proc.stderr
