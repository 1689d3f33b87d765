"""Paged attention in plain torch: the reference kernel of graphrt's torch models.

Everything here runs inside device-graph capture, so it is written with static
shapes only: no host syncs (``.item()``, ``.tolist()``, ``.cpu()``), no boolean-mask
indexing, no ``nonzero``, no Python branches on tensor values. Masked entries are
removed with ``torch.where`` rather than multiplied by zero, so stale NaN rows in the
cache can never leak into a real output.

KV cache layout (one tensor per attention layer, allocated by the runner)::

    kv_cache: [2, num_blocks * block_size + 1, num_kv_heads, head_dim]   # 0 = K, 1 = V

Slot ``s`` is row ``s``; block ``b`` covers rows ``[b * block_size, (b + 1) * block_size)``.
The last row is a trash row: tokens with a negative slot (padding) write there and
nothing ever reads it.

The kernel is also registered as the custom op ``graphrt::paged_attention`` (it mutates
``kv_cache``). ``PagedAttention`` calls it under ``torch.compile`` so Dynamo and Inductor
see one opaque op with every metadata tensor as an argument, and the piecewise splitter
(:mod:`graphrt.backends.torch.piecewise`) cuts the model at ``PagedAttention`` modules (or at
this op in a traced graph). Eagerly and during graph capture the kernel runs directly, so
the CPU recording graph sees, and checks, every aten op inside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from graphrt.core.dispatch import AttentionGraphSupport
from graphrt.core.errors import ConfigError
from graphrt.core.forward_context import get_forward_context


@dataclass
class TorchAttentionMetadata:
    """Per-step attention inputs shared by every layer, all on the model's device.

    ``T`` (tokens) and ``R`` (requests) come from the tensor shapes, so a padded batch
    is described by the same fields: padded tokens have a negative slot, padded
    requests have ``seq_len`` 0, a repeated ``query_start_loc`` and a zero block row.
    """

    slot_mapping: torch.Tensor  # int64 [T]; negative = padded token
    query_start_loc: torch.Tensor  # int32 [R + 1], non-decreasing, starts at 0
    seq_lens: torch.Tensor  # int32 [R]; computed + scheduled tokens, 0 for a padded request
    block_table: torch.Tensor  # int32 [R, B]; padded rows are all 0
    token_req_idx: torch.Tensor  # int64 [T]; request index of each token
    block_size: int

    @classmethod
    def build(
        cls,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
    ) -> "TorchAttentionMetadata":
        """Derive ``token_req_idx`` with device ops only (safe inside graph capture).

        Token ``t`` belongs to the last request ``r`` with ``query_start_loc[r] <= t``;
        tokens past the last real request land on the last request (clamped), which
        is a padded request when the batch has one.
        """
        num_tokens = slot_mapping.shape[0]
        num_reqs = seq_lens.shape[0]
        token_ids = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
        req = torch.searchsorted(query_start_loc, token_ids, right=True) - 1
        token_req_idx = req.clamp(0, max(num_reqs - 1, 0)).to(torch.int64)
        return cls(slot_mapping, query_start_loc, seq_lens, block_table, token_req_idx, int(block_size))


def paged_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, block_table: torch.Tensor,
                           token_req_idx: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """Write this step's K/V into ``kv_cache``, then attend causally over each request's blocks.

    ``q [T, Hq*D]``, ``k``/``v`` ``[T, Hkv*D]``, ``kv_cache [2, rows, Hkv, D]`` -> ``[T, Hq*D]``.
    Head counts come from the shapes; grouped-query heads share KV heads without
    materialising repeated KV.
    """
    num_tokens, out_dtype = q.shape[0], q.dtype
    hkv, d = kv_cache.shape[2], kv_cache.shape[3]
    num_heads = q.shape[1] // d
    groups = num_heads // hkv

    trash_row = kv_cache.shape[1] - 1
    rows = torch.where(slot_mapping < 0, trash_row, slot_mapping)
    kv_cache[0].index_copy_(0, rows, k.reshape(num_tokens, hkv, d).to(kv_cache.dtype))
    kv_cache[1].index_copy_(0, rows, v.reshape(num_tokens, hkv, d).to(kv_cache.dtype))

    req = token_req_idx
    bs = block_size
    blocks = block_table.index_select(0, req).to(torch.int64)  # [T, B]
    ctx_len = blocks.shape[1] * bs
    offsets = torch.arange(bs, device=blocks.device, dtype=torch.int64)
    key_rows = (blocks.unsqueeze(-1) * bs + offsets).reshape(num_tokens, ctx_len)  # [T, L]

    seq_len = seq_lens.index_select(0, req).to(torch.int64)  # [T]
    q_end = query_start_loc.index_select(0, req + 1).to(torch.int64)
    token_pos = seq_len - (q_end - torch.arange(num_tokens, device=req.device, dtype=torch.int64))
    ctx_pos = torch.arange(ctx_len, device=req.device, dtype=torch.int64)
    valid = (ctx_pos < seq_len.unsqueeze(1)) & (ctx_pos <= token_pos.unsqueeze(1))  # [T, L]

    keys = kv_cache[0][key_rows]  # [T, L, Hkv, D]
    values = torch.where(valid[:, :, None, None], kv_cache[1][key_rows], 0)
    q = q.reshape(num_tokens, hkv, groups, d).to(kv_cache.dtype)
    scores = torch.einsum("tkgd,tlkd->tkgl", q, keys).float() * scale
    score_mask = valid[:, None, None, :]
    scores = torch.where(score_mask, scores, float("-inf"))
    probs = torch.where(score_mask, torch.softmax(scores, dim=-1), 0.0)
    out = torch.einsum("tkgl,tlkd->tkgd", probs.to(values.dtype), values)
    return out.reshape(num_tokens, num_heads * d).to(out_dtype)


@torch.library.custom_op("graphrt::paged_attention", mutates_args=("kv_cache",))
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, token_req_idx: torch.Tensor, block_size: int,
                    scale: float) -> torch.Tensor:
    """``torch.ops.graphrt.paged_attention``: :func:`paged_attention_kernel` as one opaque op."""
    return paged_attention_kernel(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens,
                                  block_table, token_req_idx, block_size, scale)


@paged_attention.register_fake
def _paged_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                          seq_lens: torch.Tensor, block_table: torch.Tensor,
                          token_req_idx: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


#: The registered op, for graph passes that look for it (the piecewise splitter).
PAGED_ATTENTION_OP = torch.ops.graphrt.paged_attention.default


class PagedAttention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends causally over it.

    ``kv_cache`` is a plain attribute (not a buffer) that the runner assigns once the
    cache is allocated. Every query token reads its request's blocks through the block
    table; grouped-query heads share KV heads without materialising repeated KV.

    ``graph_support`` declares what the kernel can run inside FULL graphs (any batch: it
    reads only device tensors); ``graphrt_attention`` marks the module as a split point
    for PIECEWISE graphs. Attention backends with other limits set their own values.
    """

    graph_support: ClassVar[AttentionGraphSupport] = AttentionGraphSupport.ALWAYS
    graphrt_attention: ClassVar[bool] = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ConfigError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.kv_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [T, Hq*D]``, ``k``/``v`` ``[T, Hkv*D]`` -> ``[T, Hq*D]``."""
        meta: TorchAttentionMetadata = get_forward_context()
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("PagedAttention.kv_cache is not set: the runner must assign the KV cache")
        kernel = paged_attention if torch.compiler.is_compiling() else paged_attention_kernel
        return kernel(q, k, v, cache, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                      meta.block_table, meta.token_req_idx, meta.block_size, self.scale)
