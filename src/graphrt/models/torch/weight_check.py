"""The load-time check that a torch model's weights are finite (a NaN weight otherwise shows up
only as NaN logprobs, requests later): one reduction per tensor on its device, one transfer for
the whole model, a ``logger.warning`` naming each tensor that holds NaN or inf."""

from __future__ import annotations

import logging

import torch

from graphrt.models.checkpoint import non_finite_message

logger = logging.getLogger(__name__)


def non_finite_tensors(module: torch.nn.Module) -> list[tuple[str, int, int, int]]:
    """``(name, NaN count, inf count, elements)`` of each floating-point parameter or buffer of
    ``module`` that holds a non-finite value. Each tensor is summed once in float32 (NaN and inf
    carry through a sum; finite weights cannot overflow it) and the sums come back together; the
    flagged tensors alone are then counted exactly."""
    named = [(name, t) for name, t in (*module.named_parameters(), *module.named_buffers())
             if t.is_floating_point() and t.numel() and t.device.type != "meta"]
    if not named:
        return []
    with torch.no_grad():
        sums = [_wide(t).sum(dtype=torch.float32) for _, t in named]
        finite = torch.isfinite(torch.stack([s.to(named[0][1].device) for s in sums])).tolist()
        bad = []
        for (name, t), ok in zip(named, finite):
            if not ok:
                wide = _wide(t)
                nan, inf = int(torch.isnan(wide).sum()), int(torch.isinf(wide).sum())
                if nan or inf:           # not a float32 overflow of finite values
                    bad.append((name, nan, inf, t.numel()))
    return bad


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t``, or an fp8 tensor as float16 (torch reduces no 1-byte float type)."""
    return t if t.element_size() > 1 else t.to(torch.float16)


def warn_non_finite(module: torch.nn.Module, source: str) -> list[tuple[str, int, int, int]]:
    """Log a warning naming the non-finite tensors of ``module`` (loaded from ``source``); return them."""
    bad = non_finite_tensors(module)
    if bad:
        logger.warning(non_finite_message(source, bad))
    return bad


__all__ = ["non_finite_tensors", "warn_non_finite"]
