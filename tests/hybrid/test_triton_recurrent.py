"""The Triton kernels of recurrent layers (layers/torch/state/triton_recurrent.py) against the reference.

Interpreted on a CPU (``TRITON_INTERPRET=1`` before triton is imported: the attention kernel
tests' setup, reused; in a full-suite run where triton was imported earlier the interpreter
tests run in a child pytest), compiled on a GPU (``gpu``-marked, skipped without one).

* conv1d, the Mamba2 scan and the gated delta rule over a mixed step (Mamba1's selective scan:
  test_selective_scan.py) -- requests continuing a
  state and new ones, chunked prefill, a padded request and padded tokens, two checkpoints --
  equal the reference kernels' outputs and the states they store (within the float32 tolerance:
  the Triton scan runs token by token, the reference by chunks).
* A model's mixers (Mamba's, RecurrentGemma's and MiniMax's through the Transformers backend included) run Triton when
  ``GRAPHRT_RECURRENT=triton`` asks, and its step matches the reference's; ``triton`` is refused with the reason where it cannot run; an unknown value too.
* Interpreted, every kernel replays in graphrt's CPU recording graph (each launch is the op
  ``graphrt::interpreted_triton``), and a hybrid's FULL ``cpu`` graphs with the Triton kernels
  give the reference's logits.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.triton_interpreter import CHILD_ENV, INTERPRETER_PROBLEM  # sets TRITON_INTERPRET first

import numpy as np
import torch

import graphrt
from graphrt import ConfigError
from graphrt.core import defaults
from graphrt.layers.torch.state import mamba_kernels
from graphrt.layers.torch.state import kernels, triton_recurrent
from graphrt.layers.torch.state.gated_delta import gated_delta_rule
from graphrt.layers.torch.state.metadata import build_state_metadata
from support.hybrid_models import hybrid_model_dir

ROOT = Path(__file__).resolve().parents[2]
interpreted = pytest.mark.skipif(INTERPRETER_PROBLEM is not None, reason=f"Triton interpreter: {INTERPRETER_PROBLEM}")
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _interpret_while_testing(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRETER_PROBLEM is None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _step(device: str = "cpu"):
    """A mixed step: request 0 continues (5 computed, 3 new), request 1 is new (6 tokens), request
    2 decodes (1 token), request 3 is padding; 3 padded tokens after them; 2 checkpoints."""
    qsl = torch.tensor([0, 3, 9, 10, 10], dtype=torch.int32, device=device)
    computed = torch.tensor([5, 0, 7, 0], dtype=torch.int32, device=device)
    slots = torch.tensor([2, 0, 1, -1], dtype=torch.int32, device=device)
    return build_state_metadata(qsl, computed, slots, 13, num_slots=3, checkpoints=2)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    tol = graphrt.reduction_tolerance("float32", magnitude=float(b.abs().max()), width=256)
    torch.testing.assert_close(a, b, rtol=tol.rtol, atol=tol.atol, msg=what)


@interpreted
def test_interpret_kernels_match_the_reference() -> None:
    torch.manual_seed(0)
    meta = _step()
    t, rows = 13, 5
    # conv1d: 24 channels, kernel 4
    x, w, b = torch.randn(t, 24), torch.randn(24, 4), torch.randn(24)
    init = torch.randn(rows, 24, 3) * meta.has_initial.view(-1, 1, 1)
    got, want = triton_recurrent.triton_causal_conv1d(x, w, b, init, meta), mamba_kernels.causal_conv1d(x, w, b, init, meta)
    _close(got[0], want[0], "conv1d outputs")
    assert torch.equal(got[1], want[1])
    # Mamba2 scan: 4 heads of 8, 2 groups, state 16
    x, dt = torch.randn(t, 4, 8), torch.rand(t, 4) * 0.5
    A, B, C, D = -torch.rand(4) - 0.1, torch.randn(t, 2, 16), torch.randn(t, 2, 16), torch.randn(4)
    init = torch.randn(rows, 4, 8, 16) * meta.has_initial.view(-1, 1, 1, 1)
    got, want = triton_recurrent.triton_ssd_scan(x, dt, A, B, C, D, init, meta), \
        mamba_kernels.ssd_scan(x, dt, A, B, C, D, init, meta, chunk_size=4)
    _close(got[0][:10], want[0][:10], "scan outputs")
    _close(got[1], want[1], "scan states")
    # gated delta rule: 2 key heads, 4 value heads, dims 8
    q, k, v = torch.randn(t, 2, 8), torch.randn(t, 2, 8), torch.randn(t, 4, 8)
    g, beta = -torch.rand(t, 4), torch.rand(t, 4)
    init = torch.randn(rows, 4, 8, 8) * meta.has_initial.view(-1, 1, 1, 1)
    got, want = triton_recurrent.triton_gated_delta_rule(q, k, v, g, beta, init, meta), \
        gated_delta_rule(q, k, v, g, beta, init, meta, 4)
    _close(got[0][:10], want[0][:10], "delta rule outputs")
    _close(got[1], want[1], "delta rule states")


def _kernel_inputs(t: int, rows: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """Inputs of every Triton kernel (conv1d with and without SiLU, Mamba2, the gated delta rule,
    Mamba1, RG-LRU, lightning attention) over ``t`` tokens and ``rows`` state rows."""
    return {"conv": (torch.randn(t, 24), torch.randn(24, 4), torch.randn(24), torch.randn(rows, 24, 3)),
            "ssd": (torch.randn(t, 2, 8), torch.rand(t, 2) * 0.5, -torch.rand(2) - 0.1, torch.randn(t, 1, 16),
                    torch.randn(t, 1, 16), torch.randn(2), torch.randn(rows, 2, 8, 16)),
            "delta": (torch.randn(t, 1, 8), torch.randn(t, 1, 8), torch.randn(t, 2, 8), -torch.rand(t, 2),
                      torch.rand(t, 2), torch.randn(rows, 2, 8, 8)),
            "selective": (torch.randn(t, 24), torch.rand(t, 24) * 0.5, -torch.rand(24, 8) - 0.1, torch.randn(t, 8),
                          torch.randn(t, 8), torch.randn(24), torch.randn(rows, 24, 8)),
            "rg_lru": (torch.rand(t, 24), torch.randn(t, 24), torch.randn(rows, 24)),
            "lightning": (torch.randn(t, 2, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8), torch.rand(2) + 0.1,
                          torch.randn(rows, 2, 8, 8))}


@interpreted
def test_interpret_kernels_replay_in_a_recording_graph() -> None:
    """Every Triton kernel captured in graphrt's CPU recording graph (the ``cpu`` backend's) runs
    again at each replay, on the step then in the captured buffers -- not the capture's outputs
    left in place (an interpreted launch is no aten op: it is recorded as
    ``graphrt::interpreted_triton``). The replay equals an eager call on the new step bit for bit."""
    from graphrt.backends.torch.recording_graph import RecordingGraph, recording_graph

    torch.manual_seed(0)
    t, rows = 8, 5                 # 3 requests and a padded one, a padded token; then another layout
    qsl = torch.tensor([0, 3, 6, 7, 7], dtype=torch.int32)
    computed = torch.tensor([5, 0, 7, 0], dtype=torch.int32)
    slots = torch.tensor([2, 0, 1, -1], dtype=torch.int32)
    inputs = _kernel_inputs(t, rows)

    def step() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        meta = build_state_metadata(qsl, computed, slots, t, num_slots=3, checkpoints=2)
        conv = inputs["conv"]
        return {"conv": triton_recurrent.triton_causal_conv1d(*conv, meta),
                "short conv": triton_recurrent.triton_causal_conv1d(*conv[:2], None, conv[3], meta, activation=False),
                "ssd": triton_recurrent.triton_ssd_scan(*inputs["ssd"], meta),
                "delta": triton_recurrent.triton_gated_delta_rule(*inputs["delta"], meta),
                "selective": triton_recurrent.triton_selective_scan(*inputs["selective"], meta),
                "rg_lru": triton_recurrent.triton_rg_lru_scan(*inputs["rg_lru"], meta),
                "lightning": triton_recurrent.triton_lightning_attention(*inputs["lightning"], meta)}

    graph = RecordingGraph()
    with recording_graph(graph):
        captured = step()
    for old, new in zip(inputs.values(), _kernel_inputs(t, rows).values()):   # the next step, in place
        for a, b in zip(old, new):
            a.copy_(b)
    qsl.copy_(torch.tensor([0, 1, 5, 7, 7])), computed.copy_(torch.tensor([9, 4, 0, 0]))
    slots.copy_(torch.tensor([1, 2, 0, -1]))
    graph.replay()
    want = step()
    for name, outputs in want.items():
        for got, expected, what in zip(captured[name], outputs, ("outputs", "states")):
            assert torch.equal(got, expected), f"{name} {what}: the replay is not the kernel on the new step"


@interpreted
@pytest.mark.parametrize("arch", ["granite", "qwen3_next", "mamba", "recurrent_gemma", "minimax"])
def test_interpret_models_run_triton_when_asked(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    d = str(hybrid_model_dir(arch))
    kw = dict(backend="eager", max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, block_size=4,
              num_kv_blocks=17, progress=False)
    tokens = np.arange(64, dtype=np.int32).reshape(2, 32) % 120 + 3
    table = np.arange(1, 17, dtype=np.int32).reshape(2, 8)
    logits = {}
    for choice in ("reference", "triton"):
        monkeypatch.setenv(kernels.RECURRENT_ENV, choice)
        runner = graphrt.ModelRunner(d, **kw)
        calls = []
        real = triton_recurrent._kernels

        def counting(interpret: bool, real=real):
            calls.append(interpret)
            return real(interpret)
        monkeypatch.setattr(triton_recurrent, "_kernels", counting)
        out = []
        for c, n in ((0, (5, 3)), (1, (1, 1))):
            runner.execute(token_ids=tokens, block_table=table, req_rows=np.array([0, 1]),
                           num_computed_tokens=np.array([0, 0]) if c == 0 else np.array([5, 3]),
                           num_scheduled_tokens=np.array(n))
            out.append(runner.outputs.logits())
        logits[choice] = np.stack(out)
        assert bool(calls) == (choice == "triton")
        monkeypatch.setattr(triton_recurrent, "_kernels", real)
    tol = graphrt.reduction_tolerance("float32", magnitude=float(np.abs(logits["reference"]).max()), width=64)
    np.testing.assert_allclose(logits["triton"], logits["reference"], rtol=tol.rtol, atol=tol.atol)


@interpreted
def test_interpret_full_cpu_graphs_replay_the_triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid's FULL graphs on the ``cpu`` backend with the Triton recurrent and attention
    kernels (interpreted) give the eager reference kernels' logits at every step: each step a
    replay of the graph captured at warm-up (before: the capture's outputs, silently)."""
    d = str(hybrid_model_dir("granite"))
    kw = dict(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16, block_size=4, num_kv_blocks=9,
              progress=False)
    tokens = np.arange(32, dtype=np.int32).reshape(2, 16) % 120 + 3
    table = np.arange(1, 9, dtype=np.int32).reshape(2, 4)
    steps = (((0, 0), (5, 3)), ((5, 3), (1, 1)))                 # a mixed step, then decodes padded to 8
    logits = {}
    for choice, extra in (("reference", dict(backend="eager")),
                          ("triton", dict(backend="cpu", mode="FULL", cudagraph_capture_sizes=[8]))):
        monkeypatch.setenv(kernels.RECURRENT_ENV, choice)
        monkeypatch.setenv(defaults.ATTENTION_ENV, choice)
        runner = graphrt.ModelRunner(d, **kw, **extra)
        out = []
        for computed, scheduled in steps:
            runner.execute(token_ids=tokens, block_table=table, req_rows=np.array([0, 1]),
                           num_computed_tokens=np.array(computed), num_scheduled_tokens=np.array(scheduled))
            out.append(runner.outputs.logits())
        logits[choice] = np.stack(out)
    assert runner.stats.hits == len(steps) and {m for m, _ in runner.dispatcher.keys()} == {graphrt.RuntimeMode.FULL}
    tol = graphrt.reduction_tolerance("float32", magnitude=float(np.abs(logits["reference"]).max()), width=64)
    np.testing.assert_allclose(logits["triton"], logits["reference"], rtol=tol.rtol, atol=tol.atol)


def test_triton_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.RECURRENT_ENV, "fast")
    with pytest.raises(ConfigError, match="GRAPHRT_RECURRENT='fast' is not one of"):
        kernels.select_recurrent_kernels("cpu")
    monkeypatch.setenv(kernels.RECURRENT_ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="GRAPHRT_RECURRENT=triton: .*interpreter"):
        kernels.select_recurrent_kernels("cpu")
    monkeypatch.setenv(kernels.RECURRENT_ENV, "auto")
    assert kernels.select_recurrent_kernels("cpu").name == "reference"


def test_interpreter_suite_in_a_fresh_process() -> None:
    """Where triton was imported before this module, the interpreter tests run in a child pytest."""
    if os.environ.get(CHILD_ENV) or INTERPRETER_PROBLEM is None:
        pytest.skip("the interpreter tests run in this process")
    if HAS_CUDA or "imported earlier" not in INTERPRETER_PROBLEM:
        pytest.skip(f"Triton interpreter: {INTERPRETER_PROBLEM}")
    env = dict(os.environ, TRITON_INTERPRET="1", **{CHILD_ENV: "1"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT / "tests"), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "interpret and not fresh"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_compiled_kernels_match_the_reference_on_cuda() -> None:
    torch.manual_seed(0)
    meta = _step("cuda")
    t, rows = 13, 5
    x, dt = torch.randn(t, 4, 8, device="cuda"), torch.rand(t, 4, device="cuda") * 0.5
    A, D = -torch.rand(4, device="cuda") - 0.1, torch.randn(4, device="cuda")
    B, C = torch.randn(t, 2, 16, device="cuda"), torch.randn(t, 2, 16, device="cuda")
    init = torch.randn(rows, 4, 8, 16, device="cuda") * meta.has_initial.view(-1, 1, 1, 1)
    got = triton_recurrent.triton_ssd_scan(x, dt, A, B, C, D, init, meta)
    want = mamba_kernels.ssd_scan(x, dt, A, B, C, D, init, meta, chunk_size=4)
    _close(got[0][:10].cpu(), want[0][:10].cpu(), "scan outputs")
    _close(got[1].cpu(), want[1].cpu(), "scan states")
