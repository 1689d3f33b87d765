"""Which implementation runs a checkpoint: graphrt's own or transformers' (vLLM's ``--model-impl``).

``model_impl`` (``graphrt.LLM``, ``GraphConfig``, ``--model-impl``):

* ``"auto"`` (default): graphrt's own decoder where it implements every key of the checkpoint's
  config that changes the computation (Llama, Mistral, Qwen3: the allow-list of
  ``decoder_fields.py``; an unknown key or an unimplemented value is not), else transformers'
  model through graphrt's attention (torch backends only), the reason logged;
* ``"graphrt"``: graphrt's own, or the InputError naming the key it does not implement (also
  on a backend that is not torch's, where nothing falls back);
* ``"transformers"``: transformers' model (``models/torch/transformers_impl``), on torch backends.

Reads ``config.json`` only: no torch, no transformers import.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from graphrt.core.errors import ConfigError, InputError
from graphrt.models.hf_config import SUPPORTED_ARCHITECTURES, DecoderConfig
from graphrt.models.hybrid_config import HYBRID_ARCHITECTURES, TORCH_HYBRID_ARCHITECTURES, HybridConfig
from graphrt.models.llama4_config import LLAMA4_ARCHITECTURES, Llama4Config

logger = logging.getLogger(__name__)

MODEL_IMPLS = ("auto", "graphrt", "transformers")


def read_config_json(model_dir: str | os.PathLike) -> dict[str, Any]:
    """``model_dir/config.json`` as a dict: InputError naming ``model_dir`` if it has none, or
    naming the file and where it breaks if it is not a JSON object."""
    path = os.path.join(os.fspath(model_dir), "config.json")
    if not os.path.exists(path):
        raise InputError("model_dir", f"{model_dir!s} has no config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except UnicodeDecodeError as exc:
        raise InputError("config.json", f"{path} is not UTF-8 text ({exc})") from None
    except json.JSONDecodeError as exc:
        raise InputError("config.json", f"{path} is not JSON: {exc.msg} at line {exc.lineno} column "
                                        f"{exc.colno}") from None
    if not isinstance(raw, dict):
        raise InputError("config.json", f"{path} holds a JSON {type(raw).__name__}, not an object of config "
                                        "fields")
    return raw


def checkpoint_limits(model_dir: str | os.PathLike) -> tuple[int | None, str | None]:
    """``(max_position_embeddings, dtype name)`` of any checkpoint's config (its text config's
    where it nests one), for the checks made before loading; None where it does not say."""
    raw = read_config_json(model_dir)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    positions = raw.get("max_position_embeddings", text.get("max_position_embeddings"))
    dtype = raw.get("torch_dtype") or raw.get("dtype") or text.get("dtype") or text.get("torch_dtype")
    return (int(positions) if isinstance(positions, int) else None), (str(dtype) if dtype else None)


def resolve_model_impl(model_dir: str | os.PathLike, model_impl: str = "auto", framework: str = "torch") -> str:
    """``"graphrt"`` or ``"transformers"`` for ``model_dir`` (module docstring); ConfigError for an
    unknown value, ``"transformers"`` on a backend that is not torch's, or ``"graphrt"`` for a
    checkpoint graphrt does not implement (the reason named)."""
    if model_impl not in MODEL_IMPLS:
        raise ConfigError(f"model_impl: {model_impl!r} is not one of {MODEL_IMPLS}")
    read_config_json(model_dir)
    if model_impl == "transformers":
        if framework != "torch":
            raise ConfigError(f"model_impl='transformers' runs on the torch backends (eager, cpu, cuda, npu), not "
                              f"on a {framework} backend")
        return "transformers"
    try:
        config = DecoderConfig.from_dir(model_dir)
        if framework == "torch":
            torch_only(config)
    except InputError as exc:
        if framework != "torch" and exc.field == "architectures":
            raise ConfigError(f"architectures: {read_config_json(model_dir).get('architectures')} has no {framework} "
                              f"model in graphrt (its {framework} models: {list(SUPPORTED_ARCHITECTURES)}, "
                              f"{list(LLAMA4_ARCHITECTURES)} and the hybrids {list(HYBRID_ARCHITECTURES)}, "
                              "docs/hybrid.md); the torch backends run it "
                              "through transformers' model") from None
        if model_impl == "graphrt" or framework != "torch":
            raise
        logger.info("graphrt: model_impl=auto runs %s with transformers' model: graphrt's own decoder does not "
                    "implement its config (%s)", model_dir, exc)
        return "transformers"
    return "graphrt"


def torch_only(config: "DecoderConfig | HybridConfig | Llama4Config") -> None:
    """InputError for an architecture graphrt's own torch models do not implement, a hybrid or
    Llama 4 (its JAX model runs on xla; on a torch backend transformers' model runs, with
    ``model_impl="auto"``)."""
    if isinstance(config, Llama4Config):
        raise InputError("architectures", f"graphrt's own torch models do not implement {config.architecture} "
                                          "(its JAX model runs on backend='xla'): use model_impl='auto' or "
                                          "'transformers'")
    if isinstance(config, HybridConfig) and config.architecture not in TORCH_HYBRID_ARCHITECTURES:
        raise InputError("architectures", f"graphrt's own torch models do not implement {config.architecture} "
                                          f"(they implement {list(TORCH_HYBRID_ARCHITECTURES)}; its JAX model runs "
                                          f"on backend='xla'): use model_impl='auto' or 'transformers'")


__all__ = ["MODEL_IMPLS", "checkpoint_limits", "read_config_json", "resolve_model_impl"]
