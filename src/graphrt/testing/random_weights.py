"""Seeded random weights for tiny checkpoints: O(1) logits, saved once per process.

The hybrid sweep (:mod:`graphrt.testing.state_sweep`) builds its models with these, and so does
the developers' transformers zoo (``tools/transformers_zoo.py``)."""

from __future__ import annotations

import atexit
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

#: Seed of the weights.
SEED = 0


def randomize(model: Any, seed: int = SEED) -> None:
    """Seeded weights with O(1) logits: 1-D weights near 1 (biases near 0), matrices and expert
    stacks noise / sqrt(last dim), embeddings unit noise."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.dim() == 1:
                value = 0.1 * noise if name.endswith("bias") or "sink" in name else 1.0 + 0.1 * noise
            elif "embed" in name or "wte" in name or "wpe" in name:
                value = noise
            else:
                value = noise / math.sqrt(param.shape[-1])
            param.copy_(value.to(param.dtype))


_ROOT: Path | None = None


def saved_random_model(build: Callable[[], Any], prefix: str, seed: int) -> Path:
    """``build()``'s model (built after ``torch.manual_seed(seed)``) with seeded random weights
    (:func:`randomize`), saved to a new directory under this process's temporary root (removed
    at exit): the tiny checkpoints of the hybrid sweep and the zoo."""
    import torch
    from transformers.utils import logging as hf_logging

    global _ROOT
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    if _ROOT is None:
        _ROOT = Path(tempfile.mkdtemp(prefix="graphrt-zoo-"))
        atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)
    torch.manual_seed(seed)
    model = build()
    randomize(model, seed)
    out = Path(tempfile.mkdtemp(prefix=prefix, dir=_ROOT))
    model.save_pretrained(out)
    return out
