"""The CPU recording graph behaves like a captured device graph where it matters."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import _get_current_function_mode
from torch.utils._python_dispatch import _get_current_dispatch_mode

from graphrt.backends.torch.recording_graph import (
                                                    RecordingGraph,
                                                    RecordingPool,
                                                    graph_pool_handle,
                                                    inline_ops,
                                                    is_current_stream_capturing,
                                                    recording_graph,
                                                    )
from graphrt.core.errors import GraphCaptureError
from support.fast_subset import examples

GRAD_MODES = [torch.no_grad, torch.inference_mode]


def _no_capture_left() -> bool:
    return (not is_current_stream_capturing() and _get_current_dispatch_mode() is None
            and _get_current_function_mode() is None)


class TinyDecoder(nn.Module):
    """One decoder layer with a slot-indexed KV cache, enough to exercise an LLM step."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, hidden: int = 48) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.norm1 = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.norm2 = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + 1e-6)).to(x.dtype) * weight

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, dim = ids.shape[0], self.embed.embedding_dim
        heads, head_dim, cache_len = self.heads, dim // self.heads, k_cache.shape[0]
        x = self.embed(ids)
        q, k, v = self.qkv(self.rms_norm(x, self.norm1)).chunk(3, -1)
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)
        scores = torch.einsum("thd,shd->hts", q.view(tokens, heads, head_dim),
                              k_cache.view(cache_len, heads, head_dim)) * head_dim ** -0.5
        visible = torch.arange(cache_len)[None, :] <= positions[:, None]
        scores = torch.where(visible[None], scores, float("-inf"))
        probs = torch.softmax(scores.float(), -1).to(x.dtype)
        attn = torch.einsum("hts,shd->thd", probs, v_cache.view(cache_len, heads, head_dim))
        x = x + self.o(attn.reshape(tokens, dim))
        h = self.rms_norm(x, self.norm2)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        logits = self.lm_head(x)
        return logits, logits.argmax(-1)


TOKENS, CACHE_LEN = 4, 16


@functools.cache
def _captured_decoder(dtype: torch.dtype, grad_mode: type) -> tuple:
    """A TinyDecoder step captured once per (dtype, grad mode), with its static buffers."""
    torch.manual_seed(0)
    model = TinyDecoder().to(dtype).eval()
    ids = torch.zeros(TOKENS, dtype=torch.long)
    positions = torch.arange(TOKENS)
    slots = torch.arange(TOKENS)
    k_cache = torch.zeros(CACHE_LEN, 32, dtype=dtype)
    v_cache = torch.zeros(CACHE_LEN, 32, dtype=dtype)
    graph = RecordingGraph()
    with grad_mode(), recording_graph(graph):
        logits, next_ids = model(ids, positions, slots, k_cache, v_cache)
    return model, graph, (ids, positions, slots, k_cache, v_cache), (logits, next_ids)


@pytest.mark.parametrize("grad_mode", GRAD_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=examples(15), deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_decoder_replay_is_bitwise_eager(dtype: torch.dtype, grad_mode: type, seed: int) -> None:
    model, graph, buffers, outputs = _captured_decoder(dtype, grad_mode)
    ids, positions, slots, k_cache, v_cache = buffers
    gen = torch.Generator().manual_seed(seed)
    new_positions = torch.randperm(CACHE_LEN, generator=gen)[:TOKENS]
    new_ids = torch.randint(0, 64, (TOKENS,), generator=gen)
    k_cache.normal_(generator=gen)
    v_cache.normal_(generator=gen)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    pointers = [t.data_ptr() for t in outputs]

    ids.copy_(new_ids)
    positions.copy_(new_positions)
    slots.copy_(new_positions)
    graph.replay()
    with torch.no_grad():
        ref_logits, ref_next = model(new_ids, new_positions, new_positions, k_ref, v_ref)

    logits, next_ids = outputs
    assert [t.data_ptr() for t in outputs] == pointers
    assert torch.equal(logits, ref_logits)
    assert torch.equal(next_ids, ref_next)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_replay_writes_new_results_into_the_same_output_tensors() -> None:
    lin = nn.Linear(8, 8)
    x = torch.randn(3, 8)
    graph = RecordingGraph()
    with torch.no_grad(), recording_graph(graph):
        y = torch.softmax(lin(x), -1)
    first = y.clone()
    x.copy_(torch.randn(3, 8))
    graph.replay()
    with torch.no_grad():
        assert torch.equal(y, torch.softmax(lin(x), -1))
    assert not torch.equal(y, first)
    assert graph.is_captured and graph.num_ops > 0


def test_python_values_are_baked_in_at_capture() -> None:
    scale = 3
    x = torch.ones(4)
    threshold = float(x.sum())
    graph = RecordingGraph()
    with torch.no_grad(), recording_graph(graph):
        y = x * scale + x.shape[0] + threshold
    scale = 100
    x.fill_(2.0)
    graph.replay()
    assert torch.equal(y, torch.full((4,), 2.0 * 3 + 4 + 4.0))


def test_kv_cache_index_copy_is_reapplied_on_replay() -> None:
    cache = torch.zeros(8, 2)
    slots = torch.tensor([0, 1])
    values = torch.ones(2, 2)
    graph = RecordingGraph()
    with torch.no_grad(), recording_graph(graph):
        cache.index_copy_(0, slots, values * 2)
    cache.zero_()
    slots.copy_(torch.tensor([5, 7]))
    values.fill_(3.0)
    graph.replay()
    expected = torch.zeros(8, 2)
    expected[5] = expected[7] = 6.0
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("grad_mode", GRAD_MODES)
def test_int_tensors_and_index_ops(grad_mode: type) -> None:
    boundaries = torch.tensor([0, 4, 8, 16], dtype=torch.int32)
    query = torch.tensor([1, 5, 9, 20], dtype=torch.int32)
    table = torch.arange(20, dtype=torch.int64).view(4, 5)
    graph = RecordingGraph()
    with grad_mode(), recording_graph(graph):
        bucket = torch.searchsorted(boundaries, query, out_int32=True)
        picked = table.gather(1, bucket.long()[:, None].clamp(max=4))
        total = torch.where(query > 4, query, 0).cumsum(0)
    query.copy_(torch.tensor([0, 3, 15, 7], dtype=torch.int32))
    graph.replay()
    assert bucket.dtype == torch.int32
    assert bucket.tolist() == torch.searchsorted(boundaries, query, out_int32=True).tolist()
    assert picked.flatten().tolist() == [0, 6, 13, 17]
    assert total.tolist() == [0, 0, 15, 22]


def _host_sync_cases() -> dict:
    x = torch.randn(6)
    mask = x > 0
    return {
        "item": (lambda: x.sum().item(), "_local_scalar_dense"),
        "tolist": (lambda: x.tolist(), "tolist"),
        "int": (lambda: int(x[0]), "_local_scalar_dense"),
        "scalar_tensor_index": (lambda: x[torch.tensor(1)], "_local_scalar_dense"),
        "if": (lambda: 1 if (x > 0).any() else 0, "_local_scalar_dense"),
        "print": (lambda: repr(x), "Tensor.__repr__"),
        "nonzero": (lambda: x.nonzero(), "aten.nonzero"),
        "where_cond": (lambda: torch.where(mask), "aten.nonzero"),
        "bool_mask_index": (lambda: x[mask], "aten.index.Tensor"),
        "bool_mask_assign": (lambda: x.clone().__setitem__(mask, torch.zeros(6)), "aten.index_put"),
        "masked_select": (lambda: x.masked_select(mask), "aten.masked_select"),
        "unique": (lambda: torch.unique(mask.long()), "aten._unique2"),
        "repeat_interleave": (lambda: x.repeat_interleave(mask.long()), "aten.repeat_interleave"),
        "equal": (lambda: torch.equal(x, x), "aten.equal"),
    }


@pytest.mark.parametrize("grad_mode", GRAD_MODES)
@pytest.mark.parametrize("case", sorted(_host_sync_cases()))
def test_capture_violations_raise_naming_the_op(case: str, grad_mode: type) -> None:
    action, op_name = _host_sync_cases()[case]
    graph = RecordingGraph()
    with pytest.raises(GraphCaptureError, match="capture") as error:
        with grad_mode(), recording_graph(graph):
            torch.ones(2) + 1
            action()
    assert op_name in str(error.value)
    assert not graph.is_captured and graph.num_ops == 0
    assert _no_capture_left()
    with pytest.raises(GraphCaptureError):
        graph.replay()


def test_item_message_says_why_and_what_to_do() -> None:
    with pytest.raises(GraphCaptureError) as error:
        with torch.no_grad(), recording_graph(RecordingGraph()):
            torch.ones(3).sum().item()
    message = str(error.value)
    assert "`.item()` (aten._local_scalar_dense)" in message
    assert "bake in the value seen at capture time" in message
    assert "before capture" in message


def test_fixed_size_alternatives_are_allowed() -> None:
    x = torch.tensor([0.0, 2.0, 0.0, 3.0])
    repeats = torch.tensor([1, 0, 2, 1])
    graph = RecordingGraph()
    with torch.no_grad(), recording_graph(graph):
        first = torch.nonzero_static(x, size=2)
        spread = x.repeat_interleave(repeats, output_size=4)
        kept = torch.where(x > 0, x, -1.0)
        picked = x[torch.tensor([3, 1])]
    x.copy_(torch.tensor([5.0, 0.0, 6.0, 0.0]))
    graph.replay()
    assert first.flatten().tolist() == [0, 2]
    assert spread.tolist() == [5.0, 6.0, 6.0, 0.0]
    assert kept.tolist() == [5.0, -1.0, 6.0, -1.0]
    assert picked.tolist() == [0.0, 0.0]


def test_nested_capture_raises_and_abandons_both() -> None:
    outer, inner = RecordingGraph(), RecordingGraph()
    with pytest.raises(GraphCaptureError, match="nested capture"):
        with recording_graph(outer):
            assert is_current_stream_capturing()
            with recording_graph(inner):
                pass
    assert not outer.is_captured and not inner.is_captured
    assert _no_capture_left()


def test_bare_capture_end_after_an_error_closes_and_reraises() -> None:
    graph = RecordingGraph()
    graph.capture_begin()
    with pytest.raises(GraphCaptureError):
        torch.ones(2).tolist()
    assert not is_current_stream_capturing()
    with pytest.raises(GraphCaptureError, match="abandoned.*tolist"):
        graph.capture_end()
    assert _no_capture_left() and not graph.is_captured
    graph.capture_begin()
    y = torch.ones(2) * 2
    graph.capture_end()
    assert graph.is_captured and torch.equal(y, torch.full((2,), 2.0))


def test_other_errors_abandon_the_capture() -> None:
    graph = RecordingGraph()
    with pytest.raises(RuntimeError):
        with recording_graph(graph):
            torch.ones(2, 3) @ torch.ones(2, 3)
    assert not graph.is_captured and _no_capture_left()


def test_replay_and_pool_before_capture_raise() -> None:
    graph = RecordingGraph()
    with pytest.raises(GraphCaptureError, match="not been captured"):
        graph.replay()
    with pytest.raises(GraphCaptureError):
        graph.pool()
    with pytest.raises(GraphCaptureError):
        graph.capture_end()


def test_graphs_sharing_a_pool_both_replay() -> None:
    pool = graph_pool_handle()
    x = torch.randn(4, 8)
    first, second = RecordingGraph(), RecordingGraph()
    with torch.no_grad():
        with recording_graph(first, pool=pool):
            a = (x * 3).sum(0)
        with recording_graph(second, pool=first.pool()):
            b = torch.softmax(x, -1)
    assert isinstance(pool, RecordingPool)
    assert first.pool() is pool and second.pool() is pool and pool.num_graphs == 2
    assert pool.captured_bytes == first.captured_bytes + second.captured_bytes
    x.copy_(torch.randn(4, 8))
    second.replay()
    first.replay()
    assert torch.equal(a, (x * 3).sum(0))
    assert torch.equal(b, torch.softmax(x, -1))


def test_rng_ops_draw_fresh_values_each_replay() -> None:
    noise = torch.empty(64)
    graph = RecordingGraph()
    with torch.no_grad(), recording_graph(graph):
        fresh = torch.rand(64)
        noise.exponential_()
    seen = [(fresh.clone(), noise.clone())]
    for _ in range(2):
        graph.replay()
        seen.append((fresh.clone(), noise.clone()))
    for i in range(len(seen)):
        for j in range(i + 1, len(seen)):
            assert not torch.equal(seen[i][0], seen[j][0])
            assert not torch.equal(seen[i][1], seen[j][1])


def test_views_cost_nothing_and_captured_memory_is_counted() -> None:
    x = torch.randn(4, 8)
    graph = RecordingGraph()
    with torch.no_grad(), recording_graph(graph):
        y = x.t().unsqueeze(0).transpose(1, 2)[0, 1:]
        z = (y * 2).contiguous()
    assert graph.num_replay_steps == 1 < graph.num_ops
    assert graph.captured_bytes == z.untyped_storage().nbytes()
    x.copy_(torch.randn(4, 8))
    graph.replay()
    assert torch.equal(z, x[1:] * 2)


def test_reset_frees_the_graph_and_allows_recapture() -> None:
    x = torch.ones(3)
    graph = RecordingGraph()
    with recording_graph(graph):
        x + 1
    with pytest.raises(GraphCaptureError, match="already holds"):
        graph.capture_begin()
    graph.reset()
    assert not graph.is_captured and graph.num_ops == 0 and graph.captured_bytes == 0
    with pytest.raises(GraphCaptureError):
        graph.replay()
    with recording_graph(graph):
        y = x * 5
    x.fill_(2.0)
    graph.replay()
    assert torch.equal(y, torch.full((3,), 10.0))


def test_capture_with_grad_enabled_replays() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    graph = RecordingGraph()
    with recording_graph(graph):
        y = lin(x).relu()
    x.copy_(torch.randn(2, 4))
    graph.replay()
    with torch.no_grad():
        assert torch.equal(y, lin(x).relu())


# An engine's opaque op whose Python kernel looks up per-step state (vLLM's attention op reads its
# metadata from a forward context): ``_STEP["scale"]`` is that state.
_STEP: dict[str, torch.Tensor] = {}
_LIB = torch.library.Library("graphrt_test_inline", "DEF")
_LIB.define("scaled(Tensor x, Tensor(a!) out) -> ()")


def _scaled(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * _STEP["scale"])


def _scaled_reading_the_host(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * _STEP["scale"].item())


_LIB.impl("scaled", _scaled, "CPU")
SCALED = torch.ops.graphrt_test_inline.scaled.default


@pytest.mark.parametrize("inline", [False, True])
def test_inline_ops_record_the_kernel_a_device_graph_would_hold(inline: bool) -> None:
    """Recorded whole, an opaque op re-runs its Python at replay and finds the step's new state;
    inlined, the graph holds the ops its kernel ran at capture, on the tensor it chose then -- as a
    device graph does, so a kernel whose state is not in persistent buffers goes stale."""
    x, out = torch.ones(4), torch.zeros(4)
    _STEP["scale"] = torch.full((4,), 2.0)
    graph = RecordingGraph()
    with torch.no_grad(), (inline_ops({SCALED: _scaled}) if inline else contextlib.nullcontext()):
        with recording_graph(graph):
            SCALED(x, out)
    _STEP["scale"] = torch.full((4,), 3.0)          # the next step's state, in a new tensor
    graph.replay()
    assert out.tolist() == ([2.0] * 4 if inline else [3.0] * 4)
    assert _no_capture_left()


def test_inlined_kernels_are_checked_like_any_capture() -> None:
    """A host read inside an inlined kernel is refused, as in the model's own code."""
    _STEP["scale"] = torch.tensor(2.0)
    graph = RecordingGraph()
    with torch.no_grad(), inline_ops({SCALED: _scaled_reading_the_host}), pytest.raises(GraphCaptureError, match="item"):
        with recording_graph(graph):
            SCALED(torch.ones(4), torch.zeros(4))
    assert not graph.is_captured and _no_capture_left()
