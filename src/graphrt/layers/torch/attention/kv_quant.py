"""How K/V values are stored in a KV cache of a given dtype: one definition for every kernel.

A float cache (bf16 / fp16 / fp32) stores ``x.to(cache dtype)``: a kernel that asked
:func:`is_fp8` once per call writes and reads it with those plain torch ops (the reference
kernel's float path calls nothing here). An fp8 cache
(``torch.float8_e4m3fn`` / ``torch.float8_e5m2``) stores ``x / scale`` with a per-tensor float
scale, computed in float32 and clamped to the format's largest finite value (saturating, as
fp8 hardware conversions do), and reads back ``stored * scale``. Scales apply to fp8 caches
only. The reference kernel and the Triton kernel both quantize with :func:`quantize_kv`, so
the bytes they write are the same.
"""

from __future__ import annotations

import torch

#: The fp8 KV-cache dtypes graphrt's kernels read and write.
FP8_KV_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
#: Every KV-cache dtype graphrt's kernels read and write.
KV_CACHE_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32, *FP8_KV_DTYPES)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` is scaled fp8."""
    return dtype in FP8_KV_DTYPES


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as stored in a cache of ``cache_dtype`` (``scale``: fp8 only, stored = x / scale)."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    limit = torch.finfo(cache_dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(cache_dtype)


def write_kv_rows(cache: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``cache[rows] = values`` (``index_copy_``); fp8 through a byte view, which every device has."""
    if is_fp8(cache.dtype):
        cache, values = cache.view(torch.uint8), values.view(torch.uint8)
    cache.index_copy_(0, rows, values)


def read_kv_rows(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``cache[rows]`` for an index of any shape (``index_select``: on a CPU several times faster
    than advanced indexing); fp8 through a byte view."""
    source = cache.view(torch.uint8) if is_fp8(cache.dtype) else cache
    out = source.index_select(0, rows.reshape(-1)).view(*rows.shape, *cache.shape[1:])
    return out.view(cache.dtype) if is_fp8(cache.dtype) else out


def dequantize_kv(stored: torch.Tensor, compute_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Stored K/V rows as values of ``compute_dtype`` (fp8: ``stored * scale`` in float32)."""
    if not is_fp8(stored.dtype):
        return stored.to(compute_dtype)
    return (stored.float() * scale).to(compute_dtype)


__all__ = ["FP8_KV_DTYPES", "KV_CACHE_DTYPES", "dequantize_kv", "is_fp8", "quantize_kv", "read_kv_rows",
           "write_kv_rows"]
