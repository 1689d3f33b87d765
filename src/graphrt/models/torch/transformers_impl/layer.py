"""graphrt's attention layer for one attention layer of a transformers model.

:class:`HFPagedAttention` is graphrt's :class:`~graphrt.models.torch.attention.PagedAttention`
(the runner assigns its ``kv_cache``; it is a PIECEWISE split point) with what transformers'
decoders add to plain causal attention, read from the model when it is loaded (``facts.py``):

* logit soft-capping (Gemma 2, Cohere 2 ...): ``scores = cap * tanh(scores / cap)`` after scaling;
* attention sinks (gpt-oss): a learned logit per query head that joins each softmax and is
  then dropped (``s_aux``, a parameter of the transformers module, passed at each call);
* a V head size other than K's (MLA decoders: DeepSeek-V2/V3 ...): the cache is a ``(k, v)``
  pair (docs/models.md, "KV cache specs").

A layer with none of these runs graphrt's own kernels exactly as graphrt's decoders do
(reference, Triton on CUDA, FlashInfer / Ascend where their backends are selected). A layer with
any of them runs :func:`extended_paged_attention`, the reference kernel's algorithm with the
three additions, under graphrt's paged metadata (the model's attention backend is then
:class:`ReferencePagedBackend`, which narrows the block table to the step's context bucket).
"""

from __future__ import annotations

from typing import Any

import torch

from graphrt.models.torch.forward_context import get_forward_context
from graphrt.models.torch.attention import PagedAttention
from graphrt.models.torch.attention_backend import HostValues, PagedAttentionBackend, StepTensors
from graphrt.models.torch.kv_quant import dequantize_kv, is_fp8, quantize_kv, read_kv_rows, write_kv_rows


class HFPagedAttention(PagedAttention):
    """One transformers attention layer's paged attention (module docstring).

    ``forward(q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*Dv], sinks [Hq] | None) -> [T, Hq*Dv]``."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int = 0, softcap: float = 0.0, sinks: bool = False,
                 head_dim_v: int | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale=scale, sliding_window=sliding_window)
        self.softcap = float(softcap or 0.0)
        self.sinks = bool(sinks)
        self.head_dim_v = int(head_dim_v or head_dim)

    @property
    def extended(self) -> bool:
        """Whether this layer needs :func:`extended_paged_attention` (not graphrt's plain kernels)."""
        return bool(self.softcap or self.sinks or self.head_dim_v != self.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if not self.extended:
            return super().forward(q, k, v)
        if self.kv_cache is None:
            raise RuntimeError("HFPagedAttention.kv_cache is not set: the runner must assign the KV cache")
        meta = get_forward_context()
        return extended_paged_attention(q, k, v, self.kv_cache, meta.slot_mapping, meta.query_start_loc,
                                        meta.seq_lens, meta.block_table, meta.token_req_idx, meta.block_size,
                                        self.scale, self.sliding_window, self.softcap,
                                        sinks if self.sinks else None, self.k_scale, self.v_scale)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"head_dim_v={self.head_dim_v}, scale={self.scale:.6g}, window={self.sliding_window}, "
                f"softcap={self.softcap}, sinks={self.sinks}")


def _split_cache(kv_cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a layer's cache: ``[2, rows, H, D]`` or a ``(k, v)`` pair (different head sizes)."""
    if isinstance(kv_cache, (tuple, list)):
        return kv_cache[0], kv_cache[1]
    return kv_cache[0], kv_cache[1]


def extended_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any,
                             slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                             block_table: torch.Tensor, token_req_idx: torch.Tensor, block_size: int,
                             scale: float, sliding_window: int = 0, softcap: float = 0.0,
                             sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                             v_scale: float = 1.0) -> torch.Tensor:
    """Write the step's K/V through ``slot_mapping`` (negative: the trash row), then attend causally
    over each request's blocks with soft-capping, sinks and V's own head size.

    Device ops only, static shapes: capturable. Scores are float32, as the reference kernel's."""
    k_cache, v_cache = _split_cache(kv_cache)
    t, out_dtype = q.shape[0], q.dtype
    hkv, d, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[2]
    heads = q.shape[1] // d
    groups = heads // hkv
    fp8 = is_fp8(k_cache.dtype)
    k_scale, v_scale = (k_scale, v_scale) if fp8 else (1.0, 1.0)
    compute = torch.float32 if fp8 else k_cache.dtype

    rows = torch.where(slot_mapping < 0, k_cache.shape[0] - 1, slot_mapping)
    write_kv_rows(k_cache, rows, quantize_kv(k.reshape(t, hkv, d), k_cache.dtype, k_scale))
    write_kv_rows(v_cache, rows, quantize_kv(v.reshape(t, hkv, dv), v_cache.dtype, v_scale))

    blocks = block_table.index_select(0, token_req_idx).to(torch.int64)          # [T, B]
    ctx = blocks.shape[1] * block_size
    offsets = torch.arange(block_size, device=blocks.device, dtype=torch.int64)
    key_rows = (blocks.unsqueeze(-1) * block_size + offsets).reshape(t, ctx)   # [T, L]
    seq = seq_lens.index_select(0, token_req_idx).to(torch.int64)
    q_end = query_start_loc.index_select(0, token_req_idx + 1).to(torch.int64)
    pos = seq - (q_end - torch.arange(t, device=seq.device, dtype=torch.int64))  # each token's position
    cols = torch.arange(ctx, device=seq.device, dtype=torch.int64)
    valid = (cols < seq.unsqueeze(1)) & (cols <= pos.unsqueeze(1))
    if sliding_window:
        valid = valid & (cols > pos.unsqueeze(1) - int(sliding_window))

    keys = dequantize_kv(read_kv_rows(k_cache, key_rows), compute, k_scale)         # [T, L, Hkv, D]
    values = torch.where(valid[:, :, None, None],
                         dequantize_kv(read_kv_rows(v_cache, key_rows), compute, v_scale), 0)
    scores = torch.einsum("tkgd,tlkd->tkgl", q.reshape(t, hkv, groups, d).to(compute), keys).float() * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    mask = valid[:, None, None, :]
    scores = torch.where(mask, scores, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, hkv, groups, 1).expand(t, hkv, groups, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = torch.where(mask, probs, 0.0)
    out = torch.einsum("tkgl,tlkd->tkgd", probs.to(values.dtype), values)
    return out.reshape(t, heads * dv).to(out_dtype)


class ReferencePagedBackend(PagedAttentionBackend):
    """graphrt's paged metadata with the block table always narrowed to ``max_seq_len`` (keyed: the
    context bucket in a graph), for models whose layers run :func:`extended_paged_attention`,
    which gathers every column it is given, on every device."""

    name = "graphrt-paged-transformers"

    def keyed_host_values(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        self._narrow = True
        return ("max_seq_len",)

    def build(self, step: StepTensors, host: HostValues) -> Any:
        return super().build(step, host)


__all__ = ["HFPagedAttention", "ReferencePagedBackend", "extended_paged_attention"]
