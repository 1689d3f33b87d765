"""Tiny random hybrid checkpoints (Mamba2, Granite-4-H, Qwen3-Next) for graphrt's tests.

Built offline from transformers' config classes with seeded random weights (hf_models'
``_randomize``: norms near 1, matrices scaled by 1/sqrt(fan_in)) and saved with
``save_pretrained``; cached per process (Qwen3-Next's zero-centred norm weights around 0). ``chunk_size`` is small (4) so that prefills of a few
tokens cross several SSD chunks.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import atexit
import torch

from graphrt.testing.state_sweep import HYBRID_CONFIG_CLASSES, HYBRID_CONFIGS
from support.hf_models import _randomize

HYBRID_ARCHS = ("mamba2", "granite", "qwen3_next")

#: The tiny configs (graphrt.testing.state_sweep's, which the state sweep builds too).
_CONFIGS = HYBRID_CONFIGS
_CLASSES = HYBRID_CONFIG_CLASSES
_ROOT: Path | None = None


def hybrid_hf_config(arch: str, **overrides: Any):
    """The transformers config of a tiny ``arch`` hybrid model."""
    import transformers

    return getattr(transformers, _CLASSES[arch])(**{**_CONFIGS[arch], **overrides})


@functools.lru_cache(maxsize=None)
def _build(arch: str, seed: int, items: tuple[tuple[str, Any], ...]) -> Path:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    global _ROOT
    hf_logging.disable_progress_bar()
    if _ROOT is None:
        _ROOT = Path(tempfile.mkdtemp(prefix="graphrt-hybrid-models-"))
        atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)
    out = Path(tempfile.mkdtemp(prefix=f"{arch}-seed{seed}-", dir=_ROOT))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hybrid_hf_config(arch, **dict(items)), dtype=torch.float32)
    _randomize(model, seed)
    if arch == "qwen3_next":            # its norms scale by 1 + weight: weights around 0, as in its checkpoints
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight") and ".linear_attn.norm." not in name:
                    param.sub_(1.0)
    model.save_pretrained(out, safe_serialization=True)
    return out


def hybrid_model_dir(arch: str, *, seed: int = 0, **overrides: Any) -> Path:
    """A shared, process-cached checkpoint directory of a tiny ``arch`` model (do not modify it)."""
    return _build(arch, seed, tuple(sorted(overrides.items())))


def load_hf_hybrid(model_dir: str | Path):
    """The checkpoint as a float32 eval-mode transformers model (eager attention)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def hf_sequence_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Float32 logits ``[len(token_ids), vocab]`` of one sequence in one forward."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([token_ids])).logits[0].float()
