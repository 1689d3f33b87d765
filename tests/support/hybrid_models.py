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

from support.hf_models import _randomize

HYBRID_ARCHS = ("mamba2", "granite", "qwen3_next")

_CONFIGS: dict[str, dict[str, Any]] = {
    "mamba2": dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16,
                   n_groups=2, chunk_size=4, conv_kernel=4, expand=2, bos_token_id=1, eos_token_id=2,
                   pad_token_id=0, tie_word_embeddings=False),
    "granite": dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2,
                    layer_types=["linear_attention", "full_attention", "linear_attention"],
                    mamba_n_heads=4, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=4, mamba_expand=2,
                    mamba_d_conv=4, shared_intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                    position_embedding_type="rope", embedding_multiplier=2.0, residual_multiplier=0.5,
                    logits_scaling=3.0, attention_multiplier=0.2, max_position_embeddings=256,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False),
    "qwen3_next": dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                       linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=1,
                       mlp_only_layers=[], partial_rotary_factor=0.25, max_position_embeddings=256, linear_chunk_size=4,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False),
}
_CLASSES = {"mamba2": "Mamba2Config", "granite": "GraniteMoeHybridConfig", "qwen3_next": "Qwen3NextConfig"}
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
