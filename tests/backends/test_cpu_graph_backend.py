"""The ``cpu`` graph backend through ModelRunner: device-graph semantics on a CPU.

* Replay after new inputs gives new results, equal to eager, over many varied steps:
  within ``graphrt.tolerance`` of the unpadded eager step, bitwise an eager step padded
  to the same key.
* A Python value the model reads is baked in at capture (replay ignores a later change;
  eager sees it) -- and the runner itself never depends on one.
* A host sync (``.item()``) during capture: strict mode raises ``GraphCaptureError`` naming
  the op; otherwise that key runs eagerly, with a warning, and results stay right.
* Every graph reads the same static input tensors; ``debug_check_addresses`` runs clean
  and catches a moved buffer.
* ``select_backend("cpu")``.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import graphrt
from graphrt import GraphCaptureError, GraphrtError, ModelRunner, RuntimeMode
from graphrt.runner import FailedBuild
from support.parity import assert_close_across_shapes, pad_like
from support.runner_steps import CONFIG, LIMITS, greedy, random_steps, same_bits

SIZES = [4, 8, 16]          # steps of 17..32 tokens run eagerly (above the largest bucket)


def make_runner(model, backend, tables, sizes=SIZES, mode="FULL", **kw):
    extra = {"mode": mode} if mode is not None else {}
    if backend != "eager":
        extra["cudagraph_capture_sizes"] = sizes
    return ModelRunner(model, backend=backend, num_kv_blocks=tables.num_kv_blocks, progress=False,
                       **LIMITS, **extra, **kw)


@pytest.fixture(scope="module")
def cpu_runner(model_dir, tables):
    """FULL graphs, every replay checks its input addresses."""
    return make_runner(model_dir, "cpu", tables, debug_check_addresses=True)


@pytest.fixture(scope="module")
def eager_runner(model_dir, tables):
    return make_runner(model_dir, "eager", tables)


def run_and_compare(step, runner, ref, twin=None):
    """One step on both runners; real hidden rows, logits and tokens must agree (within
    graphrt.tolerance: ``ref`` runs the unpadded step). ``twin``, an eager runner padded
    like ``runner``, runs the same shapes and must agree bit for bit, KV cache included."""
    tokens = step.run(runner, greedy(step.num_reqs))
    ref_tokens = step.run(ref, greedy(step.num_reqs))
    assert_close_across_shapes(runner.outputs.hidden_states(), ref.outputs.hidden_states())
    assert_close_across_shapes(runner.outputs.logits(), ref.outputs.logits())
    np.testing.assert_array_equal(tokens, ref_tokens)
    if twin is not None:
        np.testing.assert_array_equal(step.run(twin, greedy(step.num_reqs)), tokens)
        np.testing.assert_array_equal(twin.outputs.hidden_states(), runner.outputs.hidden_states())
        np.testing.assert_array_equal(twin.outputs.logits(), runner.outputs.logits())
        assert same_bits(twin.executor.kv_cache, runner.executor.kv_cache)
    return runner.outputs.logits().copy()


# ---- replay on new inputs --------------------------------------------------------------

def test_replay_after_new_inputs_gives_new_results_equal_to_eager(cpu_runner, eager_runner, tables):
    for r in (cpu_runner, eager_runner):
        r.executor.kv_cache.zero_()
    first = tables.step([0, 1], [0, 0], [3, 2])
    second = tables.step([4, 5], [0, 0], [2, 3])        # same shape, other tokens and blocks
    hits = cpu_runner.stats.hits
    a = run_and_compare(first, cpu_runner, eager_runner)
    key = cpu_runner.last_step.key
    b = run_and_compare(second, cpu_runner, eager_runner)
    assert cpu_runner.last_step.key == key and cpu_runner.last_step.mode is RuntimeMode.FULL
    assert cpu_runner.stats.hits == hits + 2              # one graph, replayed twice
    assert not np.allclose(a, b), "the replay returned the previous step's results"
    # Decode on top of both prompts: the replay reads the KV the earlier replays wrote.
    run_and_compare(tables.step([0, 1, 4, 5], [3, 2, 2, 3], [1, 1, 1, 1]), cpu_runner, eager_runner)


@pytest.mark.parametrize("mode", ["FULL", None])
def test_many_varied_steps_equal_eager(model_dir, tables, eager_runner, cpu_runner, mode):
    """Decodes, prefill chunks and mixed batches of 1..32 tokens (some above the largest
    bucket), through FULL graphs and through the default mode's graphs."""
    runner = cpu_runner if mode == "FULL" else make_runner(model_dir, "cpu", tables, mode=None)
    twin = pad_like(make_runner(model_dir, "eager", tables), runner)
    for r in (runner, eager_runner, twin):
        r.executor.kv_cache.zero_()
    modes, keys, previous = set(), set(), None
    for step in random_steps(tables, CONFIG, num_steps=40, seed=11):
        logits = run_and_compare(step, runner, eager_runner, twin)
        modes.add(runner.last_step.mode)
        keys.add(runner.last_step.key)
        if previous is not None and previous.shape == logits.shape:
            assert not np.array_equal(previous, logits)
        previous = logits
    assert RuntimeMode.NONE in modes and len(modes) >= 2, modes    # graphs and eager steps
    assert len(keys) >= 10
    assert runner.stats.unplanned_builds == 0


# ---- Python values are baked in at capture ---------------------------------------------------

def test_python_value_changed_after_capture_is_not_seen_by_replay(cpu_runner, eager_runner, tables,
                                                                  monkeypatch):
    step = tables.step([0, 1, 2], [0, 0, 0], [2, 3, 2])     # 7 tokens: the 8-token graph
    for r in (cpu_runner, eager_runner):
        r.executor.kv_cache.zero_()
    before = run_and_compare(step, cpu_runner, eager_runner)
    assert cpu_runner.last_step.mode is RuntimeMode.FULL
    # The attention softmax scale is a Python float the model reads on every forward.
    for r in (cpu_runner, eager_runner):
        for attn in r.model.attention_layers():
            monkeypatch.setattr(attn, "scale", attn.scale * 3.0)
    step.run(cpu_runner)
    replayed = cpu_runner.outputs.logits().copy()
    step.run(eager_runner)
    eager = eager_runner.outputs.logits().copy()
    np.testing.assert_array_equal(replayed, before)          # the graph kept the captured value
    assert not np.allclose(eager, before, rtol=1e-3, atol=1e-3)   # eager sees the new one
    # A step above the largest bucket runs eagerly on the cpu backend too, and sees it.
    big = tables.step([3, 4], [0, 0], [10, 9])
    big.run(cpu_runner)
    assert cpu_runner.last_step.mode is RuntimeMode.NONE
    big.run(eager_runner)
    assert_close_across_shapes(cpu_runner.outputs.logits(), eager_runner.outputs.logits())


# ---- a host sync during capture -------------------------------------------------------------

class ItemReadingModel(torch.nn.Module):
    """graphrt's decoder plus a ``.item()`` in its forward (a host sync no graph can hold)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.inner(input_ids, positions)
        longest = positions.max().item()        # reads a device value on the host
        return hidden * (1.0 if longest >= 0 else 0.0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)

    def attention_layers(self):
        return self.inner.attention_layers()

    def kv_cache_spec(self):
        return self.inner.kv_cache_spec()


def item_model(model_dir):
    return ItemReadingModel(graphrt.select_backend("cpu").load_model(model_dir))


def test_item_during_capture_raises_in_strict_mode(model_dir, tables):
    with pytest.raises(GraphCaptureError) as err:
        make_runner(item_model(model_dir), "cpu", tables, sizes=[8], strict=True)
    assert "`.item()`" in str(err.value)
    assert "_local_scalar_dense" in str(err.value)


def test_item_during_capture_falls_back_to_eager_with_a_warning(model_dir, tables, eager_runner, caplog):
    with caplog.at_level(logging.WARNING, logger="graphrt"):
        runner = make_runner(item_model(model_dir), "cpu", tables, sizes=[4, 8])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("failed, it will run eagerly" in w and "`.item()`" in w
                                      for w in warnings), warnings
    entries = [runner.cache.get(k) for k in runner.cache.keys()]
    assert len(entries) == 2 and all(isinstance(e, FailedBuild) for e in entries)
    assert all("`.item()`" in e.reason for e in entries)
    # The sampler does not call the model: its graphs captured fine.
    assert not any(isinstance(runner.sampler_cache.get(k), FailedBuild) for k in runner.sampler_cache.keys())
    for r in (runner, eager_runner):
        r.executor.kv_cache.zero_()
    for step in [tables.step([0, 1], [0, 0], [3, 2]), tables.step([0, 1], [3, 2], [1, 1])]:
        run_and_compare(step, runner, eager_runner)
        assert runner.last_step.mode is RuntimeMode.NONE
        assert "`.item()`" in runner.last_step.eager_reason
    assert runner.stats.eager_steps == 2
    assert sum(runner.stats.eager_reasons.values()) == 2


# ---- static buffers shared by every graph ---------------------------------------------------

def test_every_graph_reads_the_same_static_buffers(cpu_runner, tables):
    ex = cpu_runner.executor
    ptrs = {name: t.data_ptr() for name, t in ex.static.items()}
    entries = [cpu_runner.cache.get(k) for k in cpu_runner.cache.keys()]
    entries += [cpu_runner.sampler_cache.get(k) for k in cpu_runner.sampler_cache.keys()]
    # forward graphs of 4, 8, 16 tokens; sampler graphs (greedy, random, logprobs) of 4, 8 rows
    assert len(entries) == 3 + 2 * 3
    for entry in entries:
        captured = entry.input_ptrs
        assert {k: captured[k] for k in ptrs} == ptrs
        assert captured["kv_cache"] == ex.kv_cache.data_ptr()
    # Many steps later (debug_check_addresses=True checked every replay) nothing moved.
    for step in random_steps(tables, CONFIG, num_steps=10, seed=5):
        step.run(cpu_runner, greedy(step.num_reqs))
    assert {name: t.data_ptr() for name, t in ex.static.items()} == ptrs
    assert cpu_runner.config.debug_check_addresses


def test_address_check_catches_a_moved_buffer(cpu_runner, tables, monkeypatch):
    ex = cpu_runner.executor
    monkeypatch.setitem(ex.static, "positions", ex.static["positions"].clone())
    with pytest.raises(GraphrtError, match=r"static buffers \['positions'\] moved since capture"):
        tables.step([0], [0], [3]).run(cpu_runner)


# ---- the registry -------------------------------------------------------------------------

def test_select_backend_cpu(model_dir, tables):
    backend = graphrt.select_backend("cpu")
    assert backend.name == "cpu" and backend.framework == "torch"
    assert graphrt.available_backends()["cpu"] is None
    runner = ModelRunner(model_dir, backend=backend, num_kv_blocks=tables.num_kv_blocks, progress=False,
                         mode="FULL", cudagraph_capture_sizes=[8], **LIMITS)
    assert runner.backend is backend and runner.executor.capabilities.has_graphs
    assert runner.mode is graphrt.GraphMode.FULL
    assert len(runner.cache) == 1 and runner.cache.sealed
    tables.step([0], [0], [5]).run(runner)
    assert runner.last_step.mode is RuntimeMode.FULL
