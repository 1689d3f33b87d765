"""Paged attention in Triton: graphrt's default attention on CUDA.

:func:`triton_paged_attention` has the contract of the reference
:func:`graphrt.layers.torch.attention.paged.paged_attention_kernel` (decode, chunked prefill and mixed
batches, GQA, sliding window, fp8 KV). Everything data-dependent is read on the device; the grid
and host-side choices follow tensor shapes only, so the call is capturable and replays correctly.

Kernels in :mod:`graphrt.layers.torch.attention.triton_attention_kernels`; their design (GQA tiles,
split-KV, fp8) is on docs/attention.md, "The Triton kernel's design". CPU tensors run through
Triton's interpreter only when ``TRITON_INTERPRET=1`` was set before importing triton, each launch
one op that recording graphs replay (:func:`graphrt.layers.torch.triton_launch.interpreted`).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, NamedTuple

import torch

from graphrt.core.errors import ConfigError
from graphrt.layers.torch.attention.kv_quant import KV_CACHE_DTYPES, is_fp8, quantize_kv
from graphrt.layers.torch.triton_launch import interpreted

try:  # optional: graphrt imports, and the reference kernel runs, without triton
    import triton
    import triton.language as tl
except ImportError as _exc:  # pragma: no cover - depends on the environment
    triton = tl = None
    _IMPORT_PROBLEM: str | None = f"triton does not import ({_exc})"
else:
    _IMPORT_PROBLEM = None

# ---- tuning constants ---------------------------------------------------------------------
#: Rows (query tokens x grouped heads) of one tile when every request has about one token
#: (at most ``DECODE_TOKENS_PER_REQUEST`` per request on average): tl.dot's smallest M.
DECODE_ROWS = 16
DECODE_TOKENS_PER_REQUEST = 2
#: Rows of one tile otherwise (prefill, mixed batches); the second value for head_dim > 128.
PREFILL_ROWS = 64
PREFILL_ROWS_WIDE = 32
#: Keys per KV tile: this many bytes of one K tile in the dot dtype, between 16 and 64 keys.
KV_TILE_BYTES = 64 * 128 * 2
MIN_TILE_KEYS, MAX_TILE_KEYS = 16, 64
#: (num_warps, num_stages) of the attention kernel: decode tiles, prefill tiles; the fallback
#: when a configuration runs out of shared memory or registers on this GPU.
DECODE_LAUNCH = (4, 3)
PREFILL_LAUNCH = (4, 2)
FALLBACK_LAUNCH = (4, 1)
#: A float32 dot (IEEE, the float32 cache's) runs on the FMA units with its operands in registers,
#: not on tensor cores, so its tiles are smaller: K tiles of this many bytes, prefill tiles of these
#: rows (head_dim <= 128, wider), and eight warps for every tile. The bf16 sizes spilled 13-17 KB
#: a thread at prefill and 1.3 KB at decode on sm_89 / sm_90; these spill at most a few dozen bytes
#: at head sizes 16-256 and GQA 1-32 on sm_80 / 89 / 90 (``make compile-check``).
IEEE_KV_TILE_BYTES = 16 * 128 * 4
IEEE_PREFILL_ROWS, IEEE_PREFILL_ROWS_WIDE = 32, 16
IEEE_LAUNCH = (8, 2)
#: Split-KV: aim for this many programs per SM before splitting; at most this many splits;
#: no split shorter than this many keys of the block table's reach.
PROGRAMS_PER_SM = 2
MAX_SPLITS = 32
MIN_KEYS_PER_SPLIT = 128
#: K/V write kernel: elements of a row copied per program.
STORE_BLOCK = 1024
#: Head sizes the kernel takes (powers of two: tl.arange and tl.dot tiles).
HEAD_DIMS = (16, 32, 64, 128, 256)
#: Query / output dtypes the kernel takes.
QUERY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_LOG2E = math.log2(math.e)
_INTERPRET_ENV = "TRITON_INTERPRET"
#: Integer arguments that change every step or bucket: never compile a variant per value.
_DYNAMIC_ARGS = ("num_tokens", "num_reqs", "num_blocks", "table_width", "window", "num_splits",
                 "search_steps")


class TritonPlan(NamedTuple):
    """The host-side choices of one call, all from shapes: tile rows, tokens per tile, keys
    per KV tile, KV splits, launch configuration, and the dtype of ``tl.dot``."""

    block_q: int
    block_m: int
    tile_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    dot_dtype: torch.dtype


def _interpreting() -> bool:
    return os.environ.get(_INTERPRET_ENV, "0") == "1"


def triton_unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """Why :func:`triton_paged_attention` cannot run on ``device`` here (None: it can).

    CUDA needs triton and compute capability >= 8.0; other devices need ``TRITON_INTERPRET=1``
    set before triton's first import. ``device=None``: CUDA when a GPU is present, else CPU.
    """
    if _IMPORT_PROBLEM is not None:
        return _IMPORT_PROBLEM
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_problem(device.index if device.index is not None else torch.cuda.current_device())
    if not _interpreting():
        return (f"tensors on {device.type}: the Triton kernel runs on CUDA GPUs, elsewhere only "
                f"through Triton's interpreter ({_INTERPRET_ENV}=1)")
    if isinstance(tl.zeros, triton.runtime.jit.JITFunction):
        return (f"{_INTERPRET_ENV}=1 was set after triton was imported; Triton's interpreter needs it "
                f"set before the first import of triton in the process")
    return None


@functools.lru_cache(maxsize=None)
def _cuda_problem(index: int) -> str | None:
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    major, minor = torch.cuda.get_device_capability(index)
    if major < 8:
        return f"the Triton kernel needs compute capability 8.0 or newer; cuda:{index} has {major}.{minor}"
    return None


def triton_config_problem(head_dim: int, q_dtype: torch.dtype, cache_dtype: torch.dtype,
                          device: torch.device | str | None = None) -> str | None:
    """Why the kernel does not take this head size / dtype combination (None: it does)."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {HEAD_DIMS}"
    if q_dtype not in QUERY_DTYPES:
        return f"query dtype {q_dtype} is not one of {QUERY_DTYPES}"
    if cache_dtype not in KV_CACHE_DTYPES:
        return f"KV cache dtype {cache_dtype} is not one of {KV_CACHE_DTYPES}"
    if cache_dtype == torch.float8_e4m3fn and device is not None and torch.device(device).type == "cuda":
        if torch.cuda.get_device_capability(torch.device(device)) < (8, 9):
            return "an float8_e4m3fn KV cache needs compute capability 8.9 or newer"
    return None


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _prev_pow2(n: int) -> int:
    return 1 << max(1, int(n)).bit_length() - 1


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan_attention(num_tokens: int, num_reqs: int, num_kv_heads: int, groups: int, head_dim: int,
                   dot_dtype: torch.dtype, table_width: int, block_size: int,
                   device: torch.device | str = "cuda", num_splits: int | None = None) -> TritonPlan:
    """The tiling of one call, from shapes only (see the module docstring)."""
    groups_pad = _next_pow2(groups)
    decode = num_tokens <= DECODE_TOKENS_PER_REQUEST * num_reqs
    ieee = dot_dtype == torch.float32
    rows = DECODE_ROWS if decode else (PREFILL_ROWS if head_dim <= 128 else PREFILL_ROWS_WIDE)
    if ieee and not decode:
        rows = IEEE_PREFILL_ROWS if head_dim <= 128 else IEEE_PREFILL_ROWS_WIDE
    block_m = max(rows, groups_pad)
    block_q = block_m // groups_pad
    itemsize = dot_dtype.itemsize
    tile_bytes = IEEE_KV_TILE_BYTES if ieee else KV_TILE_BYTES
    tile_n = min(MAX_TILE_KEYS, max(MIN_TILE_KEYS, _prev_pow2(tile_bytes // (head_dim * itemsize))))
    if num_splits is None:
        num_splits = 1
        device = torch.device(device)
        if device.type == "cuda":
            tiles = min(num_tokens, num_tokens // block_q + num_reqs)
            want = PROGRAMS_PER_SM * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
            reach = max(1, table_width * block_size // MIN_KEYS_PER_SPLIT)
            if tiles * num_kv_heads < want:
                num_splits = min(MAX_SPLITS, _next_pow2(-(-want // (tiles * num_kv_heads))),
                                 _prev_pow2(reach))
    if num_splits < 1:
        raise ConfigError(f"num_splits must be >= 1, got {num_splits}")
    warps, stages = IEEE_LAUNCH if ieee else (DECODE_LAUNCH if decode else PREFILL_LAUNCH)
    return TritonPlan(block_q, block_m, tile_n, int(num_splits), warps, stages, dot_dtype)


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool) -> tuple[Any, Any, Any]:
    """(store, attention, combine), compiled with triton.jit or wrapped by the interpreter."""
    from graphrt.layers.torch.attention import triton_attention_kernels as src

    fns = (src.kv_store_kernel, src.attention_kernel, src.combine_kernel)
    if interpret:
        return tuple(interpreted(fn) for fn in fns)
    dynamic = lambda fn: [a for a in _DYNAMIC_ARGS if a in fn.__code__.co_varnames]  # noqa: E731
    return tuple(triton.jit(fn, do_not_specialize=dynamic(fn)) for fn in fns)


#: (kernel id, constexpr key) -> the launch configuration that worked, after a fallback.
_LAUNCH_FALLBACKS: dict[tuple[Any, ...], tuple[int, int]] = {}


def _launch(kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], consts: dict[str, Any],
            launch: tuple[int, int]) -> None:
    """Launch; if this GPU runs out of resources for ``launch``, use ``FALLBACK_LAUNCH`` from
    then on for the same constants (found at the first, eager call, before any capture)."""
    key = (id(kernel), tuple(sorted((k, str(v)) for k, v in consts.items()))) if _LAUNCH_FALLBACKS else None
    warps, stages = _LAUNCH_FALLBACKS.get(key, launch) if key else launch
    try:
        kernel[grid](*args, **consts, num_warps=warps, num_stages=stages)
    except triton.runtime.errors.OutOfResources:
        if (warps, stages) == FALLBACK_LAUNCH:
            raise
        _LAUNCH_FALLBACKS[(id(kernel), tuple(sorted((k, str(v)) for k, v in consts.items())))] = FALLBACK_LAUNCH
        kernel[grid](*args, **consts, num_warps=FALLBACK_LAUNCH[0], num_stages=FALLBACK_LAUNCH[1])


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as an integer tensor of the same element size (bit-exact copies)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def triton_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           block_table: torch.Tensor, token_req_idx: torch.Tensor | None, block_size: int,
                           scale: float, sliding_window: int | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0, num_splits: int | None = None) -> torch.Tensor:
    """Write this step's K/V into ``kv_cache``, then attend causally over each request's blocks.

    Arguments as the reference kernel's (no ``token_req_idx``); ``sliding_window`` (None or 0:
    none) lets position ``p`` see ``p - sliding_window + 1 .. p``; ``k_scale`` / ``v_scale``:
    fp8 per-tensor scales; ``num_splits`` overrides split-KV (tests). Returns ``[T, Hq * D]`` in
    ``q``'s dtype; padded tokens get zeros.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[0] != 2:
        raise ConfigError(f"kv_cache must be [2, rows, kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    num_tokens, hkv, head_dim = q.shape[0], kv_cache.shape[2], kv_cache.shape[3]
    problem = triton_unavailable_reason(q.device) or triton_config_problem(head_dim, q.dtype, kv_cache.dtype,
                                                                           q.device)
    if problem:
        raise ConfigError(f"Triton paged attention: {problem}")
    if q.dim() != 2 or q.shape[1] % head_dim or (q.shape[1] // head_dim) % hkv:
        raise ConfigError(f"q {tuple(q.shape)} is not [T, num_heads * {head_dim}] with num_heads a "
                          f"multiple of {hkv} KV heads")
    if block_size < 1 or (kv_cache.shape[1] - 1) % block_size or kv_cache.shape[1] <= block_size:
        raise ConfigError(f"kv_cache has {kv_cache.shape[1]} rows: not num_blocks * {block_size} + 1")
    if kv_cache.stride(3) != 1 or kv_cache.stride(2) != head_dim:
        raise ConfigError("kv_cache rows must be contiguous [kv_heads, head_dim]")
    window = int(sliding_window or 0)
    if window < 0:
        raise ConfigError(f"sliding_window must be None or >= 0, got {sliding_window}")
    groups = q.shape[1] // head_dim // hkv
    num_reqs, table_width = seq_lens.shape[0], block_table.shape[1]
    fp8 = is_fp8(kv_cache.dtype)
    k_scale, v_scale = (float(k_scale), float(v_scale)) if fp8 else (1.0, 1.0)

    out = torch.empty(num_tokens, q.shape[1], dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    interpret = q.device.type != "cuda"
    store, attend, combine = _kernels(interpret)
    width = hkv * head_dim
    new_k = _as_bits(quantize_kv(k.reshape(num_tokens, width), kv_cache.dtype, k_scale))
    new_v = _as_bits(quantize_kv(v.reshape(num_tokens, width), kv_cache.dtype, v_scale))
    if new_k.stride(1) != 1:
        new_k = new_k.contiguous()
    if new_v.stride(1) != 1:
        new_v = new_v.contiguous()
    cache_bits = _as_bits(kv_cache)
    row_stride = kv_cache.stride(1)
    block = min(STORE_BLOCK, _next_pow2(width))
    store[(num_tokens, -(-width // block))](new_k, new_v, new_k.stride(0), new_v.stride(0), cache_bits[0],
                                            cache_bits[1], row_stride, slot_mapping, kv_cache.shape[1] - 1,
                                            WIDTH=width, BLOCK=block)
    if num_reqs == 0:
        return out.zero_()

    # tl.dot operands: the cache's dtype for float caches (the reference casts q to it), the
    # query's for fp8. The interpreter multiplies bf16 as raw integers, so it gets float32.
    dot_dtype = q.dtype if fp8 else kv_cache.dtype
    if interpret and dot_dtype == torch.bfloat16:
        dot_dtype = torch.float32
    plan = plan_attention(num_tokens, num_reqs, hkv, groups, head_dim, dot_dtype, table_width, block_size,
                          q.device, num_splits)
    splits = plan.num_splits
    if splits > 1:
        part_acc = torch.empty(splits, num_tokens, hkv * groups, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(splits, num_tokens, hkv * groups, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = torch.empty(2, dtype=torch.float32, device=q.device)
    tiles = -(-num_tokens // plan.block_q) + num_reqs
    num_blocks = (kv_cache.shape[1] - 1) // block_size
    q_scale = float(scale) * k_scale * _LOG2E
    args = (q, q.stride(0), kv_cache[0], kv_cache[1], row_stride, out, out.stride(0), part_acc, part_ml,
            query_start_loc, seq_lens, block_table, block_table.stride(0), num_tokens, num_reqs, num_blocks,
            table_width, q_scale, v_scale, window, splits, max(1, num_reqs.bit_length()))
    consts = dict(GROUPS=groups, GROUPS_PAD=_next_pow2(groups), HEAD_DIM=head_dim, BLOCK_Q=plan.block_q,
                  BLOCK_M=plan.block_m, TILE_N=plan.tile_n, BLOCK_SIZE=block_size,
                  DOT_DTYPE=_TL_DTYPES[dot_dtype], IEEE=dot_dtype == torch.float32, WINDOWED=window > 0)
    _launch(attend, (tiles, hkv, splits), args, consts, (plan.num_warps, plan.num_stages))
    if splits > 1:
        combine[(num_tokens, hkv * groups)](part_acc, part_ml, out, out.stride(0), num_tokens, splits, v_scale,
                                            HEAD_DIM=head_dim, num_warps=1)
    return out


_TL_DTYPES: dict[torch.dtype, Any] = ({} if tl is None else
                                     {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                                      torch.float32: tl.float32})

__all__ = ["TritonPlan", "plan_attention", "triton_config_problem", "triton_paged_attention",
           "triton_unavailable_reason"]
