"""Ascend: the ACL graph stream budget, the npu backend's availability, and ACL task updates.

The adapter runs here against a stand-in ``torch.npu`` over the CPU recording graph
(``device_fakes.FakeNpu``); the test marked ``npu`` needs real hardware and is skipped
without it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import numpy as np
import pytest
import torch

from support.device_fakes import FakeNpu
from graphrt import BackendUnavailableError, GraphConfig, available_backends, select_backend
from graphrt.backends.torch import acl
from graphrt.backends.torch.cpu import CpuGraphBackend
from graphrt.backends.torch.eager import EagerBackend
from graphrt.backends.torch.npu import NpuGraphBackend, torch_npu_problem
from graphrt.core.graph_tasks import graph_task
from graphrt.core.errors import ConfigError
from graphrt.core.graph_modes import RuntimeMode
from graphrt.layers.torch.attention.backend import PagedAttentionBackend
from graphrt.runner import ModelRunner
from support.hf_models import tiny_hf_model_dir
from support.parity import assert_bitwise, assert_close_across_shapes, assert_same_tokens, pad_like

CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32, block_size=4,
              cudagraph_capture_sizes=[1, 2, 4, 8, 16])
HAS_NPU = torch_npu_problem() is None


# ------------------------------------------------------------------------------ budget


@pytest.mark.parametrize(("kwargs", "expected"), [
    # the stream budget's worked examples use 1920 streams: A2 with AIV, a dense model reserves its
    # all-reduce streams up front: floor((1920 - 2 * 49) / 49 / 2) = 18 ...
    (dict(num_hidden_layers=48, tp_size=4, aiv_mode=True, max_graphs=1920), 18),
    # ... an MoE model does not: floor(1920 / 49 / 2) = 19
    (dict(num_hidden_layers=48, tp_size=4, aiv_mode=True, moe=True, max_graphs=1920), 19),
    # A3 / FFTS+: floor((1920 - 40) / 49 / 3) = 12
    (dict(num_hidden_layers=48, tp_size=4, max_graphs=1920), 12),
    # graphrt's default budget of 1800 streams, one device: floor(1800 / 29) = 62
    (dict(num_hidden_layers=28), 62),
    (dict(num_hidden_layers=28, aiv_mode=True), 61),
    # a one-layer MTP draft adds 2 streams per graph: floor(1800 / 31) = 58
    (dict(num_hidden_layers=28, draft_layers=1), 58),
    # TP and DP: two communication groups: floor((1800 - 80) / 62 / 5) = 5
    (dict(num_hidden_layers=61, tp_size=8, dp_size=2), 5),
    # AIV, MoE, expert parallel, TP + DP: factor 1 + 2 + 1 + 1 = 5: floor(1800 / 62 / 5) = 5
    (dict(num_hidden_layers=61, tp_size=8, dp_size=2, expert_parallel=True, aiv_mode=True), 5),
    (dict(num_hidden_layers=5000), 0),
])
def test_capture_budget_formula(kwargs: dict, expected: int) -> None:
    assert acl.capture_budget(**kwargs) == expected


def test_capture_budget_rejects_nonsense() -> None:
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        acl.capture_budget(0)
    with pytest.raises(ConfigError, match="tp_size"):
        acl.capture_budget(4, tp_size=0)


def test_limit_policy_keeps_ends_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    policy = GraphConfig.create(max_num_seqs=256).capture_policy()
    assert len(policy) == 51
    with caplog.at_level(logging.INFO, logger="graphrt"):
        limited = acl.limit_policy(policy, 61, tp_size=8, aiv_mode=False)
    sizes = limited.sizes
    assert len(sizes) == acl.capture_budget(61, tp_size=8) == 9
    assert sizes[0] == 1 and sizes[-1] == 512
    assert limited == policy.limit_to(9)
    assert any("limiting 51 sizes" in r.getMessage() for r in caplog.records)
    with caplog.at_level(logging.INFO, logger="graphrt"):
        same = acl.limit_policy(policy, 2)
    assert same is policy
    assert any("all 51 configured sizes fit" in r.getMessage() for r in caplog.records)


def test_aiv_mode_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HCCL_OP_EXPANSION_MODE", raising=False)
    assert not acl.aiv_mode_from_env()
    monkeypatch.setenv("HCCL_OP_EXPANSION_MODE", "AIV")
    assert acl.aiv_mode_from_env()


def test_npu_backend_limits_the_capture_policy(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(acl, "capture_budget", lambda layers, **kw: 3)
    with caplog.at_level(logging.INFO, logger="graphrt"):
        runner = ModelRunner(str(tiny_hf_model_dir("qwen3")), backend=NpuGraphBackend("cpu", npu=FakeNpu()),
                             num_kv_blocks=33, progress=False, mode="FULL", **CONFIG)
    assert runner.dispatcher.token_buckets.sizes == (1, 4, 16)
    assert sorted(k.num_tokens for _, k in runner.dispatcher.keys()) == [1, 4, 16]
    assert any("ACL stream budget" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------ availability


def test_npu_is_unavailable_here_and_says_why() -> None:
    if HAS_NPU:
        pytest.skip("an Ascend NPU is present")
    reason = available_backends()["npu"]
    assert reason is not None and "torch_npu" in reason
    for name in ("npu", "acl"):
        with pytest.raises(BackendUnavailableError, match="npu.*torch_npu"):
            select_backend(name)


def test_importing_the_adapter_does_not_import_torch_npu() -> None:
    import graphrt.backends.torch.npu  # noqa: F401
    assert "torch_npu" not in sys.modules or HAS_NPU


# ------------------------------------------------------------------------------ task updates

HOST: dict[str, float] = {"scale": 1.0}


class HostScaled(torch.nn.Module):
    """Scales its input by a host-side value passed to the op as a Python number.

    A graph bakes that number in; wrapping the op in ``graph_task`` lets a hook re-issue it
    before each replay with the value the attention's ``before_replay`` refreshed (Ascend's task
    update; the hook takes no step).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)

        def issue(value: float) -> None:
            torch.mul(x, value, out=out)

        with graph_task(lambda: issue(HOST["scale"])):       # before_replay set it
            issue(HOST["scale"])
        return out


class ScaleRefresh(PagedAttentionBackend):
    """graphrt's attention whose refresh sets the step's host scale before every run."""

    name = "scale-refresh"
    refreshed_host_values = ("seq_lens", "real_num_reqs")

    def before_replay(self, step: Any, host: Any) -> None:
        HOST.update(scale=float(host.seq_lens[:host.real_num_reqs].sum()) / 8.0)


def scaled_model(backend: Any) -> torch.nn.Module:
    model = backend.load_model(str(tiny_hf_model_dir("qwen3")))
    model.model.norm = torch.nn.Sequential(model.model.norm, HostScaled())
    model.attention_backend = ScaleRefresh(model.config.head_dim)
    return model


def run_scaled(backend: Any, like: ModelRunner | None = None) -> tuple[ModelRunner, list[np.ndarray]]:
    """Two steps through the scaled model; on an eager backend, padded as ``like`` pads them."""
    runner = ModelRunner(scaled_model(backend), backend=backend, num_kv_blocks=33, progress=False,
                         mode="FULL", **CONFIG)
    if like is not None:
        pad_like(runner, like)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 128, size=(4, 32), dtype=np.int32)
    blocks = (np.arange(32, dtype=np.int32) + 1).reshape(4, 8)
    out = []
    for computed, scheduled in (([0, 0, 0], [5, 2, 3]), ([5, 2, 3], [1, 1, 1])):
        runner.execute(token_ids=tokens, block_table=blocks, req_rows=np.arange(3),
                       num_computed_tokens=np.array(computed), num_scheduled_tokens=np.array(scheduled))
        assert runner.last_step.mode is RuntimeMode.FULL or isinstance(backend, EagerBackend)
        out.append(runner.outputs.logits().copy())
    return runner, out


def test_task_update_refreshes_host_values_baked_into_a_graph() -> None:
    HOST["scale"] = 1.0
    _, want = run_scaled(EagerBackend())
    npu = FakeNpu()
    HOST["scale"] = 1.0
    runner, got = run_scaled(NpuGraphBackend("cpu", npu=npu))
    HOST["scale"] = 1.0
    _, same = run_scaled(EagerBackend(), like=runner)
    for g, s, w in zip(got, same, want):
        assert_bitwise(g, s)                  # eager at the replayed (padded) shape
        assert_close_across_shapes(g, w)      # eager at the real shape
        assert_same_tokens(g, w)
    calls = [c[0] for c in npu.calls]
    # capture: the graph waits on the external event, then the op is one task group
    first = calls.index("event.wait")
    assert calls[first:first + 4] == ["event.wait", "event.reset", "group_begin", "group_end"]
    # before a replay: the update stream waits for the device, re-issues the op, records the event
    last = len(calls) - 1 - calls[::-1].index("update_begin")
    assert calls[last - 1:last + 3] == ["wait_stream", "update_begin", "update_end", "event.record"]
    update = next(c for c in reversed(npu.calls) if c[0] == "update_begin")
    record = next(c for c in reversed(npu.calls) if c[0] == "event.record")
    assert update[1] == record[2] != "default"
    forward_tasks = [e.tasks for e in runner.cache._entries.values() if getattr(e, "tasks", None)]
    assert len(forward_tasks) == 5 and all(len(t) == 1 for t in forward_tasks)


@pytest.mark.slow
def test_without_task_update_the_graph_would_keep_the_captured_value() -> None:
    """Why Ascend needs task updates: elsewhere a host value stays as captured, so a refresh
    must write device buffers the op reads instead. The baked-values check a model's own
    backend with a refresh gets at every FULL capture sees the number vary between two steps
    of one key and refuses the capture; the steps run eagerly, right (before, silently wrong)."""
    HOST["scale"] = 1.0
    _, want = run_scaled(EagerBackend())
    HOST["scale"] = 1.0
    runner = ModelRunner(scaled_model(CpuGraphBackend()), backend=CpuGraphBackend(), num_kv_blocks=33,
                         progress=False, mode="FULL", **CONFIG)
    assert runner.stats.failed_builds > 0
    assert all("aten.mul" in e["failed"] for e in runner.cache.report() if e["failed"])
    with pytest.raises(Exception, match="aten.mul"):
        ModelRunner(scaled_model(CpuGraphBackend()), backend=CpuGraphBackend(), num_kv_blocks=33, progress=False,
                    mode="FULL", strict=True, **CONFIG)


def test_compile_model_is_ignored_on_npu(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="graphrt"):
        runner = ModelRunner(str(tiny_hf_model_dir("qwen3")), backend=NpuGraphBackend("cpu", npu=FakeNpu()),
                             num_kv_blocks=33, progress=False, mode="FULL", compile_model=True,
                             **{**CONFIG, "cudagraph_capture_sizes": [2, 4]})
    assert any("compile_model is ignored" in r.getMessage() for r in caplog.records)
    assert not any(r["compiled"] for r in runner.executor.builder.report)


@pytest.mark.npu
@pytest.mark.skipif(not HAS_NPU, reason=f"needs an Ascend NPU: {torch_npu_problem()}")
def test_acl_graph_replay_matches_eager_on_hardware() -> None:
    config = dict(CONFIG, cudagraph_capture_sizes=[1, 2, 4])
    want = ModelRunner(str(tiny_hf_model_dir("qwen3")), backend=EagerBackend("npu"), num_kv_blocks=33,
                       progress=False, **config)
    got = ModelRunner(str(tiny_hf_model_dir("qwen3")), backend="npu", num_kv_blocks=33, progress=False,
                      mode="FULL", **config)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128, size=(4, 32), dtype=np.int32)
    blocks = (np.arange(32, dtype=np.int32) + 1).reshape(4, 8)
    same = pad_like(ModelRunner(str(tiny_hf_model_dir("qwen3")), backend=EagerBackend("npu"), num_kv_blocks=33,
                                progress=False, **config), got)
    for runner in (want, got, same):
        runner.execute(token_ids=tokens, block_table=blocks, req_rows=np.arange(3),
                       num_computed_tokens=np.zeros(3, dtype=np.int32), num_scheduled_tokens=np.array([1, 1, 1]))
    assert got.last_step.mode is RuntimeMode.FULL and same.last_step.key == got.last_step.key
    assert_close_across_shapes(got.outputs.logits(), same.outputs.logits())   # the same padded shape, graph and eager
    assert_close_across_shapes(got.outputs.logits(), want.outputs.logits())   # padded and unpadded
    assert_same_tokens(got.outputs.logits(), want.outputs.logits())
