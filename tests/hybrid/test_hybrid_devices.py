"""Hybrid models through the device-graph API of ``npu`` and ``cuda`` (docs/hybrid.md).

The Ascend and CUDA adapters run here over stand-in ``torch.npu`` / ``torch.cuda`` namespaces
on the CPU recording graph (``device_fakes``), as tests/test_acl.py and the conformance tests
do: their own capture, replay and (Ascend) task-update code around the recurrent layers.

* Teacher-forced parity with transformers (requests of different lengths, chunked prefill,
  a preempted request recomputed in another slot) with decode and mixed steps replaying FULL
  graphs, and with mixed steps in PIECEWISE graphs broken at the recurrent layers.
* ``state_isolated`` on a verification step padded to more requests.
* On a CUDA GPU (``gpu``-marked; skipped here): the same parity on ``cuda``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import graphrt
from support.device_fakes import FakeCuda, FakeNpu
from graphrt.backends.torch.cuda import CudaGraphAPI, CudaGraphBackend
from graphrt.backends.torch.npu import NpuGraphBackend
from graphrt.testing.properties import state_isolated
from graphrt.testing.runners import RunnerFactory
from graphrt.testing.step import Step
from support.hybrid_models import hybrid_model_dir, load_hf_hybrid
from support.hybrid_parity import reference_logits, run_schedule

LIMITS = dict(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=32, block_size=4,
              cudagraph_capture_sizes=[4, 8, 16])
LENGTHS = (11, 6, 14)


class SimCudaBackend(CudaGraphBackend):
    """The CUDA adapter on the CPU: its own code, a stand-in ``torch.cuda`` namespace."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.fake = FakeCuda()

    def graph_api(self) -> CudaGraphAPI:
        return CudaGraphAPI(self.device, self.fake)


def _backend(name: str) -> Any:
    return {"npu": lambda: NpuGraphBackend("cpu", npu=FakeNpu()), "cuda-sim": SimCudaBackend,
            "cuda": lambda: "cuda"}[name]()


@pytest.fixture(scope="module")
def granite():
    d = hybrid_model_dir("granite")
    rng = np.random.default_rng(11)
    seqs = [[int(t) for t in rng.integers(3, 128, size=n)] for n in LENGTHS]
    return str(d), seqs, reference_logits(load_hf_hybrid(d), seqs)


def _parity(granite, backend: str, mode: str) -> graphrt.ModelRunner:
    d, seqs, refs = granite
    runner = graphrt.ModelRunner(d, backend=_backend(backend), mode=mode, progress=False, num_kv_blocks=25, **LIMITS)
    run_schedule(runner, seqs, refs, chunk=5, joins=[0, 1, 2], preempt={3: 0})
    return runner


@pytest.mark.parametrize("backend", ["npu", "cuda-sim"])
def test_full_graphs_of_every_step_match_transformers(granite, backend):
    """FULL mode: decode and mixed steps alike replay FULL graphs (of mixed keys)."""
    runner = _parity(granite, backend, "FULL")
    assert {m for m, _ in runner.dispatcher.keys()} == {graphrt.RuntimeMode.FULL}
    assert runner.stats.hits > 0


def test_full_decode_and_piecewise_mixed_graphs_match_transformers_on_npu(granite):
    """FULL_AND_PIECEWISE: uniform decode steps in FULL graphs, mixed steps in PIECEWISE ones."""
    runner = _parity(granite, "npu", "FULL_AND_PIECEWISE")
    keys = {(m, k.uniform_decode) for m, k in runner.dispatcher.keys()}
    assert {(graphrt.RuntimeMode.FULL, True), (graphrt.RuntimeMode.PIECEWISE, False)} <= keys
    assert runner.stats.hits > 0


def test_padded_verification_rows_never_touch_a_live_slot_on_npu():
    """3 requests x (1 + 2) tokens in slots 1-3, padded to 4 requests; slot 0 parked."""
    rng = np.random.default_rng(3)
    step = Step(rng.integers(3, 120, size=(4, 64)).astype(np.int32), np.arange(1, 65, dtype=np.int32).reshape(4, 16),
                np.array([0, 1, 2], np.int32), np.array([5, 6, 7], np.int32), np.full(3, 3, np.int32), 4, seed=5,
                state_slots=np.array([1, 2, 3, 0], np.int32))
    factory = RunnerFactory(str(hybrid_model_dir("mamba2")), NpuGraphBackend("cpu", npu=FakeNpu()), mode="FULL",
                            num_speculative_tokens=2, cudagraph_capture_sizes=[12])
    state_isolated(factory, step)
    assert factory().last_step.mode is graphrt.RuntimeMode.FULL and factory().last_step.key.num_reqs == 4


#: The oldest transformers whose GraniteMoeHybrid forward this parity was checked against. On the
#: H200 (2026-11-29) transformers 5.17.0's forward of the same tiny checkpoint gave other logits
#: from the first prefill on (0.19 apart), while graphrt's CUDA graphs gave, to 1e-6, the logits
#: transformers 5.24 gives on the CPU: the oracle differs between releases, not the graphs.
ORACLE_TRANSFORMERS = (5, 24)


def _transformers_version() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(_transformers_version() < ORACLE_TRANSFORMERS,
                    reason="the GraniteMoeHybrid oracle was checked with transformers>=5.24 (5.17 computes other "
                           "logits for the same checkpoint)")
@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE"])
def test_cuda_graphs_match_transformers(granite, mode):
    runner = _parity(granite, "cuda", mode)
    assert runner.stats.hits > 0
