"""graphrt's paged attention as a vLLM attention backend: ``GraphrtAttentionBackend``.

vLLM's CPU attention cannot sit in a FULL graph: its builder makes new host-planned tensors every
step (``AttentionCGSupport.NEVER``). This backend's metadata is only what vLLM's runner already
keeps in persistent buffers -- ``query_start_loc``, ``seq_lens``, the block table and the slot
mapping, sliced to the step's padded sizes -- and its forward is graphrt's reference kernel
(:func:`graphrt.layers.torch.attention.paged.paged_attention_kernel`: device ops only, no host reads), so
a graph replays it on fresh values: it declares ``AttentionCGSupport.ALWAYS``. The platform picks
it where the cudagraph mode has FULL graphs (:mod:`.platform`).

KV cache: vLLM hands each layer a ``[blocks, kv_heads, block_size, 2 * head_size]`` view; the
layout this backend asks for (``LBNHC``) stores it token-major, so slot ``s`` (vLLM's
``block * block_size + offset``) is row ``s`` of a ``[rows, kv_heads, 2 * head_size]`` view, K in
the first half of the last axis, V in the second. Padded tokens (slot -1) write row 0: vLLM's null
block, which no request reads unmasked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from graphrt.core.errors import ConfigError
from graphrt.layers.torch.attention.paged import TorchAttentionMetadata, paged_attention_kernel
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl, AttentionMetadataBuilder,
                                       AttentionType, CommonAttentionMetadata, MultipleOf)
from vllm.v1.kv_cache_layout import KVCacheLayout


@dataclass
class GraphrtAttentionMetadata:
    """Views of vLLM's persistent buffers at the step's padded sizes (nothing allocated per step)."""

    num_actual_tokens: int          # tokens the metadata covers: the key's (padded) count in a FULL graph
    query_start_loc: torch.Tensor   # int32 [R + 1]
    seq_lens: torch.Tensor          # int32 [R]; 0 for a padded request
    block_table: torch.Tensor       # int32 [R, max blocks per request]; padded rows hold the null block
    slot_mapping: torch.Tensor      # int64 [T]; -1 for a padded token


class GraphrtAttentionMetadataBuilder(AttentionMetadataBuilder[GraphrtAttentionMetadata]):
    """Hands the kernel vLLM's own buffers; every batch kind fits a graph (``ALWAYS``)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> GraphrtAttentionMetadata:
        m = common_attn_metadata
        return GraphrtAttentionMetadata(m.num_actual_tokens, m.query_start_loc, m.seq_lens, m.block_table_tensor,
                                        m.slot_mapping)


class GraphrtAttentionImpl(AttentionImpl[GraphrtAttentionMetadata]):
    """Decoder self-attention by graphrt's reference paged-attention kernel."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        unsupported = {"alibi_slopes": alibi_slopes is not None, "sinks": sinks is not None,
                       f"attn_type {attn_type}": attn_type != AttentionType.DECODER,
                       "kv_sharing_target_layer_name": kv_sharing_target_layer_name is not None,
                       f"kv_cache_dtype {kv_cache_dtype}": kv_cache_dtype != "auto"}
        refused = [name for name, bad in unsupported.items() if bad]
        if refused:
            raise ConfigError(f"graphrt's vLLM attention backend (FULL graphs on a CPU) does not support "
                              f"{', '.join(refused)}; use cudagraph_mode PIECEWISE (vLLM's CPU attention)")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.softcap = float(logits_soft_cap or 0.0)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None

    @staticmethod
    def write_slots(slot_mapping: torch.Tensor) -> torch.Tensor:
        """The KV row each token writes: its slot, and row 0 (vLLM's null block) for a padded token (-1)."""
        return slot_mapping.clamp(min=0)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: GraphrtAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None
                ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise ConfigError("graphrt's vLLM attention backend: fused output quantisation is not supported")
        if attn_metadata is None:          # vLLM's profile run: no metadata, nothing to attend
            return output
        m = attn_metadata
        n = m.num_actual_tokens
        rows = kv_rows(kv_cache, self.head_size)
        d = self.head_size
        meta = TorchAttentionMetadata.build(self.write_slots(m.slot_mapping[:n]), m.query_start_loc, m.seq_lens,
                                            m.block_table, kv_cache.shape[2])
        out = paged_attention_kernel(query[:n].reshape(n, -1), key[:n].reshape(n, -1), value[:n].reshape(n, -1),
                                     (rows[..., :d], rows[..., d:]), meta.slot_mapping, meta.query_start_loc,
                                     meta.seq_lens, meta.block_table, meta.token_req_idx, meta.block_size,
                                     self.scale, self.sliding_window, softcap=self.softcap)
        output[:n].view(n, -1).copy_(out)
        return output


def kv_rows(kv_cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """vLLM's ``[blocks, heads, block_size, content]`` layer view as ``[rows, heads, content]`` rows
    (a view: the ``LBNHC`` layout stores a layer token-major). ConfigError where vLLM chose another."""
    blocks, heads, block_size, content = kv_cache.shape
    token_major = kv_cache.permute(0, 2, 1, 3)
    if not token_major.is_contiguous():
        raise ConfigError(f"graphrt's vLLM attention backend needs the KV cache layout LBNHC (token-major "
                          f"blocks); vLLM gave strides {tuple(kv_cache.stride())}: unset VLLM_KV_CACHE_LAYOUT")
    return token_major.view(blocks * block_size, heads, content)


class GraphrtAttentionBackend(AttentionBackend):
    """vLLM's registration of graphrt's paged attention (the module docstring)."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "GRAPHRT"

    @staticmethod
    def get_impl_cls() -> type[GraphrtAttentionImpl]:
        return GraphrtAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[GraphrtAttentionMetadataBuilder]:
        return GraphrtAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


__all__ = ["GraphrtAttentionBackend", "GraphrtAttentionImpl", "GraphrtAttentionMetadata",
           "GraphrtAttentionMetadataBuilder", "kv_rows"]
