"""Two engines in one process (issue 46, item 1): a draft and a target, two models served side
by side, a test harness. Each engine's forward must read its own step's metadata even while the
other engine's main thread or background warm-up thread runs a forward at the same time, and each
engine's compile statistics count only its own compiles.

The torch cases drive a ``warmup="background"`` engine on the ``cpu`` graph backend (its builder
thread captures between steps) beside an eager engine (or a second background one) of the same
tiny model, ``generate()`` called from two threads at once, several rounds: every request must get
the greedy tokens it gets alone. With one process-wide forward context the engines read each
other's metadata (``IndexError`` in ``write_kv_rows``, captures failing and running eagerly).

The CUDA case runs the CUDA adapter over a stand-in ``torch.cuda`` whose global-mode captures
fail other threads' synchronizes, as a GPU does; the collector cases start and end two captures
(two warm-ups) on two threads out of order.

The XLA case holds a strict engine's step inside its executable call until the other engine has
compiled a key on its own threads: a compile listener counting process-wide would charge that
compile to the strict engine's step ("compile(s) while running the precompiled forward")."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest

import graphrt
from graphrt.layers.torch.forward_context import (forward_context, get_forward_context, get_state_context,
                                                  state_context)
from graphrt.backends.torch.cuda import CudaGraphAPI, CudaGraphBackend
from support.device_fakes import FakeCuda
from support.hf_models import random_prompts, tiny_hf_model_dir

#: No frozen heap (it checks the collector's switches and freeze count): tests/support/frozen_heap.py.
pytestmark = pytest.mark.live_heap

LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4)
#: Few graphs, so the background builder is still capturing while both engines serve.
CPU_GRAPHS = dict(cudagraph_capture_sizes=[1, 2, 4], progress=False)
GREEDY = graphrt.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = random_prompts([3 + (7 * i) % 20 for i in range(12)], seed=46)
#: ``generate()`` calls per thread: the builder takes turns between the steps of the first ones.
ROUNDS = 3


def _engine(kind: str, **extra: Any) -> graphrt.LLM:
    model = str(tiny_hf_model_dir("qwen3"))
    if kind == "eager":
        return graphrt.LLM(model, backend="eager", **LIMITS, **extra)
    return graphrt.LLM(model, backend="cpu", warmup="background", **CPU_GRAPHS, **LIMITS, **extra)


def _generate_concurrently(engines: dict[str, graphrt.LLM], prompts: list[list[int]],
                           params: graphrt.SamplingParams, rounds: int) -> dict[str, list[Any]]:
    """``rounds`` generate() calls per engine, each engine on its own thread, started together;
    per engine the list of each call's token ids, or the exception a call raised."""
    results: dict[str, list[Any]] = {name: [] for name in engines}
    start = threading.Barrier(len(engines))

    def serve(name: str) -> None:
        start.wait()
        for _ in range(rounds):
            try:
                results[name].append([o.token_ids for o in engines[name].generate(prompts, params)])
            except Exception as exc:  # noqa: BLE001 - reported by the test, with the engine's name
                results[name].append(exc)

    threads = [threading.Thread(target=serve, args=(name,), name=f"serve-{name}") for name in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.fixture(scope="module")
def solo() -> list[list[int]]:
    """Each prompt's greedy tokens from an engine alone in the process."""
    with _engine("eager") as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _check(results: dict[str, list[Any]], solo: list[list[int]]) -> None:
    for name, calls in results.items():
        errors = [c for c in calls if isinstance(c, BaseException)]
        assert not errors, f"engine {name}: {len(errors)} of {len(calls)} generate() calls failed: {errors[0]!r}"
        for call in calls:
            wrong = [i for i, (got, want) in enumerate(zip(call, solo)) if got != want]
            assert not wrong, f"engine {name}: requests {wrong} got other tokens than alone"


def test_the_forward_and_state_contexts_belong_to_the_thread_that_set_them():
    seen: dict[str, Any] = {}
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait()
        for name, get in (("forward", get_forward_context), ("state", get_state_context)):
            try:
                seen[name] = get()
            except RuntimeError as exc:
                seen[name] = exc
        with forward_context("other's"):
            seen["own"] = get_forward_context()
        release.set()

    thread = threading.Thread(target=other)
    thread.start()
    with forward_context("mine"), state_context("my state"):
        inside.set()
        release.wait(10)
        assert (get_forward_context(), get_state_context()) == ("mine", "my state")
    thread.join()
    assert isinstance(seen["forward"], RuntimeError) and "no forward context is set" in str(seen["forward"])
    assert isinstance(seen["state"], RuntimeError) and "state_context" in str(seen["state"])
    assert seen["own"] == "other's"
    with pytest.raises(RuntimeError, match="no forward context is set"):
        get_forward_context()


@pytest.mark.parametrize("kinds", [("background", "eager"), ("background", "background")],
                         ids=["background+eager", "background+background"])
def test_two_torch_engines_generating_at_once_give_each_request_its_solo_tokens(solo, kinds):
    engines = {f"{kind}{i}": _engine(kind) for i, kind in enumerate(kinds)}
    try:
        results = _generate_concurrently(engines, PROMPTS, GREEDY, ROUNDS)
        _check(results, solo)
        for name, llm in engines.items():   # the background engines' builds: none broken by the other
            if llm.runner.background is not None:
                assert llm.runner.background.wait(60)
                assert llm.stats["warmup"]["failed"] == 0, (name, llm.stats["warmup"])
    finally:
        for llm in engines.values():
            llm.close()


def test_two_transformers_backend_engines_generating_at_once_keep_their_own_attention(solo):
    """``model_impl="transformers"``: each engine's attention calls reach its own paged layers
    (and its own KV cache), not the other engine's."""
    engines = {"background": _engine("background", model_impl="transformers"),
               "eager": _engine("eager", model_impl="transformers")}
    try:
        _check(_generate_concurrently(engines, PROMPTS, GREEDY, ROUNDS), solo)
    finally:
        for llm in engines.values():
            llm.close()


def test_a_capture_keeps_the_collector_off_while_another_threads_capture_ends():
    """Two captures at once on two threads (two engines' builders): the one that started first
    ends first, and the collector stays off for the other until it ends too, then is on again."""
    from graphrt.backends.torch.cpu import CpuGraphAPI
    from graphrt.backends.torch.device_graphs import record

    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def first() -> None:
        api = CpuGraphAPI()
        record(api, api.new_pool(), lambda: (a_in.set(), b_in.wait(10)))
        a_done.set()

    def second() -> None:
        a_in.wait(10)
        api = CpuGraphAPI()

        def during() -> None:
            b_in.set()
            a_done.wait(10)
            seen["enabled"] = gc.isenabled()
        record(api, api.new_pool(), during)

    assert gc.isenabled()
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"enabled": False}, "the first capture's end turned the collector on under the second"
    assert gc.isenabled()


def test_frozen_objects_stay_frozen_until_the_last_warm_up_ends():
    from graphrt.core.collector import objects_frozen

    assert gc.get_freeze_count() == 0
    first = objects_frozen()
    first.__enter__()
    with objects_frozen():
        first.__exit__(None, None, None)           # the first warm-up ends inside the second
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


#: The KV cache's size given (no graph memory sampled first); steps resolved before the next is
#: launched, so the builder takes its turns between steps here as on the ``cpu`` backend.
SIM_CUDA = dict(num_kv_blocks=LIMITS["max_num_seqs"] * LIMITS["max_model_len"] // LIMITS["block_size"] + 1,
                disable_overlap_schedule=True)


class _SimCuda(CudaGraphBackend):
    """The CUDA adapter's own code over a stand-in ``torch.cuda`` (support/device_fakes.py), whose
    captures in CUDA's "global" mode fail every other thread's synchronize, as a GPU does."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.fake = FakeCuda()

    def graph_api(self) -> CudaGraphAPI:
        return CudaGraphAPI(self.device, self.fake)


def test_two_cuda_engines_capturing_and_stepping_at_once_leave_each_other_alone(solo):
    """Each engine's background thread captures while the other engine's thread waits on its
    step's tokens: captures in thread-local mode, and nothing process-wide (``gc.collect``,
    ``torch.cuda.empty_cache``) swapped out for a capture, where two captures at once would
    leave it swapped."""
    collect = gc.collect
    model = str(tiny_hf_model_dir("qwen3"))
    engines = {f"cuda{i}": graphrt.LLM(model, backend=_SimCuda(), warmup="background", **SIM_CUDA, **CPU_GRAPHS,
                                       **LIMITS) for i in range(2)}
    try:
        _check(_generate_concurrently(engines, PROMPTS, GREEDY, ROUNDS), solo)
        for name, llm in engines.items():
            assert llm.runner.background.wait(60)
            assert llm.stats["warmup"]["failed"] == 0, (name, llm.stats["warmup"])
        assert gc.collect is collect
    finally:
        gc.collect = collect
        for llm in engines.values():
            llm.close()


#: Two XLA buckets (one mixed, one decode) and their samplers: few compiles per engine.
XLA = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=4, precompile_token_paddings=[16],
           precompile_bs_paddings=[4], progress=False, strict=True)
XLA_PROMPTS = random_prompts([3 + (7 * i) % 12 for i in range(8)], seed=46)


def test_two_xla_engines_generating_at_once_count_only_their_own_compiles():
    pytest.importorskip("jax")
    from graphrt.core.graph_modes import RuntimeMode

    model = str(tiny_hf_model_dir("qwen3"))
    engines = {"upfront": graphrt.LLM(model, backend="xla", **XLA)}
    try:
        ready = engines["upfront"]
        solo = [o.token_ids for o in ready.generate(XLA_PROMPTS, GREEDY)]
        compiled, counted = ready.runner.stats.compiles, ready.runner.executor.compiles.stats.compiles
        engines["background"] = warming = graphrt.LLM(model, backend="xla", warmup="background", **XLA)
        own = warming.runner.executor.compiles.stats
        overlapped = threading.Event()

        def hold(real: Any) -> Any:
            def call(*args: Any) -> Any:        # the first call: until the other engine compiled once
                if not overlapped.is_set():
                    before, deadline = own.compiles, time.monotonic() + 120
                    while own.compiles == before and time.monotonic() < deadline:
                        time.sleep(0.005)
                    if own.compiles > before:
                        overlapped.set()
                return real(*args)
            return call

        for mode, key in ready.runner.cache.keys():
            entry = ready.runner.cache.lookup((mode, key))
            if mode is RuntimeMode.FULL:
                entry.executable = hold(entry.executable)
        results = _generate_concurrently(engines, XLA_PROMPTS, GREEDY, ROUNDS)
        assert overlapped.is_set(), "the background engine compiled nothing while the strict engine ran a step"
        _check(results, solo)
        assert ready.runner.stats.compiles == compiled and ready.runner.executor.compiles.stats.compiles == counted
        assert ready.runner.stats.unplanned_builds == 0
        assert warming.runner.background.wait(120) and warming.stats["warmup"]["failed"] == 0
        built = len(warming.runner.cache) + len(warming.runner.sampler_cache)
        assert warming.runner.stats.compiles == own.compiles == built, "the background engine's own compiles"
    finally:
        for llm in engines.values():
            llm.close()


@pytest.mark.no_session_xla_cache
def test_a_second_xla_engine_with_another_cache_directory_says_it_moves_the_process_wide_cache(tmp_path, caplog):
    jax = pytest.importorskip("jax")
    from jax.experimental.compilation_cache import compilation_cache as cc

    from graphrt import ModelRunner

    model = str(tiny_hf_model_dir("qwen3"))
    saved = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        with caplog.at_level("WARNING", logger="graphrt"):
            for name in ("first", "second"):
                ModelRunner(model, backend="xla", warmup=False, compilation_cache_dir=str(tmp_path / name),
                            **{k: v for k, v in XLA.items() if k != "strict"})
        moved = [r.getMessage() for r in caplog.records if "persistent compilation cache" in r.getMessage()]
        assert len(moved) == 1 and str(tmp_path / "second") in moved[0] and str(tmp_path / "first") in moved[0]
    finally:
        jax.config.update("jax_compilation_cache_dir", saved[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
        cc.reset_cache()
