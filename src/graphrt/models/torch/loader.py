"""Load a Hugging Face Llama / Mistral / Qwen3 checkpoint into :class:`DecoderForCausalLM`.

The model is built on the meta device (no init cost), given uninitialised storage on
the target device, and every parameter is then filled from the ``*.safetensors``
files; a parameter the checkpoint does not fill is an error, as is a checkpoint
tensor the model has no place for.

A tensor-parallel rank's model (``tp_size > 1``) loads its shard: every sharded parameter's
``weight_loader`` gets the safetensors slice (``get_slice``) and reads only the rank's rows or
columns from the file; replicated parameters (the norms) are read whole.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from graphrt.core.errors import InputError
from graphrt.models.checkpoint import names_with_files, safetensors_files, tensor_files
from graphrt.models.hf_config import DecoderConfig
from graphrt.models.hybrid_config import HybridConfig
from graphrt.models.model_impl import read_config_json, torch_only
from graphrt.models.torch.decoder import DecoderForCausalLM
from graphrt.models.torch.weight_check import warn_non_finite

# Checkpoint tensors that carry no model state (old HF checkpoints saved these buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A layer's fp8 KV-cache scales, as fp8 checkpoints name them (scalars; "kv_scale": both).
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:(?:k_proj\.)?(k)_scale|(?:v_proj\.)?(v)_scale|(kv)_scale)$")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Copy a whole checkpoint tensor into ``param`` after checking its shape."""
    if tuple(loaded_weight.shape) != tuple(param.shape):
        raise InputError("loaded_weight", f"tensor has shape {tuple(loaded_weight.shape)}, "
                                          f"the model expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded_weight)


def _packed_target(name: str, mapping: dict[str, tuple[str, str | int]]) -> tuple[str, str | int] | None:
    """``model.layers.0.self_attn.k_proj.weight`` -> (``...qkv_proj.weight``, ``"k"``), else None."""
    for ckpt_part, (fused_part, shard_id) in mapping.items():
        token = f".{ckpt_part}."
        if token in name:
            return name.replace(token, f".{fused_part}.", 1), shard_id
    return None


def load_weights(model: DecoderForCausalLM, model_dir: str | os.PathLike) -> None:
    """Fill every parameter of ``model`` from ``model_dir``'s safetensors files; a sharded model
    (built with ``tp_rank`` / ``tp_size``) reads only its rank's slices.

    Raises :class:`InputError` for a broken file (``checkpoint.safetensors_header``: a truncated
    one names the tensor cut off), a shape mismatch (naming the key and its file), or checkpoint
    keys the model has no place for and parameters (or fused shards) that no tensor filled,
    every one of them listed.
    """
    files = safetensors_files(model_dir)
    if not files:
        raise InputError("model_dir", f"{model_dir!s} has no *.safetensors files")
    where = tensor_files(model_dir)            # every header checked before a byte is copied
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = model.config.tie_word_embeddings
    expected = expected_targets(model)

    loaded: set[tuple[str, str | int | None]] = set()
    unknown: list[str] = []
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    done = _load_key(model, params, f, key, os.path.basename(path), tied)
                    if done is None:
                        unknown.append(key)
                    elif done:
                        loaded.add(done)
        except SafetensorError as exc:
            raise InputError(os.path.basename(path), f"{path} cannot be read as safetensors: {exc}") from None

    missing = sorted(name + ("" if shard is None else f"[{shard}]") for name, shard in expected - loaded)
    if missing or unknown:
        found = [f"is missing parameters: {names_with_files(missing, {})}"] if missing else []
        if unknown:
            found.append(f"has unknown keys {names_with_files(unknown, where)}: the {model.config.architecture} "
                         "model has no such parameter")
        raise InputError("checkpoint", f"{model_dir!s} " + "; it ".join(found))


@dataclass(frozen=True)
class CheckpointTarget:
    """Where checkpoint tensor ``key`` goes in a graphrt torch model (:func:`checkpoint_target`):
    parameter ``param`` (its fused shard ``shard_id``), or nothing by design (``param`` None: an
    ignored buffer, the tied head), or layer ``kv_scale[0]``'s fp8 KV scale ``kv_scale[1]``."""

    param: str | None
    shard_id: str | int | None = None
    kv_scale: tuple[int, str] | None = None


def checkpoint_target(model: Any, key: str) -> CheckpointTarget:
    """What the loader does with checkpoint tensor ``key`` (packed q/k/v and gate/up names mapped
    to their fused parameter and shard): shared by loading and the in-place refit."""
    if key.endswith(_IGNORED_SUFFIXES) or (model.config.tie_word_embeddings and key == "lm_head.weight"):
        return CheckpointTarget(None)
    scale = _KV_SCALE.match(key)
    if scale is not None:
        return CheckpointTarget(None, kv_scale=(int(scale.group(1)), "".join(filter(None, scale.groups()[1:]))))
    packed = _packed_target(key, model.packed_modules_mapping)
    name, shard_id = packed if packed is not None else (key, None)
    return CheckpointTarget(name, shard_id)


def expected_targets(model: Any) -> set[tuple[str, str | int | None]]:
    """Every (parameter, fused shard) a checkpoint must fill (the tied head's excepted)."""
    tied = model.config.tie_word_embeddings
    expected: set[tuple[str, str | int | None]] = set()
    for module_name, module in model.named_modules():
        shard_ids = list(getattr(module, "shard_offsets", None) or [None])
        for name, _ in module.named_parameters(prefix=module_name, recurse=False):
            if not (tied and name == "lm_head.weight"):
                expected.update((name, shard_id) for shard_id in shard_ids)
    return expected


def _load_key(model: DecoderForCausalLM, params: dict[str, nn.Parameter], f: Any, key: str, file: str,
              tied: bool) -> tuple[str, str | int | None] | tuple[()] | None:
    """Load checkpoint tensor ``key`` of the open file ``f`` into ``model``: the (parameter,
    shard) it filled, ``()`` for a key that fills none by design (a KV scale, an ignored buffer,
    the tied head), None for a key the model has no place for."""
    target = checkpoint_target(model, key)
    if target.kv_scale is not None:
        _load_kv_scale(model, key, *target.kv_scale, f.get_tensor(key))
        return ()
    if target.param is None:
        return ()
    name, shard_id = target.param, target.shard_id
    param = params.get(name)
    if param is None:
        return None
    try:
        _load_one(param, f, key, shard_id)
    except InputError as err:
        raise InputError("checkpoint", f"{key!r} in {file}: {err}") from None
    return name, shard_id


def _load_kv_scale(model: DecoderForCausalLM, key: str, layer: int, which: str, value: torch.Tensor) -> None:
    """Set layer ``layer``'s per-tensor fp8 KV scale ``which`` ("k", "v" or "kv": both) from a
    checkpoint scalar; the kernels apply it to fp8 caches only (stored = value / scale)."""
    if layer >= len(model.model.layers) or value.numel() != 1:
        raise InputError("checkpoint", f"{key!r}: a KV scale of layer {layer} must be one number of one of the "
                                       f"{len(model.model.layers)} layers, got shape {tuple(value.shape)}")
    number = float(value.float().reshape(()))
    if not math.isfinite(number) or number <= 0:
        raise InputError("checkpoint", f"{key!r}: a KV scale must be finite and > 0, got {number}")
    attn = model.model.layers[layer].self_attn.attn
    if which in ("k", "kv"):
        attn.k_scale = number
    if which in ("v", "kv"):
        attn.v_scale = number


def _load_one(param: nn.Parameter, f: Any, key: str, shard_id: str | int | None) -> None:
    """Fill ``param`` (or its fused shard ``shard_id``) from checkpoint tensor ``key`` of the
    open file ``f``: through its ``weight_loader`` from a slice, else whole."""
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        default_weight_loader(param, f.get_tensor(key).to(param.dtype))
    elif shard_id is None:
        loader(param, f.get_slice(key))
    else:
        loader(param, f.get_slice(key), shard_id)


def load_torch_model(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", tp_rank: int = 0, tp_size: int = 1,
                     group: Any = None) -> DecoderForCausalLM:
    """Read ``config.json`` + ``*.safetensors`` from ``model_dir`` into an eval-mode model;
    with ``tp_size > 1``, rank ``tp_rank``'s shard over ``group`` (see :class:`DecoderForCausalLM`).
    Weights holding NaN or inf are named in a warning (``weight_check``)."""
    read_config_json(model_dir)                    # a config.json that is not JSON: InputError naming it
    config = DecoderConfig.from_dir(model_dir)
    torch_only(config)                             # Mamba1 / LFM2: JAX models only (transformers' on torch)
    if isinstance(config, HybridConfig):           # Mamba2, Granite-4-H, Qwen3-Next (docs/hybrid.md)
        if tp_size > 1:
            raise InputError("tensor_parallel_size", f"graphrt's hybrid {config.architecture} runs on one rank; "
                                                     f"tensor parallelism of recurrent layers is not implemented")
        from graphrt.models.torch.hybrid import hybrid_model_class
        with torch.device("meta"):
            model = hybrid_model_class(config)(config, dtype=dtype)
    else:
        with torch.device("meta"):
            model = DecoderForCausalLM(config, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size, group=group)
    model.to_empty(device=device)
    model.bind_parameters()
    load_weights(model, model_dir)
    warn_non_finite(model, os.fspath(model_dir))
    return model.eval().requires_grad_(False)
