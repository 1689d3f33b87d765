"""Complete keys: a captured forward must not bake in host values that depend on a step's data.

The planted bug is transformers' #45323 in small: an attention backend whose ``before_replay``
plans from the step's longest sequence on the host and passes that number to a kernel as a
Python scalar. A graph would replay the number it was captured with, so later steps under the
same key would compute with a stale value. The attention seam (docs/attention.md) refuses it:
while a graph is captured, a refresh (or a backend's metadata builder) that reads a host value
it did not declare fails the capture in every mode, naming the value and the key,
and the step runs eagerly with the right number. Declared refreshed, the same plan written
into a device buffer replays right. The recording graph also sees every number baked into
the captured ops, and ``check_baked_values`` / strict mode compare each FULL key's forward
under two steps it holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from graphrt import GraphCaptureError, ModelRunner, RuntimeMode
from graphrt.backends.torch.cpu import CpuGraphBackend
from graphrt.backends.torch.eager import EagerBackend
from graphrt.backends.torch.recording_graph import RecordingGraph, recording_graph
from support.hf_models import tiny_hf_model_dir
from support.planned_backend import planned_model
from support.parity import assert_bitwise, assert_close_across_shapes, assert_same_tokens, pad_like

LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32, block_size=4,
              cudagraph_capture_sizes=[4, 8, 16], mode="FULL")
TOKENS = np.random.default_rng(3).integers(0, 128, size=(4, 32), dtype=np.int32)
BLOCKS = (np.arange(32, dtype=np.int32) + 1).reshape(4, 8)


def runner_with(model: torch.nn.Module, backend: Any = None, **overrides: Any) -> ModelRunner:
    return ModelRunner(model, backend=backend or CpuGraphBackend(), num_kv_blocks=33, progress=False,
                       **{**LIMITS, **overrides})


def forward_entries(r: ModelRunner) -> list[dict[str, Any]]:
    """The capture report's FULL forward keys (sampler graphs are FULL too, and not checked)."""
    return [e for e in r.executor.builder.report
            if e["mode"] == "FULL" and not e["key"].startswith("(sample")]


def steps(r: ModelRunner, graphs: bool = True) -> list[np.ndarray]:
    """A prefill then two decodes (seq lens grow: the planned scale changes every step)."""
    out = []
    for computed, scheduled in (([0, 0], [5, 3]), ([5, 3], [1, 1]), ([6, 4], [1, 1])):
        r.execute(token_ids=TOKENS, block_table=BLOCKS, req_rows=np.array([0, 1]),
                  num_computed_tokens=np.array(computed), num_scheduled_tokens=np.array(scheduled))
        assert r.last_step.mode is RuntimeMode.FULL or not r.executor.capabilities.has_graphs or not graphs
        out.append(r.outputs.logits())
    return out


def test_graphrts_own_forward_is_complete_in_strict_mode():
    r = ModelRunner(str(tiny_hf_model_dir("qwen3")), backend="cpu", num_kv_blocks=33, progress=False,
                    strict=True, **LIMITS)
    full = forward_entries(r)
    assert len(full) == 3 and all(e["baked"] > 0 and e["varying"] == [] for e in full), full


def test_an_undeclared_host_value_fails_the_capture_in_the_default_mode(caplog: pytest.LogCaptureFixture):
    """The repro: no strict mode, no check_baked_values. Every FULL capture is refused naming
    seq_lens, before_replay and the key; the steps run eagerly, with the right plan (no wrong token)."""
    model = planned_model(device_value=False)
    with caplog.at_level("WARNING", logger="graphrt"):
        r = runner_with(model)
    assert forward_entries(r) == [] and r.stats.failed_builds == 3
    assert "'seq_lens' in before_replay" in caplog.text and "tokens=16" in caplog.text
    assert "refreshed_host_values" in caplog.text
    eager = runner_with(planned_model(device_value=False), backend=EagerBackend())  # unpadded, as the fallback runs
    for i, (got, want) in enumerate(zip(steps(r, graphs=False), steps(eager))):
        assert_close_across_shapes(got, want, err_msg=f"step {i}")
        assert_same_tokens(got, want, f"step {i}")


def test_strict_mode_fails_the_capture_naming_the_value_and_the_key():
    with pytest.raises(GraphCaptureError, match=r"'seq_lens'.*tokens=16"):
        runner_with(planned_model(device_value=False), strict=True)


def test_declared_but_baked_as_a_python_number_is_caught_by_the_baked_check_in_every_mode():
    """Declared refreshed, yet the refresh hands the layers a Python number: the graph bakes it.
    A model's own backend with a before_replay gets the baked-values check at every FULL
    capture, which compares two captures and names the op: refused in strict mode, and in the
    default mode the keys run eagerly with the right plan (before, this was silent there)."""
    with pytest.raises(GraphCaptureError, match=r"tokens=16.*aten\.mul"):
        runner_with(planned_model(device_value=False, declared=True), strict=True)
    r = runner_with(planned_model(device_value=False, declared=True))
    assert forward_entries(r) == [] and r.stats.failed_builds == 3
    eager = runner_with(planned_model(device_value=False, declared=True), backend=EagerBackend())
    for i, (got, want) in enumerate(zip(steps(r, graphs=False), steps(eager))):
        assert_close_across_shapes(got, want, err_msg=f"step {i}")
        assert_same_tokens(got, want, f"step {i}")


def test_the_same_plan_declared_and_through_a_device_buffer_replays_right():
    r = runner_with(planned_model(device_value=True, declared=True), strict=True)
    assert len(forward_entries(r)) == 3 and all(e["varying"] == [] for e in forward_entries(r))
    eager = pad_like(runner_with(planned_model(device_value=True, declared=True), backend=EagerBackend()), r)
    for i, (got, want) in enumerate(zip(steps(r), steps(eager))):
        assert_bitwise(got, want, f"step {i}")


def test_recording_graph_lists_the_numbers_each_op_bakes():
    x = torch.arange(6.0)
    g = RecordingGraph()
    with recording_graph(g):
        y = x[1:4] * 2.5
        y.add_(x.sum(), alpha=3)
    names = [op for op, _ in g.baked_values()]
    values = dict(g.baked_values())
    assert any("slice" in n for n in names) and any(v == (2.5,) for v in values.values())
    assert (3,) in values.values()


def test_each_key_is_checked_once_when_graph_memory_is_sampled_first(monkeypatch: pytest.MonkeyPatch):
    """Sizing the KV cache from a budget captures sample keys before warm-up; warm-up checks
    every FULL key, so the samples are not checked too."""
    from graphrt.backends.torch.capture import baked_values as baked

    checked = []
    real = baked.BakedValueChecks.check_key
    monkeypatch.setattr(baked.BakedValueChecks, "check_key",
                        lambda checks, key: (checked.append(key), real(checks, key))[1])
    r = ModelRunner(str(tiny_hf_model_dir("qwen3")), backend="cpu", kv_cache_memory=64 << 20, progress=False,
                    strict=True, **LIMITS)
    assert r.graph_memory.deducted and r.graph_memory.sampled
    assert sorted(map(str, checked)) == sorted(e["key"] for e in forward_entries(r))
