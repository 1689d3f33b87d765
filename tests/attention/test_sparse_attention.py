"""Indexed sparse attention (DeepSeek-V3.2's DSA, GLM-MoE-DSA, HY-V4; MiniMax-M3's block-sparse
attention) through graphrt (issue 45).

The indexer's keys are kept beside K and V (``KVCacheGroup.index_head_size``); graphrt's kernel
(``layers/torch/attention/sparse.py``) scores each token's readable context, takes the top-k on
the device (k fixed by the step's shapes) and attends over those keys only. Here:

* the kernel against a dense float64 oracle per request (prefill tiles and decode, padded
  tokens and requests, NaN in every row no request reads): outputs and the cache rows written;
* the spec's checks (an indexer key size is an int >= 0, float caches only) and layout;
* teacher-forced parity with transformers' own forward for tiny ``deepseek_v32`` and
  ``glm_moe_dsa`` (top-4 of up to 18 keys): 4 requests joining at different steps, chunked
  prefill, a preempted request recomputed, on ``eager`` and ``cpu`` FULL graphs (mixed and
  decode steps captured);
* HY-V4 (its indexer's RoPE on the later dimensions, sinks, a gated output, its second layer
  reusing the first's selection: ``indexer_types`` "shared") and MiniMax-M3 (block-sparse: the
  top blocks of keys per KV head) in the same parity run; the kernel with sinks, with a reused
  selection and with block selections against the oracle;
* the kit's ``kv_isolated`` and ``padding_invisible`` on DeepSeek-V3.2, HY-V4 and MiniMax-M3
  (padded rows of the top-k, of a reused selection and of block selections included); GLM-MoE-DSA's "shared" layer wired to the earlier call site.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import graphrt
from graphrt.core.errors import ConfigError
from graphrt.core.kv_spec import KVCacheGroup, KVCacheSpec, resolve_kv_spec
from graphrt.layers.torch.attention.paged import TorchAttentionMetadata
from graphrt.layers.torch.attention.sparse import (BlockIndexerInputs, IndexerInputs, indexed_attention_kernel,
                                                   sparse_attention_kernel)
from support.hybrid_parity import run_schedule
from support.parity import assert_close_across_reductions

transformers = pytest.importorskip("transformers")

from transformers_zoo import load_reference, reference_logits, tiny_checkpoint  # noqa: E402

#: A tiny DSA model whose top-k (4) is shorter than the test prompts; 16 indexer heads make an
#: exact tie of two keys' scores (every head's ReLU at 0) unlikely.
DSA = dict(index_topk=4, index_n_heads=16, index_head_dim=16)
LIMITS = dict(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=32, block_size=4, num_kv_blocks=33)
SHAPES = {"eager": {}, "cpu": dict(cudagraph_capture_sizes=[4, 16])}
HKV, GROUPS, D, DV, HI, DI, BS = 2, 2, 8, 4, 16, 8, 4     # 16 indexer heads: no exact ties


def _step(reqs, topk, pad_tokens, pad_reqs, seed):
    """A step of ``reqs`` ``(computed, scheduled)``: distinct random blocks, NaN in unread rows."""
    gen = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in reqs]
    width = max(-(-n // BS) for n in lens) + 1
    num_blocks = 2 + sum(-(-n // BS) for n in lens)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(reqs) + pad_reqs, width, dtype=torch.int32)
    qsl, slots, where_all = [0], [], []
    for r, ((computed, scheduled), n) in enumerate(zip(reqs, lens)):
        blocks = [order.pop() for _ in range(-(-n // BS))]
        table[r, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        where = [blocks[p // BS] * BS + p % BS for p in range(n)]
        where_all.append(where)
        slots += where[computed:]
        qsl.append(qsl[-1] + scheduled)
    qsl += [qsl[-1]] * pad_reqs
    real = len(slots)
    slots += [-1] * pad_tokens
    t, rows = len(slots), num_blocks * BS + 1
    cache = (torch.randn(rows, HKV, D, generator=gen), torch.randn(rows, HKV, DV, generator=gen),
             torch.randn(rows, DI, generator=gen))
    unread = torch.ones(rows, dtype=torch.bool)
    unread[torch.tensor([x for w in where_all for x in w])] = False
    for c in cache:
        c[unread] = float("nan")
    q, k, v = (torch.randn(t, HKV * GROUPS * D, generator=gen), torch.randn(t, HKV * D, generator=gen),
               torch.randn(t, HKV * DV, generator=gen))
    index = IndexerInputs(torch.randn(t, HI, DI, generator=gen), torch.randn(t, DI, generator=gen),
                          torch.randn(t, HI, generator=gen))
    meta = TorchAttentionMetadata.build(torch.tensor(slots), torch.tensor(qsl, dtype=torch.int32),
                                        torch.tensor(lens + [0] * pad_reqs, dtype=torch.int32), table, BS)
    return q, k, v, cache, index, meta, where_all, real


def _dense(reqs, q, cache, index, where_all, topk, scale, index_scale, sinks=None):
    """Per request in float64: each token's indexer scores over its causal keys, the top-k of
    them (all where fewer), softmax attention over those only (``sinks [Hq]``: a logit per head
    joining each softmax, then dropped)."""
    outs, start = [], 0
    for (computed, scheduled), where in zip(reqs, where_all):
        rows = torch.tensor(where)
        keys = cache[0][rows].double().repeat_interleave(GROUPS, 1)
        values = cache[1][rows].double().repeat_interleave(GROUPS, 1)
        ikeys = cache[2][rows].double()
        for t in range(start, start + scheduled):
            pos = computed + t - start
            scores = torch.relu(index.q[t].double() @ ikeys[:pos + 1].T * index_scale)      # [Hi, pos + 1]
            iscore = index.weights[t].double() @ scores
            ranked = torch.sort(iscore, descending=True).values
            if pos + 1 > topk:
                gap = float(ranked[topk - 1] - ranked[topk])
                assert gap > 1e-6 * float(ranked.abs().max()), "a near tie at the top-k boundary: draw another seed"
            chosen = iscore.topk(min(topk, pos + 1)).indices
            att = torch.einsum("hd,nhd->hn", q[t].double().view(HKV * GROUPS, D), keys[chosen]) * scale
            if sinks is not None:
                probs = torch.softmax(torch.cat((att, sinks.double()[:, None]), -1), -1)[:, :-1]
            else:
                probs = torch.softmax(att, -1)
            outs.append(torch.einsum("hn,nhd->hd", probs, values[chosen]).reshape(-1))
        start += scheduled
    return torch.stack(outs)


@pytest.mark.parametrize("reqs,topk,pad_tokens,pad_reqs,seed", [
    ([(0, 13), (5, 9), (20, 1)], 4, 3, 1, 0),       # prefill tiles: a new prompt, a continued one, a decode
    ([(7, 1), (12, 1), (0, 1), (30, 1)], 5, 2, 2, 1),  # decode (one token per tile), fewer keys than k at first
    ([(3, 6), (0, 20)], 50, 0, 0, 2),               # k above every context: dense causal attention
])
def test_the_sparse_kernel_is_dense_attention_over_the_top_k(reqs, topk, pad_tokens, pad_reqs, seed):
    q, k, v, cache, index, meta, where_all, real = _step(reqs, topk, pad_tokens, pad_reqs, seed)
    before = [c.clone() for c in cache]
    out = indexed_attention_kernel(q, k, v, cache, index, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                                   meta.block_table, meta.token_req_idx, BS, D ** -0.5, topk, DI ** -0.5)
    assert torch.isfinite(out).all() and torch.equal(out[real:], torch.zeros_like(out[real:]))
    want = _dense(reqs, q, cache, index, where_all, topk, D ** -0.5, DI ** -0.5)
    assert_close_across_reductions(out[:real].double(), want, width=max(len(w) for w in where_all), dtype=q.dtype)
    slots = meta.slot_mapping[:real]
    for new, old, x in zip(cache, before, (k, v, index.k)):
        assert torch.equal(new[slots], x[:real].view(new[slots].shape)), "the step's rows are not in its slots"
        untouched = torch.ones(new.shape[0] - 1, dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(new[:-1][untouched].nan_to_num(), old[:-1][untouched].nan_to_num()), "foreign rows written"


def test_sinks_join_the_softmax_and_a_shared_layer_attends_over_the_same_selection():
    """HY-V4: sinks in the indexed kernel; a layer reusing the selection (its own K / V, no indexer
    keys) reads exactly the keys the indexed layer selected this step."""
    reqs = [(0, 13), (5, 9), (20, 1)]
    q, k, v, cache, index, meta, where_all, real = _step(reqs, 4, 3, 1, 3)
    sinks = torch.randn(HKV * GROUPS, generator=torch.Generator().manual_seed(9))
    args = (meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_table, meta.token_req_idx, BS, D ** -0.5)
    out, selection = sparse_attention_kernel(q, k, v, cache, *args, index=index, index_topk=4,
                                             index_scale=DI ** -0.5, sinks=sinks)
    width = max(len(w) for w in where_all)
    want = _dense(reqs, q, cache, index, where_all, 4, D ** -0.5, DI ** -0.5, sinks)
    assert_close_across_reductions(out[:real].double(), want, width=width, dtype=q.dtype)
    # the shared layer: its own K / V pair (the same rows' values here, other queries), no indexer keys
    q2 = torch.randn(q.shape, generator=torch.Generator().manual_seed(11))
    pair = (cache[0].clone(), cache[1].clone())
    out2, again = sparse_attention_kernel(q2, k, v, pair, *args, selection=selection, sinks=sinks)
    assert again is selection
    want2 = _dense(reqs, q2, cache, index, where_all, 4, D ** -0.5, DI ** -0.5, sinks)
    assert_close_across_reductions(out2[:real].double(), want2, width=width, dtype=q.dtype)
    with pytest.raises(ValueError, match="give exactly one of index"):
        sparse_attention_kernel(q2, k, v, pair, *args)
    with pytest.raises(ValueError, match="it was not computed this step"):
        sparse_attention_kernel(q2, k, v, pair, *args, selection=selection[:1])


def test_a_kept_selection_is_the_threads_own():
    """The selection a layer keeps for a later one is per thread, as each forward's call sites are:
    a graph built on a background thread never hands its selection to a step on this one."""
    import threading

    from graphrt.layers.torch.attention.sparse import IndexedPagedBackend, kept_selection
    from graphrt.layers.torch.forward_context import forward_context

    class Layer:                         # what the backend reads of a layer
        scale, index_topk, index_scale, softcap, keeps_selection = D ** -0.5, 4, DI ** -0.5, 0.0, True

    q, k, v, cache, index, meta, _, _ = _step([(0, 13), (5, 9), (20, 1)], 4, 3, 1, 0)
    layer = Layer()
    layer.kv_cache = cache
    seen = {}

    def run():
        with forward_context(meta):
            IndexedPagedBackend().attend(layer, q, k, v, index=index)
        seen["there"] = kept_selection(layer)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    there = seen["there"]
    assert there is not None and kept_selection(layer) is None
    run()
    here = kept_selection(layer)
    assert here is not there and torch.equal(here, there)       # its own, computed from the same step


def _dense_blocks(reqs, q, cache, index, where_all, topk_blocks, block, local, scale):
    """MiniMax-M3's block-sparse attention per request in float64: per KV head, each key's score
    ``q_h . k`` max-pooled over blocks of ``block`` positions (future keys left out), the token's
    block and the ``local - 1`` before it kept, the best ``topk_blocks`` read."""
    outs, start = [], 0
    for (computed, scheduled), where in zip(reqs, where_all):
        rows = torch.tensor(where)
        keys, values, ikeys = (c[rows].double() for c in cache)
        for t in range(start, start + scheduled):
            pos = computed + t - start
            out = []
            for h in range(HKV):
                scores = index.q[t, h].double() @ ikeys[:pos + 1].T
                nb = pos // block + 1
                best = torch.stack([scores[b * block:(b + 1) * block].max() for b in range(nb)])
                best[max(0, pos // block - local + 1):pos // block + 1] = float("inf")
                chosen = best.topk(min(topk_blocks, nb)).indices
                cols = torch.cat([torch.arange(b * block, min((b + 1) * block, pos + 1)) for b in chosen.tolist()])
                qh = q[t].double().view(HKV, GROUPS, D)[h]
                att = torch.softmax(qh @ keys[cols, h].T * scale, -1)
                out.append(att @ values[cols, h])
            outs.append(torch.cat(out).reshape(-1))
        start += scheduled
    return torch.stack(outs)


@pytest.mark.parametrize("reqs,topk_blocks,block,local,seed", [
    ([(0, 13), (5, 9), (20, 1)], 2, 4, 1, 4),       # prefill tiles and a decode; blocks of the KV block size
    ([(7, 1), (12, 1), (0, 1), (30, 1)], 3, 3, 2, 5),  # decode; blocks of 3 (the context padded to whole blocks)
])
def test_block_sparse_attention_reads_each_kv_heads_best_blocks(reqs, topk_blocks, block, local, seed):
    """MiniMax-M3: one selection per KV head (the per-head mask of the reference kernel)."""
    q, k, v, cache, _, meta, where_all, real = _step(reqs, 4, 2, 1, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    index = BlockIndexerInputs(torch.randn(q.shape[0], HKV, DI, generator=gen), torch.randn(q.shape[0], DI, generator=gen))
    out, selection = sparse_attention_kernel(q, k, v, cache, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                                             meta.block_table, meta.token_req_idx, BS, D ** -0.5, index=index,
                                             index_topk=topk_blocks, index_block=(block, local))
    assert selection.shape[1] == HKV and torch.isfinite(out).all()
    want = _dense_blocks(reqs, q, cache, index, where_all, topk_blocks, block, local, D ** -0.5)
    assert_close_across_reductions(out[:real].double(), want, width=max(len(w) for w in where_all), dtype=q.dtype)


def test_the_spec_keeps_the_indexer_keys_beside_k_and_v():
    def resolve(*groups, kv="auto"):
        return resolve_kv_spec(KVCacheSpec(groups), block_size=4, model_dtype="float32", kv_cache_dtype=kv,
                               supported={"float32", "float8_e4m3fn"}, backend="eager")

    group = resolve(KVCacheGroup((0, 1), 2, 24, 16, index_head_size=8)).groups[0]
    assert group.layer_shapes(9) == ((9, 2, 24), (9, 2, 16), (9, 8))
    assert group.row_bytes() == (2 * (24 + 16) + 8) * 4
    with pytest.raises(ConfigError, match=r"groups\[0\]\.index_head_size: must be an int >= 0"):
        resolve(KVCacheGroup((0,), 2, 16, index_head_size=-2))
    with pytest.raises(ConfigError, match="indexed sparse attention keeps float caches only"):
        resolve(KVCacheGroup((0,), 2, 16, index_head_size=8), kv="fp8")


#: YaRN RoPE with ``mscale_all_dim``: HY-V4's attention scales its scores by mscale squared.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale_all_dim": 1.0, "mscale": 1.0}
#: Per architecture: the tiny config's indexer layers, and what graphrt's layers say of them
#: (each call site's top-k and the call site whose selection it reuses). HY-V4's second layer
#: reuses the first's selection (``indexer_types`` "shared"), and HY-V4 has sinks, a gate and YaRN's mscale.
DSA_CASES = {
    "deepseek_v32": (dict(DSA), [(4, -1), (4, -1)], [16]),
    "glm_moe_dsa": (dict(DSA), [(4, -1), (4, -1)], [16]),
    "hy_v4": (dict(DSA, indexer_types=["full", "shared"], rope_parameters=YARN), [(4, -1), (0, 0)], [16, 0]),
    # block-sparse: the zoo's tiny model (a sparse layer: top-2 blocks of 4 keys per KV head, then a dense one)
    "minimax_m3_vl_text": ({}, [(2, -1), (0, -1)], [16, 0]),
}


@functools.lru_cache(maxsize=None)
def _dsa_sequences_and_references(arch: str) -> tuple[list[list[int]], list[np.ndarray]]:
    """The four teacher-forced sequences and transformers' logits on them, once per checkpoint:
    the eager and the cpu case of an architecture compare with the same (deterministic) oracle."""
    d = tiny_checkpoint(arch, **DSA_CASES[arch][0])
    rng = np.random.default_rng(5)
    seqs = [[int(t) for t in rng.integers(3, 128, size=n)] for n in (13, 7, 18, 9)]
    ref = load_reference(d)
    return seqs, [reference_logits(ref, s).numpy() for s in seqs]


@pytest.mark.parametrize("arch,backend,mode", [("deepseek_v32", "eager", "NONE"), ("deepseek_v32", "cpu", "FULL"),
                                               ("glm_moe_dsa", "eager", "NONE"), ("glm_moe_dsa", "cpu", "FULL"),
                                               ("hy_v4", "eager", "NONE"), ("hy_v4", "cpu", "FULL"),
                                               ("minimax_m3_vl_text", "eager", "NONE"),
                                               ("minimax_m3_vl_text", "cpu", "FULL")])
def test_teacher_forced_parity_with_transformers_dsa(arch, backend, mode):
    overrides, layers, index_sizes = DSA_CASES[arch]
    d = tiny_checkpoint(arch, **overrides)
    seqs, refs = _dsa_sequences_and_references(arch)
    runner = graphrt.ModelRunner(str(d), backend=backend, mode=mode, model_impl="transformers", progress=False,
                                 **SHAPES[backend], **LIMITS)
    assert [g.index_head_size for g in runner.model.kv_cache_spec().groups] == index_sizes
    assert [(layer.index_topk, layer.index_from) for layer in runner.model.paged] == layers
    seqs, refs = [list(q) for q in seqs], [r.copy() for r in refs]     # the cached ones stay as built
    assert run_schedule(runner, seqs, refs, chunk=5, joins=[0, 0, 1, 3], preempt={2: 0}) >= 8
    if backend == "cpu":
        assert runner.stats.hits > 0 and runner.stats.eager_steps == 0


@pytest.mark.parametrize("arch", ["deepseek_v32", "hy_v4", "minimax_m3_vl_text"])
def test_kit_kv_isolation_and_padding_on_sparse_models(arch):
    """Padded rows in the top-k (DeepSeek-V3.2), in a reused selection (HY-V4's shared layer) and
    in per-KV-head block selections (MiniMax-M3) change no live token and no other request's KV."""
    from graphrt.models.torch.transformers_impl import load_transformers_model
    from graphrt.testing.conformance import run_conformance
    from graphrt.testing.runners import RunnerFactory

    d = tiny_checkpoint(arch, **DSA_CASES[arch][0])
    factory = RunnerFactory(lambda: load_transformers_model(d), "cpu", mode="FULL_AND_PIECEWISE",
                            cudagraph_capture_sizes=[2, 4, 8, 16])
    results = run_conformance(factory=factory, properties=["kv_isolated", "padding_invisible"], examples=6,
                              report=None)
    assert [r.status for r in results] == ["PASS"] * 2, [r.line() for r in results]


def test_a_layer_reusing_another_layers_selection_reads_it_on_the_device():
    """GLM-MoE-DSA's "shared" layer: no indexer keys in its cache, the earlier call site's
    selection (HY-V4's parity run above checks the values)."""
    from graphrt.models.torch.transformers_impl import load_transformers_model

    model = load_transformers_model(tiny_checkpoint("glm_moe_dsa", indexer_types=["full", "shared"], **DSA))
    assert [(f.index is not None, f.index_from) for f in model.facts] == [(True, -1), (False, 0)]
    assert [g.index_head_size for g in model.kv_cache_spec().groups] == [16, 0]
    full, shared = model.paged
    assert full.keeps_selection and not shared.keeps_selection


def test_a_block_indexer_with_other_heads_than_kv_heads_is_refused():
    from graphrt.models.torch.transformers_impl import load_transformers_model

    with pytest.raises(ConfigError, match=r"its block indexer has 4 heads for 2 KV heads.*selects per KV head"):
        load_transformers_model(tiny_checkpoint("minimax_m3_vl_text", index_n_heads=4))
