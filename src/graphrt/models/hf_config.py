"""The architecture facts graphrt's reference models read from a Hugging Face ``config.json``.

Shared by the torch and the JAX models; numpy-free and framework-free. A JAX model of another
architecture brings a config class of its own instead
(:mod:`graphrt.models.jax.model_config`: what the XLA backend reads of it); the helpers at the
end read any model's config.
"""

from __future__ import annotations

import json
import numbers
import os
from dataclasses import dataclass
from typing import Any

from graphrt.core.errors import InputError
from graphrt.core.kv_spec import KVCacheGroup, KVCacheSpec
from graphrt.models.decoder_fields import unimplemented_field
from graphrt.models.hybrid_config import HYBRID_ARCHITECTURES, HybridConfig
from graphrt.models.llama4_config import LLAMA4_ARCHITECTURES, Llama4Config

#: A Qwen3 config.json without ``max_window_layers`` slides (with ``use_sliding_window``) the layers
#: from this one on: transformers' Qwen3Config default, read by models/hf_config.py.
QWEN3_MAX_WINDOW_LAYERS = 28

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class DecoderConfig:
    """A decoder-only transformer as graphrt's reference models see it (it has every member of
    :class:`graphrt.models.jax.model_config.JaxModelConfig`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_id: tuple[int, ...]
    torch_dtype: str
    #: Each layer's sliding window (0: full attention); empty: no layer slides.
    sliding_windows: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0: full attention)."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    def kv_cache_spec(self, num_kv_heads: int | None = None) -> KVCacheSpec:
        """The KV cache of the reference models: one group per distinct sliding window, every
        layer ``num_kv_heads`` (default: all of them) heads of ``head_dim``, in the cache's
        dtype ("auto": the config's ``kv_cache_dtype``, else the weights')."""
        return decoder_kv_spec(self, num_kv_heads)

    @classmethod
    def from_dict(cls, raw: dict) -> "DecoderConfig":
        """The config of graphrt's own decoder; InputError naming the first key of ``raw`` it does
        not implement with its value (:func:`graphrt.models.decoder_fields.unimplemented_field`:
        an allow-list per architecture, unknown keys refused), or an unsupported architecture."""
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise InputError("architectures", f"{archs} not supported; graphrt's reference models "
                                              f"are {list(SUPPORTED_ARCHITECTURES)}")
        problem = unimplemented_field(raw, arch)
        if problem is not None:
            raise InputError(*problem)
        rope_params = raw.get("rope_parameters") or {}
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),    # False for Mistral (decoder_fields)
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_id=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            sliding_windows=sliding_windows(raw, arch),
        )

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> "DecoderConfig | HybridConfig | Llama4Config":
        """The checkpoint's config: a :class:`DecoderConfig`, or for a hybrid architecture
        (Mamba2, Granite-4-H, Qwen3-Next: docs/hybrid.md) a :class:`HybridConfig`, for Llama 4's
        text model a :class:`Llama4Config`; each has the fields every caller of this reads
        (``architecture``, ``torch_dtype``, ``max_position_embeddings``, ``vocab_size``,
        ``eos_token_id``)."""
        path = os.path.join(os.fspath(model_dir), "config.json")
        if not os.path.exists(path):
            raise InputError("model_dir", f"{model_dir!s} has no config.json")
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        if any(a in HYBRID_ARCHITECTURES for a in raw.get("architectures") or []):
            return HybridConfig.from_dict(raw)
        if any(a in LLAMA4_ARCHITECTURES for a in raw.get("architectures") or []):
            return Llama4Config.from_dict(raw)
        return cls.from_dict(raw)


def sliding_windows(raw: dict, arch: str) -> tuple[int, ...]:
    """Each layer's sliding window as transformers applies it (empty: none). Qwen3 slides only
    with ``use_sliding_window``, the layers ``layer_types`` calls "sliding_attention" (by
    default those from ``max_window_layers`` on); Mistral slides every layer where
    ``sliding_window`` is set; Llama never (transformers ignores the field)."""
    window = raw.get("sliding_window")
    layers = int(raw["num_hidden_layers"])
    if not window or arch == "LlamaForCausalLM" or (arch == "Qwen3ForCausalLM"
                                                    and not raw.get("use_sliding_window", False)):
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise InputError("sliding_window", f"must be a positive int or null, got {window!r}")
    if arch == "MistralForCausalLM":
        return (window,) * layers
    first = raw.get("max_window_layers", QWEN3_MAX_WINDOW_LAYERS)
    kinds = raw.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if len(kinds) != layers:
        raise InputError("layer_types", f"{len(kinds)} entries for {layers} layers")
    windows = tuple(window if kind == "sliding_attention" else 0 for kind in kinds)
    return windows if any(windows) else ()


def decoder_kv_spec(config: Any, num_kv_heads: int | None = None) -> KVCacheSpec:
    """:meth:`DecoderConfig.kv_cache_spec` of any config with its fields (``sliding_windows``
    optional): one group per distinct window."""
    heads = config.num_key_value_heads if num_kv_heads is None else num_kv_heads
    layers = int(config.num_hidden_layers)
    windows = tuple(getattr(config, "sliding_windows", ()) or ()) or (0,) * layers
    by_window: dict[int, list[int]] = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(int(window), []).append(layer)
    return KVCacheSpec(tuple(KVCacheGroup(tuple(ids), int(heads), int(config.head_dim), sliding_window=window)
                             for window, ids in by_window.items()))


def model_max_len(model: object) -> int | None:
    """A loaded model's ``config.max_position_embeddings`` (None if it has no such config)."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def model_eos_token_ids(model: object) -> tuple[int, ...]:
    """A loaded model's ``config.eos_token_id`` as a tuple: a sequence of ids, or one id as
    Hugging Face configs write it (empty if it has none)."""
    eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, numbers.Integral) else tuple(int(e) for e in eos)
