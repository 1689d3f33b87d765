"""Graph memory in the KV budget (issue 14): with a memory budget, the KV cache is sized after
the graphs' estimated memory and its margin are taken out; the estimate is extrapolated from
sample keys measured before the KV cache exists (on CPU: the recording graph's byte counts)
and reported against the bytes warm-up actually built.

vLLM's failures this guards against: #45178 (the second graph's bytes times the number of
graphs, over one shared pool: two thirds of the KV cache lost) and #51590 (per-mode deltas of
one shared pool from two samples: 1.3 GiB estimated against 4.7 GiB).
"""

from __future__ import annotations

import logging
import math
from fractions import Fraction

import pytest
import torch

from support.fast_subset import slow_except
from support.device_fakes import FakeCuda, FakeNpu
from graphrt import ConfigError, ModelRunner
from graphrt.backends.torch.cuda import CudaGraphAPI, CudaGraphBackend
from graphrt.backends.torch.eager import EagerBackend
from graphrt.backends.torch.npu import NpuGraphBackend
from graphrt.core import defaults
from graphrt.core import graph_memory
from graphrt.core.graph_memory import GRAPH_MEMORY_MARGIN
from graphrt.core.dispatch import BatchDescriptor, SamplerKey
from graphrt.core.graph_memory import (GraphMemory, choose_samples, estimate_graph_memory, extrapolate,
                                       kv_blocks_after_graphs)
from graphrt.core.graph_modes import RuntimeMode

#: The cache holds at most 8 requests x 32 blocks + 1 = 257 blocks of 2048 bytes.
LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128, block_size=4)
PER_BLOCK = 2048
SIZES = [1, 2, 4, 8, 16]
#: KV blocks the budget of the main test leaves once the graphs are out of it.
BLOCKS = 100


def make(model_dir, backend="cpu", **kw):
    kw = {"mode": "FULL", "cudagraph_capture_sizes": SIZES, **LIMITS, **kw}
    return ModelRunner(model_dir, backend=backend, progress=False, **kw)


@pytest.fixture(scope="module")
def deducted(model_dir):
    """Bytes the graphs of ``make(model_dir)`` take out of a budget (estimate + margin): the
    estimate is a deterministic function of the recording graph's byte counts."""
    return make(model_dir, kv_cache_memory=1 << 30, warmup=False).graph_memory.deducted


@pytest.fixture(scope="module")
def budget(deducted):
    """A budget that holds the graphs and BLOCKS blocks, and part of one more."""
    return deducted + BLOCKS * PER_BLOCK + PER_BLOCK // 2


@pytest.fixture(scope="module")
def cpu_runner(model_dir, budget):
    return make(model_dir, kv_cache_memory=budget)


def line(points: dict[int, int], size: int) -> Fraction:
    """The rule by hand: the straight line through two (size, bytes) points."""
    (x0, y0), (x1, y1) = sorted(points.items())
    return y0 + Fraction(y1 - y0, x1 - x0) * (size - x0)


def test_kv_blocks_are_reduced_by_the_recording_graphs_measured_bytes(cpu_runner, budget):
    r = cpu_runner
    gm = r.graph_memory
    built = {row["key"]: row["bytes"] for row in r.warmup_report}
    # The samples: per family the largest, the smallest and the middle key, measured before the
    # KV cache existed -- the same byte counts the recording graph gives them at warm-up.
    fwd = {n: f"FULL (mixed, tokens={n}, reqs={min(n, 8)}, context<=128)" for n in SIZES}   # one context bucket
    kinds = ("greedy", "random", "logprobs")          # three sampler families: greedy, random, logprobs
    smp = {(n, g): f"sampler (reqs={n}, {g})" for n in (1, 2, 4, 8) for g in kinds}
    assert set(gm.sampled) == {fwd[1], fwd[4], fwd[16]} | {smp[n, g] for n in (1, 4, 8) for g in kinds}
    assert all(gm.sampled[k] == built[k] > 0 for k in gm.sampled)
    # The estimate: every sample as measured; each other key on its family's line (the first
    # capture, tokens=16, is no point of it: its bytes would include a shared pool's).
    expected = sum(gm.sampled.values())
    fwd_line = {n: built[fwd[n]] for n in (1, 4)}
    expected += line(fwd_line, 2) + line(fwd_line, 8)
    for g in kinds:
        expected += line({n: built[smp[n, g]] for n in (1, 4)}, 2)
    assert gm.estimate == math.ceil(expected)
    assert gm.margin == math.ceil(gm.estimate * GRAPH_MEMORY_MARGIN) > 0
    assert r.executor.kv_cache_bytes_per_block(LIMITS["block_size"]) == PER_BLOCK
    assert r.num_kv_blocks == (budget - gm.estimate - gm.margin) // PER_BLOCK == BLOCKS
    assert gm.budget == budget and gm.kv_bytes == BLOCKS * PER_BLOCK
    assert r.executor.kv_cache.shape[2] == r.num_kv_blocks * LIMITS["block_size"] + 1
    # After warm-up: the actual bytes, every key's, next to the estimate.
    assert gm.actual == sum(built.values()) == r.stats.build_bytes + r.sampler_stats.build_bytes
    assert abs(gm.estimate - gm.actual) <= 0.1 * gm.actual
    assert r.executor.builder.report and len(r.executor.builder.report) == len(built)   # samples not reported
    summary = gm.summary()
    assert "estimated from 12 of 17 keys" in summary and "actual" in summary and "estimate / actual" in summary
    d = gm.as_dict()
    assert d["estimate"] == gm.estimate and d["actual"] == gm.actual and d["reason"] is None


@pytest.mark.slow
def test_estimate_and_actual_are_logged(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="graphrt"):
        r = make(model_dir, cudagraph_capture_sizes=[1, 2, 4], kv_cache_memory=64 << 20)
    lines = [m for m in caplog.messages if m.startswith("graphrt: graph memory:")]
    assert len(lines) == 2 and "not built yet" in lines[0] and "estimate / actual" in lines[1]
    assert f"{r.graph_memory.actual / 2**20:.2f} MiB actual" in lines[1]


@pytest.mark.slow
def test_the_margin_is_the_defaults_fraction(model_dir, monkeypatch):
    monkeypatch.setattr(graph_memory, "GRAPH_MEMORY_MARGIN", 0.5)
    small = make(model_dir, cudagraph_capture_sizes=[1, 2], kv_cache_memory=1 << 30, warmup=False).graph_memory
    budget = small.estimate + small.margin + 10 * PER_BLOCK
    r = make(model_dir, cudagraph_capture_sizes=[1, 2], kv_cache_memory=budget, warmup=False)
    gm = r.graph_memory
    assert gm.margin == math.ceil(gm.estimate * 0.5) and gm.estimate == small.estimate
    assert r.num_kv_blocks == 10


@pytest.mark.parametrize("how", ["eager backend", "enforce_eager"])
def test_no_graphs_no_reduction(model_dir, how):
    budget = 100 * PER_BLOCK + 5
    r = (make(model_dir, backend=EagerBackend(), kv_cache_memory=budget) if how == "eager backend"
         else make(model_dir, enforce_eager=True, kv_cache_memory=budget))
    assert r.num_kv_blocks == 100
    gm = r.graph_memory
    assert gm.estimate == gm.margin == 0 and gm.sampled == {} and gm.reason
    assert gm.actual == 0 and "not deducted" in gm.summary()


def test_a_budget_too_small_for_graphs_and_one_request_names_the_numbers(model_dir, cpu_runner):
    gm = cpu_runner.graph_memory
    per_block = PER_BLOCK
    budget = gm.estimate + gm.margin + per_block          # one block: no room for a request
    assert budget // per_block >= 2                         # without graphs it would have fitted
    with pytest.raises(ConfigError) as err:
        make(model_dir, kv_cache_memory=budget, warmup=False)
    text = str(err.value)
    for number in (budget, per_block, gm.estimate, gm.margin, 2 * per_block):
        assert str(number) in text
    assert "kv_cache_memory" in text and "12 of 17 keys" in text


def test_explicit_blocks_and_the_default_host_size_deduct_nothing(model_dir):
    r = make(model_dir, kv_cache_memory=None, num_kv_blocks=50, cudagraph_capture_sizes=[1, 2])
    assert r.num_kv_blocks == 50 and r.graph_memory.reason == "num_kv_blocks given"
    assert r.graph_memory.actual == r.stats.build_bytes + r.sampler_stats.build_bytes > 0
    r = make(model_dir, kv_cache_memory=None, warmup=False, cudagraph_capture_sizes=[1, 2])
    per_block = r.executor.kv_cache_bytes_per_block(LIMITS["block_size"])
    assert r.num_kv_blocks == min(defaults.DEFAULT_HOST_KV_CACHE_BYTES // per_block, 8 * 32 + 1)
    assert "default host KV size" in r.graph_memory.reason and r.graph_memory.actual is None


class SimCuda(CudaGraphBackend):
    """The CUDA adapter's own code over a stand-in ``torch.cuda`` (tests/support/device_fakes.py)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.fake = FakeCuda()

    def graph_api(self) -> CudaGraphAPI:
        return CudaGraphAPI(self.device, self.fake)


@pytest.mark.parametrize("device", slow_except(["cuda", "npu"], "cuda"))
def test_device_adapters_measure_reserved_memory_and_release_the_samples(model_dir, device):
    """The CUDA and Ascend adapters (stand-in namespaces over the recording graph): samples are
    measured by the namespace's reserved memory, dropped, and handed back with empty_cache;
    without a budget, the device's free memory is the budget the graphs come out of."""
    backend = SimCuda() if device == "cuda" else NpuGraphBackend(device="cpu", npu=FakeNpu())
    fake = backend.fake if device == "cuda" else backend._npu
    r = make(model_dir, backend=backend, kv_cache_memory=None, cudagraph_capture_sizes=[1, 2, 4])
    gm = r.graph_memory
    assert gm.reason is None and gm.estimate > 0 and len(gm.sampled) == 12
    free, total = 8 << 30, 16 << 30                      # what the stand-ins report
    assert gm.budget == int(free - total * (1 - defaults.DEFAULT_GPU_MEMORY_UTILIZATION))
    assert gm.actual == r.stats.build_bytes + r.sampler_stats.build_bytes
    assert gm.estimate == gm.actual                      # every key sampled: nothing extrapolated
    if device == "cuda":
        assert ("empty_cache",) in fake.calls
        assert fake.memory_reserved() == gm.actual       # the samples' graphs are gone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_on_a_gpu_the_estimate_is_near_the_captured_pool(model_dir):
    r = ModelRunner(model_dir, backend="cuda", progress=False, kv_cache_memory=1 << 30,
                    **{**LIMITS, "max_num_batched_tokens": 256, "max_num_seqs": 64})
    gm = r.graph_memory
    assert gm.reason is None and gm.actual is not None
    built = {row["key"]: row["bytes"] for row in r.warmup_report if row["bytes"]}
    why = f"sampled {gm.sampled}; built (nonzero) {built}"
    assert gm.estimate + gm.margin >= 0.5 * gm.actual and gm.estimate <= 3 * max(gm.actual, 1 << 20), why


@pytest.mark.slow
def test_xla_deducts_its_executables_measured_before_the_kv_cache(model_dir):
    """XLA compiles the samples against a two-block cache (issue 41: no executable's temp memory
    grows with the cache), so the budget holds their code and, once, the largest temp memory;
    they are what warm-up then builds."""
    pytest.importorskip("jax")
    budget = 4 << 20
    r = ModelRunner(model_dir, backend="xla", progress=False, kv_cache_memory=budget,
                    precompile_token_paddings=[16], precompile_bs_paddings=[8], **LIMITS)
    gm = r.graph_memory
    assert gm.reason is None and gm.scratch > 0
    assert gm.margin == math.ceil((gm.estimate + gm.scratch) * GRAPH_MEMORY_MARGIN)
    per_block = r.executor.kv_cache_bytes_per_block(LIMITS["block_size"])
    full = LIMITS["max_num_seqs"] * LIMITS["max_model_len"] // LIMITS["block_size"] + 1
    assert r.num_kv_blocks == min((budget - gm.deducted) // per_block, full)
    assert gm.actual == sum(row["bytes"] for row in r.warmup_report)
    assert abs(gm.estimate - gm.actual) <= 0.1 * gm.actual and gm.scratch == gm.actual_scratch, gm.summary()


# ---- the rule alone ----------------------------------------------------------------------

def _jobs(sizes):
    return [(RuntimeMode.FULL, BatchDescriptor(n, n, False)) for n in sorted(sizes, reverse=True)]


def test_samples_are_the_largest_smallest_and_middle_of_each_family_in_warmup_order():
    jobs = _jobs(range(1, 12)) + [(RuntimeMode.FULL, SamplerKey(n, True)) for n in (8, 4, 2, 1)]
    picked = choose_samples(jobs, per_family=3)
    assert [k.num_tokens for _, k in picked if isinstance(k, BatchDescriptor)] == [11, 6, 1]
    assert [k.num_reqs for _, k in picked if isinstance(k, SamplerKey)] == [8, 4, 1]
    assert choose_samples(_jobs([4, 2]), per_family=3) == _jobs([4, 2])


def test_a_shared_pool_is_not_multiplied_by_the_number_of_graphs():
    """vLLM #45178: the first graph of a shared pool holds the pool; each later one adds little.
    The line goes through the later ones only, so 51 keys cost pool + 50 small marginals."""
    jobs = _jobs(range(8, 8 * 52, 8))
    pool, marginal = 1 << 30, 1 << 20
    measured = {k: (pool if i == 0 else marginal) for i, (_, k) in enumerate(choose_samples(jobs))}
    assert extrapolate(jobs, measured) == pool + (len(jobs) - 1) * marginal


def test_linear_costs_are_extrapolated_exactly():
    jobs = _jobs([1, 2, 3, 5, 8, 13, 21])
    cost = {k: 100 + 7 * k.num_tokens for _, k in jobs}
    measured = {k: cost[k] for _, k in choose_samples(jobs)}
    extra = 7 * 21    # the first (largest) capture also allocated shared buffers, once
    measured[jobs[0][1]] += extra
    assert extrapolate(jobs, measured) == sum(cost.values()) + extra


def test_a_measure_that_cannot_deducts_nothing():
    gm = estimate_graph_memory(_jobs([1, 2]), lambda jobs: ({}, "cannot here"))
    assert gm.deducted == 0 and gm.reason == "cannot here" and gm.num_keys == 2
    assert estimate_graph_memory([], lambda jobs: ({}, None)).reason.startswith("no keys")
    with pytest.raises(ConfigError, match="100 bytes leave 40"):
        kv_blocks_after_graphs(100, 30, 10, GraphMemory(estimate=50, margin=10, num_keys=2))


def test_a_shared_pool_takes_the_smaller_neighbour_not_a_line_through_segments():
    """On a caching allocator (CUDA, NPU) a graph after a larger one adds whole segments or
    nothing: samples of 0 and 2 MiB must not become 1 MiB for every key between them (an H200
    estimated 105 MiB that way for graphs that took 4.5 MiB). A line still holds where graphs
    keep their own memory."""
    jobs = _jobs(range(1, 34))
    picked = [k for _, k in choose_samples(jobs)]            # 33 (first), 17, 1
    segment = 2 << 20
    measured = {picked[0]: 40 << 20, picked[1]: 0, picked[2]: segment}
    shared = extrapolate(jobs, measured, shared_pool=True)
    assert shared == (40 << 20) + segment                   # every unsampled key: min(neighbours)
    assert extrapolate(jobs, measured) > shared + 5 * segment    # the line charges the keys between
    constant = {k: (1 << 20) for k in picked}
    assert extrapolate(jobs, constant, shared_pool=True) == len(jobs) * (1 << 20)
