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

import logging
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from graphrt.core.errors import InputError
from graphrt.models.checkpoint import (names_with_files, non_finite_message, safetensors_files, safetensors_header,
                                      tensor_files)
from graphrt.models.hf_config import DecoderConfig
from graphrt.models.model_impl import read_config_json

logger = logging.getLogger(__name__)

Params = dict[str, Any]

# safetensors dtype tags -> numpy dtypes (little-endian, as the format defines). BF16 goes through
# ml_dtypes because safetensors' own numpy path cannot express it.
_SAFETENSORS_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_FLOAT_DTYPES = frozenset(_SAFETENSORS_DTYPES[t] for t in ("F64", "F32", "F16", "BF16"))

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


#: Where the top-level HF tensors go in the params pytree: (leaf, stored transposed?).
_TOP_TENSORS = {"embed_tokens.weight": ("embed", False), "norm.weight": ("norm", False),
                "lm_head.weight": ("lm_head", True)}


def param_target(config: DecoderConfig, key: str) -> tuple[tuple[str, ...], int | None, bool] | None:
    """The params-pytree place of HF checkpoint tensor ``key`` (with or without ``model.``): the
    leaf's path, the layer it fills on the stacked layer axis (None: the whole leaf) and whether
    it is stored transposed; ``((), None, False)`` for a tensor that fills nothing by design (an
    old rotary buffer, the head of tied embeddings); None for one the config has no place for."""
    name = key.removeprefix("model.")
    if _IGNORED.match(name) or (config.tie_word_embeddings and name == "lm_head.weight"):
        return (), None, False
    if name in _TOP_TENSORS:
        leaf, transpose = _TOP_TENSORS[name]
        return (leaf,), None, transpose
    m = _LAYER_KEY.match(name)
    entry = _LAYER_TENSORS.get(m.group(2)) if m else None
    if entry is None or entry[0] not in layer_shapes(config) or int(m.group(1)) >= config.num_hidden_layers:
        return None
    return ("layers", entry[0]), int(m.group(1)), entry[1]


def hf_names(config: DecoderConfig) -> list[str]:
    """Every HF tensor name a checkpoint of ``config`` holds (what a full refit fills)."""
    suffix = {ours: hf for hf, (ours, _) in _LAYER_TENSORS.items()}
    names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if config.tie_word_embeddings
                                                                   else ["lm_head.weight"])
    return names + [f"model.layers.{i}.{suffix[ours]}" for ours in layer_shapes(config)
                    for i in range(config.num_hidden_layers)]


def abstract_params(config: DecoderConfig, dtype: Any = jnp.float32) -> Params:
    """The params pytree :func:`params_from_hf_tensors` builds for ``config``, as
    ``jax.ShapeDtypeStruct`` leaves: programs lowered and compiled ahead of time without the
    weights (deviceless TPU compiles, ``make compile-check``)."""
    h, v, n = config.hidden_size, config.vocab_size, config.num_hidden_layers
    arr = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))  # noqa: E731
    params: Params = {"embed": arr(v, h), "norm": arr(h)}
    if not config.tie_word_embeddings:
        params["lm_head"] = arr(h, v)
    params["layers"] = {name: arr(n, *shape) for name, shape in layer_shapes(config).items()}
    return params


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Memory-map every tensor of one ``.safetensors`` file as a numpy array (bf16 via ml_dtypes),
    its header checked first (``checkpoint.safetensors_header``: a truncated or malformed file is
    an InputError naming the file and the tensor)."""
    path = os.fspath(path)
    tensors = safetensors_header(path)
    if not tensors:
        return {}
    with open(path, "rb") as f:
        data_start = 8 + int.from_bytes(f.read(8), "little")
    buf = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start)
    out = {}
    for name, info in tensors.items():
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise InputError(name, f"safetensors dtype {info['dtype']} in {path} is not supported")
        start, end = info["data_offsets"]
        out[name] = buf[start:end].view(dtype).reshape(info["shape"])
    return out


def read_checkpoint(model_dir: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a (possibly sharded) safetensors checkpoint, keyed by their HF names; a
    warning names those holding NaN or inf (:func:`warn_non_finite`)."""
    model_dir = os.fspath(model_dir)
    files = safetensors_files(model_dir)
    if not files:
        raise InputError("model_dir", f"{model_dir} has no .safetensors files")
    out: dict[str, np.ndarray] = {}
    where: dict[str, str] = {}
    for path in files:
        for name, arr in read_safetensors(path).items():
            if name in out:
                raise InputError(name, f"the tensor is in both {where[name]} and {os.path.basename(path)} of "
                                       f"{model_dir}")
            out[name], where[name] = arr, os.path.basename(path)
    warn_non_finite(out, model_dir)
    return out


def non_finite_arrays(tensors: dict[str, np.ndarray]) -> list[tuple[str, int, int, int]]:
    """``(name, NaN count, inf count, elements)`` of each floating-point array holding NaN or
    inf: one float32 sum per array (NaN and inf carry through it), the flagged ones then counted."""
    bad = []
    for name, arr in tensors.items():
        if arr.size and arr.dtype in _FLOAT_DTYPES and not np.isfinite(np.sum(arr, dtype=np.float32)):
            nan, inf = int(np.isnan(arr).sum()), int(np.isinf(arr).sum())
            if nan or inf:               # not a float32 overflow of finite values
                bad.append((name, nan, inf, int(arr.size)))
    return bad


def warn_non_finite(tensors: dict[str, np.ndarray], source: str) -> list[tuple[str, int, int, int]]:
    """Log a warning naming the arrays of ``tensors`` (read from ``source``) that hold NaN or inf."""
    bad = non_finite_arrays(tensors)
    if bad:
        logger.warning(non_finite_message(source, bad))
    return bad


def _check_shape(key: str, arr: np.ndarray, shape: tuple[int, ...], files: dict[str, str]) -> None:
    if tuple(arr.shape) != tuple(shape):
        where = f"in {files[key]}: " if key in files else ""
        raise InputError(key, f"{where}has shape {tuple(arr.shape)}, config expects {tuple(shape)}")


def params_from_hf_tensors(config: DecoderConfig, tensors: dict[str, np.ndarray],
                           dtype: Any = jnp.float32, files: dict[str, str] | None = None) -> Params:
    """Convert HF-named tensors into the stacked params pytree, checking every key and shape:
    tensors the config has no place for and tensors it needs that are absent are one InputError
    listing them all (its field the first of them); ``files`` (tensor -> file) names each one's file."""
    files = files or {}
    target = jnp.dtype(dtype)
    h, v, n_layers = config.hidden_size, config.vocab_size, config.num_hidden_layers
    wanted = layer_shapes(config)
    per_layer: dict[str, list[np.ndarray | None]] = {name: [None] * n_layers for name in wanted}
    top: dict[str, np.ndarray] = {}
    unexpected: list[str] = []
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
            unexpected.append(key)
            continue
        ours, transpose = entry
        arr = arr.T if transpose else arr
        _check_shape(key, arr, wanted[ours], files)
        per_layer[ours][int(m.group(1))] = arr
    _refuse_unmatched(config, tensors, top, per_layer, unexpected, files)

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        key = next(k for k in (f"model.{name}", name) if k in tensors)
        _check_shape(key, top[name], shape, files)
        return top[name]

    # jax.device_put, not jnp.asarray: jax compiles a staging program per shape for the latter
    # (nine compiles at every start, warm persistent cache or not).
    params: Params = {
        "embed": jax.device_put(take("embed_tokens.weight", (v, h)).astype(target)),
        "norm": jax.device_put(take("norm.weight", (h,)).astype(target)),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = jax.device_put(np.ascontiguousarray(take("lm_head.weight", (v, h)).T).astype(target))
    params["layers"] = {ours: jax.device_put(np.stack([a.astype(target) for a in arrs]))
                        for ours, arrs in per_layer.items()}
    return params


def _refuse_unmatched(config: DecoderConfig, tensors: dict[str, np.ndarray], top: dict[str, np.ndarray],
                      per_layer: dict[str, list[np.ndarray | None]], unexpected: list[str],
                      files: dict[str, str]) -> None:
    """One InputError listing the tensors the config needs that are absent and those it has no
    place for (its field: the first of them), or nothing."""
    needed = ["embed_tokens.weight", "norm.weight"] + ([] if config.tie_word_embeddings else ["lm_head.weight"])
    missing = [next((k for k in (f"model.{n}", n) if k in tensors), f"model.{n}") for n in needed if n not in top]
    suffix = {ours: hf for hf, (ours, _) in _LAYER_TENSORS.items()}
    missing += [f"model.layers.{i}.{suffix[ours]}" for ours, arrs in per_layer.items()
                for i, a in enumerate(arrs) if a is None]
    if not (missing or unexpected):
        return
    found = []
    if missing:
        tied = "" if config.tie_word_embeddings else "; tie_word_embeddings is false"
        found.append(f"missing from checkpoint: {names_with_files(missing, {})}{tied}")
    if unexpected:
        found.append(f"unexpected checkpoint tensors for {config.architecture} (attention_bias="
                     f"{config.attention_bias}, layers={config.num_hidden_layers}): "
                     f"{names_with_files(unexpected, files)}")
    raise InputError((missing or sorted(unexpected))[0], "; ".join(found))


def load_jax_params(model_dir: str | os.PathLike, dtype: Any = jnp.float32) -> tuple[DecoderConfig, Params]:
    """Read ``config.json`` and the safetensors weights of ``model_dir`` into ``(config, params)``.

    Every tensor is cast to ``dtype``. Unknown or missing checkpoint tensors raise
    :class:`graphrt.core.errors.InputError` naming the tensors and their files, as does a broken
    file (truncated: the tensor cut off); a ``config.json`` that is not JSON names the file.
    """
    read_config_json(model_dir)
    config = DecoderConfig.from_dir(model_dir)
    files = tensor_files(model_dir)
    return config, params_from_hf_tensors(config, read_checkpoint(model_dir), dtype, files)


def read_flat_params(model_dir: str | os.PathLike, dtype: Any) -> Params:
    """Every checkpoint tensor, by its name, as a ``dtype`` array: the params of graphrt's JAX
    models whose layers differ in kind (hybrid, Llama 4), read by name in the forward."""
    return {name: jnp.asarray(np.asarray(t).astype(np.float32)).astype(dtype)
            for name, t in read_checkpoint(model_dir).items()}


def flat_param(p: Params, name: str) -> jax.Array:
    """``p[name]``, or an InputError naming the tensor the checkpoint lacks (at trace time)."""
    if name not in p:
        raise InputError(name, "missing from checkpoint")
    return p[name]


def flat_linear(p: Params, name: str, x: jax.Array) -> jax.Array:
    """``x @ W^T (+ b)`` with ``name``'s weight and, where the checkpoint has one, its bias."""
    out = x @ flat_param(p, f"{name}.weight").T
    return out + p[f"{name}.bias"] if f"{name}.bias" in p else out

