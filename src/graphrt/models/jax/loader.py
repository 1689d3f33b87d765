"""Load a Hugging Face Llama / Qwen3 safetensors checkpoint into the params pytree of ``jax_decoder``.

The pytree is a plain nested dict of ``jnp`` arrays; per-layer weights are stacked on a leading
layer axis so the forward can ``jax.lax.scan`` over layers::

    {"embed": [V, H], "norm": [H], "lm_head": [H, V] (absent when embeddings are tied),
     "layers": {"input_norm": [L, H], "wq": [L, H, Hq*D], "wk": [L, H, Hkv*D], "wv": [L, H, Hkv*D],
                "wo": [L, Hq*D, H], "post_norm": [L, H], "w_gate": [L, H, I], "w_up": [L, H, I],
                "w_down": [L, I, H],
                with attention_bias: "bq": [L, Hq*D], "bk": [L, Hkv*D], "bv": [L, Hkv*D], "bo": [L, H],
                with qk_norm (Qwen3): "q_norm": [L, D], "k_norm": [L, D]}}

Linear weights are stored as ``[in, out]`` (HF stores ``[out, in]``), so a projection is ``x @ w``.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from graphrt.core.errors import InputError
from graphrt.models.hf_config import DecoderConfig

Params = dict[str, Any]

# safetensors dtype tags -> numpy dtypes (little-endian, as the format defines). BF16 goes through
# ml_dtypes because safetensors' own numpy path cannot express it.
_SAFETENSORS_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}

# HF per-layer tensor suffix -> (our name, transpose?) for every layer tensor we read.
_LAYER_TENSORS = {
    "input_layernorm.weight": ("input_norm", False),
    "post_attention_layernorm.weight": ("post_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.o_proj.bias": ("bo", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
# Checkpoint tensors that carry no weights (old checkpoints persisted the rotary buffer).
_IGNORED = re.compile(r"^layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")


def layer_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """The per-layer tensor shapes (without the layer axis) this config's params hold, in our layout."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    shapes = {
        "input_norm": (h,), "post_norm": (h,),
        "wq": (h, config.q_size), "wk": (h, config.kv_size), "wv": (h, config.kv_size),
        "wo": (config.q_size, h),
        "w_gate": (h, i), "w_up": (h, i), "w_down": (i, h),
    }
    if config.attention_bias:
        shapes.update(bq=(config.q_size,), bk=(config.kv_size,), bv=(config.kv_size,), bo=(h,))
    if config.qk_norm:
        shapes.update(q_norm=(d,), k_norm=(d,))
    return shapes


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Memory-map every tensor of one ``.safetensors`` file as a numpy array (bf16 via ml_dtypes)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    data_start = 8 + header_len
    tensors = {name: info for name, info in header.items() if name != "__metadata__"}
    if not tensors:
        return {}
    buf = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start)
    out = {}
    for name, info in tensors.items():
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise InputError(name, f"safetensors dtype {info['dtype']} in {path} is not supported")
        start, end = info["data_offsets"]
        out[name] = buf[start:end].view(dtype).reshape(info["shape"])
    return out


def _checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        raise InputError("model_dir", f"{model_dir} has no .safetensors files")
    return [os.path.join(model_dir, n) for n in names]


def read_checkpoint(model_dir: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a (possibly sharded) safetensors checkpoint, keyed by their HF names."""
    model_dir = os.fspath(model_dir)
    out: dict[str, np.ndarray] = {}
    for path in _checkpoint_files(model_dir):
        for name, arr in read_safetensors(path).items():
            if name in out:
                raise InputError(name, f"tensor appears in more than one file of {model_dir}")
            out[name] = arr
    return out


def _check_shape(key: str, arr: np.ndarray, shape: tuple[int, ...]) -> None:
    if tuple(arr.shape) != tuple(shape):
        raise InputError(key, f"has shape {tuple(arr.shape)}, config expects {tuple(shape)}")


def params_from_hf_tensors(config: DecoderConfig, tensors: dict[str, np.ndarray],
                           dtype: Any = jnp.float32) -> Params:
    """Convert HF-named tensors into the stacked params pytree, checking every key and shape."""
    target = jnp.dtype(dtype)
    h, v, n_layers = config.hidden_size, config.vocab_size, config.num_hidden_layers
    wanted = layer_shapes(config)
    per_layer: dict[str, list[np.ndarray | None]] = {name: [None] * n_layers for name in wanted}
    top: dict[str, np.ndarray] = {}
    for key, arr in tensors.items():
        name = key.removeprefix("model.")
        if _IGNORED.match(name):
            continue
        if name in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
            top[name] = arr
            continue
        m = _LAYER_KEY.match(name)
        entry = _LAYER_TENSORS.get(m.group(2)) if m else None
        if entry is None or entry[0] not in wanted or int(m.group(1)) >= n_layers:
            raise InputError(key, f"unexpected checkpoint tensor for {config.architecture} "
                                  f"(attention_bias={config.attention_bias}, layers={n_layers})")
        ours, transpose = entry
        arr = arr.T if transpose else arr
        _check_shape(key, arr, wanted[ours])
        per_layer[ours][int(m.group(1))] = arr

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        key = next((k for k in (f"model.{name}", name) if k in tensors), f"model.{name}")
        if name not in top:
            raise InputError(key, "missing from checkpoint")
        _check_shape(key, top[name], shape)
        return top[name]

    # jax.device_put, not jnp.asarray: jax compiles a staging program per shape for the latter
    # (nine compiles at every start, warm persistent cache or not).
    params: Params = {
        "embed": jax.device_put(take("embed_tokens.weight", (v, h)).astype(target)),
        "norm": jax.device_put(take("norm.weight", (h,)).astype(target)),
    }
    if not config.tie_word_embeddings:
        if "lm_head.weight" not in top:
            raise InputError("lm_head.weight", "missing from checkpoint (tie_word_embeddings is false)")
        _check_shape("lm_head.weight", top["lm_head.weight"], (v, h))
        params["lm_head"] = jax.device_put(np.ascontiguousarray(top["lm_head.weight"].T).astype(target))
    layers = {}
    for ours, arrs in per_layer.items():
        missing = [i for i, a in enumerate(arrs) if a is None]
        if missing:
            suffix = next(k for k, e in _LAYER_TENSORS.items() if e[0] == ours)
            raise InputError(f"model.layers.{missing[0]}.{suffix}", "missing from checkpoint")
        layers[ours] = jax.device_put(np.stack([a.astype(target) for a in arrs]))
    params["layers"] = layers
    return params


def load_jax_params(model_dir: str | os.PathLike, dtype: Any = jnp.float32) -> tuple[DecoderConfig, Params]:
    """Read ``config.json`` and the safetensors weights of ``model_dir`` into ``(config, params)``.

    Every tensor is cast to ``dtype``. Unknown or missing checkpoint tensors raise
    :class:`graphrt.core.errors.InputError` naming the tensor.
    """
    config = DecoderConfig.from_dir(model_dir)
    return config, params_from_hf_tensors(config, read_checkpoint(model_dir), dtype)
