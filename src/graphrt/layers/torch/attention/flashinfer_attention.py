"""FlashInfer's paged attention behind graphrt's attention seam (``GRAPHRT_ATTENTION=flashinfer``).

graphrt keeps the KV cache (NHD pages, no copy) and its write; FlashInfer's ``plan()`` is host
work, so :meth:`before_replay` plans before every run, outside any graph, and each graph shape
reads wrappers made for it. Graph support ``UNIFORM_BATCH``; fp8 refused. ``flashinfer`` is
imported lazily. See docs/attention.md, "FlashInfer".
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import torch

from graphrt.core.attention_decl import FLOAT_KV_DTYPES
from graphrt.core.errors import ConfigError, GraphCaptureError
from graphrt.core.graph_modes import AttentionGraphSupport
from graphrt.core.kv_spec import blocks_for
from graphrt.layers.torch.attention.paged import ATTENTION_ENV, TorchAttentionMetadata, paged_attend, requested_attention
from graphrt.layers.torch.attention.backend import AttentionBackend, HostValues, StepTensors
from graphrt.layers.torch.attention.flashinfer_kernel import PlanSignature, flashinfer_unavailable_reason, plan_signature
from graphrt.layers.torch.attention.kv_quant import is_fp8

#: The float workspace FlashInfer's wrappers share (its recommended 128 MiB), and the kernel
#: backend: "fa2", whose CUDA-graph mode fixes tile size and padded grid from a wrapper's tokens
#: and requests (scheduler.cuh, PrefillSplitQOKVIndptr): replaying under later plans relies on it.
FLASHINFER_WORKSPACE_BYTES = 128 * 1024 * 1024
FLASHINFER_KERNEL_BACKEND = "fa2"


def flashinfer_selected() -> bool:
    """Whether ``GRAPHRT_ATTENTION`` asks for FlashInfer."""
    return requested_attention() == "flashinfer"


class PagedLayout(NamedTuple):
    """A step as FlashInfer's paged arrays (int32, on the host)."""

    qo_indptr: torch.Tensor          # [R + 1]
    kv_indptr: torch.Tensor          # [R + 1]
    kv_indices: torch.Tensor         # [kv_indptr[-1]]
    kv_last_page_len: torch.Tensor   # [R]; 0 for a request without pages


def paged_layout(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 block_size: int) -> PagedLayout:
    """FlashInfer's arrays of a graphrt step (host tensors in, new host tensors out: FlashInfer
    may copy them asynchronously after the staging buffers are rewritten)."""
    seq = seq_lens.to("cpu", torch.int64)
    pages = blocks_for(seq, block_size)
    kv_indptr = torch.zeros(seq.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(pages, 0, out=kv_indptr[1:])
    table = block_table.to("cpu")
    used = torch.arange(table.shape[1]).unsqueeze(0) < pages.unsqueeze(1)     # row-major: each request's pages
    last = torch.where(pages > 0, seq - (pages - 1) * block_size, 0)
    return PagedLayout(query_start_loc.to("cpu", torch.int32, copy=True), kv_indptr.to(torch.int32),
                       table[used].to(torch.int32), last.to(torch.int32))


def padding_layout(num_tokens: int, num_reqs: int, width: int, block_size: int) -> PagedLayout:
    """A plan for a capture or warm-up of pure padding: every token in some request (FlashInfer
    fixes a graph wrapper's most rows at its first plan), each request's context as long as its
    query (at most ``width`` blocks), every page the null block."""
    qo_len = torch.ones(num_reqs, dtype=torch.int64)
    if num_reqs:
        qo_len[0] += max(num_tokens - num_reqs, 0)
        qo_len[num_tokens:] = 0
    pages = blocks_for(qo_len, block_size).clamp(min=1, max=max(width, 1))
    last = (qo_len - (pages - 1) * block_size).clamp(min=1, max=block_size)
    qo, kv = torch.zeros(num_reqs + 1, dtype=torch.int64), torch.zeros(num_reqs + 1, dtype=torch.int64)
    torch.cumsum(qo_len, 0, out=qo[1:])
    torch.cumsum(pages, 0, out=kv[1:])
    return PagedLayout(qo.to(torch.int32), kv.to(torch.int32), torch.zeros(int(kv[-1]), dtype=torch.int32),
                       last.to(torch.int32))


@dataclass
class FlashInferMetadata(TorchAttentionMetadata):
    """graphrt's metadata plus the planned wrapper of each layer signature (the graph of this
    shape reads the wrappers' buffers; ``before_replay`` planned them)."""

    flashinfer_wrappers: dict[PlanSignature, Any] = field(default_factory=dict)


@dataclass
class _WrapperSet:
    """The wrappers of one step shape (or the eager ones), by layer signature."""

    wrappers: dict[PlanSignature, Any]
    planned: bool = False


class FlashInferAttentionBackend(AttentionBackend):
    """Plans FlashInfer for each step outside the graph and hands the layers its wrappers."""

    name = "flashinfer"
    graph_support = AttentionGraphSupport.UNIFORM_BATCH
    refreshed_host_values = ("num_tokens", "num_reqs")
    kv_cache_dtypes = FLOAT_KV_DTYPES          # no k_scale / v_scale are passed: fp8 is refused by name

    def __init__(self, layers: Sequence[torch.nn.Module],
                 workspace_bytes: int = FLASHINFER_WORKSPACE_BYTES) -> None:
        """``layers``: the model's attention layers (graphrt's ``PagedAttention``); the plans
        follow their heads, head size, scale and window."""
        self.layers = list(layers)
        missing = [type(m).__name__ for m in self.layers if not hasattr(m, "num_kv_heads")]
        if not self.layers or missing:
            raise ConfigError(f"{ATTENTION_ENV}=flashinfer runs graphrt's PagedAttention layers; the model's "
                              f"attention layers are {missing or 'none'}")
        chunked = [i for i, m in enumerate(self.layers) if getattr(m, "attention_chunk", 0)]
        if chunked:
            raise ConfigError(f"{ATTENTION_ENV}=flashinfer: attention layers {chunked} attend within chunks "
                              f"(attention_chunk), which graphrt's FlashInfer plans do not express; use "
                              f"{ATTENTION_ENV}=reference or auto")
        self.signatures = sorted({plan_signature(m.num_heads, m.num_kv_heads, m.head_dim, m.scale,
                                                 m.sliding_window) for m in self.layers})
        self.workspace_bytes = int(workspace_bytes)
        self.device: torch.device | None = None
        self._workspace: torch.Tensor | None = None
        self._graph_sets: dict[tuple[int, int], _WrapperSet] = {}    # per captured (tokens, requests)
        self._eager: _WrapperSet | None = None
        self._fresh: tuple[tuple[int, int], _WrapperSet] | None = None  # planned by before_replay

    def setup(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        """Nothing keyed (every length is planned per step); refuses a device FlashInfer cannot run on."""
        problem = flashinfer_unavailable_reason(device)
        if problem is not None:
            raise ConfigError(f"{ATTENTION_ENV}=flashinfer, but FlashInfer cannot run: {problem}")
        self.device = torch.device(device)
        return ()

    # ---- wrappers -----------------------------------------------------------------------
    def _new_set(self, shape: tuple[int, int] | None, width: int) -> _WrapperSet:
        flashinfer = importlib.import_module("flashinfer")
        if self._workspace is None:
            self._workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=self.device)
        graph: dict[str, Any] = {}
        if shape is not None:       # fixed buffers a graph reads; shared: every plan writes the same
            r = shape[1]
            ints = dict(dtype=torch.int32, device=self.device)
            graph = dict(use_cuda_graph=True, qo_indptr_buf=torch.zeros(r + 1, **ints),
                         paged_kv_indptr_buf=torch.zeros(r + 1, **ints),
                         paged_kv_indices_buf=torch.zeros(max(r * width, 1), **ints),
                         paged_kv_last_page_len_buf=torch.zeros(r, **ints))
        return _WrapperSet({sig: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend=FLASHINFER_KERNEL_BACKEND, **graph) for sig in self.signatures})

    def _plan(self, wset: _WrapperSet, layout: PagedLayout, block_size: int) -> bool:
        """Plan every wrapper of ``wset`` for ``layout``; False while the KV cache is unassigned."""
        cache = getattr(self.layers[0], "kv_cache", None)
        if cache is None:
            return False
        if is_fp8(cache.dtype):
            raise ConfigError(f"{ATTENTION_ENV}=flashinfer: the KV cache is {cache.dtype}, and graphrt's "
                              "FlashInfer adapter runs float caches only (use kv_cache_dtype='auto')")
        for sig, wrapper in wset.wrappers.items():
            wrapper.plan(layout.qo_indptr, layout.kv_indptr, layout.kv_indices, layout.kv_last_page_len,
                         sig.num_qo_heads, sig.num_kv_heads, sig.head_dim, block_size, causal=True,
                         sm_scale=sig.scale, window_left=sig.window_left, q_data_type=cache.dtype,
                         kv_data_type=cache.dtype)
        wset.planned = True
        return True

    # ---- the seam -------------------------------------------------------------------------
    def before_replay(self, step: StepTensors, host: HostValues) -> None:
        """Plan this step (outside any graph): the wrappers of its shape's graph where one was
        captured, else the eager ones."""
        shape = (int(host.num_tokens), int(host.num_reqs))
        src = step.on_host or step
        wset = self._graph_sets.get(shape)
        if wset is None:
            wset = self._eager = self._eager or self._new_set(None, step.block_table.shape[1])
        layout = paged_layout(src.query_start_loc, src.seq_lens, src.block_table, step.block_size)
        self._fresh = (shape, wset) if self._plan(wset, layout, step.block_size) else None

    def build_for_capture(self, step: StepTensors, host: HostValues) -> FlashInferMetadata:
        """A capture's metadata: its shape's wrappers, planned once with padding before the
        capture (plan() must not be captured: the capture's warm-up plans them)."""
        shape = (step.slot_mapping.shape[0], step.seq_lens.shape[0])
        wset = self._graph_sets.get(shape)
        if wset is None:
            wset = self._graph_sets[shape] = self._new_set(shape, step.block_table.shape[1])
        if not wset.planned:
            if self.device is not None and self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise GraphCaptureError(f"attention backend 'flashinfer': the graph of {shape[0]} tokens and "
                                        f"{shape[1]} requests was captured before FlashInfer was planned for it "
                                        "(captures must be warmed up first)")
            self._plan(wset, padding_layout(*shape, step.block_table.shape[1], step.block_size), step.block_size)
        return self._metadata(step, wset)

    def build(self, step: StepTensors, host: HostValues) -> FlashInferMetadata:
        """An eager run's or a replay's metadata: after ``before_replay`` the wrappers it planned;
        else the eager ones, planned with padding."""
        shape = (step.slot_mapping.shape[0], step.seq_lens.shape[0])
        if self._fresh is not None and self._fresh[0] == shape:
            wset = self._fresh[1]
        else:
            wset = self._eager = self._eager or self._new_set(None, step.block_table.shape[1])
            self._plan(wset, padding_layout(*shape, step.block_table.shape[1], step.block_size), step.block_size)
        return self._metadata(step, wset)

    def _metadata(self, step: StepTensors, wset: _WrapperSet) -> FlashInferMetadata:
        self._fresh = None
        base = TorchAttentionMetadata.build(step.slot_mapping, step.query_start_loc, step.seq_lens, step.block_table,
                                            step.block_size)
        return FlashInferMetadata(base.slot_mapping, base.query_start_loc, base.seq_lens, base.block_table,
                                  base.token_req_idx, base.block_size, self.attend,
                                  flashinfer_wrappers=dict(wset.wrappers))

    def attend(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """FlashInfer's kernel with the wrappers this step's metadata holds."""
        return paged_attend("flashinfer", layer, q, k, v)


__all__ = ["FlashInferAttentionBackend", "FlashInferMetadata", "PagedLayout", "flashinfer_selected", "padding_layout",
           "paged_layout"]
