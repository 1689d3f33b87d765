"""The one selector of graphrt's torch attention: which backend, and so which kernel, a model's
attention runs, chosen once when the runner is built.

A kernel is one module holding its backend (the phases and ``attend``, backend.py) and a maker,
registered here by name (:func:`register_attention_kernel`): ``GRAPHRT_ATTENTION=<name>`` selects
it, and ``auto`` (the default) tries the kernels registered ``auto=True`` in order, each only on
the device types it declares (its module is not asked elsewhere). A model's own
``attention_backend`` is kept. docs/attention.md, "Adding a kernel".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from graphrt.core.attention_decl import FLOAT_KV_DTYPES, device_type, requested_kernel
from graphrt.core.defaults import ATTENTION_ENV
from graphrt.core.errors import ConfigError


@dataclass(frozen=True)
class AttentionSite:
    """What a kernel is selected for: the model's attention layers, their device (None: not
    known yet), the weights' and the KV cache's dtypes (``kv_dtype``: the first group's, the one
    a kernel is chosen for; ``kv_dtypes``: every group's, empty where not known), the block size,
    and the requested name (``auto`` or a registered kernel's)."""

    layers: Sequence[torch.nn.Module]
    device: torch.device | str | None
    dtype: torch.dtype | None
    kv_dtype: torch.dtype | None
    block_size: int | None
    requested: str
    kv_dtypes: tuple[torch.dtype, ...] = ()

    @property
    def device_type(self) -> str | None:
        """The device's type (None: not known yet)."""
        return None if self.device is None else device_type(self.device)

    @property
    def head_dim(self) -> int | None:
        """The first layer's head size (None: no layer declares one)."""
        return next((getattr(layer, "head_dim", None) for layer in self.layers), None)


#: A kernel's maker: its backend for a site, or None where it does not run there under ``auto``
#: (a kernel requested by name that cannot run raises ConfigError saying why).
AttentionMaker = Callable[[AttentionSite], Any]


@dataclass(frozen=True)
class _Kernel:
    """A registered kernel: its maker, whether ``auto`` tries it, and the device types it serves
    under ``auto`` (None: any)."""

    maker: AttentionMaker
    auto: bool
    devices: frozenset[str] | None


_KERNELS: dict[str, _Kernel] = {}


def register_attention_kernel(name: str, maker: AttentionMaker, *, auto: bool = False,
                              devices: Sequence[str] | None = None) -> None:
    """Register kernel ``name`` (a ``GRAPHRT_ATTENTION`` value): ``maker(site)`` makes its backend;
    ``auto``: tried, in registration order, when the variable is ``auto`` or unset, on the device
    types ``devices`` names (None: any device)."""
    _KERNELS[name.strip().lower()] = _Kernel(maker, auto, frozenset(devices) if devices is not None else None)


def unregister_attention_kernel(name: str) -> None:
    """Remove a kernel :func:`register_attention_kernel` added (a test's toy kernel)."""
    _KERNELS.pop(name, None)


def attention_kernels() -> tuple[str, ...]:
    """The registered kernels' names, in registration order."""
    return tuple(_KERNELS)


def requested_attention() -> str:
    """``GRAPHRT_ATTENTION``: ``auto`` (also where unset) or a registered kernel (ConfigError
    naming the choices for another)."""
    return requested_kernel(("auto",) + attention_kernels(), "graphrt's torch attention")


def select_attention(model: torch.nn.Module, device: torch.device | str | None = None,
                     dtype: torch.dtype | None = None, block_size: int | None = None,
                     kv_dtype: torch.dtype | None = None, kv_dtypes: Sequence[torch.dtype] = ()) -> Any:
    """The model's one attention backend: ``model.attention_backend`` where it declares one, else
    the requested kernel's, else (``auto``, or a kernel that makes none here: no device given)
    the first registered ``auto`` kernel that runs here. ``kv_dtypes``: every KV cache group's
    dtype (``kv_dtype`` is the first one's), where known."""
    own = getattr(model, "attention_backend", None)
    if own is not None:
        return own
    layers = tuple(model.attention_layers()) if hasattr(model, "attention_layers") else ()
    site = AttentionSite(layers, device, dtype, kv_dtype, block_size, requested_attention(), tuple(kv_dtypes))
    makers = [k.maker for k in _KERNELS.values()           # auto's kernels that serve this device type
              if k.auto and (k.devices is None or site.device_type in k.devices)]
    if site.requested != "auto":                              # a named kernel first (None: not here, e.g. no device)
        makers.insert(0, _KERNELS[site.requested].maker)
    for maker in makers:
        if (backend := maker(site)) is not None:
            return backend
    raise ConfigError(f"{ATTENTION_ENV}={site.requested}: no registered attention kernel runs on {site.device} "
                      f"(registered: {attention_kernels()})")


# ---- graphrt's kernels (one module each; the makers beside their backends) -------------------

def _ascend(site: AttentionSite) -> Any:
    from graphrt.layers.torch.attention.ascend_attention import ascend_backend

    return None if site.device is None else ascend_backend(site.layers, site.device, site.dtype, site.block_size,
                                                             site.requested)


def _flashinfer(site: AttentionSite) -> Any:
    from graphrt.layers.torch.attention.flashinfer_attention import FlashInferAttentionBackend

    return FlashInferAttentionBackend(site.layers)


def _paged(site: AttentionSite) -> Any:
    """graphrt's paged backend with Triton or the reference kernel (Triton where ``auto`` or
    ``triton`` and it runs; ``triton`` where it cannot run raises). A model whose layers are not
    all graphrt's gets float KV caches only (its layers may not quantize fp8) unless they
    declare ``kv_cache_dtypes``. Whether the caches are fp8 is decided here, once: False where
    every group's cache is float (the kernel then never asks), else asked per call."""
    from graphrt.layers.torch.attention.backend import PagedAttentionBackend
    from graphrt.layers.torch.attention.kv_quant import is_fp8
    from graphrt.layers.torch.attention.paged import PagedAttention, choose_attention_kernel

    kernel = None
    if site.device is not None and site.dtype is not None:
        kernel = choose_attention_kernel(site.device, site.head_dim or 64, site.dtype, site.kv_dtype or site.dtype,
                                         site.requested).kernel
    chunked = [i for i, layer in enumerate(site.layers) if getattr(layer, "attention_chunk", 0)]
    if chunked and kernel not in (None, "reference"):      # chunked local attention: the reference kernel's only
        if site.requested == kernel:
            raise ConfigError(f"{ATTENTION_ENV}={kernel}, but attention layers {chunked} attend within chunks "
                              f"(attention_chunk), which only graphrt's reference kernel runs; use "
                              f"{ATTENTION_ENV}=reference or auto")
        kernel = "reference"
    float_kv = bool(site.kv_dtypes) and not any(is_fp8(d) for d in site.kv_dtypes)
    paged = PagedAttentionBackend(site.head_dim, kernel, kv_fp8=False if float_kv else None)
    foreign = [layer for layer in site.layers if not isinstance(layer, PagedAttention)]
    if foreign:
        declared = [set(getattr(layer, "kv_cache_dtypes", FLOAT_KV_DTYPES)) for layer in foreign]
        paged.kv_cache_dtypes = tuple(d for d in paged.kv_cache_dtypes if all(d in allowed for allowed in declared))
    return paged


register_attention_kernel("ascend", _ascend, auto=True, devices=("npu",))   # ascend_attention.py: NPUs under auto
register_attention_kernel("flashinfer", _flashinfer)           # flashinfer_attention.py: by name only
register_attention_kernel("triton", _paged)                    # triton_attention.py, in graphrt's paged backend
register_attention_kernel("reference", _paged, auto=True)      # paged.py: Triton first where it runs


__all__ = ["AttentionMaker", "AttentionSite", "attention_kernels", "register_attention_kernel", "requested_attention",
           "select_attention", "unregister_attention_kernel"]
