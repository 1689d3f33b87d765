"""Ascend's fused attention as graphrt's attention backend (layers/torch/attention/ascend_attention.py).

Everything here runs on a CPU: torch_npu is a stand-in module (``fake_torch_npu``) whose
``npu_fused_infer_attention_score`` is a dense masked softmax reading the host lists it is
given, and ACL graphs are the CPU recording graph behind ``device_fakes.FakeNpu`` (task groups
and task updates included). So these tests show that graphrt drives the op's contract -- the
KV write, the paged layout, the lists refreshed before every replay -- not that the real kernel
agrees; the test marked ``npu`` needs an Ascend device and is skipped without one.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from support.device_fakes import FakeNpu
from support.fake_torch_npu import make_fake_torch_npu
from graphrt.backends.torch.cpu import CpuGraphBackend
from graphrt.backends.torch.eager import EagerBackend
from graphrt.backends.torch.npu import NpuGraphAPI, NpuGraphBackend, torch_npu_problem
from graphrt.core.errors import ConfigError, GraphCaptureError
from graphrt.core.graph_modes import RuntimeMode
from graphrt.layers.torch.attention.selector import select_attention
from graphrt.layers.torch.forward_context import forward_context
from graphrt.layers.torch.attention.ascend_attention import AscendAttentionBackend, ascend_backend
from graphrt.layers.torch.attention.paged import PagedAttention
from graphrt.layers.torch.attention.backend import (CaptureHostValues, HostValues, PagedAttentionBackend,
                                                     StepTensors)
from graphrt.runner import ModelRunner
from support.hf_models import tiny_hf_model_dir
from support.parity import assert_close_across_shapes, assert_same_tokens

CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32, block_size=4,
              cudagraph_capture_sizes=[1, 2, 4, 8, 16])
HAS_NPU = torch_npu_problem() is None
#: (computed, scheduled) per request: prefills, decodes, chunked prefill beside decodes.
STEPS = [([0, 0, 0], [5, 2, 3]), ([5, 2, 3], [1, 1, 1]), ([6, 3, 4], [1, 1, 1]), ([7, 4, 5], [2, 1, 1]),
         ([9, 5, 6], [1, 1, 1]), ([10, 6, 7], [3, 4, 1])]


@pytest.fixture
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The stand-in torch_npu, importable as ``torch_npu`` for this test."""
    if HAS_NPU:
        pytest.skip("a real torch_npu is present")
    CpuGraphBackend().load_model(str(tiny_hf_model_dir("qwen3")))   # transformers probes torch_npu on import
    fake = make_fake_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


# ---------------------------------------------------------------------------- import, selection


def test_importing_the_module_does_not_import_torch_npu() -> None:
    code = ("import sys, torch, graphrt.layers.torch.attention.ascend_attention, graphrt.backends.torch.model_protocol; "
            "print('torch_npu' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False" or HAS_NPU


def test_selection_follows_graphrt_attention(fake_npu: Any, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    layers = [PagedAttention(4, 2, 16) for _ in range(2)]
    monkeypatch.delenv("GRAPHRT_ATTENTION", raising=False)
    assert ascend_backend(layers, "cpu", torch.float32) is None                 # auto: NPUs only
    assert isinstance(ascend_backend(layers, "npu", torch.bfloat16, 128), AscendAttentionBackend)
    with caplog.at_level(logging.WARNING, logger="graphrt"):
        assert ascend_backend(layers, "npu", torch.float32, 128) is None         # the op's dtypes
        assert ascend_backend(layers, "npu", torch.bfloat16, 16) is None         # its block sizes
    assert "float16 or bfloat16" in caplog.text and "block_size 16" in caplog.text
    monkeypatch.setenv("GRAPHRT_ATTENTION", "reference")
    assert ascend_backend(layers, "npu", torch.bfloat16, 128) is None
    monkeypatch.setenv("GRAPHRT_ATTENTION", "ascend")
    assert isinstance(ascend_backend(layers, "cpu", torch.float32), AscendAttentionBackend)
    with pytest.raises(ConfigError, match="GRAPHRT_ATTENTION=ascend.*block_size 16"):
        ascend_backend(layers, "npu", torch.bfloat16, 16)
    with pytest.raises(ConfigError, match="layer 1 has a sliding window"):
        ascend_backend([layers[0], PagedAttention(4, 2, 16, sliding_window=8)], "cpu", torch.float32)
    model = CpuGraphBackend().load_model(str(tiny_hf_model_dir("qwen3")))
    assert isinstance(select_attention(model, "cpu", torch.float32), AscendAttentionBackend)
    assert isinstance(select_attention(model), PagedAttentionBackend)          # no device: no choice


def test_forcing_ascend_without_torch_npu_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    if HAS_NPU:
        pytest.skip("a real torch_npu is present")
    monkeypatch.setitem(sys.modules, "torch_npu", None)          # import torch_npu -> ImportError
    monkeypatch.setenv("GRAPHRT_ATTENTION", "ascend")
    with pytest.raises(ConfigError, match="GRAPHRT_ATTENTION=ascend.*torch_npu does not import"):
        ModelRunner(str(tiny_hf_model_dir("qwen3")), backend=EagerBackend(), num_kv_blocks=33, progress=False,
                    **CONFIG)
    monkeypatch.delenv("GRAPHRT_ATTENTION")
    assert ascend_backend([PagedAttention(4, 2, 16)], "npu", torch.bfloat16, 128) is None


# ---------------------------------------------------------------------------- eager parity


def step_tensors(computed: list[int], scheduled: list[int], tables: np.ndarray, block_size: int,
                 num_tokens: int, num_reqs: int) -> tuple[StepTensors, HostValues]:
    """A padded step (``num_tokens`` / ``num_reqs`` rows) as the executor hands it to a backend."""
    qsl = np.zeros(num_reqs + 1, np.int32)
    qsl[1:len(scheduled) + 1] = np.cumsum(scheduled)
    qsl[len(scheduled) + 1:] = qsl[len(scheduled)]
    seq = np.zeros(num_reqs, np.int32)
    seq[:len(scheduled)] = np.add(computed, scheduled)
    table = np.zeros((num_reqs, tables.shape[1]), np.int32)
    table[:len(scheduled)] = tables[:len(scheduled)]
    slots = np.full(num_tokens, -1, np.int64)
    for r, (c, n) in enumerate(zip(computed, scheduled)):
        pos = np.arange(c, c + n)
        slots[qsl[r]:qsl[r + 1]] = table[r, pos // block_size] * block_size + pos % block_size
    t = torch.from_numpy
    step = StepTensors(torch.zeros(num_tokens, dtype=torch.int32), torch.zeros(num_tokens, dtype=torch.int32),
                       t(slots), t(qsl), t(seq), t(np.asarray(computed + [0] * (num_reqs - len(computed)), np.int32)),
                       t(table), block_size)
    host = HostValues(num_tokens, num_reqs, int(qsl[-1]), len(scheduled), max(scheduled), int(seq.max()), False,
                      qsl, seq)
    return step, host


def test_eager_parity_with_the_reference_kernel_with_gqa(fake_npu: Any) -> None:
    heads, kv_heads, d, bs = 8, 2, 16, 4
    layer = PagedAttention(heads, kv_heads, d)
    tables = np.array([[3, 4, 5, 6], [7, 8, 9, 10], [11, 1, 2, 12]], np.int32)
    rows = 13 * bs + 1
    caches = {"ascend": torch.zeros(2, rows, kv_heads, d), "reference": torch.zeros(2, rows, kv_heads, d)}
    ascend, reference = AscendAttentionBackend(d), PagedAttentionBackend(d)
    gen = torch.Generator().manual_seed(0)
    for computed, scheduled in STEPS:
        real = sum(scheduled)
        t, r = real + 3, 4                                   # padded tokens and a padded request
        step, host = step_tensors(computed, scheduled, tables, bs, t, r)
        q, k, v = (torch.randn(t, h * d, generator=gen) for h in (heads, kv_heads, kv_heads))
        out = {}
        for name, backend in (("ascend", ascend), ("reference", reference)):
            backend.before_replay(step, host)
            layer.kv_cache = caches[name]
            with forward_context(backend.build(step, host)):
                out[name] = layer(q, k, v)
        torch.testing.assert_close(out["ascend"][:real], out["reference"][:real], rtol=1e-5, atol=1e-5)
        assert not out["ascend"][real:].any()              # tokens after every request: zeros
        torch.testing.assert_close(caches["ascend"][:, :-1], caches["reference"][:, :-1], rtol=0, atol=0)
    ops = [c for c in fake_npu.calls if c[0] == "op"]
    assert ops[-1][1:] == ([3, 7, 8, 8], [13, 10, 8, 0])    # the last step's lists, padded request last


def test_the_host_arrays_cannot_be_read_inside_a_capture() -> None:
    """No key holds them: a backend that read them while building a graph's metadata would bake
    them in, so the capture's guarded values refuse it, naming the value and the backend."""
    values = HostValues(4, 2, 3, 2, 2, 8, False, np.array([0, 2, 3], np.int32), np.array([5, 8], np.int32))
    guarded = CaptureHostValues(values, ("max_seq_len",), "ascend-fia", "key")
    assert guarded.max_seq_len == 8
    for name in ("query_start_loc", "seq_lens"):
        with pytest.raises(GraphCaptureError, match=f"'ascend-fia' read the host value '{name}'"):
            getattr(guarded, name)


# ---------------------------------------------------------------------------- graphs


def run_steps(runner: ModelRunner, steps: list = STEPS, seen: list | None = None) -> list[np.ndarray]:
    """``steps`` through ``runner``; each step's logits (``seen`` gets each step's ``last_step``)."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 128, size=(4, 32), dtype=np.int32)
    blocks = (np.arange(32, dtype=np.int32) + 1).reshape(4, 8)
    out = []
    for computed, scheduled in steps:
        runner.execute(token_ids=tokens, block_table=blocks, req_rows=np.arange(len(scheduled)),
                       num_computed_tokens=np.array(computed), num_scheduled_tokens=np.array(scheduled))
        out.append(runner.outputs.logits().copy())
        if seen is not None:
            seen.append(runner.last_step)
    return out


@pytest.fixture(scope="module")
def reference_logits() -> list[np.ndarray]:
    """graphrt's reference attention, eagerly at each step's own shape."""
    runner = ModelRunner(str(tiny_hf_model_dir("qwen3")), backend=EagerBackend(), num_kv_blocks=33, progress=False,
                         **CONFIG)
    return run_steps(runner)


def acl_runner(monkeypatch: pytest.MonkeyPatch, npu: FakeNpu) -> ModelRunner:
    monkeypatch.setenv("GRAPHRT_ATTENTION", "ascend")
    return ModelRunner(str(tiny_hf_model_dir("qwen3")), backend=NpuGraphBackend("cpu", npu=npu), num_kv_blocks=33,
                       progress=False, mode="FULL", **CONFIG)


def test_full_acl_graphs_refresh_the_host_lists_before_replay(fake_npu: Any, monkeypatch: pytest.MonkeyPatch,
                                                              reference_logits: list[np.ndarray]) -> None:
    npu = FakeNpu()
    runner = acl_runner(monkeypatch, npu)
    assert isinstance(runner.executor.attention, AscendAttentionBackend)
    assert runner.executor.capabilities.keyed_host_values == ()                   # nothing keyed: no context buckets
    seen: list = []
    fake_npu.calls.clear()
    for i, (got, want) in enumerate(zip(run_steps(runner, seen=seen), reference_logits)):
        assert_close_across_shapes(got, want, err_msg=f"step {i}")
        assert_same_tokens(got, want, err_msg=f"step {i}")
    keys = [step.key for step in seen]
    assert [step.mode for step in seen] == [RuntimeMode.FULL] * len(STEPS)
    assert any(keys.count(k) > 1 for k in keys), keys                # one graph, several lengths
    # each replay re-issued the op (a task per layer) between update_begin / end, with the step's lists
    layers = len(runner.model.attention_layers())
    captured = [len(e.tasks) for e in runner.cache._entries.values() if getattr(e, "tasks", None)]
    assert len(captured) >= len(set(keys)) and set(captured) == {layers}
    assert sum(c[0] == "update_begin" for c in npu.calls) == layers * len(STEPS)
    pad = runner.last_step.key.num_reqs - 3
    issued = [c[1:] for c in fake_npu.calls if c[0] == "out"][-layers:]
    assert issued == [([3, 7, 8] + [8] * pad, [13, 10, 8] + [0] * pad)] * layers


def test_piecewise_acl_graphs_run_the_op_eagerly_with_each_steps_lists(
        fake_npu: Any, monkeypatch: pytest.MonkeyPatch, reference_logits: list[np.ndarray]) -> None:
    monkeypatch.setenv("GRAPHRT_ATTENTION", "ascend")
    runner = ModelRunner(str(tiny_hf_model_dir("qwen3")), backend=NpuGraphBackend("cpu", npu=FakeNpu()),
                         num_kv_blocks=33, progress=False, mode="PIECEWISE", **CONFIG)
    seen: list = []
    for i, (got, want) in enumerate(zip(run_steps(runner, seen=seen), reference_logits)):
        assert_close_across_shapes(got, want, err_msg=f"step {i}")
        assert_same_tokens(got, want, err_msg=f"step {i}")
    assert [step.mode for step in seen] == [RuntimeMode.PIECEWISE] * len(STEPS)
    assert any(c[0] == "op" for c in fake_npu.calls)
    assert not any(c[0] in ("out", "workspace") for c in fake_npu.calls)    # never inside a graph


@pytest.mark.parametrize("skip", ["before_replay", "task_update"])
def test_a_skipped_refresh_gives_wrong_logits(skip: str, fake_npu: Any, monkeypatch: pytest.MonkeyPatch,
                                              reference_logits: list[np.ndarray]) -> None:
    """The mutation check: without the refresh (or without the update that re-issues the op) a
    replay runs with stale or captured lists, and the logits are wrong."""
    if skip == "before_replay":
        monkeypatch.setattr(AscendAttentionBackend, "before_replay", lambda self, step, host: None)
    else:
        monkeypatch.setattr(NpuGraphAPI, "pre_replay", lambda self, tasks: None)
    runner = acl_runner(monkeypatch, FakeNpu())
    got = run_steps(runner)
    assert runner.last_step.mode is RuntimeMode.FULL
    wrong = [i for i, (g, w) in enumerate(zip(got, reference_logits)) if not np.allclose(g, w, atol=1e-3)]
    assert wrong == list(range(len(STEPS))), wrong


def test_a_graph_without_task_updates_refuses_the_capture(fake_npu: Any, monkeypatch: pytest.MonkeyPatch,
                                                          reference_logits: list[np.ndarray],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The cpu graph backend cannot re-issue a captured op: its FULL captures fail, naming why,
    and the steps run eagerly with each step's lists -- the right logits."""
    monkeypatch.setenv("GRAPHRT_ATTENTION", "ascend")
    with caplog.at_level(logging.WARNING, logger="graphrt"):
        runner = ModelRunner(str(tiny_hf_model_dir("qwen3")), backend=CpuGraphBackend(), num_kv_blocks=33,
                             progress=False, mode="FULL", **CONFIG)
    assert runner.stats.failed_builds == len(runner.cache) > 0
    assert "needs_task_update" in caplog.text
    for i, (got, want) in enumerate(zip(run_steps(runner), reference_logits)):
        assert runner.last_step.mode is not RuntimeMode.FULL
        assert_close_across_shapes(got, want, err_msg=f"step {i}")


@pytest.mark.npu
@pytest.mark.skipif(not HAS_NPU, reason=f"needs an Ascend NPU: {torch_npu_problem()}")
def test_fused_attention_on_hardware_matches_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a device: bfloat16 weights, 128-token blocks (the op's limits), FULL ACL graphs."""
    config = dict(CONFIG, block_size=128, max_model_len=1024, num_kv_blocks=33, progress=False)
    path = str(tiny_hf_model_dir("qwen3"))
    monkeypatch.setenv("GRAPHRT_ATTENTION", "reference")
    eager = EagerBackend("npu")
    want = run_steps(ModelRunner(eager.load_model(path, "bfloat16"), backend=eager, **config))
    monkeypatch.setenv("GRAPHRT_ATTENTION", "ascend")
    npu = NpuGraphBackend()
    runner = ModelRunner(npu.load_model(path, "bfloat16"), backend=npu, mode="FULL", **config)
    assert isinstance(runner.executor.attention, AscendAttentionBackend)
    for got, ref in zip(run_steps(runner), want):
        assert_close_across_shapes(got, ref, dtype="bfloat16")
