"""Breakable capture (``piecewise_capture="breakable"``): PIECEWISE graphs captured by running
the forward once and breaking at each attention call, with no torch.fx.

* Parity with the fx path and with eager, in PIECEWISE on every torch graph backend this
  machine runs, in FULL_AND_PIECEWISE on cpu, and in FULL / FULL_DECODE_ONLY on cpu (``cpu`` recording graph, the Ascend and CUDA adapters over
  stand-ins): the same schedule, replay bit-identical to eager at the padded shape and to the
  fx pieces, unpadded eager within ``graphrt.tolerance``.
* A model torch.fx cannot trace (Python control flow on a shape) gets PIECEWISE graphs with
  ``auto``, and none with ``fx``.
* The layers' own ``forward`` is restored after capture; a failed capture falls back to
  eager and leaves a fresh pool.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from graphrt import RuntimeMode
from graphrt.backends.torch.cpu import CpuGraphBackend
from support.hf_models import tiny_hf_model_dir
from support.parity import assert_bitwise
from test_conformance import (BACKENDS, CONFIG, MIXED_STEPS, NUM_KV_BLOCKS, assert_across_shapes, make_backend,
                              make_runner, padded_reference, reference, run_schedule, step_kwargs)
from graphrt.core.graph_modes import GraphMode
from graphrt.runner import ModelRunner

GRAPH_BACKENDS = [b for b in BACKENDS if b not in ("eager",)]


#: Both modes on cpu; the device adapters (stand-ins), whose capture calls are what differs,
#: in PIECEWISE -- FULL_AND_PIECEWISE adds nothing breakable-specific there.
PARITY = [pytest.param(*b.values, m, marks=b.marks) if hasattr(b, "values") else (b, m)
          for b in GRAPH_BACKENDS for m in ("PIECEWISE", "FULL_AND_PIECEWISE") if b == "cpu" or m == "PIECEWISE"]


@pytest.mark.parametrize("backend,mode", PARITY)
def test_breakable_equals_fx_and_eager(backend: str, mode: str) -> None:
    check_parity(backend, mode)


@pytest.mark.parametrize("mode", ["FULL", "FULL_DECODE_ONLY"])
def test_breakable_changes_nothing_in_modes_without_pieces(mode: str) -> None:
    check_parity("cpu", mode)


def check_parity(backend: str, mode: str) -> None:
    breakable = make_runner(backend, mode=mode, piecewise_capture="breakable")
    fx = make_runner(backend, mode=mode, piecewise_capture="fx")
    assert breakable.executor.pieces.capture == "breakable" and fx.executor.pieces.capture == "fx"
    got, want = run_schedule(breakable), run_schedule(fx)
    same, eager_kv = padded_reference(breakable, backend, [key for _, _, key in got])
    unpadded, _ = reference("cuda" if backend == "cuda" else "cpu")
    for i, ((ran, logits, key), (fx_ran, fx_logits, fx_key)) in enumerate(zip(got, want)):
        assert ran is fx_ran and key == fx_key, (i, ran, fx_ran, key, fx_key)
        if i in MIXED_STEPS:
            assert ran is GraphMode(mode).mixed_mode()
        if backend != "cuda":
            assert_bitwise(logits, fx_logits, f"step {i}: breakable against fx")
            assert_bitwise(logits, same[i], f"step {i}: breakable against eager at its padded shape")
        assert_across_shapes(logits, unpadded[i], f"step {i}: against unpadded eager")
    if backend != "cuda":
        assert_bitwise(breakable.executor.kv_cache, eager_kv, "KV cache")
    report = [r for r in breakable.executor.builder.report if r["mode"] == "PIECEWISE"]
    assert bool(report) == ("PIECEWISE" in mode)
    if breakable.executor.capabilities.graphs_share_memory:   # later graphs reuse the pool the first one grew
        assert not report or (max(r["bytes"] for r in report) > 0 and min(r["bytes"] for r in report) >= 0)
    else:                                        # the recording graph keeps every graph's own bytes
        assert all(r["bytes"] > 0 for r in report)


def untraceable_model() -> torch.nn.Module:
    """graphrt's reference Qwen3 with Python control flow on a shape in its forward: fine in a
    graph (the shape is the key's), but torch.fx's symbolic tracing cannot branch on it."""
    model = CpuGraphBackend().load_model(str(tiny_hf_model_dir("qwen3")))
    base = type(model)

    def forward(self: Any, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] == 0:
            raise ValueError("an empty step")
        return base.forward(self, input_ids, positions)

    model.__class__ = type("Untraceable", (base,), {"forward": forward})
    return model


def test_a_model_fx_cannot_trace_gets_breakable_piecewise_graphs() -> None:
    auto = ModelRunner(untraceable_model(), backend="cpu", num_kv_blocks=NUM_KV_BLOCKS, progress=False,
                       mode="PIECEWISE", **CONFIG)
    assert auto.executor.pieces.split_model is None and auto.executor.pieces.capture == "breakable"
    assert auto.mode is GraphMode.PIECEWISE
    assert all("forward" not in layer.__dict__ for layer in auto.executor.model.attention_layers())
    got = run_schedule(auto)
    unpadded, _ = reference("cpu")
    for i in MIXED_STEPS:
        assert got[i][0] is RuntimeMode.PIECEWISE
        assert_across_shapes(got[i][1], unpadded[i], f"step {i}")
    fx_only = ModelRunner(untraceable_model(), backend="cpu", num_kv_blocks=NUM_KV_BLOCKS, progress=False,
                          mode="PIECEWISE", piecewise_capture="fx", **CONFIG)
    assert fx_only.executor.pieces.capture is None and fx_only.mode is GraphMode.NONE


def test_layers_get_their_forward_back_and_a_failed_capture_runs_eagerly() -> None:
    model = CpuGraphBackend().load_model(str(tiny_hf_model_dir("qwen3")))
    layers = list(model.attention_layers())

    def host_sync(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        float(output.sum())        # a host sync: fatal while a segment is being captured

    handle = model.model.layers[0].mlp.register_forward_hook(host_sync)
    r = ModelRunner(model, backend=make_backend("cpu"), num_kv_blocks=NUM_KV_BLOCKS, progress=False,
                    mode="PIECEWISE", piecewise_capture="breakable", **CONFIG)
    assert all("forward" not in layer.__dict__ for layer in layers)
    assert r.stats.failed_builds == len(r.cache.keys()) > 0
    r.execute(**step_kwargs(0))
    assert r.last_step.mode is RuntimeMode.NONE and "host" in (r.last_step.eager_reason or "").lower()
    handle.remove()

