"""graphrt's attention layer for one attention layer of a transformers model.

:class:`HFPagedAttention` is graphrt's :class:`~graphrt.layers.torch.attention.paged.PagedAttention`
(the runner assigns its ``kv_cache``; it is a PIECEWISE split point) with what transformers'
decoders add to plain causal attention, read from the model when it is loaded (``facts.py``):

* logit soft-capping (Gemma 2, Cohere 2 ...): ``scores = cap * tanh(scores / cap)`` after scaling;
* attention sinks (gpt-oss): a learned logit per query head that joins each softmax and is
  then dropped (``s_aux``, a parameter of the transformers module, passed at each call);
* a V head size other than K's (MLA decoders: DeepSeek-V2/V3 ...): the cache is a ``(k, v)``
  pair (docs/models.md, "KV cache specs").

A layer with none of these runs graphrt's own kernels exactly as graphrt's decoders do
(reference, Triton on CUDA, FlashInfer / Ascend where their backends are selected). A layer with
any of them runs graphrt's reference kernel
(:func:`~graphrt.layers.torch.attention.paged.paged_attention_kernel`) with the three additions, under
graphrt's paged metadata (the model's attention backend is then
:class:`ReferencePagedBackend`, which narrows the block table to the step's context bucket).
"""

from __future__ import annotations

from typing import Any

import torch

from graphrt.layers.torch.forward_context import get_forward_context
from graphrt.layers.torch.attention.paged import PagedAttention, paged_attention_kernel
from graphrt.layers.torch.attention.backend import HostValues, PagedAttentionBackend, StepTensors


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
    def head_size_v(self) -> int:
        """V's head size, as graphrt's KV cache checks read it (``kv_cache.layer_kv_shape``)."""
        return self.head_dim_v

    @property
    def extended(self) -> bool:
        """Whether this layer needs the reference kernel's additions (not graphrt's plain kernels)."""
        return bool(self.softcap or self.sinks or self.head_dim_v != self.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if not self.extended:
            return super().forward(q, k, v)
        if self.kv_cache is None:
            raise RuntimeError("HFPagedAttention.kv_cache is not set: the runner must assign the KV cache")
        meta = get_forward_context()
        return paged_attention_kernel(q, k, v, self.kv_cache, meta.slot_mapping, meta.query_start_loc,
                                      meta.seq_lens, meta.block_table, meta.token_req_idx, meta.block_size,
                                      self.scale, self.sliding_window, self.k_scale, self.v_scale,
                                      softcap=self.softcap, sinks=sinks if self.sinks else None)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"head_dim_v={self.head_dim_v}, scale={self.scale:.6g}, window={self.sliding_window}, "
                f"softcap={self.softcap}, sinks={self.sinks}")


class ReferencePagedBackend(PagedAttentionBackend):
    """graphrt's paged metadata with the block table always narrowed to ``max_seq_len`` (keyed: the
    context bucket in a graph), for models whose layers run the reference kernel with
    :class:`HFPagedAttention`'s additions, which gathers every column it is given, on every device."""

    name = "graphrt-paged-transformers"

    def keyed_host_values(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        self._narrow = True
        return ("max_seq_len",)

    def build(self, step: StepTensors, host: HostValues) -> Any:
        return super().build(step, host)


__all__ = ["HFPagedAttention", "ReferencePagedBackend"]
