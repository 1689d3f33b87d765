"""Tiny random Hugging Face checkpoints (Qwen3, Llama) for graphrt's tests.

No network: each model is built from a config with seeded random weights and saved
with ``save_pretrained(..., safe_serialization=True)``. Weights are drawn so that
logits are O(1) and every parameter (norm weights included) differs from its default,
so a parity test can tell a wrong load from a right one.

Public helpers:

* :func:`tiny_hf_config` - the ``transformers`` config (defaults below, ``**overrides``).
* :func:`tiny_hf_model_dir` - a shared, process-cached checkpoint directory; read-only.
* :func:`make_tiny_hf_model` - a private copy under a caller's directory, free to edit.
* :func:`load_hf_model` / :func:`hf_logits` - the float32 eager HF model as a reference.
* :func:`random_prompts` - seeded prompts of given lengths, without the special token ids.

Defaults: vocab 128, hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16,
intermediate 128, float32. ``arch="qwen3-tied"`` is Qwen3 with
``tie_word_embeddings=True`` (its checkpoint has no ``lm_head.weight``); ``arch="mistral"`` is
Llama's weights with Mistral's ``sliding_window`` (every layer; MistralConfig's default 4096
is longer than any test prompt unless overridden).

:data:`SLIDING` is the override of a hybrid Qwen3: layer 0 full attention, layer 1 a sliding
window of 5 tokens, shorter than most test prompts.
"""

from __future__ import annotations

import atexit
import functools
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

ARCHS = ("qwen3", "qwen3-tied", "llama", "mistral")

_DEFAULTS: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

#: A hybrid Qwen3 (``tiny_hf_model_dir("qwen3", **SLIDING)``): transformers slides the layers
#: from ``max_window_layers`` on, here layer 1 of 2, over the last 5 positions.
SLIDING: dict[str, Any] = dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)

#: The first ordinary token id: 0 is padding, 1 BOS, 2 EOS (``_DEFAULTS``), kept out of prompts
#: so that nothing depends on them.
FIRST_ORDINARY_ID = 3


def random_prompts(lengths: Iterable[int], seed: int, vocab: int = _DEFAULTS["vocab_size"]) -> list[list[int]]:
    """One prompt per length, ids drawn from ``[FIRST_ORDINARY_ID, vocab)`` by a generator
    seeded with ``seed`` (the same prompts on every run and machine)."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(FIRST_ORDINARY_ID, vocab, size=n)] for n in lengths]


_CACHE_ROOT: Path | None = None


def tiny_hf_config(arch: str = "qwen3", **overrides: Any):
    """The ``transformers`` config of a tiny ``arch`` model, defaults updated by ``overrides``."""
    from transformers import LlamaConfig, MistralConfig, Qwen3Config

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")
    kwargs = dict(_DEFAULTS)
    if arch == "qwen3-tied":
        kwargs["tie_word_embeddings"] = True
    kwargs.update(overrides)
    config_cls = {"llama": LlamaConfig, "mistral": MistralConfig}.get(arch, Qwen3Config)
    return config_cls(**kwargs)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights: norms near 1, biases small, matrices scaled by 1/sqrt(fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.2 * noise
            elif name.endswith(".bias"):
                value = 0.2 * noise
            elif "embed_tokens" in name:
                value = noise
            else:
                value = noise / math.sqrt(param.shape[-1])
            param.copy_(value)


@functools.lru_cache(maxsize=None)
def _build(arch: str, seed: int, items: tuple[tuple[str, Any], ...]) -> Path:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    global _CACHE_ROOT
    hf_logging.disable_progress_bar()
    if _CACHE_ROOT is None:
        _CACHE_ROOT = Path(tempfile.mkdtemp(prefix="graphrt-hf-models-"))
        atexit.register(shutil.rmtree, _CACHE_ROOT, ignore_errors=True)
    out = Path(tempfile.mkdtemp(prefix=f"{arch}-seed{seed}-", dir=_CACHE_ROOT))
    config = tiny_hf_config(arch, **dict(items))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(out, safe_serialization=True)
    return out


def tiny_hf_model_dir(arch: str = "qwen3", *, seed: int = 0, **overrides: Any) -> Path:
    """A shared checkpoint directory, built once per process per arguments. Do not modify it.

    Override values must be hashable (they key the cache).
    """
    return _build(arch, seed, tuple(sorted(overrides.items())))


def make_tiny_hf_model(tmp_dir: str | Path, arch: str = "qwen3", *, seed: int = 0, **overrides: Any) -> Path:
    """Copy the tiny ``arch`` checkpoint into a fresh sub-directory of ``tmp_dir`` and return it.

    The copy belongs to the caller (tests may add, drop or corrupt tensors in it).
    """
    src = tiny_hf_model_dir(arch, seed=seed, **overrides)
    dst = Path(tmp_dir) / src.name
    suffix = 0
    while dst.exists():
        suffix += 1
        dst = Path(tmp_dir) / f"{src.name}-{suffix}"
    shutil.copytree(src, dst)
    return dst


def load_hf_model(model_dir: str | Path):
    """The checkpoint as a float32, eval-mode ``transformers`` model with eager attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def hf_logits(model, token_ids: Sequence[int]) -> torch.Tensor:
    """Float32 logits ``[len(token_ids), vocab]`` of one sequence, every position."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long).unsqueeze(0)
    with torch.no_grad():
        return model(input_ids=ids).logits[0].float()
