"""Adding a recurrent kernel touches one file and its registration: a toy set
(tests/support/toy_recurrent.py) registered by name is chosen once by the state backend, runs
in graphrt's mixers, gives the reference kernels' logits and passes the kit's state properties."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import graphrt
from graphrt.layers.torch.state.kernels import register_recurrent_kernels, unregister_recurrent_kernels
from graphrt.testing.conformance import run_conformance
from graphrt.testing.runners import RunnerFactory
from support.hybrid_models import hybrid_model_dir
from support.toy_recurrent import CALLS, make_toy_kernels


@pytest.fixture
def toy_kernels(monkeypatch):
    register_recurrent_kernels("toy", make_toy_kernels)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield monkeypatch
    torch.set_num_threads(threads)
    unregister_recurrent_kernels("toy")


def _logits(d: str) -> tuple[np.ndarray, graphrt.ModelRunner]:
    runner = graphrt.ModelRunner(d, backend="cpu", mode="FULL", max_num_seqs=2, max_num_batched_tokens=16,
                                 max_model_len=32, block_size=4, num_kv_blocks=17, progress=False,
                                 cudagraph_capture_sizes=[2, 4])
    tokens = np.arange(64, dtype=np.int32).reshape(2, 32) % 120 + 3
    table = np.arange(1, 17, dtype=np.int32).reshape(2, 8)
    out = []
    for computed, scheduled in (((0, 0), (5, 3)), ((5, 3), (1, 1))):
        runner.execute(token_ids=tokens, block_table=table, req_rows=np.array([0, 1]),
                       num_computed_tokens=np.array(computed), num_scheduled_tokens=np.array(scheduled))
        out.append(runner.outputs.logits())
    return np.stack(out), runner


def test_a_toy_recurrent_kernel_added_in_one_file_and_registered_runs_and_passes_the_kit(toy_kernels):
    d = str(hybrid_model_dir("mamba2"))
    toy_kernels.setenv("GRAPHRT_RECURRENT", "reference")
    want, _ = _logits(d)
    toy_kernels.setenv("GRAPHRT_RECURRENT", "toy")
    before = CALLS["conv"]
    got, runner = _logits(d)
    assert runner.executor.state_backend.kernels.name == "toy" and CALLS["conv"] > before
    tol = graphrt.reduction_tolerance("float32", magnitude=float(np.abs(want).max()), width=64)
    np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=tol.atol)
    lines: list[str] = []
    results = run_conformance(factory=RunnerFactory(d, "cpu", mode="FULL", cudagraph_capture_sizes=[2, 4]),
                              examples=3, report=lines.append,
                              properties=["state_isolated", "padding_invisible", "replay_matches_eager"])
    assert [r.name for r in results if not r.passed] == [] and all(r.examples >= 1 for r in results), "\n".join(lines)
