"""Paged attention in plain torch: the reference kernel of graphrt's torch models.

Capture-safe: static shapes, no host syncs, no boolean-mask indexing, branches on shapes only
(never on tensor values); a context column a token may not read is gathered from a row this
step wrote, so stale (even NaN) cache rows never leak.

KV cache layout (one tensor per attention layer)::

    kv_cache: [2, num_blocks * block_size + 1, num_kv_heads, head_dim]   # 0 = K, 1 = V

Slot ``s`` is row ``s``; the last row is the trash row padding writes and nothing reads. The
kernel is also the custom op ``graphrt::paged_attention`` (opaque to Dynamo and the piecewise
splitter). Kernel choice (``GRAPHRT_ATTENTION``) and options: docs/attention.md, "graphrt's
kernels".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple, Optional

import torch
from torch import nn

from graphrt.core import defaults
from graphrt.core.attention_decl import requested_kernel
from graphrt.core.errors import ConfigError
from graphrt.core.graph_modes import AttentionGraphSupport
from graphrt.layers.torch.forward_context import get_forward_context
from graphrt.layers.torch.attention.kv_quant import dequantize_kv, is_fp8, quantize_kv, write_kv_rows

logger = logging.getLogger(__name__)

#: Environment variable choosing the kernel: ``auto`` (default) or a kernel the selector
#: registers (graphrt's: ``reference``, ``triton``, ``flashinfer``, ``ascend``; selector.py).
ATTENTION_ENV = defaults.ATTENTION_ENV
#: graphrt's own kernels' names (the selector registers them, and may register more).
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
    #: What every graphrt attention layer calls, ``attend(layer, q, k, v)``: the attention
    #: backend's kernel, fixed when the backend was set up (its ``attend``); metadata built
    #: without a backend runs the reference kernel.
    attend: Callable[..., torch.Tensor] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.attend is None:
            self.attend = reference_attend

    @classmethod
    def build(
        cls,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        attend: Callable[..., torch.Tensor] | None = None,
    ) -> "TorchAttentionMetadata":
        """Derive ``token_req_idx`` with device ops only (capture-safe); tokens past the last
        real request are clamped onto the last (padded) request."""
        num_tokens = slot_mapping.shape[0]
        num_reqs = seq_lens.shape[0]
        token_ids = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
        req = torch.searchsorted(query_start_loc, token_ids, right=True) - 1
        token_req_idx = req.clamp(0, max(num_reqs - 1, 0)).to(torch.int64)
        return cls(slot_mapping, query_start_loc, seq_lens, block_table, token_req_idx, int(block_size), attend)


#: The most query tokens of one request a tile of the reference kernel holds (query_tile).
MAX_QUERY_TILE = 32


def query_tile(num_tokens: int, num_reqs: int) -> int:
    """Query tokens per tile of the reference kernel, from the step's shapes only (graph-safe).

    A tile is up to this many consecutive tokens of one request; the kernel gathers each tile's
    context once for all its tokens and heads. A step of ``T`` tokens and ``R`` requests has at
    most ``T // tile + R`` tiles, each computing ``tile`` rows, so the tile is 1 (one tile per
    token, nothing padded) for decode-like steps, and for prefills the largest power of two up to
    half the mean query length (at most :data:`MAX_QUERY_TILE`): padding then adds at most half
    the rows while the gathered context shrinks by the tile size.
    """
    mean = num_tokens // max(num_reqs, 1)
    if mean < 4:
        return 1
    return min(MAX_QUERY_TILE, 1 << ((mean // 2).bit_length() - 1))


class AttentionPlan(NamedTuple):
    """What the reference kernel reads of a step besides K/V (the same in every layer of a
    window): ``N`` query tiles of ``tile`` tokens (:func:`query_tile`), each of one request.

    ``tokens [N, tile]``: the step's token at each tile row (clamped into the step); ``live [N,
    tile]``: whether it is a token of the tile's request; ``key_rows [N, L]``: the cache row of
    each context column (a column no row of the tile may read points at the tile's first
    token's row, written this step, so stale or NaN rows are never read); ``masked [N, tile,
    L]``: what the causal (and window) mask hides (``[N, Hkv, tile, L]`` where block-sparse
    attention's selection differs between KV heads: ``sparse.py``); ``rows_of_tokens [T]``: each token's row of
    the flattened tiles (None when ``tile`` is 1: the identity); ``token_live [T]``: whether
    each token of the step belongs to a request (padding does not).
    """

    tile: int
    tokens: torch.Tensor
    live: torch.Tensor
    key_rows: torch.Tensor
    masked: torch.Tensor
    rows_of_tokens: torch.Tensor | None
    token_live: torch.Tensor


def attention_plan(rows: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                   block_table: torch.Tensor, token_req_idx: torch.Tensor, block_size: int,
                   sliding_window: int | None = None, attention_chunk: int = 0) -> AttentionPlan:
    """The step's :class:`AttentionPlan` (device ops only; every shape from the tensors' shapes).

    ``rows [T]``: each token's cache row this step (the trash row for padding). Request ``r``'s
    tiles are numbered from ``query_start_loc[r] // tile + r``, so ``T // tile + R`` tiles hold
    them all; tokens past the last request (padding) fall to the last request's tiles, not live.
    ``attention_chunk`` C > 0: a token at p reads only (p // C) * C .. p (its chunk).
    """
    num_tokens, num_reqs = rows.shape[0], seq_lens.shape[0]
    tile = query_tile(num_tokens, num_reqs)
    device = rows.device
    i64 = torch.int64
    qsl = query_start_loc.to(i64)
    if tile == 1:
        req = token_req_idx
        tokens = torch.arange(num_tokens, device=device, dtype=i64).unsqueeze(1)
        num_tiles = num_tokens
    else:
        first = qsl[:-1] // tile + torch.arange(num_reqs, device=device, dtype=i64)     # [R], ascending
        num_tiles = num_tokens // tile + num_reqs
        n = torch.arange(num_tiles, device=device, dtype=i64)
        req = (torch.searchsorted(first, n, right=True) - 1).clamp(0, max(num_reqs - 1, 0))
        start = qsl.index_select(0, req) + (n - first.index_select(0, req)) * tile
        tokens = start.unsqueeze(1) + torch.arange(tile, device=device, dtype=i64)       # [N, tile]
    q_end = qsl.index_select(0, req + 1).unsqueeze(1)
    seq_len = seq_lens.index_select(0, req).to(i64).unsqueeze(1)                         # [N, 1]
    live = tokens < q_end
    pos = (seq_len - (q_end - tokens)).unsqueeze(2)                                      # [N, tile, 1]
    tokens = tokens.clamp(max=max(num_tokens - 1, 0))

    bs = block_size
    blocks = block_table.index_select(0, req).to(i64)                                    # [N, B]
    ctx_len = blocks.shape[1] * bs
    key_rows = (blocks.unsqueeze(-1) * bs + torch.arange(bs, device=device, dtype=i64)).reshape(num_tiles, ctx_len)
    ctx_pos = torch.arange(ctx_len, device=device, dtype=i64)
    readable = ctx_pos < seq_len                                                         # [N, L]
    valid = readable.unsqueeze(1) & (ctx_pos <= pos) & live.unsqueeze(2)                 # [N, tile, L]
    if sliding_window:
        valid = valid & (ctx_pos > pos - int(sliding_window))
        readable = readable & (ctx_pos > pos[:, 0] - int(sliding_window))
    if attention_chunk:           # a tile's first token starts the earliest chunk of the tile
        chunk = int(attention_chunk)
        valid = valid & (ctx_pos >= pos.div(chunk, rounding_mode="floor") * chunk)
        readable = readable & (ctx_pos >= pos[:, 0].div(chunk, rounding_mode="floor") * chunk)
    if tile == 1:
        readable = valid[:, 0]
    key_rows = torch.where(readable, key_rows, rows.index_select(0, tokens[:, 0]).unsqueeze(1))
    if tile == 1:
        return AttentionPlan(tile, tokens, live, key_rows, ~valid, None, live[:, 0])
    local = torch.arange(num_tokens, device=device, dtype=i64) - qsl.index_select(0, token_req_idx)
    rows_of_tokens = ((first.index_select(0, token_req_idx) + local // tile) * tile + local % tile)
    rows_of_tokens = rows_of_tokens.clamp(0, num_tiles * tile - 1)
    return AttentionPlan(tile, tokens, live, key_rows, ~valid, rows_of_tokens,
                         live.reshape(-1).index_select(0, rows_of_tokens))


def _gather_heads(cache: torch.Tensor, index: torch.Tensor, fp8: bool) -> torch.Tensor:
    """``cache [rows, H, D]`` at ``index [N, H, L]`` (``row * H + head``) -> ``[N * H, L, D]``,
    head-major (the layout the batched matmuls read), one ``index_select`` (``fp8``: as bytes)."""
    rows, heads, dim = cache.shape
    source = cache.view(torch.uint8) if fp8 else cache
    out = source.reshape(rows * heads, dim).index_select(0, index.reshape(-1))
    out = out.view(index.shape[0] * heads, index.shape[2], dim)
    return out.view(cache.dtype) if fp8 else out


def attend_tiles(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan, scale: float,
            compute: torch.dtype, k_scale: float, v_scale: float, softcap: float,
            sinks: torch.Tensor | None, fp8: bool | None = None) -> torch.Tensor:
    """The tiles' attention -> ``[N, tile, Hq, Dv]``: each tile's context gathered once,
    head-major, and every query head of a KV head's group in one batched matmul (GQA by
    reshaping the queries, never repeating K/V); scores and softmax in float32. ``fp8``:
    whether the cache is scaled fp8, as the caller decided it (None: asked here); a float
    cache is read in its own dtype, never through the quantization module.

    With one token per tile (decode) on a CPU and a float cache, ``P @ V`` is one
    ``embedding_bag`` (a weighted sum of cache rows) straight from the cache: the gathered V,
    as large as the context, is never written and read back."""
    num_tiles, tile = plan.tokens.shape
    hkv, d, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[2]
    groups = q.shape[1] // d // hkv
    if fp8 is None:
        fp8 = is_fp8(k_cache.dtype)
    index = plan.key_rows.unsqueeze(1) * hkv + torch.arange(hkv, device=q.device, dtype=torch.int64)[:, None]
    keys = _gather_heads(k_cache, index, fp8)                                            # [N*Hkv, L, D]
    keys = dequantize_kv(keys, compute, k_scale) if fp8 else keys.to(compute)
    ctx_len = keys.shape[1]
    qt = q.reshape(q.shape[0], hkv, groups, d).to(compute)
    if tile > 1:      # [N, tile, Hkv, g, D] -> [N, Hkv, tile, g, D]
        qt = qt.index_select(0, plan.tokens.reshape(-1)).view(num_tiles, tile, hkv, groups, d).transpose(1, 2)
    scores = torch.bmm(qt.reshape(num_tiles * hkv, tile * groups, d), keys.transpose(1, 2))
    scores = scores.mul_(scale) if scores.dtype == torch.float32 else scores.float() * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(num_tiles, hkv, tile, groups, ctx_len)
    # Masked scores are the least finite float, not -inf: exp gives exactly 0 beside any real
    # score, and a row with none (a padded token) stays finite (the caller zeroes it).
    # a mask per KV head [N, Hkv, tile, L] where a block-sparse selection differs between them
    masked = plan.masked[:, None, :, None, :] if plan.masked.dim() == 3 else plan.masked.unsqueeze(3)
    scores = scores.masked_fill_(masked, torch.finfo(torch.float32).min)
    if sinks is not None:
        sink = sinks.float().reshape(1, hkv, 1, groups, 1).expand(num_tiles, hkv, tile, groups, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    if tile == 1 and q.device.type == "cpu" and not fp8:
        bags = index.view(num_tiles, hkv, 1, ctx_len).expand(num_tiles, hkv, groups, ctx_len)
        out = torch.nn.functional.embedding_bag(
            bags.reshape(-1, ctx_len), v_cache.reshape(-1, dv),
            per_sample_weights=probs.to(v_cache.dtype).reshape(-1, ctx_len), mode="sum")
        return out.view(num_tiles, 1, hkv * groups, dv)
    values = _gather_heads(v_cache, index, fp8)                                          # [N*Hkv, L, Dv]
    values = dequantize_kv(values, compute, v_scale) if fp8 else values.to(compute)
    probs = probs.to(values.dtype).reshape(num_tiles * hkv, tile * groups, ctx_len)
    out = torch.bmm(probs, values)                                                       # [N*Hkv, tile*g, Dv]
    return out.view(num_tiles, hkv, tile, groups * dv).transpose(1, 2)


def paged_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any,
                           slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, block_table: torch.Tensor,
                           token_req_idx: torch.Tensor, block_size: int, scale: float,
                           sliding_window: int | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0, *, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None, attention_chunk: int = 0,
                           fp8: bool | None = None) -> torch.Tensor:
    """Write this step's K/V into ``kv_cache``, then attend causally over each request's blocks.

    ``q [T, Hq*D]``, ``k`` / ``v`` ``[T, Hkv*D]``, ``kv_cache [2, rows, Hkv, D]`` -> ``[T, Hq*D]``.
    A float cache computes in its dtype; fp8 is dequantized (``k_scale`` / ``v_scale``) to
    float32. For transformers' decoders: ``softcap`` (``cap * tanh(scores / cap)``), ``sinks
    [Hq]`` (a per-head logit joining each softmax), and a V head size ``Dv`` with ``kv_cache`` a
    ``(k [rows, Hkv, D], v [rows, Hkv, Dv])`` pair (-> ``[T, Hq*Dv]``). ``attention_chunk`` C >
    0: chunked local attention (Llama 4), a token at p attends to (p // C) * C .. p only. Padded
    tokens (past the last request's queries) get zeros. ``fp8``: whether the cache is scaled fp8,
    as its attention backend decided once from the KV cache's dtypes (None: asked here, per call).

    A fixed few ops per call, whatever the head count (docs/attention.md, "The reference
    kernel"): the queries are cut into tiles of :func:`query_tile` tokens of one request
    (:func:`attention_plan`), each tile's context is gathered once for all its tokens and heads,
    and every query head attends in one batched matmul (:func:`attend_tiles`).
    """
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_tokens, out_dtype = q.shape[0], q.dtype
    hkv, d, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[2]
    num_heads = q.shape[1] // d
    if fp8 is None:
        fp8 = is_fp8(k_cache.dtype)
    k_scale, v_scale = (k_scale, v_scale) if fp8 else (1.0, 1.0)
    compute = torch.float32 if fp8 else k_cache.dtype

    rows = torch.where(slot_mapping < 0, k_cache.shape[0] - 1, slot_mapping)      # negative: the trash row
    k, v = k.reshape(num_tokens, hkv, d), v.reshape(num_tokens, hkv, dv)
    if fp8:                     # scaled and written as bytes (kv_quant.py)
        write_kv_rows(k_cache, rows, quantize_kv(k, k_cache.dtype, k_scale))
        write_kv_rows(v_cache, rows, quantize_kv(v, v_cache.dtype, v_scale))
    else:                       # a float cache stores the values in its dtype: nothing to quantize
        k_cache.index_copy_(0, rows, k.to(k_cache.dtype))
        v_cache.index_copy_(0, rows, v.to(v_cache.dtype))

    plan = attention_plan(rows, query_start_loc, seq_lens, block_table, token_req_idx, block_size, sliding_window,
                          attention_chunk)
    out = attend_tiles(q, k_cache, v_cache, plan, scale, compute, k_scale, v_scale, softcap, sinks, fp8)
    return tokens_out(out, plan, num_tokens, num_heads * dv, out_dtype)


def tokens_out(out: torch.Tensor, plan: AttentionPlan, num_tokens: int, width: int,
               out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`attend_tiles`' output as one ``[num_tokens, width]`` row per token, in ``out_dtype``;
    padded tokens read nothing: zeros (finite, whatever their masked rows computed)."""
    if plan.tile == 1:
        out = out.reshape(num_tokens, width)
    else:
        out = out.reshape(-1, width).index_select(0, plan.rows_of_tokens)
    return torch.where(plan.token_live.unsqueeze(1), out, 0.0).to(out_dtype)


class AttentionChoice(NamedTuple):
    """Which kernel graphrt's attention runs for a call (``"triton"`` or ``"reference"``), and why."""

    kernel: str
    reason: str


_LOGGED_FALLBACKS: set[str] = set()


def requested_attention() -> str:
    """``GRAPHRT_ATTENTION`` checked against graphrt's own kernels (:data:`ATTENTION_CHOICES`), for
    a choice made outside the selector (whose parse also takes the kernels registered with it)."""
    return requested_kernel(ATTENTION_CHOICES, "graphrt's torch attention")


def choose_attention_kernel(device: torch.device | str, head_dim: int, q_dtype: torch.dtype,
                            cache_dtype: torch.dtype, requested: str | None = None) -> AttentionChoice:
    """The kernel graphrt's paged backend runs for these tensors under ``requested`` (None:
    ``GRAPHRT_ATTENTION``): called once, by the selector, when a runner is built. Raises
    ``ConfigError`` for an unknown value, or for ``triton`` where it cannot run."""
    choice = requested_attention() if requested is None else requested
    if choice in ("reference", "ascend"):   # ascend: only metadata without its own ``attend`` gets here
        return AttentionChoice("reference", f"{ATTENTION_ENV}={choice}")
    device = torch.device(device)
    if choice == "flashinfer":          # layers/torch/attention/flashinfer_attention.py: its backend plans the steps
        from graphrt.layers.torch.attention.flashinfer_kernel import flashinfer_unavailable_reason

        problem = flashinfer_unavailable_reason(device)
        if problem is not None:
            raise ConfigError(f"{ATTENTION_ENV}=flashinfer, but FlashInfer cannot run: {problem}")
        return AttentionChoice("flashinfer", f"{ATTENTION_ENV}=flashinfer")
    if choice == "auto" and device.type != "cuda":
        return AttentionChoice("reference", f"tensors on {device.type}; Triton is the default on cuda only")
    from graphrt.layers.torch.attention import triton_attention

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


def _triton(*args: Any, fp8: bool | None = None) -> torch.Tensor:
    """The Triton kernel (it checks the cache's dtype with the rest of its launch, per call)."""
    from graphrt.layers.torch.attention.triton_attention import triton_paged_attention

    return triton_paged_attention(*args)


def _flashinfer(*args: Any, fp8: bool | None = None) -> torch.Tensor:
    """The FlashInfer kernel (float caches only: it refuses an fp8 one per call)."""
    from graphrt.layers.torch.attention.flashinfer_kernel import flashinfer_paged_attention

    return flashinfer_paged_attention(*args)


#: graphrt's kernels of :func:`paged_attention_kernel`'s contract, by the name a backend fixed at
#: setup (the name crosses the opaque op ``graphrt::paged_attention`` as a string).
PAGED_KERNELS: dict[str, Callable[..., torch.Tensor]] = {"reference": paged_attention_kernel,
                                                        "triton": _triton, "flashinfer": _flashinfer}


def run_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_table: torch.Tensor, token_req_idx: torch.Tensor, block_size: int, scale: float,
                        sliding_window: int | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0, kernel: str = "reference", attention_chunk: int = 0,
                        fp8: bool | None = None) -> torch.Tensor:
    """:func:`paged_attention_kernel`'s contract, run by ``kernel``: the one of
    :data:`PAGED_KERNELS` its attention backend fixed when it was set up (never chosen here).
    Chunked layers (``attention_chunk``) run the reference kernel only (the selector fixes it).
    ``fp8``: whether the cache is scaled fp8, as the backend decided it (None: the kernel asks)."""
    if attention_chunk:
        if kernel != "reference":
            raise ConfigError(f"attention_chunk {attention_chunk}: chunked local attention runs on graphrt's "
                              f"reference kernel only, not {kernel!r} ({ATTENTION_ENV}=reference)")
        return paged_attention_kernel(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table,
                                      token_req_idx, block_size, scale, sliding_window, k_scale, v_scale,
                                      attention_chunk=attention_chunk, fp8=fp8)
    return PAGED_KERNELS[kernel](q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table,
                                 token_req_idx, block_size, scale, sliding_window, k_scale, v_scale, fp8=fp8)


@torch.library.custom_op("graphrt::paged_attention", mutates_args=("kv_cache",))
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, token_req_idx: torch.Tensor, block_size: int,
                    scale: float, sliding_window: int = 0, k_scale: float = 1.0,
                    v_scale: float = 1.0, impl: str = "reference", attention_chunk: int = 0,
                    fp8: Optional[bool] = None) -> torch.Tensor:
    """``torch.ops.graphrt.paged_attention``: :func:`run_paged_attention` as one opaque op. The
    kernel's name is ``impl``: an op argument named ``kernel`` breaks Inductor's lowering of the
    op (``FallbackKernel.create`` takes a ``kernel`` of its own)."""
    return run_paged_attention(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table,
                               token_req_idx, block_size, scale, sliding_window, k_scale, v_scale, impl,
                               attention_chunk, fp8)


@paged_attention.register_fake
def _paged_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                          seq_lens: torch.Tensor, block_table: torch.Tensor,
                          token_req_idx: torch.Tensor, block_size: int, scale: float,
                          sliding_window: int = 0, k_scale: float = 1.0, v_scale: float = 1.0,
                          impl: str = "reference", attention_chunk: int = 0,
                          fp8: Optional[bool] = None) -> torch.Tensor:
    return torch.empty_like(q)


#: The registered op, for graph passes that look for it (the piecewise splitter).
PAGED_ATTENTION_OP = torch.ops.graphrt.paged_attention.default


def paged_attend(kernel: str, layer: "PagedAttention", q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, fp8: bool | None = None) -> torch.Tensor:
    """``layer``'s attention by graphrt's paged ``kernel`` (a :data:`PAGED_KERNELS` name) over the
    step's metadata (the forward context); under torch.compile as the opaque op. ``fp8``: whether
    the KV caches are scaled fp8, as the backend decided once (None: the kernel asks per call)."""
    meta = get_forward_context()
    cache = layer.kv_cache
    if cache is None:
        raise RuntimeError(f"{type(layer).__name__}.kv_cache is not set: the runner must assign the KV cache")
    run = paged_attention if torch.compiler.is_compiling() else run_paged_attention
    return run(q, k, v, cache, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_table,
               meta.token_req_idx, meta.block_size, layer.scale, layer.sliding_window, layer.k_scale,
               layer.v_scale, kernel, getattr(layer, "attention_chunk", 0), fp8)


def reference_attend(layer: "PagedAttention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference kernel's ``attend``: what metadata built without a backend runs."""
    return paged_attend("reference", layer, q, k, v)


class PagedAttention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends causally over it.

    ``kv_cache`` is a plain attribute the runner assigns once the cache is allocated.
    ``graph_support`` declares what the kernel can run in FULL graphs; ``graphrt_attention``
    marks the module as a PIECEWISE split point. Other attention backends set their own values.
    """

    graph_support: ClassVar[AttentionGraphSupport] = AttentionGraphSupport.ALWAYS
    graphrt_attention: ClassVar[bool] = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                 attention_chunk: int = 0) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ConfigError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if sliding_window is not None and sliding_window < 0:
            raise ConfigError(f"sliding_window must be None or >= 0, got {sliding_window}")
        if attention_chunk < 0 or (attention_chunk and sliding_window):
            raise ConfigError(f"attention_chunk must be >= 0 and not beside a sliding window, got "
                              f"{attention_chunk} (sliding_window {sliding_window})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window = int(sliding_window or 0)
        #: Chunked local attention (0: none): a token at p attends to (p // C) * C .. p.
        self.attention_chunk = int(attention_chunk)
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)
        self.kv_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [T, Hq*D]``, ``k``/``v`` ``[T, Hkv*D]`` -> ``[T, Hq*D]``: the kernel the step's
        attention backend fixed at setup (the metadata's ``attend``)."""
        if self.kv_cache is None:
            raise RuntimeError("PagedAttention.kv_cache is not set: the runner must assign the KV cache")
        return get_forward_context().attend(self, q, k, v)
