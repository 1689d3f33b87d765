"""graphrt's reference paged-attention kernel (``layers/torch/attention/paged.py``, issue 46 item 13).

* Against dense attention written out per request in float64, on drawn steps: query and KV
  heads (GQA, MQA, MHA), K and V head sizes, block sizes, decodes, chunked and fresh prefills
  (so every query tile size the kernel picks, from one token per tile to
  ``MAX_QUERY_TILE``), padded requests and tokens, sliding windows, soft-capping, sinks,
  float32 / bfloat16 / fp8 caches and NaN in every cache row no request may read. Padded
  tokens get zeros; the step's K/V land in its slots, nothing else changes.
* Its cost follows the shapes, not the head count: ``graphrt lint`` counts the same ops for a
  model of 2 KV heads and of 8, grouped or not (the per-KV-head loop it replaced ran 2 ops per head), and it
  finds nothing to fix (no host sync, no data-dependent shape or control flow).
* A prefill's graph keeps memory that follows the request's context, not tokens x context
  (each token gathered its own copy of the context before).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from graphrt.backends.torch.recording_graph import RecordingGraph, recording_graph
from graphrt.cli.lint import lint_model
from graphrt.models.random_checkpoint import write_random_checkpoint
from graphrt.layers.torch.attention.paged import MAX_QUERY_TILE, TorchAttentionMetadata, paged_attention_kernel, query_tile
from graphrt.layers.torch.attention.kv_quant import dequantize_kv, is_fp8, quantize_kv
from graphrt.models.torch.loader import load_torch_model
from support.fast_subset import examples
from support.parity import assert_close_across_reductions


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


@st.composite
def steps(draw: st.DrawFn) -> dict:
    """One step's shapes and options; requests are ``(computed, scheduled)`` token counts."""
    prefill = draw(st.booleans())
    n = draw(st.integers(1, 6))
    reqs = [(draw(st.integers(0, 40)), draw(st.integers(1, 70) if prefill else st.integers(1, 2))) for _ in range(n)]
    cache = draw(st.sampled_from(["float32", "float32", "bfloat16", "float8_e4m3fn"]))
    d = draw(st.sampled_from([8, 16, 32]))
    return dict(reqs=reqs, kv_heads=draw(st.sampled_from([1, 2, 4])), groups=draw(st.sampled_from([1, 2, 3, 4])),
                d=d, dv=draw(st.sampled_from([d, d // 2])), block_size=draw(st.sampled_from([4, 16])),
                pad_reqs=draw(st.integers(0, 2)), pad_tokens=draw(st.integers(0, 5)),
                window=(window := draw(st.sampled_from([0, 0, 1, 5, 24]))),
                chunk=0 if window else draw(st.sampled_from([0, 0, 1, 4, 7])),     # a layer slides or is chunked
                softcap=draw(st.sampled_from([0.0, 0.0, 3.0])),
                sinks=draw(st.booleans()), cache=getattr(torch, cache), seed=draw(st.integers(0, 2**31 - 1)))


def build(s: dict) -> tuple:
    """The step's tensors: distinct random blocks per request (block 0 stays null), random
    context, NaN in every row no request reads; padded requests (no tokens, length 0) and
    padded tokens (slot -1) at the end."""
    gen = torch.Generator().manual_seed(s["seed"])
    bs, hkv, d, dv = s["block_size"], s["kv_heads"], s["d"], s["dv"]
    hq = hkv * s["groups"]
    lens = [c + n for c, n in s["reqs"]]
    width = max(-(-n // bs) for n in lens) + 1
    num_blocks = 1 + sum(-(-n // bs) for n in lens) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(lens) + s["pad_reqs"], width, dtype=torch.int32)
    qsl, slots, req_slots = [0], [], []
    for r, ((computed, scheduled), n) in enumerate(zip(s["reqs"], lens)):
        blocks = [order.pop() for _ in range(-(-n // bs))]
        table[r, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        where = [blocks[p // bs] * bs + p % bs for p in range(n)]
        req_slots.append(where)
        slots += where[computed:]
        qsl.append(qsl[-1] + scheduled)
    qsl += [qsl[-1]] * s["pad_reqs"]
    real = len(slots)
    slots += [-1] * s["pad_tokens"]
    t, rows = len(slots), num_blocks * bs + 1
    fp8 = is_fp8(s["cache"])
    k_cache = quantize_kv(torch.randn(rows, hkv, d, generator=gen), s["cache"])
    v_cache = quantize_kv(torch.randn(rows, hkv, dv, generator=gen), s["cache"])
    if not fp8:                                  # fp8 has no NaN (e4m3fn's NaN bytes are not what's read)
        unread = torch.ones(rows, dtype=torch.bool)
        unread[torch.tensor([x for w in req_slots for x in w], dtype=torch.int64)] = False
        k_cache[unread], v_cache[unread] = float("nan"), float("nan")
    q_dtype = torch.float32 if fp8 else s["cache"]
    q = torch.randn(t, hq * d, generator=gen).to(q_dtype)
    k = torch.randn(t, hkv * d, generator=gen).to(q_dtype)
    v = torch.randn(t, hkv * dv, generator=gen).to(q_dtype)
    sinks = torch.randn(hq, generator=gen) if s["sinks"] else None
    meta = TorchAttentionMetadata.build(torch.tensor(slots, dtype=torch.int64), torch.tensor(qsl, dtype=torch.int32),
                                        torch.tensor(lens + [0] * s["pad_reqs"], dtype=torch.int32), table, bs)
    cache = torch.stack([k_cache, v_cache]) if dv == d else (k_cache, v_cache)
    return q, k, v, cache, meta, sinks, req_slots, real


def dense(s: dict, q, cache, sinks, req_slots) -> torch.Tensor:
    """Each request's attention written out in float64 over its own rows of the written cache:
    scaled scores, soft-capping, the causal (and window or chunk) mask, sinks joining the softmax."""
    hkv, g, d, dv = s["kv_heads"], s["groups"], s["d"], s["dv"]
    outs, start = [], 0
    for (computed, scheduled), where in zip(s["reqs"], req_slots):
        rows = torch.tensor(where, dtype=torch.int64)
        keys = dequantize_kv(cache[0][rows], torch.float64).repeat_interleave(g, 1)    # [n, Hq, D]
        values = dequantize_kv(cache[1][rows], torch.float64).repeat_interleave(g, 1)  # [n, Hq, Dv]
        qi = q[start:start + scheduled].double().view(scheduled, hkv * g, d)
        scores = torch.einsum("thd,nhd->htn", qi, keys) * d ** -0.5
        if s["softcap"]:
            scores = torch.tanh(scores / s["softcap"]) * s["softcap"]
        pos = torch.arange(computed, computed + scheduled)[:, None]
        ctx = torch.arange(len(where))[None, :]
        allowed = (ctx <= pos) & ((ctx > pos - s["window"]) if s["window"] else True)
        if s.get("chunk"):                       # chunked local attention: the token's own chunk only
            allowed = allowed & (ctx // s["chunk"] == pos // s["chunk"])
        scores = scores.masked_fill(~allowed, -math.inf)
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, scheduled, 1)], -1)
        probs = torch.softmax(scores, -1)[..., :len(where)]
        outs.append(torch.einsum("htn,nhd->thd", probs, values).reshape(scheduled, -1))
        start += scheduled
    return torch.cat(outs)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps())
def test_the_kernel_is_dense_attention(s: dict) -> None:
    q, k, v, cache, meta, sinks, req_slots, real = build(s)
    before = [c.clone() for c in cache]
    out = paged_attention_kernel(q, k, v, cache, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                                 meta.block_table, meta.token_req_idx, s["block_size"], s["d"] ** -0.5,
                                 s["window"], softcap=s["softcap"], sinks=sinks, attention_chunk=s["chunk"])
    assert out.shape == (q.shape[0], s["kv_heads"] * s["groups"] * s["dv"]) and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "NaN in unread rows reached the output"
    assert torch.equal(out[real:], torch.zeros_like(out[real:])), "padded tokens must get zeros"
    want = dense(s, q, cache, sinks, req_slots)
    assert_close_across_reductions(out[:real].double(), want, width=max(s["d"], max(len(w) for w in req_slots)),
                                   dtype=q.dtype, err_msg=str(s))
    slots = meta.slot_mapping[:real]
    trash = cache[0].shape[0] - 1
    for i, (new, old, x) in enumerate(zip(cache, before, (k, v))):
        stored = quantize_kv(x[:real].view(real, s["kv_heads"], -1), new.dtype)
        assert torch.equal(_bytes(new[slots]), _bytes(stored)), f"cache {i}: the step's K/V are not in its slots"
        untouched = torch.ones(trash, dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(_bytes(new[:trash][untouched]), _bytes(old[:trash][untouched])), f"cache {i}: foreign rows"


def test_query_tiles_follow_the_shapes() -> None:
    assert query_tile(32, 32) == query_tile(3, 1) == 1             # decodes: one token per tile
    assert query_tile(16, 4) == 2 and query_tile(1024, 32) == 16
    assert query_tile(4096, 1) == MAX_QUERY_TILE


def _model(tmp_path, kv_heads: int, groups: int):
    root = write_random_checkpoint(tmp_path / f"kv{kv_heads}", "qwen3", seed=0, vocab_size=128, hidden_size=64,
                                   intermediate_size=128, num_hidden_layers=2, num_attention_heads=kv_heads * groups,
                                   num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=256)
    return load_torch_model(root)


def test_the_op_count_does_not_grow_with_heads(tmp_path) -> None:
    reports = {heads: lint_model(_model(tmp_path, *heads)) for heads in ((2, 2), (8, 2), (8, 1))}
    for heads, report in reports.items():
        assert report.clean, f"{heads}: {report}"
    counts = {heads: report.num_ops for heads, report in reports.items()}
    assert len(set(counts.values())) == 1, f"ops per forward by (kv heads, group): {counts}"


def test_a_prefill_graph_keeps_memory_of_its_context_not_tokens_times_context() -> None:
    hkv, g, d, bs, n = 4, 2, 32, 16, 512
    s = dict(reqs=[(0, n)], kv_heads=hkv, groups=g, d=d, dv=d, block_size=bs, pad_reqs=0, pad_tokens=0, window=0,
             softcap=0.0, sinks=False, cache=torch.float32, seed=0)
    q, k, v, cache, meta, _, _, _ = build(s)
    graph = RecordingGraph()
    with recording_graph(graph):
        paged_attention_kernel(q, k, v, cache, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                               meta.block_table, meta.token_req_idx, bs, d ** -0.5)
    context = 2 * n * hkv * d * 4                        # the request's K and V, float32
    # Tiles of 32 tokens gather the context once each (n / 32 + 1 = 17 copies of K and V), and the
    # scores and probabilities are [17 tiles, Hq, 32, n]: about 60 contexts in all. One copy per
    # token (what the kernel did before) keeps n = 512 copies, over 600 contexts.
    assert graph.captured_bytes < 128 * context, f"{graph.captured_bytes} bytes kept for a {context}-byte context"


def test_the_opaque_op_lowers_through_inductor() -> None:
    """``torch.compile`` (Inductor, fullgraph) of a forward that calls ``graphrt::paged_attention``
    with every keyword: what ``reduce-overhead`` compiles in bench_cuda.py. An op argument named
    ``kernel`` made Inductor's lowering fail (``FallbackKernel.create() got multiple values for
    argument 'kernel'``); the compiled call writes the same cache and returns the eager values."""
    from graphrt.layers.torch.attention.paged import paged_attention, run_paged_attention

    s = dict(reqs=[(3, 1), (0, 5)], kv_heads=2, groups=2, d=16, dv=16, block_size=4, pad_reqs=0, pad_tokens=0,
             window=0, chunk=0, softcap=0.0, sinks=False, cache=torch.float32, seed=7)
    q, k, v, cache, meta, _, _, _ = build(s)
    cache = torch.nan_to_num(cache)
    args = (meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_table, meta.token_req_idx, 4, 0.25)

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return paged_attention(q, k, v, kv, *args, sliding_window=0, k_scale=1.0, v_scale=1.0, impl="reference",
                               attention_chunk=0) * 2.0

    torch._dynamo.reset()
    compiled_cache, eager_cache = cache.clone(), cache.clone()
    got = torch.compile(forward, backend="inductor", fullgraph=True, dynamic=False)(q, k, v, compiled_cache)
    want = run_paged_attention(q, k, v, eager_cache, *args) * 2.0
    assert_close_across_reductions(got, want, width=s["d"])
    assert torch.equal(compiled_cache, eager_cache)


def test_a_graphrt_model_traces_whole_under_torch_compile(tmp_path) -> None:
    """``torch.compile(model, fullgraph=True)`` of a graphrt model inside a forward context (what
    bench_cuda.py's reduce-overhead column compiles): the attention layers find the thread's
    context while Dynamo traces, and the compiled forward gives the eager logits. On the H200's
    torch 2.11 a ``threading.local`` subclass holding the context traced as unset ("no forward
    context is set"); the context is now a plain ``threading.local`` read with defaults."""
    from graphrt import ModelRunner
    from graphrt.layers.torch.forward_context import forward_context

    write_random_checkpoint(tmp_path, "qwen3", seed=0)
    runner = ModelRunner(str(tmp_path), backend="eager", max_num_seqs=2, max_num_batched_tokens=8, max_model_len=32,
                         block_size=4, progress=False, warmup=False)
    executor, model = runner.executor, runner.executor.model
    t, r = 2, 2
    static = executor.static
    static["input_ids"][:t] = torch.tensor([5, 7])
    static["positions"][:t] = 0
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=False)
    with torch.no_grad(), forward_context(executor.fwd.metadata(t, r, executor.fwd.dummy_host(t, r))):
        want = model(static["input_ids"][:t], static["positions"][:t]).clone()
        got = compiled(static["input_ids"][:t], static["positions"][:t])
    assert_close_across_reductions(got, want, width=int(model.config.hidden_size))
    runner.close()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_float_cache_never_enters_the_quantization_module(kv_cache_dtype, monkeypatch):
    """An eager step over a float KV cache writes and reads it with plain torch ops: the
    reference kernel asks once per call whether the cache is fp8 and quantizes nothing
    (issue 44: the eager step entered kv_quant 28 times for 2 layers); an fp8 cache still does."""
    from graphrt import LLM, SamplingParams
    from graphrt.layers.torch.attention import paged
    from support.hf_models import tiny_hf_model_dir

    calls: dict[str, int] = {}
    for name in ("quantize_kv", "dequantize_kv", "write_kv_rows"):
        real = getattr(paged, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(paged, name, counted)
    llm = LLM(str(tiny_hf_model_dir("qwen3")), backend="eager", max_num_seqs=2, max_num_batched_tokens=16,
              max_model_len=32, block_size=4, kv_cache_dtype=kv_cache_dtype, progress=False)
    try:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    finally:
        llm.close()
    assert len(out[0].token_ids) == 3
    if kv_cache_dtype == "auto":
        assert calls == {}, f"a float cache called {calls}"
    else:
        assert calls.get("quantize_kv", 0) > 0 and calls.get("write_kv_rows", 0) > 0 and calls.get("dequantize_kv", 0) > 0
