"""Write a small Hugging Face-format checkpoint with random weights (no download, no transformers).

For the CLI demo and benchmarks: ``config.json`` + ``model.safetensors`` with the tensor
names transformers uses for Llama / Qwen3, which graphrt's torch and JAX loaders read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from graphrt.core.errors import InputError

#: A Qwen3-shaped model small enough to capture in seconds on a CPU.
TINY_SIZES = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "max_position_embeddings": 1024}


def write_random_checkpoint(path: str | os.PathLike, arch: str = "qwen3", seed: int = 0,
                            tie_word_embeddings: bool = False, **sizes: int) -> Path:
    """Create ``path`` with a random ``arch`` ("qwen3" or "llama") checkpoint; returns the path."""
    from safetensors.numpy import save_file

    if arch not in ("qwen3", "llama"):
        raise InputError("arch", f"must be 'qwen3' or 'llama', got {arch!r}")
    cfg = {**TINY_SIZES, **sizes}
    h, inter, heads, kv, d = (cfg["hidden_size"], cfg["intermediate_size"],
                              cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(cfg["vocab_size"], h), "model.norm.weight": norm(h)}
    if not tie_word_embeddings:
        tensors["lm_head.weight"] = w(cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": w(heads * d, h), p + "self_attn.k_proj.weight": w(kv * d, h),
            p + "self_attn.v_proj.weight": w(kv * d, h), p + "self_attn.o_proj.weight": w(h, heads * d),
            p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter)})
        if arch == "qwen3":
            tensors[p + "self_attn.q_norm.weight"] = norm(d)
            tensors[p + "self_attn.k_norm.weight"] = norm(d)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = {"architectures": ["Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM"],
              "model_type": arch, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0 if arch == "qwen3" else 10000.0,
              "tie_word_embeddings": tie_word_embeddings, "eos_token_id": cfg["vocab_size"] - 1,
              "torch_dtype": "float32", "attention_bias": False, **cfg}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
