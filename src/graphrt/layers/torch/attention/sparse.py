"""Indexed sparse attention (DeepSeek-V3.2's DSA and its relatives): a lightning indexer scores
each token's context, and attention reads only the ``index_topk`` best-scored keys of it.

The indexer's keys live beside the layer's K / V in the paged cache (``KVCacheGroup.index_head_size``:
the layer's ``kv_cache`` is ``(k [rows, Hkv, D], v [rows, Hkv, Dv], index_k [rows, Di])``), written
by the same slots. The indexer's score of key j for token t is

    score[t, j] = sum_h weights[t, h] * relu(index_scale * q_index[t, h] . index_k[j])

over the keys the causal mask lets t read; the ``min(index_topk, L)`` best (``L``: the gathered
context's width, fixed by the step's shapes -- the graph key's context bucket) are selected on
the device with ``torch.topk`` (no host sync), and the reference kernel's attention runs with
every other key masked. A token with fewer readable keys than ``k`` reads all of them (the rest
of its selection is masked keys). Capture-safe as the reference kernel: shapes only.

MiniMax-M3's block indexer (:class:`BlockIndexerInputs`) selects blocks of keys instead, one
selection per KV head: each key's score ``q_h . k_j``, max-pooled over blocks of
``index_block_size`` positions, the token's own block (and ``index_local_blocks - 1`` before it)
always kept, the ``index_topk_blocks`` best blocks read (:func:`block_selection`).

A layer without an indexer of its own (HY-V4's and GLM-MoE-DSA's ``indexer_types`` "shared")
attends over the selection the last indexed layer before it computed in the same forward: that
layer keeps it (a device tensor, per thread: :func:`kept_selection`) and the later one reads it, in call order,
in an eager step, a FULL graph (both kernels in one capture) and a PIECEWISE one (the attention
calls re-run in order between the segments).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, NamedTuple

import torch

from graphrt.core.errors import ConfigError
from graphrt.layers.torch.attention.backend import PagedAttentionBackend
from graphrt.layers.torch.attention.kv_quant import is_fp8, write_kv_rows
from graphrt.layers.torch.attention.paged import attend_tiles, attention_plan, paged_attention_kernel, tokens_out
from graphrt.layers.torch.forward_context import get_forward_context


class IndexerInputs(NamedTuple):
    """One step's indexer projections: ``q [T, Hi, Di]`` and ``k [T, Di]`` (positions applied),
    ``weights [T, Hi]`` (each head's weight, any scaling of the model's applied)."""

    q: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor


class BlockIndexerInputs(NamedTuple):
    """One step's block indexer projections (MiniMax-M3's): ``q [T, Hi, Di]`` and ``k [T, Di]``
    (norms and positions applied); ``Hi`` is the KV heads' count: one selection per KV head."""

    q: torch.Tensor
    k: torch.Tensor


def block_selection(index: BlockIndexerInputs, index_cache: torch.Tensor, plan: Any, topk_blocks: int,
                    block: int, local_blocks: int) -> torch.Tensor:
    """Which context columns each KV head of each tile row of ``plan`` reads: ``[N, Hi, tile, L]``
    bool. Each key's score ``q_h . k`` (no scale, no ReLU), the readable ones max-pooled over blocks
    of ``block`` positions; the ``local_blocks`` blocks ending at the token's own are always
    kept, and the ``min(topk_blocks, blocks)`` best blocks are selected on the device (a block
    with no readable key is never selected: the causal mask drops it)."""
    num_tiles, tile = plan.tokens.shape
    ctx_len = plan.key_rows.shape[1]
    heads, dim = index.q.shape[1], index.q.shape[2]
    keys = index_cache.index_select(0, plan.key_rows.reshape(-1)).view(num_tiles, ctx_len, dim).float()
    q = index.q.float()
    if tile > 1:
        q = q.index_select(0, plan.tokens.reshape(-1))
    scores = torch.bmm(q.view(num_tiles, tile * heads, dim), keys.transpose(1, 2)).view(num_tiles, tile, heads, ctx_len)
    scores = scores.masked_fill(plan.masked.unsqueeze(2), float("-inf")).transpose(1, 2)     # [N, Hi, tile, L]
    num_blocks = -(-ctx_len // block)
    if num_blocks * block != ctx_len:
        scores = torch.nn.functional.pad(scores, (0, num_blocks * block - ctx_len), value=float("-inf"))
    block_scores = scores.view(num_tiles, heads, tile, num_blocks, block).amax(dim=-1)
    if local_blocks > 0:     # a token's position: its readable columns less one (causal, no window)
        pos = (~plan.masked).sum(-1) - 1                                                       # [N, tile]
        own = pos.div(block, rounding_mode="floor").unsqueeze(-1)
        near = (own - torch.arange(local_blocks, device=pos.device)).clamp(0, num_blocks - 1)
        block_scores = block_scores.scatter(-1, near.unsqueeze(1).expand(-1, heads, -1, -1), float("inf"))
    top = block_scores.topk(min(int(topk_blocks), num_blocks), dim=-1).indices
    chosen = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(-1, top, True)
    return chosen.repeat_interleave(block, dim=-1)[..., :ctx_len]


def index_selection(index: IndexerInputs, index_cache: torch.Tensor, plan: Any, index_topk: int,
                    index_scale: float) -> torch.Tensor:
    """Which context columns each tile row of ``plan`` reads: ``[N, tile, L]`` bool, the
    ``min(index_topk, L)`` best indexer scores among the readable columns (module docstring)."""
    num_tiles, tile = plan.tokens.shape
    ctx_len = plan.key_rows.shape[1]
    heads, dim = index.q.shape[1], index.q.shape[2]
    keys = index_cache.index_select(0, plan.key_rows.reshape(-1)).view(num_tiles, ctx_len, dim).float()
    q = index.q.float()
    weights = index.weights.float()
    if tile > 1:
        q = q.index_select(0, plan.tokens.reshape(-1))
        weights = weights.index_select(0, plan.tokens.reshape(-1))
    scores = torch.relu(torch.bmm(q.reshape(num_tiles, tile * heads, dim), keys.transpose(1, 2)) * index_scale)
    scores = torch.matmul(weights.view(num_tiles, tile, 1, heads), scores.view(num_tiles, tile, heads, ctx_len))
    scores = scores.view(num_tiles, tile, ctx_len).masked_fill(plan.masked, float("-inf"))
    top = scores.topk(min(int(index_topk), ctx_len), dim=-1).indices
    return torch.zeros_like(plan.masked).scatter_(-1, top, True)


def sparse_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any,
                            slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor, token_req_idx: torch.Tensor, block_size: int, scale: float, *,
                            index: IndexerInputs | BlockIndexerInputs | None = None, index_topk: int = 0,
                            index_scale: float = 0.0, index_block: tuple[int, int] = (0, 0),
                            selection: torch.Tensor | None = None, softcap: float = 0.0,
                            sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the step's K, V (and indexer keys), attend over each token's selected keys ->
    ``(out [T, Hq*Dv], selection [N, tile, L])``; padded tokens get zeros. Float caches only.

    An indexed layer gives ``index`` (the step's :class:`IndexerInputs`; ``kv_cache`` the ``(k, v,
    index_k)`` triple) and its selection is computed (:func:`index_selection`); a layer reusing
    another's selection (HY-V4's and GLM's ``indexer_types`` "shared") gives that ``selection``
    instead, computed this step over the same plan (one block table per step; same window and
    chunk: none). ``sinks [Hq]``: a per-head logit joining each softmax (HY-V4). A
    :class:`BlockIndexerInputs` ``index`` selects ``index_topk`` blocks per KV head
    (:func:`block_selection`, ``index_block``: the block size and local blocks kept) -> a
    selection ``[N, Hkv, tile, L]``."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if is_fp8(k_cache.dtype):
        raise ConfigError("kv_cache_dtype: indexed sparse attention keeps float caches only; use 'auto'")
    if (index is None) == (selection is None):
        raise ValueError("sparse_attention_kernel: give exactly one of index (an indexed layer) and selection "
                         "(a layer reusing another layer's)")
    num_tokens, out_dtype = q.shape[0], q.dtype
    hkv, d, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[2]
    rows = torch.where(slot_mapping < 0, k_cache.shape[0] - 1, slot_mapping)      # negative: the trash row
    write_kv_rows(k_cache, rows, k.reshape(num_tokens, hkv, d).to(k_cache.dtype))
    write_kv_rows(v_cache, rows, v.reshape(num_tokens, hkv, dv).to(v_cache.dtype))
    plan = attention_plan(rows, query_start_loc, seq_lens, block_table, token_req_idx, block_size)
    if index is not None:
        index_cache = kv_cache[2]
        index_cache.index_copy_(0, rows, index.k.to(index_cache.dtype))
        if isinstance(index, BlockIndexerInputs):
            selection = block_selection(index, index_cache, plan, index_topk, *index_block)
        else:
            selection = index_selection(index, index_cache, plan, index_topk, index_scale)
    elif (selection.shape[0], selection.shape[-2], selection.shape[-1]) != plan.masked.shape:
        raise ValueError(f"sparse_attention_kernel: a selection of shape {tuple(selection.shape)} for a step "
                         f"planned as {tuple(plan.masked.shape)}: it was not computed this step")
    masked = plan.masked if selection.dim() == 3 else plan.masked.unsqueeze(1)      # per KV head: [N, Hkv, tile, L]
    plan = plan._replace(masked=masked | ~selection)
    out = attend_tiles(q, k_cache, v_cache, plan, scale, k_cache.dtype, 1.0, 1.0, softcap, sinks)
    return tokens_out(out, plan, num_tokens, q.shape[1] // d * dv, out_dtype), selection


def indexed_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any, index: IndexerInputs,
                             slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                             block_table: torch.Tensor, token_req_idx: torch.Tensor, block_size: int, scale: float,
                             index_topk: int, index_scale: float, *, softcap: float = 0.0,
                             sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Write the step's K, V and indexer keys, select each token's top-k keys, attend over them.

    ``q [T, Hq*D]``, ``k`` / ``v`` ``[T, Hkv*D]`` / ``[T, Hkv*Dv]``, ``kv_cache`` the ``(k, v,
    index_k)`` triple (module docstring), ``index`` the step's :class:`IndexerInputs` -> ``[T,
    Hq*Dv]``; padded tokens get zeros. Float caches only (:func:`sparse_attention_kernel`)."""
    return sparse_attention_kernel(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table,
                                   token_req_idx, block_size, scale, index=index, index_topk=index_topk,
                                   index_scale=index_scale, softcap=softcap, sinks=sinks)[0]


class _KeptSelections(threading.local):
    """This thread's selections kept for later layers, by layer (weakly: a dropped model's go with
    it). Per thread, as each forward's call sites are: a graph built on a background thread never
    hands its selection to a step running on the main thread."""

    def __init__(self) -> None:
        self.by_layer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_KEPT = _KeptSelections()


def kept_selection(layer: Any) -> torch.Tensor | None:
    """The selection ``layer`` computed last on this thread (``keeps_selection`` layers), or None."""
    return _KEPT.by_layer.get(layer)


class IndexedPagedBackend(PagedAttentionBackend):
    """graphrt's paged metadata (the table narrowed to the keyed context, as the reference kernel
    needs) with a kernel for every kind of layer a DSA model has: an indexed layer (``index``
    given) and a layer reusing another's selection (``selection`` given) run
    :func:`sparse_attention_kernel`, any other the reference kernel with its additions
    (soft-capping, sinks, its own V head size, a chunk). A layer whose ``keeps_selection`` is true
    (a later layer reuses it) keeps this step's selection (:func:`kept_selection`)."""

    name = "graphrt-indexed-sparse"
    attends_extended = True

    def __init__(self, head_dim: int | None = None) -> None:
        super().__init__(head_dim, kernel="reference")

    def attend(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None, index: IndexerInputs | BlockIndexerInputs | None = None,
               selection: torch.Tensor | None = None) -> torch.Tensor:
        meta = get_forward_context()
        args = (meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_table, meta.token_req_idx,
                meta.block_size, layer.scale)
        softcap = getattr(layer, "softcap", 0.0)
        if index is not None or selection is not None:
            out, chosen = sparse_attention_kernel(q, k, v, layer.kv_cache, *args, index=index,
                                                  index_topk=layer.index_topk, index_scale=layer.index_scale,
                                                  index_block=getattr(layer, "index_block", (0, 0)),
                                                  selection=selection, softcap=softcap, sinks=sinks)
            if getattr(layer, "keeps_selection", False):
                _KEPT.by_layer[layer] = chosen
            return out
        return paged_attention_kernel(q, k, v, layer.kv_cache, *args, layer.sliding_window, layer.k_scale,
                                      layer.v_scale, softcap=softcap, sinks=sinks,
                                      attention_chunk=getattr(layer, "attention_chunk", 0))


__all__ = ["BlockIndexerInputs", "IndexedPagedBackend", "IndexerInputs", "block_selection", "index_selection",
           "indexed_attention_kernel", "kept_selection", "sparse_attention_kernel"]
