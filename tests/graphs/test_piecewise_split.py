"""PIECEWISE graphs: the split at attention, the shared piece buffers, ``compile_model``,
the registered attention op, and pre-replay hooks (all on the ``cpu`` backend)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch

from graphrt.backends.torch.cpu import CpuGraphAPI, CpuGraphBackend
from graphrt.backends.torch.eager import EagerBackend
from graphrt.backends.torch.capture.fx_split import ATTENTION, PIECE, SplitError, SplitModel, split_or_reason
from graphrt.core.graph_modes import GraphMode, RuntimeMode
from graphrt.layers.torch.forward_context import forward_context
from graphrt.layers.torch.attention.backend import PagedAttentionBackend
from graphrt.layers.torch.attention.paged import PagedAttention, TorchAttentionMetadata, paged_attention_kernel
from graphrt.runner import ModelRunner
from support.hf_models import tiny_hf_model_dir
from support.parity import assert_bitwise, assert_close_across_shapes, assert_same_tokens, pad_like

CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32, block_size=4,
              cudagraph_capture_sizes=[1, 2, 4, 8, 16])
BLOCKS = (np.arange(32, dtype=np.int32) + 1).reshape(4, 8)
TOKENS = np.random.default_rng(5).integers(0, 128, size=(4, 32), dtype=np.int32)
# (computed, scheduled) of rows 0..2: a prefill, a decode, a mixed step, above the largest bucket.
STEPS = [([0, 0, 0], [5, 7, 3]), ([5, 7, 3], [1, 1, 1]), ([6, 8, 4], [1, 4, 2]), ([7, 12, 6], [9, 8, 3])]


def load(arch: str = "qwen3") -> torch.nn.Module:
    return CpuGraphBackend().load_model(str(tiny_hf_model_dir(arch)))


def runner(backend: Any, model: Any = None, **overrides: Any) -> ModelRunner:
    return ModelRunner(model if model is not None else str(tiny_hf_model_dir("qwen3")), backend=backend,
                       num_kv_blocks=33, progress=False, **{**CONFIG, **overrides})


def run(r: ModelRunner) -> list[tuple[RuntimeMode, np.ndarray]]:
    out = []
    for computed, scheduled in STEPS:
        r.execute(token_ids=TOKENS, block_table=BLOCKS, req_rows=np.arange(3),
                  num_computed_tokens=np.array(computed), num_scheduled_tokens=np.array(scheduled))
        out.append((r.last_step.mode, r.outputs.logits().copy()))
    return out


def metadata(num_tokens: int = 6) -> tuple[TorchAttentionMetadata, torch.Tensor, torch.Tensor]:
    meta = TorchAttentionMetadata.build(torch.arange(num_tokens) + 4, torch.tensor([0, 3, 6], dtype=torch.int32),
                                        torch.tensor([3, 3], dtype=torch.int32),
                                        torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), 4)
    ids = torch.randint(0, 128, (num_tokens,), generator=torch.Generator().manual_seed(0))
    return meta, ids, torch.tensor([0, 1, 2, 0, 1, 2])


def with_caches(model: torch.nn.Module) -> torch.nn.Module:
    (group,) = model.kv_cache_spec().groups
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(2, 33, group.num_kv_heads, group.head_size)
    return model


# ------------------------------------------------------------------------------ the split


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_split_cuts_at_every_attention_call(arch: str) -> None:
    model = load(arch)
    split = SplitModel(model)
    layers = model.config.num_hidden_layers
    assert [s.kind for s in split.calls] == [PIECE, ATTENTION] * layers + [PIECE]
    assert split.num_attention == layers and len(split.pieces) == layers + 1
    attn = [m for s in split.calls if s.kind == ATTENTION for m in s.module.modules() if isinstance(m, PagedAttention)]
    assert attn == model.attention_layers()  # the model's own modules (their KV caches)
    params = {p.data_ptr() for p in model.parameters()}
    assert {p.data_ptr() for p in split.graph_module.parameters()} <= params  # shared, not copied


def test_split_forward_is_bitwise_the_model() -> None:
    model = with_caches(load())
    split = SplitModel(model)
    meta, ids, pos = metadata()
    with torch.no_grad(), forward_context(meta):
        want = model(ids, pos)
        got = split.forward(ids, pos)
    assert torch.equal(got, want)


def test_modules_with_hooks_stay_whole() -> None:
    model = load()
    mlp = model.model.layers[0].mlp
    mlp.register_forward_hook(lambda m, a, o: None)
    split = SplitModel(model)
    targets = [n.target for s in split.pieces for n in s.module.graph.nodes if n.op == "call_module"]
    assert any(t.endswith("layers_0_mlp") for t in targets)


class NoAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.config = type("C", (), {"vocab_size": 8, "hidden_size": 4, "num_hidden_layers": 1})()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.lin(input_ids.float().unsqueeze(-1).expand(-1, 4))


class Branchy(NoAttention):
    def __init__(self) -> None:
        super().__init__()
        self.attn = PagedAttention(1, 1, 4)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.lin(input_ids.float().unsqueeze(-1).expand(-1, 4))
        if x.sum() > 0:  # Python control flow on a tensor value
            x = x * 2
        return self.attn(x, x, x)


@pytest.mark.parametrize(("model", "why"), [(NoAttention(), "no attention call"),
                                            (Branchy(), "cannot trace")])
def test_unsplittable_models_say_why(model: torch.nn.Module, why: str) -> None:
    with pytest.raises(SplitError, match=why):
        SplitModel(model)
    assert split_or_reason(model)[0] is None


def test_unsplittable_model_degrades_piecewise_modes(caplog: pytest.LogCaptureFixture) -> None:
    from graphrt.backends.torch.executor import TorchExecutor
    from graphrt.config import GraphConfig
    from graphrt.core.graph_modes import resolve_mode
    executor = TorchExecutor(Branchy(), GraphConfig.create(**CONFIG), torch.device("cpu"), CpuGraphAPI())
    with caplog.at_level(logging.INFO, logger="graphrt"):
        assert not executor.capabilities.supports_piecewise
    assert any("cannot trace" in r.getMessage() for r in caplog.records)
    support = executor.capabilities.attention_support
    assert resolve_mode(GraphMode.FULL_AND_PIECEWISE, attention=support, piecewise=False)[0] is GraphMode.FULL
    assert resolve_mode(GraphMode.PIECEWISE, attention=support, piecewise=False)[0] is GraphMode.NONE


# ------------------------------------------------------------------------------ buffers


def test_token_buckets_share_one_set_of_piece_buffers() -> None:
    r = runner(CpuGraphBackend(), mode="PIECEWISE")
    buffers = r.executor.pieces.buffers
    assert buffers is not None and buffers.capacity == 16
    assert not buffers._own  # every crossing value is token-major
    report = {x["key"]: x["bytes"] for x in r.executor.builder.report}
    assert report["(mixed, tokens=16, reqs=any)"] >= buffers.nbytes > 0
    entries = [e for e in r.cache._entries.values()]
    assert {e.output.untyped_storage().data_ptr() for e in entries} == {
        entries[0].output.untyped_storage().data_ptr()}
    assert all(len(e.graphs) == 3 for e in entries)  # 2 layers: 3 pieces per bucket


def test_piecewise_is_bitwise_eager_and_above_the_bucket_runs_eagerly() -> None:
    """Bitwise the eager forward at the same padded token count; within graphrt.tolerance of
    the unpadded eager forward (other row counts may pick other matmul kernels)."""
    want = run(runner(EagerBackend()))
    pieces = runner(CpuGraphBackend(), mode="PIECEWISE")
    got = run(pieces)
    same = run(pad_like(runner(EagerBackend()), pieces))
    assert [m for m, _ in got] == [RuntimeMode.PIECEWISE] * 3 + [RuntimeMode.NONE]
    for i, ((_, g), (_, s), (_, w)) in enumerate(zip(got, same, want)):
        assert_bitwise(g, s, f"step {i}")
        assert_close_across_shapes(g, w, err_msg=f"step {i}")
        assert_same_tokens(g, w, f"step {i}")


# ------------------------------------------------------------------------------ compile


@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE"])
def test_compile_model_compiles_buckets_up_to_the_maximum(mode: str) -> None:
    want = run(runner(EagerBackend()))
    r = runner(CpuGraphBackend(), mode=mode, compile_model=True, compile_max_size=4,
               cudagraph_capture_sizes=[2, 4, 16])
    compiled = {x["key"]: x["compiled"] for x in r.executor.builder.report if "sample" not in x["key"]}
    assert [c for _, c in sorted(compiled.items(), key=lambda kv: int(kv[0].split("tokens=")[1].split(",")[0]))] \
        == [True, True, False]
    assert sorted(r.executor.pieces.compiled) == [2, 4]
    for (_, g), (_, w) in zip(run(r), want):
        assert_close_across_shapes(g, w)   # compiled kernels, padded: graphrt.tolerance of eager
        assert_same_tokens(g, w)


def test_a_failed_compile_captures_uncompiled(monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(CpuGraphAPI, "compile_backend", "no_such_backend")
    with caplog.at_level(logging.WARNING, logger="graphrt"):
        r = runner(CpuGraphBackend(), mode="PIECEWISE", compile_model=True, cudagraph_capture_sizes=[2, 4])
    assert any("torch.compile of" in x.getMessage() for x in caplog.records)
    assert not any(x["compiled"] for x in r.executor.builder.report)
    assert run(r)[1][0] is RuntimeMode.PIECEWISE


def test_compile_model_on_the_eager_backend_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="graphrt"):
        runner(EagerBackend(), compile_model=True)
    assert any("compile_model is ignored" in x.getMessage() for x in caplog.records)


# ------------------------------------------------------------------------------ the op


def test_registered_op_matches_the_kernel_and_mutates_the_cache() -> None:
    torch.manual_seed(0)
    t, hq, hkv, d = 6, 4, 2, 8
    q, k, v = torch.randn(t, hq * d), torch.randn(t, hkv * d), torch.randn(t, hkv * d)
    meta, _, _ = metadata(t)
    args = (meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_table, meta.token_req_idx,
            meta.block_size, d ** -0.5)
    cache_a, cache_b = torch.zeros(2, 33, hkv, d), torch.zeros(2, 33, hkv, d)
    want = paged_attention_kernel(q, k, v, cache_a, *args)
    got = torch.ops.graphrt.paged_attention(q, k, v, cache_b, *args)
    assert torch.equal(got, want) and torch.equal(cache_a, cache_b) and cache_b.abs().sum() > 0


def test_torch_compile_sees_the_op_and_matches_eager() -> None:
    model = with_caches(load())
    meta, ids, pos = metadata()
    with torch.no_grad(), forward_context(meta):
        want = model(ids, pos)
        for layer in model.attention_layers():
            layer.kv_cache.zero_()
        got = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)(ids, pos)
    assert_close_across_shapes(got, want)   # the compiled kernels may sum in another order


class OpModel(torch.nn.Module):
    """Calls the registered op directly with metadata passed in: split at the op node."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, qsl: torch.Tensor,
                lens: torch.Tensor, table: torch.Tensor, req: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).split(8, dim=-1)
        return self.out(torch.ops.graphrt.paged_attention(q, k, v, cache, slots, qsl, lens, table, req, 4, 0.5))


def test_split_at_the_registered_op() -> None:
    model = OpModel()
    split = SplitModel(model)
    assert [s.kind for s in split.calls] == [PIECE, ATTENTION, PIECE]
    meta, _, _ = metadata()
    x = torch.randn(6, 8)
    args = (meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_table, meta.token_req_idx)
    with torch.no_grad():
        want = model(x, torch.zeros(2, 33, 1, 8), *args)
        got = split.forward(x, torch.zeros(2, 33, 1, 8), *args)
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------ hooks


class Seeing(PagedAttentionBackend):
    """graphrt's attention whose refresh notes each run's real and padded tokens and requests."""

    refreshed_host_values = ("real_num_tokens", "num_tokens", "num_reqs")

    def __init__(self, head_dim: int) -> None:
        super().__init__(head_dim)
        self.seen: list[tuple[int, int, int]] = []

    def before_replay(self, step: Any, host: Any) -> None:
        self.seen.append((host.real_num_tokens, host.num_tokens, host.num_reqs))


@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE"])
def test_the_refresh_sees_every_padded_step(mode: str) -> None:
    model = CpuGraphBackend().load_model(str(tiny_hf_model_dir("qwen3")))
    backend = model.attention_backend = Seeing(model.config.head_dim)
    r = runner(CpuGraphBackend(), model, mode=mode)
    backend.seen.clear()                        # captures refreshed too
    run(r)
    seen = backend.seen
    padded_reqs = 3 if mode == "PIECEWISE" else 4
    assert seen == [(15, 16, padded_reqs), (3, 4, 4 if mode == "FULL" else 3), (7, 8, padded_reqs), (20, 20, 3)]
