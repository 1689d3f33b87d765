"""FlashInfer's sort-free filter kernels behind the torch sampler (CUDA, ``graphrt[flashinfer]``).

``top_k_renorm_probs`` / ``top_p_renorm_probs`` find the thresholds on the GPU with no host read
or RNG state, so a graph captures them; graphrt keeps its own draw (per-request seeds stay
exact). ``GRAPHRT_SAMPLER``: ``auto`` (FlashInfer on CUDA where it imports), ``torch`` or
``flashinfer`` (required: ConfigError where missing). Imports without flashinfer."""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from graphrt.core.errors import ConfigError

SAMPLER_ENV = "GRAPHRT_SAMPLER"
CHOICES = ("auto", "torch", "flashinfer")
#: The device types FlashInfer's kernels serve: the sampler asks :func:`flashinfer_sampling`
#: only there (or where ``GRAPHRT_SAMPLER`` is set: a wrong choice is refused on any device).
DEVICE_TYPES = frozenset({"cuda"})


def flashinfer_sampling(device: torch.device) -> Any | None:
    """``flashinfer.sampling`` where the sampler should use it on ``device`` (module doc), else None."""
    choice = os.environ.get(SAMPLER_ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ConfigError(f"{SAMPLER_ENV}={choice!r}: must be one of {', '.join(CHOICES)}")
    if choice == "torch":
        return None
    reason = None if device.type in DEVICE_TYPES else f"FlashInfer samples on CUDA devices, not {device.type}"
    module = None
    if reason is None:
        try:
            module = importlib.import_module("flashinfer.sampling")
        except ImportError as exc:
            reason = f"flashinfer does not import ({exc}); pip install 'graphrt[flashinfer]'"
    if module is None and choice == "flashinfer":
        raise ConfigError(f"{SAMPLER_ENV}=flashinfer: {reason}")
    return module


def flashinfer_filtered(module: Any, probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None,
                        min_p: torch.Tensor | None, scratch: torch.Tensor) -> torch.Tensor:
    """The filtered distribution of ``probs`` ``[R, V]`` (unnormalised, the largest 1, as
    :func:`~graphrt.backends.torch.sampling.sampler_ops.scaled_probs` makes them): min-p here, then
    FlashInfer's top-k and top-p renormalisations (top-p on what top-k and min-p keep)."""
    vocab = probs.shape[-1]
    if min_p is not None:
        torch.ge(probs, min_p.unsqueeze(1), out=scratch)
        probs.mul_(scratch)
    probs.div_(probs.sum(dim=-1, keepdim=True))
    out = module.top_k_renorm_probs(probs, top_k.clamp(1, vocab).to(torch.int32))
    if top_p is not None:
        out = module.top_p_renorm_probs(out, top_p)
    return out


__all__ = ["SAMPLER_ENV", "flashinfer_sampling", "flashinfer_filtered"]
