"""Qwen3-Next's fields of :class:`~graphrt.models.hybrid_config.HybridConfig` (framework-free):
gated delta-net layers ("linear_attention") and gated attention layers ("full_attention") with
q/k norms and partial rotary, experts with a gated shared expert, zero-centred norms."""

from __future__ import annotations

from typing import Any

from graphrt.core.errors import InputError

_KINDS = {"linear_attention": "gated_delta_net", "full_attention": "attention"}


def qwen3_next_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The :class:`HybridConfig` fields of a ``Qwen3NextForCausalLM`` config.json."""
    layers = int(raw["num_hidden_layers"])
    names = raw.get("layer_types") or ["linear_attention" if (i + 1) % int(raw.get("full_attention_interval", 4))
                                       else "full_attention" for i in range(layers)]
    kinds = tuple(_KINDS.get(name, "") for name in names)
    if len(kinds) != layers or "" in kinds:
        raise InputError("layer_types", f"{names}: one of {sorted(_KINDS)} per layer ({layers})")
    if raw.get("mlp_only_layers") or int(raw.get("decoder_sparse_step", 1)) != 1 or not int(raw.get("num_experts", 0)):
        raise InputError("mlp_only_layers", "graphrt's Qwen3-Next has experts in every layer "
                                            "(decoder_sparse_step 1, no mlp_only_layers, num_experts > 0)")
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise InputError("rope_parameters", f"{rope} not supported (only default rotary)")
    heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // heads)
    factor = float(raw.get("partial_rotary_factor") or rope.get("partial_rotary_factor", 0.25))
    return dict(layer_kinds=kinds, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                num_attention_heads=heads, num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=head_dim, attention_bias=bool(raw.get("attention_bias", False)),
                rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta", 10000.0)),
                rotary_dim=int(head_dim * factor), qk_norm=True, attention_output_gate=True,
                conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
                chunk_size=int(raw.get("linear_chunk_size", 64)),       # (graphrt's own key; transformers: 64)
                delta_key_heads=int(raw["linear_num_key_heads"]), delta_value_heads=int(raw["linear_num_value_heads"]),
                delta_key_dim=int(raw["linear_key_head_dim"]), delta_value_dim=int(raw["linear_value_head_dim"]),
                mamba_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), mlp="qwen3_next",
                intermediate_size=int(raw.get("moe_intermediate_size", 0)),
                shared_intermediate_size=int(raw.get("shared_expert_intermediate_size", 0)),
                num_experts=int(raw["num_experts"]), num_experts_per_tok=int(raw.get("num_experts_per_tok", 1)),
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)), zero_centered_norm=True)


__all__ = ["qwen3_next_fields"]
