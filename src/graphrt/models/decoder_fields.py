"""Which ``config.json`` keys graphrt's own decoder implements, with which values (an allow-list).

graphrt's own Llama / Mistral / Qwen3 decoder (torch and JAX, :class:`~graphrt.models.hf_config.DecoderConfig`)
runs a checkpoint only where it implements every key of its config that changes what transformers
computes. Each key of a config is one of:

* read and implemented (:data:`IMPLEMENTED`, per architecture): the value must be one graphrt
  computes as transformers does (``hidden_act`` "silu", ``mlp_bias`` false, default RoPE, ...);
* neutral (:data:`NEUTRAL`): changes nothing at inference (ids, names, dtype, transformers'
  bookkeeping, training-only settings, generation defaults), some only at their no-op value
  (:data:`NEUTRAL_AT`);
* anything else -- an unknown key, or a known one with a value graphrt does not implement --
  is "not implemented": :func:`unimplemented_field` names it, ``model_impl="auto"`` runs the
  checkpoint with transformers' model instead (models/model_impl.py), ``model_impl="graphrt"``
  and the XLA backend (no transformers fallback) raise an InputError naming it.

Unknown keys are refused on purpose: a key graphrt has never classified may change the
computation, and running it anyway gives silently wrong tokens. The tables follow the modeling
code of transformers 5 (``config.<field>`` reads of ``modeling_llama.py``, ``modeling_mistral.py``
and ``modeling_qwen3.py``) and its config classes' defaults where a key is missing.
"""

from __future__ import annotations

import math
from typing import Any, Callable

#: A check of one value: True where graphrt computes it as transformers does.
Accepts = Callable[[Any], bool]


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive_int(v: Any) -> bool:
    return _int(v) and v > 0


def _positive_int_or_none(v: Any) -> bool:
    return v is None or _positive_int(v)


def _positive_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _off(v: Any) -> bool:
    return v is None or v is False


def _any(v: Any) -> bool:
    return True


def _token_ids(v: Any) -> bool:
    return v is None or _int(v) or (isinstance(v, list) and all(_int(t) for t in v))


#: Activations graphrt's MLP computes (both are transformers' SiLU).
ACTIVATIONS = ("silu", "swish")

#: Keys every own architecture reads: (the values it implements, what they are, for messages).
_COMMON: dict[str, tuple[Accepts, str]] = {
    "architectures": (_any, "the class name"),
    "vocab_size": (_positive_int, "a positive int"),
    "hidden_size": (_positive_int, "a positive int"),
    "intermediate_size": (_positive_int, "a positive int"),
    "num_hidden_layers": (_positive_int, "a positive int"),
    "num_attention_heads": (_positive_int, "a positive int"),
    "num_key_value_heads": (_positive_int_or_none, "a positive int dividing num_attention_heads"),
    "head_dim": (_positive_int_or_none, "a positive int"),
    "rms_norm_eps": (_positive_number, "a positive number"),
    "rope_theta": (_positive_number, "a positive number"),
    "rope_scaling": (_any, "default RoPE (checked with rope_parameters)"),
    "rope_parameters": (_any, "default RoPE: rope_type 'default' and rope_theta only"),
    "max_position_embeddings": (_positive_int, "a positive int"),
    "tie_word_embeddings": (_bool, "true or false"),
    "hidden_act": (lambda v: v in ACTIVATIONS, f"one of {list(ACTIVATIONS)} (its MLP is SiLU-gated)"),
    "eos_token_id": (_token_ids, "an id or a list of ids"),
    "torch_dtype": (lambda v: v is None or isinstance(v, str), "a dtype name"),
    "dtype": (lambda v: v is None or isinstance(v, str), "a dtype name"),
}

#: Per architecture: every key its own decoder reads, with the values it implements.
IMPLEMENTED: dict[str, dict[str, tuple[Accepts, str]]] = {
    "LlamaForCausalLM": {
        **_COMMON,
        "attention_bias": (_bool, "true or false (q/k/v/o biases)"),
        "mlp_bias": (_off, "false (graphrt's MLP has no biases)"),
        # transformers 5's Llama reads neither (4.x split its matmuls by pretraining_tp: the same sums)
        "pretraining_tp": (_any, "any (transformers' Llama ignores it)"),
        "sliding_window": (_any, "any (transformers' Llama ignores it)"),
    },
    "MistralForCausalLM": {
        **_COMMON,
        "sliding_window": (_positive_int_or_none, "null or a positive int (every layer slides)"),
        # transformers' Mistral builds no biases whatever these say; graphrt would
        "attention_bias": (_off, "false (transformers' Mistral has no attention biases)"),
        "mlp_bias": (_off, "false"),
    },
    "Qwen3ForCausalLM": {
        **_COMMON,
        "attention_bias": (_bool, "true or false (q/k/v/o biases)"),
        "mlp_bias": (_off, "false (transformers' Qwen3 has no MLP biases)"),
        "use_sliding_window": (_bool, "true or false"),
        "sliding_window": (_positive_int_or_none, "null or a positive int"),
        "max_window_layers": (lambda v: _int(v) and v >= 0, "an int >= 0"),
        "layer_types": (_any, "'full_attention' / 'sliding_attention' per layer"),
    },
}

#: Each architecture's transformers ``model_type`` (a config naming another builds another class).
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen3ForCausalLM": "qwen3"}

#: Keys that must be present: where transformers' config class defaults them to a value graphrt's
#: reading of a missing key would not give (Mistral: 8 KV heads, a 4096 window; Qwen3: 32 KV
#: heads of 128).
REQUIRED: dict[str, tuple[str, ...]] = {
    "LlamaForCausalLM": (),
    "MistralForCausalLM": ("num_key_value_heads", "sliding_window"),
    "Qwen3ForCausalLM": ("num_key_value_heads", "head_dim"),
}
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

#: Keys that change nothing graphrt or transformers computes at inference: names, ids, dtype
#: flags, transformers' bookkeeping (its attention choice too: graphrt attends with its own
#: kernels and checks them against transformers' eager attention), training-only settings (initialisation, dropout: off in
#: eval), generation defaults of older configs (graphrt samples by SamplingParams), and
#: ``auto_map`` (graphrt runs, as transformers without ``trust_remote_code`` does, transformers'
#: own class for ``model_type``).
NEUTRAL = frozenset({
    "_name_or_path", "_commit_hash", "_attn_implementation", "_attn_implementation_autoset",
    "transformers_version", "model_type", "auto_map", "tokenizer_class",
    "id2label", "label2id", "num_labels", "problem_type", "finetuning_task", "prefix", "task_specific_params",
    "bos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "use_return_dict", "torchscript",
    "tf_legacy_loss", "use_bfloat16", "chunk_size_feed_forward", "is_decoder",
    "initializer_range", "attention_dropout",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
})

#: Keys that are neutral only at their no-op value (a decoder-only model without pruned heads).
NEUTRAL_AT: dict[str, tuple[Accepts, str]] = {
    "is_encoder_decoder": (_off, "false"),
    "add_cross_attention": (_off, "false"),
    "tie_encoder_decoder": (_off, "false"),
    "cross_attention_hidden_size": (lambda v: v is None, "null"),
    "pruned_heads": (lambda v: not v, "empty"),
}

#: The RoPE keys graphrt's default rotary reads.
_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta"})
#: ``layer_types`` entries graphrt's decoder runs.
_LAYER_TYPES = ("full_attention", "sliding_attention")


def unimplemented_field(raw: dict[str, Any], arch: str) -> tuple[str, str] | None:
    """``(key, why)`` of the first key (sorted) of config ``raw`` that graphrt's own ``arch`` decoder
    does not implement with its value, or None where it implements them all (module docstring)."""
    table = IMPLEMENTED[arch]
    own = f"graphrt's own {arch} decoder"
    model_type = raw.get("model_type")
    if model_type is not None and model_type != MODEL_TYPES[arch]:
        return "model_type", (f"{model_type!r}: transformers builds that model type's class, not {arch} "
                              f"(model_type {MODEL_TYPES[arch]!r})")
    for key in _SIZES + REQUIRED[arch]:
        if key not in raw:
            return key, (f"missing; {own} would not read it as transformers' config class defaults it"
                         if key in REQUIRED[arch] else f"missing; {own} needs it")
    for key in sorted(raw):
        value = raw[key]
        if key in table:
            accepts, what = table[key]
            if not accepts(value):
                return key, f"{value!r} is not implemented by {own}, which implements {what}"
        elif key in NEUTRAL_AT:
            accepts, what = NEUTRAL_AT[key]
            if not accepts(value):
                return key, f"{value!r}: {own} implements only {what}"
        elif key not in NEUTRAL:
            return key, (f"{own} does not read this key (set to {value!r}), which may change what transformers "
                         "computes; graphrt runs a checkpoint itself only where it implements every key")
    return _rope_problem(raw, own) or _heads_problem(raw, own) or _layer_types_problem(raw, arch, own)


def _rope_problem(raw: dict[str, Any], own: str) -> tuple[str, str] | None:
    """Default RoPE only, one theta: ``rope_scaling`` / ``rope_parameters`` with any other type
    or any other parameter (a factor, a partial rotary factor, per-layer dicts) are not."""
    for field in ("rope_scaling", "rope_parameters"):
        rope = raw.get(field)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            return field, f"{rope!r} is not a dict of RoPE parameters"
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            return field, f"rope_type {kind!r} is not implemented by {own} (default RoPE only)"
        extra = sorted(set(rope) - _ROPE_KEYS)
        if extra:
            return field, f"{extra} are not implemented by {own} (default RoPE reads rope_type and rope_theta)"
    sources = (raw, raw.get("rope_parameters") or {}, raw.get("rope_scaling") or {})
    thetas = [rope["rope_theta"] for rope in sources if "rope_theta" in rope]
    if not all(_positive_number(theta) for theta in thetas):
        return "rope_theta", f"{thetas!r}: not a positive number"
    if len({float(theta) for theta in thetas}) > 1:
        return "rope_theta", f"{thetas}: the top-level rope_theta and the RoPE parameters' differ"
    return None


def _heads_problem(raw: dict[str, Any], own: str) -> tuple[str, str] | None:
    heads, kv = raw["num_attention_heads"], raw.get("num_key_value_heads") or raw["num_attention_heads"]
    if heads % kv:
        return "num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}"
    return None


def _layer_types_problem(raw: dict[str, Any], arch: str, own: str) -> tuple[str, str] | None:
    """Qwen3's ``layer_types``: one full or sliding entry per layer, sliding ones with a window."""
    types = raw.get("layer_types")
    if arch != "Qwen3ForCausalLM" or types is None:
        return None
    layers = raw["num_hidden_layers"]
    if not isinstance(types, list) or len(types) != layers or any(t not in _LAYER_TYPES for t in types):
        return "layer_types", f"{types!r}: {own} implements one of {list(_LAYER_TYPES)} per layer ({layers})"
    if "sliding_attention" in types and not (raw.get("use_sliding_window") and raw.get("sliding_window")):
        return "layer_types", ("sliding_attention layers without a window (use_sliding_window false or "
                               "sliding_window null) are not implemented by " + own)
    return None


__all__ = ["ACTIVATIONS", "IMPLEMENTED", "MODEL_TYPES", "NEUTRAL", "NEUTRAL_AT", "REQUIRED", "unimplemented_field"]
