"""FlashInfer's side of graphrt's FlashInfer attention: whether it can run, and the kernel call.

:func:`flashinfer_paged_attention` keeps :func:`~graphrt.layers.torch.attention.paged.paged_attention_kernel`'s
contract (``GRAPHRT_ATTENTION=flashinfer`` makes ``run_paged_attention`` call it): graphrt's K/V
write, then the wrapper that :mod:`graphrt.layers.torch.attention.flashinfer_attention`'s backend planned for
the layer, on the cache's no-copy NHD page view. It imports neither graphrt's attention module
(which imports this one lazily) nor ``flashinfer``: the wrapper comes from the step's metadata.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch

from graphrt.core.errors import ConfigError
from graphrt.layers.torch.forward_context import get_forward_context
from graphrt.layers.torch.attention.kv_quant import is_fp8, quantize_kv, write_kv_rows

#: Device types FlashInfer runs on (the CPU tests add "cpu" to run a fake ``flashinfer``).
SUPPORTED_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


def flashinfer_unavailable_reason(device: torch.device | str) -> str | None:
    """Why FlashInfer cannot run on ``device`` (a sentence), or None when it can."""
    device = torch.device(device)
    if device.type not in SUPPORTED_DEVICE_TYPES:
        return f"the model runs on {device.type}, and FlashInfer runs on CUDA devices only"
    try:
        importlib.import_module("flashinfer")
    except ImportError as exc:
        return (f"flashinfer does not import ({exc}); install it with `pip install graphrt[flashinfer]` "
                "(the flashinfer-python package)")
    return None


class PlanSignature(NamedTuple):
    """What one FlashInfer plan fixes about a layer: heads, head size, scale, window."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window_left: int   # FlashInfer's: keys at positions p - window_left .. p; -1: no window


def plan_signature(num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                   sliding_window: int | None) -> PlanSignature:
    """A layer's :class:`PlanSignature`; graphrt's window ``W`` (``p - W + 1 .. p``) is ``W - 1``."""
    return PlanSignature(int(num_heads), int(num_kv_heads), int(head_dim), float(scale),
                         int(sliding_window) - 1 if sliding_window else -1)


def paged_view(kv_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's cache ``[2, blocks * block_size + 1, H, D]`` as FlashInfer's NHD pages ``(K, V)``,
    each ``[blocks, block_size, H, D]``: views without the trash row, no copy."""
    blocks = (kv_cache.shape[1] - 1) // block_size
    shape = (blocks, block_size, kv_cache.shape[2], kv_cache.shape[3])
    return kv_cache[0, :-1].view(shape), kv_cache[1, :-1].view(shape)


def flashinfer_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                               block_table: torch.Tensor, token_req_idx: torch.Tensor, block_size: int,
                               scale: float, sliding_window: int | None = None, k_scale: float = 1.0,
                               v_scale: float = 1.0) -> torch.Tensor:
    """:func:`~graphrt.layers.torch.attention.paged.paged_attention_kernel`'s contract through the
    FlashInfer wrapper the step's :class:`FlashInferMetadata` holds for this layer: graphrt's
    K/V write, then FlashInfer on the paged view; padded tokens get zeros."""
    wrappers = getattr(get_forward_context(), "flashinfer_wrappers", None)
    if wrappers is None:
        raise ConfigError("the FlashInfer kernel runs with its attention backend's metadata "
                          "(GRAPHRT_ATTENTION=flashinfer picks both for graphrt's models; a model with its own "
                          "attention_backend runs its own kernels)")
    if is_fp8(kv_cache.dtype):
        raise ConfigError(f"the FlashInfer kernel runs float KV caches only, got {kv_cache.dtype}")
    t, hkv, d = q.shape[0], kv_cache.shape[2], kv_cache.shape[3]
    heads = q.shape[1] // d
    sig = plan_signature(heads, hkv, d, scale, sliding_window)
    wrapper = wrappers.get(sig)
    if wrapper is None:
        raise ConfigError(f"no FlashInfer plan for a layer of {sig} (planned: "
                          f"{sorted(wrappers) or 'none'}); the backend plans the layers it was built with")
    rows = torch.where(slot_mapping < 0, kv_cache.shape[1] - 1, slot_mapping)
    write_kv_rows(kv_cache[0], rows, quantize_kv(k.reshape(t, hkv, d), kv_cache.dtype, 1.0))
    write_kv_rows(kv_cache[1], rows, quantize_kv(v.reshape(t, hkv, d), kv_cache.dtype, 1.0))
    out = wrapper.run(q.reshape(t, heads, d).to(kv_cache.dtype), paged_view(kv_cache, block_size))
    real = torch.arange(t, device=q.device) < query_start_loc[-1]
    return torch.where(real[:, None], out.reshape(t, heads * d), 0).to(q.dtype)


__all__ = ["PlanSignature", "SUPPORTED_DEVICE_TYPES", "flashinfer_paged_attention", "flashinfer_unavailable_reason",
           "paged_view", "plan_signature"]
