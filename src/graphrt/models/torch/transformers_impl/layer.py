"""graphrt's attention layer for one attention layer of a transformers model.

:class:`HFPagedAttention` is graphrt's :class:`~graphrt.layers.torch.attention.paged.PagedAttention`
(the runner assigns its ``kv_cache``; it is a PIECEWISE split point) with what transformers'
decoders add to plain causal attention, read from the model when it is loaded (``facts.py``):

* logit soft-capping (Gemma 2, Cohere 2 ...): ``scores = cap * tanh(scores / cap)`` after scaling;
* attention sinks (gpt-oss): a learned logit per query head that joins each softmax and is
  then dropped (``s_aux``, a parameter of the transformers module, passed at each call);
* a V head size other than K's (MLA decoders: DeepSeek-V2/V3 ...): the cache is a ``(k, v)``
  pair (docs/models.md, "KV cache specs");
* chunked local attention (Llama 4's ``chunked_attention`` layers): a token at p attends to
  (p // C) * C .. p, C the config's ``attention_chunk_size``;
* Llama 4's query temperature on NoPE layers: queries scaled by ``1 + attn_scale * log1p(floor((p
  + 1) / floor_scale))`` at each token's own position p (transformers' module, which would number
  the packed row from 0, has it turned off: ``facts.own_temperature``).

Every layer calls its step's ``attend`` (the attention backend's kernel, fixed once). A model
with none of these runs graphrt's own kernels exactly as graphrt's decoders do (reference,
Triton on CUDA, FlashInfer / Ascend where their backends are selected). A model with any of
them gets :class:`ReferencePagedBackend`, whose kernel is graphrt's reference one
(:func:`~graphrt.layers.torch.attention.paged.paged_attention_kernel`) with the three additions,
and which narrows the block table to the step's context bucket.
"""

from __future__ import annotations

from typing import Any

import torch

from graphrt.layers.torch.forward_context import get_forward_context
from graphrt.layers.torch.attention.paged import PagedAttention, paged_attention_kernel
from graphrt.layers.torch.attention.backend import PagedAttentionBackend
from graphrt.layers.torch.attention.sparse import kept_selection


class HFPagedAttention(PagedAttention):
    """One transformers attention layer's paged attention (module docstring).

    ``forward(q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*Dv], sinks [Hq] | None) -> [T, Hq*Dv]``."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int = 0, softcap: float = 0.0, sinks: bool = False,
                 head_dim_v: int | None = None, attention_chunk: int = 0,
                 temperature: tuple[float, float] | None = None,
                 index: tuple[int, int, int, float] | None = None, index_from: int = -1,
                 index_block: tuple[int, int] = (0, 0)) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale=scale, sliding_window=sliding_window,
                         attention_chunk=attention_chunk)
        self.softcap = float(softcap or 0.0)
        self.sinks = bool(sinks)
        self.head_dim_v = int(head_dim_v or head_dim)
        self.temperature = None if temperature is None else (float(temperature[0]), float(temperature[1]))
        #: DSA (indexed sparse attention): the indexer's heads, key size (kept in the KV cache
        #: beside K and V), top-k and score scale; 0 / None without an indexer.
        self.index_heads, self.index_head_size, self.index_topk, self.index_scale = index or (0, 0, 0, 0.0)
        #: A block indexer's ``(block size, local blocks)`` (MiniMax-M3; ``index_topk`` counts blocks).
        self.index_block = (int(index_block[0]), int(index_block[1]))
        #: A layer reusing another's selection (``indexer_types`` "shared"): that call site, else -1.
        self.index_from = int(index_from)
        #: Whether a later layer reuses this indexed layer's selection (the backend then keeps it).
        self.keeps_selection = False
        self._selection_source: tuple[HFPagedAttention, ...] = ()

    def share_selection_of(self, source: "HFPagedAttention") -> None:
        """Attend over ``source``'s selection of each step (``source`` runs first in the forward)."""
        if not source.index_head_size:
            raise ValueError("share_selection_of: the source layer has no indexer")
        source.keeps_selection = True
        self._selection_source = (source,)        # a tuple: not registered as a submodule

    @property
    def head_size_v(self) -> int:
        """V's head size, as graphrt's KV cache checks read it (``kv_cache.layer_kv_shape``)."""
        return self.head_dim_v

    @property
    def extended(self) -> bool:
        """Whether this layer needs the reference kernel's additions (not graphrt's plain kernels)."""
        return bool(self.softcap or self.sinks or self.head_dim_v != self.head_dim or self.attention_chunk
                    or self.temperature or self.index_head_size or self.index_from >= 0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: torch.Tensor | None = None, index: Any = None) -> torch.Tensor:
        """The step's ``attend`` (the backend's kernel); ``sinks`` (a layer with sinks only)
        passed on to it, which only :class:`ReferencePagedBackend`'s takes."""
        if self.kv_cache is None:
            raise RuntimeError("HFPagedAttention.kv_cache is not set: the runner must assign the KV cache")
        meta = get_forward_context()
        if self.temperature is not None:
            q = self._tempered(q, meta)
        attend = meta.attend
        extra = {} if sinks is None else dict(sinks=sinks)
        if self.index_head_size:            # a DSA layer: the step's indexer projections (indexer.py)
            if index is None:
                raise RuntimeError(f"{type(self).__name__}: an indexed layer was called without its indexer's inputs")
            return attend(self, q, k, v, index=index, **extra)
        if self._selection_source:          # a DSA layer reusing an earlier layer's selection of this step
            selection = kept_selection(self._selection_source[0])
            if selection is None:
                raise RuntimeError(f"{type(self).__name__}: the layer whose selection this one reuses has not run")
            return attend(self, q, k, v, selection=selection, **extra)
        return attend(self, q, k, v, **extra)

    def _tempered(self, q: torch.Tensor, meta: Any) -> torch.Tensor:
        """``q`` scaled by Llama 4's temperature at each token's position (device ops; a padded
        token's position is past its request's and its output is zeroed anyway)."""
        floor_scale, attn_scale = self.temperature
        req = meta.token_req_idx
        ends = meta.query_start_loc.index_select(0, req + 1).to(torch.int64)
        tokens = torch.arange(q.shape[0], device=q.device, dtype=torch.int64)
        pos = meta.seq_lens.index_select(0, req).to(torch.int64) - (ends - tokens)
        scales = torch.log1p(torch.floor((pos.float() + 1.0) / floor_scale)) * attn_scale + 1.0
        return (q * scales.unsqueeze(1)).to(q.dtype)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"head_dim_v={self.head_dim_v}, scale={self.scale:.6g}, window={self.sliding_window}, "
                f"softcap={self.softcap}, sinks={self.sinks}, chunk={self.attention_chunk}, "
                f"temperature={self.temperature}, index_topk={self.index_topk}, index_from={self.index_from}")


class ReferencePagedBackend(PagedAttentionBackend):
    """graphrt's paged metadata with the block table always narrowed to ``max_seq_len`` (keyed: the
    context bucket in a graph), for models whose layers need :class:`HFPagedAttention`'s additions:
    its kernel is the reference one with them, which gathers every column it is given, on every
    device."""

    name = "graphrt-paged-transformers"
    #: Its kernel runs the additions (soft-capping, sinks, a V head size of its own).
    attends_extended = True

    def __init__(self, head_dim: int | None = None) -> None:
        super().__init__(head_dim, kernel="reference")

    def attend(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The reference kernel with ``layer``'s soft-capping and ``sinks``."""
        meta = get_forward_context()
        return paged_attention_kernel(q, k, v, layer.kv_cache, meta.slot_mapping, meta.query_start_loc,
                                      meta.seq_lens, meta.block_table, meta.token_req_idx, meta.block_size,
                                      layer.scale, layer.sliding_window, layer.k_scale, layer.v_scale,
                                      softcap=getattr(layer, "softcap", 0.0), sinks=sinks,
                                      attention_chunk=getattr(layer, "attention_chunk", 0))


__all__ = ["HFPagedAttention", "ReferencePagedBackend"]
