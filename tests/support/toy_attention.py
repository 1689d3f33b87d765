"""A toy attention kernel added the way docs/attention.md ("Adding a kernel") says: this one file
(its backend: phases and ``attend``) and one registration with graphrt's selector
(``register_attention_kernel("toy", make_toy_backend)``); nothing else in graphrt changes.

Its algorithm is not graphrt's: each token gathers its request's whole table (no tiles, no
narrowing: it keys nothing) and attends in float32 with two einsums. Columns a token may not
read are pointed at the token's own row (written this step), so stale or NaN rows never leak;
padded tokens (past the last request's queries) get zeros.
"""

from __future__ import annotations

from typing import Any

import torch

from graphrt.layers.torch.attention.backend import AttentionBackend, HostValues, StepTensors
from graphrt.layers.torch.attention.paged import TorchAttentionMetadata
from graphrt.layers.torch.attention.selector import AttentionSite
from graphrt.layers.torch.forward_context import get_forward_context


class ToyAttentionBackend(AttentionBackend):
    """graphrt's metadata bound to the toy kernel; counts the layer calls it ran (eager and captured)."""

    name = "toy"
    calls = 0

    def build(self, step: StepTensors, host: HostValues) -> TorchAttentionMetadata:
        return TorchAttentionMetadata.build(step.slot_mapping, step.query_start_loc, step.seq_lens, step.block_table,
                                            step.block_size, attend=self.attend)

    def attend(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        meta, cache = get_forward_context(), layer.kv_cache            # [2, rows, Hkv, D]
        t, hkv, d = q.shape[0], cache.shape[2], cache.shape[3]
        dev, i64 = q.device, torch.int64
        rows = torch.where(meta.slot_mapping < 0, cache.shape[1] - 1, meta.slot_mapping)   # padding: trash row
        cache[0].index_copy_(0, rows, k.reshape(t, hkv, d).to(cache.dtype))
        cache[1].index_copy_(0, rows, v.reshape(t, hkv, d).to(cache.dtype))
        req, qsl = meta.token_req_idx, meta.query_start_loc.to(i64)
        table = meta.block_table.index_select(0, req).to(i64)                                # [T, B]
        width = table.shape[1] * meta.block_size
        key_rows = (table.unsqueeze(-1) * meta.block_size + torch.arange(meta.block_size, device=dev)).reshape(t, width)
        seq = meta.seq_lens.to(i64).index_select(0, req)
        pos = seq - (qsl.index_select(0, req + 1) - torch.arange(t, device=dev))             # each token's position
        col = torch.arange(width, device=dev)
        valid = (col <= pos[:, None]) & (col < seq[:, None])
        if layer.sliding_window:
            valid &= col > pos[:, None] - layer.sliding_window
        key_rows = torch.where(valid, key_rows, rows[:, None])
        keys = cache[0].index_select(0, key_rows.reshape(-1)).view(t, width, hkv, d).float()
        values = cache[1].index_select(0, key_rows.reshape(-1)).view(t, width, hkv, d).float()
        queries = q.reshape(t, hkv, -1, d).float()
        scores = torch.einsum("tkgd,tlkd->tkgl", queries, keys) * layer.scale
        scores = scores.masked_fill(~valid[:, None, None, :], torch.finfo(torch.float32).min)
        out = torch.einsum("tkgl,tlkd->tkgd", scores.softmax(-1), values).reshape(t, -1)
        live = torch.arange(t, device=dev) < qsl[-1]
        return torch.where(live[:, None], out, 0.0).to(q.dtype)


def make_toy_backend(site: AttentionSite) -> ToyAttentionBackend:
    """The toy kernel's maker: it runs wherever torch does."""
    return ToyAttentionBackend()
