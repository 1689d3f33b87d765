"""Paged attention in plain torch: the reference kernel of graphrt's torch models.

Capture-safe: static shapes, no host syncs, no boolean-mask indexing, no branches on tensor
values; masked entries are removed with ``torch.where`` so stale NaN cache rows never leak.

KV cache layout (one tensor per attention layer)::

    kv_cache: [2, num_blocks * block_size + 1, num_kv_heads, head_dim]   # 0 = K, 1 = V

Slot ``s`` is row ``s``; the last row is the trash row padding writes and nothing reads. The
kernel is also the custom op ``graphrt::paged_attention`` (opaque to Dynamo and the piecewise
splitter). Kernel choice (``GRAPHRT_ATTENTION``) and options: docs/attention.md, "graphrt's
kernels".
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from graphrt.core.errors import ConfigError
from graphrt.core.graph_modes import AttentionGraphSupport
from graphrt.models.torch.forward_context import get_forward_context
from graphrt.models.torch.kv_quant import dequantize_kv, is_fp8, quantize_kv, read_kv_rows, write_kv_rows

logger = logging.getLogger(__name__)

#: Environment variable choosing the kernel: ``auto`` (default), ``reference``, ``triton``,
#: ``flashinfer`` or ``ascend``.
ATTENTION_ENV = "GRAPHRT_ATTENTION"
ATTENTION_CHOICES = ("auto", "reference", "triton", "flashinfer", "ascend")


@dataclass
class TorchAttentionMetadata:
    """Per-step attention inputs shared by every layer, all on the model's device.

    ``T`` and ``R`` come from the shapes: padded tokens have a negative slot, padded requests
    ``seq_len`` 0, a repeated ``query_start_loc`` and a zero block row.
    """

    slot_mapping: torch.Tensor  # int64 [T]; negative = padded token
    query_start_loc: torch.Tensor  # int32 [R + 1], non-decreasing, starts at 0
    seq_lens: torch.Tensor  # int32 [R]; computed + scheduled tokens, 0 for a padded request
    block_table: torch.Tensor  # int32 [R, B]; padded rows are all 0; B covers every request's blocks
    token_req_idx: torch.Tensor  # int64 [T]; request index of each token
    block_size: int
    #: The kernel every layer runs ("triton", "reference", "flashinfer"), chosen once with the
    #: attention backend; "auto": choose per call (:func:`choose_attention_kernel`).
    kernel: str = "auto"

    @classmethod
    def build(
        cls,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        kernel: str = "auto",
    ) -> "TorchAttentionMetadata":
        """Derive ``token_req_idx`` with device ops only (capture-safe); tokens past the last
        real request are clamped onto the last (padded) request."""
        num_tokens = slot_mapping.shape[0]
        num_reqs = seq_lens.shape[0]
        token_ids = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
        req = torch.searchsorted(query_start_loc, token_ids, right=True) - 1
        token_req_idx = req.clamp(0, max(num_reqs - 1, 0)).to(torch.int64)
        return cls(slot_mapping, query_start_loc, seq_lens, block_table, token_req_idx, int(block_size), kernel)


def paged_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any,
                           slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, block_table: torch.Tensor,
                           token_req_idx: torch.Tensor, block_size: int, scale: float,
                           sliding_window: int | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0, *, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Write this step's K/V into ``kv_cache``, then attend causally over each request's blocks.

    ``q [T, Hq*D]``, ``k`` / ``v`` ``[T, Hkv*D]``, ``kv_cache [2, rows, Hkv, D]`` -> ``[T, Hq*D]``.
    GQA without repeating KV. A float cache computes in its dtype; fp8 is dequantized
    (``k_scale`` / ``v_scale``) to float32; scores are float32. For transformers' decoders:
    ``softcap`` (``cap * tanh(scores / cap)``), ``sinks [Hq]`` (a per-head logit joining each
    softmax), and a V head size ``Dv`` with ``kv_cache`` a ``(k [rows, Hkv, D], v [rows, Hkv,
    Dv])`` pair (-> ``[T, Hq*Dv]``).
    """
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_tokens, out_dtype = q.shape[0], q.dtype
    hkv, d, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[2]
    num_heads = q.shape[1] // d
    groups = num_heads // hkv
    fp8 = is_fp8(k_cache.dtype)
    k_scale, v_scale = (k_scale, v_scale) if fp8 else (1.0, 1.0)
    compute = torch.float32 if fp8 else k_cache.dtype

    rows = torch.where(slot_mapping < 0, k_cache.shape[0] - 1, slot_mapping)      # negative: the trash row
    write_kv_rows(k_cache, rows, quantize_kv(k.reshape(num_tokens, hkv, d), k_cache.dtype, k_scale))
    write_kv_rows(v_cache, rows, quantize_kv(v.reshape(num_tokens, hkv, dv), v_cache.dtype, v_scale))

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
    if sliding_window:
        valid = valid & (ctx_pos > token_pos.unsqueeze(1) - int(sliding_window))

    # A column a token may not read gathers the token's own row instead, written just above: rows
    # no token may read can hold anything (NaN too), and there its weight is exactly 0 -- times a
    # finite value. (Cheaper than masking the gathered V: a broadcast mask over [T, L, Hkv, Dv].)
    key_rows = torch.where(valid, key_rows, rows.unsqueeze(1))
    keys = dequantize_kv(read_kv_rows(k_cache, key_rows), compute, k_scale)      # [T, L, Hkv, D]
    values = dequantize_kv(read_kv_rows(v_cache, key_rows), compute, v_scale)    # [T, L, Hkv, Dv]
    q = q.reshape(num_tokens, hkv, groups, d).to(compute)
    # One batched matmul per KV head over strided views of the gathered rows (an einsum over
    # [T, L, Hkv, D] copies them into its own layout first).
    scores = torch.stack([torch.bmm(q[:, h], keys[:, :, h].transpose(1, 2)) for h in range(hkv)], 1)
    scores = scores.float() * scale                                               # [T, Hkv, g, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    score_mask = valid[:, None, None, :]
    scores = torch.where(score_mask, scores, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, hkv, groups, 1).expand(num_tokens, hkv, groups, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = torch.where(score_mask, probs, 0.0)
    probs = probs.to(values.dtype)
    out = torch.stack([torch.bmm(probs[:, h], values[:, :, h]) for h in range(hkv)], 1)   # [T, Hkv, g, Dv]
    return out.reshape(num_tokens, num_heads * dv).to(out_dtype)


class AttentionChoice(NamedTuple):
    """Which kernel graphrt's attention runs for a call (``"triton"`` or ``"reference"``), and why."""

    kernel: str
    reason: str


_LOGGED_FALLBACKS: set[str] = set()


def requested_attention() -> str:
    """``GRAPHRT_ATTENTION``, checked: one of :data:`ATTENTION_CHOICES` (unset: ``auto``); read
    once, when a runner chooses its attention (ConfigError for another value)."""
    choice = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if choice not in ATTENTION_CHOICES:
        raise ConfigError(f"{ATTENTION_ENV}={choice!r}: expected one of {ATTENTION_CHOICES}")
    return choice


def choose_attention_kernel(device: torch.device | str, head_dim: int, q_dtype: torch.dtype,
                            cache_dtype: torch.dtype) -> AttentionChoice:
    """The kernel paged attention runs for these tensors under ``GRAPHRT_ATTENTION``: called
    once per runner, and per call only for ``kernel="auto"``. Raises ``ConfigError`` for an
    unknown value, or for ``triton`` where it cannot run."""
    choice = requested_attention()
    if choice in ("reference", "ascend"):   # ascend: only metadata without its own ``attend`` gets here
        return AttentionChoice("reference", f"{ATTENTION_ENV}={choice}")
    device = torch.device(device)
    if choice == "flashinfer":          # models/torch/flashinfer_attention.py: its backend plans the steps
        from graphrt.models.torch.flashinfer_kernel import flashinfer_unavailable_reason

        problem = flashinfer_unavailable_reason(device)
        if problem is not None:
            raise ConfigError(f"{ATTENTION_ENV}=flashinfer, but FlashInfer cannot run: {problem}")
        return AttentionChoice("flashinfer", f"{ATTENTION_ENV}=flashinfer")
    if choice == "auto" and device.type != "cuda":
        return AttentionChoice("reference", f"tensors on {device.type}; Triton is the default on cuda only")
    from graphrt.models.torch import triton_attention

    problem = (triton_attention.triton_unavailable_reason(device)
               or triton_attention.triton_config_problem(head_dim, q_dtype, cache_dtype, device))
    if problem is None:
        return AttentionChoice("triton", f"{ATTENTION_ENV}={choice}, Triton runs on {device.type}")
    if choice == "triton":
        raise ConfigError(f"{ATTENTION_ENV}=triton, but the Triton kernel cannot run: {problem}")
    if problem not in _LOGGED_FALLBACKS:
        _LOGGED_FALLBACKS.add(problem)
        logger.warning("paged attention on %s uses the reference kernel: %s", device, problem)
    return AttentionChoice("reference", problem)


def run_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_table: torch.Tensor, token_req_idx: torch.Tensor, block_size: int, scale: float,
                        sliding_window: int | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0, kernel: str = "auto") -> torch.Tensor:
    """:func:`paged_attention_kernel`'s contract, run by ``kernel`` (the one its attention backend
    chose); ``"auto"``: the one :func:`choose_attention_kernel` picks for these tensors."""
    if kernel == "auto":
        kernel = choose_attention_kernel(q.device, kv_cache.shape[-1], q.dtype, kv_cache.dtype).kernel
    if kernel == "triton":
        from graphrt.models.torch.triton_attention import triton_paged_attention as run
    elif kernel == "flashinfer":
        from graphrt.models.torch.flashinfer_kernel import flashinfer_paged_attention as run
    else:
        run = paged_attention_kernel
    return run(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table, token_req_idx,
                  block_size, scale, sliding_window, k_scale, v_scale)


@torch.library.custom_op("graphrt::paged_attention", mutates_args=("kv_cache",))
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, token_req_idx: torch.Tensor, block_size: int,
                    scale: float, sliding_window: int = 0, k_scale: float = 1.0,
                    v_scale: float = 1.0, kernel: str = "auto") -> torch.Tensor:
    """``torch.ops.graphrt.paged_attention``: :func:`run_paged_attention` as one opaque op."""
    return run_paged_attention(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table,
                               token_req_idx, block_size, scale, sliding_window, k_scale, v_scale, kernel)


@paged_attention.register_fake
def _paged_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                          seq_lens: torch.Tensor, block_table: torch.Tensor,
                          token_req_idx: torch.Tensor, block_size: int, scale: float,
                          sliding_window: int = 0, k_scale: float = 1.0, v_scale: float = 1.0,
                          kernel: str = "auto") -> torch.Tensor:
    return torch.empty_like(q)


#: The registered op, for graph passes that look for it (the piecewise splitter).
PAGED_ATTENTION_OP = torch.ops.graphrt.paged_attention.default


class PagedAttention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends causally over it.

    ``kv_cache`` is a plain attribute the runner assigns once the cache is allocated.
    ``graph_support`` declares what the kernel can run in FULL graphs; ``graphrt_attention``
    marks the module as a PIECEWISE split point. Other attention backends set their own values.
    """

    graph_support: ClassVar[AttentionGraphSupport] = AttentionGraphSupport.ALWAYS
    graphrt_attention: ClassVar[bool] = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ConfigError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if sliding_window is not None and sliding_window < 0:
            raise ConfigError(f"sliding_window must be None or >= 0, got {sliding_window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window = int(sliding_window or 0)
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)
        self.kv_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [T, Hq*D]``, ``k``/``v`` ``[T, Hkv*D]`` -> ``[T, Hq*D]``."""
        meta: TorchAttentionMetadata = get_forward_context()
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("PagedAttention.kv_cache is not set: the runner must assign the KV cache")
        attend = getattr(meta, "attend", None)
        if attend is not None:             # a backend's own kernel (ascend_attention.py)
            return attend(self, q, k, v)
        kernel = paged_attention if torch.compiler.is_compiling() else run_paged_attention
        return kernel(q, k, v, cache, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                      meta.block_table, meta.token_req_idx, meta.block_size, self.scale,
                      self.sliding_window, self.k_scale, self.v_scale, getattr(meta, "kernel", "auto"))
