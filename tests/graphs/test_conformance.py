"""The conformance suite every torch graph backend passes.

Backends: ``eager`` (the reference; runs everything eagerly), ``cpu`` (recording graph),
``npu`` (the Ascend adapter over a stand-in ``torch.npu`` built on the recording graph,
see ``device_fakes.py``), ``cuda-sim`` (the CUDA adapter over a stand-in ``torch.cuda``)
and ``cuda`` (a real GPU; marked ``gpu``, skipped where there is none).

Each test drives a :class:`graphrt.ModelRunner` through a schedule of prefill, decode,
mixed and above-the-largest-bucket steps and checks it against the eager backend on the
same device: capture/replay parity, padding invisibility, KV isolation, eager fallback
when a capture fails, strict misses, mode degradation and piecewise parity on mixed
batches.

Two eager references: each step padded to the key the graph runner replays it at (the
same shapes and kernels: bitwise on a CPU), and each step unpadded (other row counts, so
possibly other matmul kernels: within ``graphrt.tolerance``, the same greedy tokens).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np
import pytest
import torch

from support.device_fakes import FakeCuda, FakeNpu
from graphrt.core.graph_modes import AttentionGraphSupport, GraphMode, RuntimeMode
from graphrt.testing import properties
from graphrt.testing.properties import kv_isolated, replay_matches_eager
from graphrt.testing.runners import RunnerFactory
from graphrt.testing.step import Step
from graphrt import BackendUnavailableError, CacheMissError, GraphrtError, select_backend
from graphrt.backends.torch.cpu import CpuGraphBackend
from graphrt.backends.torch.cuda import CudaGraphAPI, CudaGraphBackend
from graphrt.backends.torch.eager import EagerBackend
from graphrt.backends.torch.npu import NpuGraphBackend
from graphrt.runner import ModelRunner
from support.fast_subset import matrix
from support.hf_models import tiny_hf_model_dir
from support.parity import assert_bitwise, assert_close_across_shapes, assert_same_tokens, pad_like

HAS_CUDA = torch.cuda.is_available()
BACKENDS = ["eager", "cpu", "npu", "cuda-sim",
            pytest.param("cuda", marks=[pytest.mark.gpu,
                                        pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])]
GRAPH_BACKENDS = BACKENDS[1:]
MODES = ["FULL", "FULL_AND_PIECEWISE", "PIECEWISE", "FULL_DECODE_ONLY"]

#: The schedule's steps pad to 1, 4 and 16 tokens (or run eagerly above 16): the buckets 2 and 8
#: would be captured at every warm-up and never replayed, so only the tests about the buckets
#: themselves (covering buckets, capture order, the adapter's captures) take ``ALL_SIZES``.
CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32, block_size=4,
              cudagraph_capture_sizes=[1, 4, 16])
ALL_SIZES = dict(cudagraph_capture_sizes=[1, 2, 4, 8, 16])
ROWS, WIDTH = 4, 8  # request slots, blocks per slot (max_model_len / block_size)
NUM_KV_BLOCKS = ROWS * WIDTH + 1

# (rows, computed, scheduled): prefill, decode, mixed (a new request), decode, a single
# decode, and a 21-token step above the largest bucket (16).
SCHEDULE = [
    ([0, 1, 2], [0, 0, 0], [5, 7, 3]),
    ([0, 1, 2], [5, 7, 3], [1, 1, 1]),
    ([0, 1, 2, 3], [6, 8, 4, 0], [1, 1, 2, 6]),
    ([0, 1, 2, 3], [7, 9, 6, 6], [1, 1, 1, 1]),
    ([1], [10], [1]),
    ([0, 3], [8, 7], [12, 9]),
]
DECODE_STEPS = (1, 3, 4)
MIXED_STEPS = (0, 2)
EAGER_STEP = 5


class SimCudaBackend(CudaGraphBackend):
    """The CUDA adapter on the CPU: its own code, a stand-in ``torch.cuda`` namespace."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.fake = FakeCuda()

    def graph_api(self) -> CudaGraphAPI:
        return CudaGraphAPI(self.device, self.fake)


def device_of(name: str) -> str:
    return "cuda" if name == "cuda" else "cpu"


def make_backend(name: str) -> Any:
    return {"eager": lambda: EagerBackend(),
            "cpu": lambda: CpuGraphBackend(),
            "npu": lambda: NpuGraphBackend(device="cpu", npu=FakeNpu()),
            "cuda-sim": SimCudaBackend,
            "cuda": lambda: CudaGraphBackend()}[name]()


def model_dir() -> str:
    return str(tiny_hf_model_dir("qwen3"))


def make_runner(name: str, model: Any = None, **overrides: Any) -> ModelRunner:
    return ModelRunner(model if model is not None else model_dir(), backend=make_backend(name),
                       num_kv_blocks=NUM_KV_BLOCKS, progress=False, **{**CONFIG, **overrides})


def tables() -> tuple[np.ndarray, np.ndarray]:
    """Token ids per slot, and each slot's own shuffled, non-null blocks."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 128, size=(ROWS, CONFIG["max_model_len"]), dtype=np.int32)
    blocks = (rng.permutation(ROWS * WIDTH) + 1).astype(np.int32).reshape(ROWS, WIDTH)
    return tokens, blocks


def step_kwargs(i: int) -> dict[str, Any]:
    tokens, blocks = tables()
    rows, computed, scheduled = SCHEDULE[i]
    return dict(token_ids=tokens, block_table=blocks, req_rows=np.array(rows),
                num_computed_tokens=np.array(computed), num_scheduled_tokens=np.array(scheduled))


def kit_step(i: int) -> Step:
    """Schedule step ``i`` as the kit's :class:`~graphrt.testing.step.Step` (its slot
    arithmetic is the kit's, written independently of graphrt's input preparation)."""
    tokens, blocks = tables()
    rows, computed, scheduled = (np.asarray(v, np.int32) for v in SCHEDULE[i])
    return Step(tokens, blocks, rows, computed, scheduled, CONFIG["block_size"], seed=i)


def kit_factory(backend: str, mode: str) -> RunnerFactory:
    """The kit's runner factory for ``backend`` with this file's limits and every bucket."""
    return RunnerFactory(model_dir(), make_backend(backend), num_kv_blocks=NUM_KV_BLOCKS, mode=mode,
                         **{**CONFIG, **ALL_SIZES})


def run_schedule(runner: ModelRunner,
                 steps: range | list[int] | None = None) -> list[tuple[RuntimeMode, np.ndarray, Any]]:
    """Each step's runtime mode, logits and key (the padded shape it ran at)."""
    out = []
    for i in steps if steps is not None else range(len(SCHEDULE)):
        runner.execute(**step_kwargs(i))
        out.append((runner.last_step.mode, runner.outputs.logits().copy(), runner.last_step.key))
    return out


@functools.lru_cache(maxsize=None)
def reference(device: str) -> tuple[list[np.ndarray], np.ndarray]:
    """Eager logits of every schedule step and the final KV cache, on ``device``."""
    runner = ModelRunner(model_dir(), backend=EagerBackend(device=device), num_kv_blocks=NUM_KV_BLOCKS,
                         progress=False, **CONFIG)
    logits = [lg for _, lg, _ in run_schedule(runner)]
    return logits, runner.executor.kv_cache.float().cpu().numpy()


#: (device, steps, the keys they ran at) -> the eager run padded to those keys (see below).
_PADDED: dict[tuple[Any, ...], tuple[list[np.ndarray], torch.Tensor]] = {}


def padded_reference(runner: ModelRunner, backend: str, keys: list[Any],
                     steps: range | list[int] | None = None) -> tuple[list[np.ndarray], torch.Tensor]:
    """Eager logits of the schedule's ``steps``, each padded to the key ``runner`` runs it at
    (``keys``: the keys its run of those steps recorded), and the eager runner's KV cache.
    The eager run is a function of the device and the keys alone (the same model, steps and
    padded shapes), so the backends and modes that pad the schedule alike share one."""
    steps = list(steps if steps is not None else range(len(SCHEDULE)))
    cache_key = (device_of(backend), tuple(steps), tuple(keys))
    if cache_key not in _PADDED:
        eager = ModelRunner(model_dir(), backend=EagerBackend(device=device_of(backend)),
                            num_kv_blocks=NUM_KV_BLOCKS, progress=False, **CONFIG)
        pad_like(eager, runner)
        ran = run_schedule(eager, steps)
        assert [key for _, _, key in ran] == list(keys)      # padded as the runner's run was
        _PADDED[cache_key] = [lg for _, lg, _ in ran], eager.executor.kv_cache.clone()
    return _PADDED[cache_key]


def assert_same_shape(name: str, got: Any, want: Any, err_msg: str = "") -> None:
    """The same step at the same padded shape: bitwise on a CPU (the same kernels on the same
    rows); within ``graphrt.tolerance`` on a GPU, whose graph and eager kernels need not
    reduce in the same order."""
    if device_of(name) == "cpu":
        assert_bitwise(got, want, err_msg)
    else:
        assert_close_across_shapes(got, want, err_msg=err_msg)


def assert_across_shapes(got: np.ndarray, want: np.ndarray, err_msg: str = "") -> None:
    """The same step at another shape (another bucket, or unpadded): within
    ``graphrt.tolerance``, and the same greedy tokens."""
    assert_close_across_shapes(got, want, err_msg=err_msg)
    assert_same_tokens(got, want, err_msg)


# ------------------------------------------------------------------------------ parity


def one_eager_mode(rows: list, mode: str) -> list:
    """``rows`` without the eager backend's rows but the one in ``mode``: an eager backend runs
    every mode as ``NONE`` (``open_executor`` sets it before the dispatcher, the warm-up or any
    step sees the mode), so its other rows would run the very same steps again."""
    return [r for r in rows if r.values[0] != "eager" or r.values[1] == mode]


@pytest.mark.parametrize(("backend", "mode"), one_eager_mode(matrix(
    "backend mode", [BACKENDS, MODES], lambda b, m: b == "cpu" or m == "FULL_AND_PIECEWISE"), "FULL_AND_PIECEWISE"))
def test_replay_matches_eager(backend: str, mode: str) -> None:
    runner = make_runner(backend, mode=mode)
    want, want_kv = reference(device_of(backend))
    results = run_schedule(runner)
    same, eager_kv = padded_reference(runner, backend, [key for _, _, key in results])
    for i, ((ran, got, _), padded, unpadded) in enumerate(zip(results, same, want)):
        assert_same_shape(backend, got, padded, f"step {i}")
        assert_across_shapes(got, unpadded, f"step {i}")
    modes = [ran for ran, _, _ in results]
    assert modes[EAGER_STEP] is RuntimeMode.NONE
    if backend == "eager":
        assert set(modes) == {RuntimeMode.NONE}
        return
    graph_mode = GraphMode(mode)
    for i in DECODE_STEPS:
        assert modes[i] is graph_mode.decode_mode() or (
            graph_mode is GraphMode.FULL_DECODE_ONLY and modes[i] is RuntimeMode.FULL)
    for i in MIXED_STEPS:
        assert modes[i] is graph_mode.mixed_mode()
    assert_same_shape(backend, runner.executor.kv_cache, eager_kv, "KV cache")
    kv = runner.executor.kv_cache.float().cpu().numpy()
    assert_close_across_shapes(kv[:, :, :-1], want_kv[:, :, :-1], err_msg="KV cache")  # all but the trash row
    assert runner.stats.misses == 0 and runner.stats.unplanned_builds == 0


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_piecewise_parity_on_mixed_batches(backend: str) -> None:
    """Mixed prefill + decode batches run as pieces with eager attention, equal to eager."""
    runner = make_runner(backend, mode="PIECEWISE")
    want, _ = reference(device_of(backend))
    steps = range(len(SCHEDULE) - 1)
    got, keys = [], []
    for i in steps:
        runner.execute(**step_kwargs(i))
        assert runner.last_step.mode is RuntimeMode.PIECEWISE
        assert runner.last_step.key.num_reqs is None
        got.append(runner.outputs.logits())
        keys.append(runner.last_step.key)
        assert_across_shapes(got[i], want[i], f"step {i}")
    same, eager_kv = padded_reference(runner, backend, keys, steps)
    for i in steps:
        assert_same_shape(backend, got[i], same[i], f"step {i}")
    assert_same_shape(backend, runner.executor.kv_cache, eager_kv, "KV cache")
    report = {r["key"]: r for r in runner.executor.builder.report}
    assert all(r["mode"] == "PIECEWISE" for r in report.values())
    assert report["(mixed, tokens=16, reqs=any)"]["bytes"] > 0


# ------------------------------------------------------------------------------ padding


@pytest.mark.parametrize(("backend", "mode"), one_eager_mode(matrix(
    "backend mode", [BACKENDS, ["FULL", "PIECEWISE"]], lambda b, m: b in ("cpu", "eager") or m == "FULL"), "FULL"))
def test_padded_tokens_never_touch_real_kv(backend: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Schedule step 1 (three decodes, padded to 4 tokens) through the kit's properties:
    ``kv_isolated`` -- padding writes only the real slots and the trash row, every row stays
    finite, and NaN in every KV slot the step does not read (and in the slots it writes
    before reading them) changes no bit of its outputs; ``replay_matches_eager`` -- the
    replay equals eager at the same padded shape; ``padding_invisible`` -- the step replayed
    by the graphs of every covering bucket (4, 8 and 16 tokens) equals the unpadded step
    (same greedy tokens)."""
    factory = kit_factory(backend, mode)
    step = kit_step(1)
    kv_isolated(factory, step)
    if backend != "eager":
        assert factory().last_step.key.num_tokens == 4  # 3 real tokens + 1 padded
    replay_matches_eager(factory, step)
    replayed = []
    replay_at = properties.replay_at

    def spy(runner: ModelRunner, step: Step, key: Any) -> Any:
        replayed.append(key.num_tokens)
        return replay_at(runner, step, key)

    monkeypatch.setattr(properties, "replay_at", spy)
    properties.padding_invisible(factory, step)
    assert sorted(set(replayed)) == ([] if backend == "eager" else [4, 8, 16])


# ------------------------------------------------------------------------------ failures


def _host_sync(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
    """A forward hook reading a device value on the host: harmless eagerly, fatal in a graph."""
    float(output.sum())


@pytest.mark.parametrize(("backend", "mode"), matrix("backend mode", [GRAPH_BACKENDS, ["FULL", "PIECEWISE"]],
                                                     lambda b, m: b == "cpu" or m == "FULL"))
def test_failed_capture_falls_back_to_eager(backend: str, mode: str, caplog: pytest.LogCaptureFixture) -> None:
    model = make_backend(backend).load_model(model_dir())
    model.model.layers[1].mlp.register_forward_hook(_host_sync)
    with caplog.at_level(logging.WARNING, logger="graphrt"):
        runner = make_runner(backend, model=model, mode=mode)
    warnings = [r.getMessage() for r in caplog.records if "will run eagerly" in r.getMessage()]
    # every forward bucket; the sampler graphs still capture
    assert len(warnings) == len(CONFIG["cudagraph_capture_sizes"]), warnings
    assert any(w in warnings[0] for w in ("host", "capture")), warnings[0]
    want, _ = reference(device_of(backend))
    for i, (ran, got, _) in enumerate(run_schedule(runner)):
        assert ran is RuntimeMode.NONE
        assert_same_shape(backend, got, want[i], f"step {i}")  # eager at the real shape, as the reference
    assert runner.last_step.eager_reason is not None


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_strict_mode(backend: str) -> None:
    """After warm-up every covered step hits; a key warm-up never built raises CacheMissError."""
    runner = make_runner(backend, mode="FULL_AND_PIECEWISE", strict=True)
    run_schedule(runner)
    assert runner.stats.misses == 0
    assert runner.stats.eager_reasons and "above the largest" in next(iter(runner.stats.eager_reasons))
    cold = make_runner(backend, mode="FULL", strict=True, warmup=False)
    cold.cache.seal()
    with pytest.raises(CacheMissError, match=r"tokens=16, reqs=4"):
        cold.execute(**step_kwargs(0))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_debug_mode_checks_replay_addresses(backend: str) -> None:
    runner = make_runner(backend, mode="FULL_AND_PIECEWISE", debug_check_addresses=True)
    run_schedule(runner, [0, 1])
    runner.executor.static["input_ids"] = runner.executor.static["input_ids"].clone()
    with pytest.raises(GraphrtError, match="input_ids"):
        runner.execute(**step_kwargs(2))


# ------------------------------------------------------------------------------ modes


@pytest.mark.parametrize(("support", "graph_mode", "decode", "mixed"), [
    (AttentionGraphSupport.NEVER, GraphMode.PIECEWISE, RuntimeMode.PIECEWISE, RuntimeMode.PIECEWISE),
    (AttentionGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE, GraphMode.FULL_AND_PIECEWISE,
     RuntimeMode.FULL, RuntimeMode.PIECEWISE),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_mode_degrades_to_what_attention_supports(backend: str, support: AttentionGraphSupport,
                                                  graph_mode: GraphMode, decode: RuntimeMode,
                                                  mixed: RuntimeMode, caplog: pytest.LogCaptureFixture) -> None:
    model = make_backend(backend).load_model(model_dir())
    for layer in model.attention_layers():
        layer.graph_support = support
    with caplog.at_level(logging.INFO, logger="graphrt"):
        runner = make_runner(backend, model=model, mode="FULL")
    assert any("degraded" in r.getMessage() or "eagerly" in r.getMessage() for r in caplog.records)
    if backend == "eager":
        assert runner.mode is GraphMode.NONE
        return
    assert runner.mode is graph_mode
    want, _ = reference(device_of(backend))
    results = run_schedule(runner)
    for i in DECODE_STEPS:
        assert results[i][0] is decode
    for i in MIXED_STEPS:
        assert results[i][0] is mixed
    same, _ = padded_reference(runner, backend, [key for _, _, key in results])
    for i, ((_, got, _), padded, unpadded) in enumerate(zip(results, same, want)):
        assert_same_shape(backend, got, padded, f"step {i}")
        assert_across_shapes(got, unpadded, f"step {i}")


def test_unavailable_cuda_says_why() -> None:
    if HAS_CUDA:
        pytest.skip("a CUDA GPU is present")
    with pytest.raises(BackendUnavailableError, match="cuda.*(CUDA|GPU)"):
        select_backend("cuda")


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_capture_pauses_gc_and_goes_largest_first(backend: str) -> None:
    import gc

    from graphrt.backends.torch import recording_graph

    capturing = (torch.cuda.is_current_stream_capturing if backend == "cuda"
                 else recording_graph.is_current_stream_capturing)
    seen: list[tuple[bool, bool]] = []
    model = make_backend(backend).load_model(model_dir())
    model.model.register_forward_pre_hook(lambda m, a: seen.append((capturing(), gc.isenabled())))
    runner = make_runner(backend, model=model, mode="FULL", **ALL_SIZES)
    assert gc.isenabled()
    assert {enabled for captured, enabled in seen if captured} == {False}
    assert {enabled for captured, enabled in seen if not captured} == {True}  # warm-up runs
    forward = [r for r in runner.executor.builder.report if "sample" not in r["key"]]
    sizes = [int(r["key"].split("tokens=")[1].split(",")[0]) for r in forward]
    assert sizes == sorted(sizes, reverse=True) == [16, 8, 4, 2, 1]
    assert all(r["seconds"] > 0 for r in forward) and forward[0]["bytes"] > 0


def test_cuda_adapter_uses_one_side_stream_and_one_pool() -> None:
    import gc

    collect = gc.collect
    backend = SimCudaBackend()
    runner = ModelRunner(model_dir(), backend=backend, num_kv_blocks=NUM_KV_BLOCKS, progress=False,
                         mode="FULL_AND_PIECEWISE", **{**CONFIG, **ALL_SIZES})
    assert gc.collect is collect  # nothing process-wide is swapped out for a capture
    graphs = [c for c in backend.fake.calls if c[0] == "capture_begin"]
    assert len(graphs) == len(runner.executor.builder.report) + 5 * 2  # 3 pieces per piecewise bucket
    assert {stream for _, stream, _ in graphs} == {"s1"}
    assert {mode for _, _, mode in graphs} == {"thread_local"}   # another thread's steps may sync meanwhile
    assert [c for c in backend.fake.calls if c[0] == "graph_pool_handle"] == [("graph_pool_handle",)]
    assert ("empty_cache",) not in backend.fake.calls
