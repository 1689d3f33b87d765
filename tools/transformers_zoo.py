"""Tiny random checkpoints of every transformers causal LM that supports attention backends.

No network: :func:`tiny_config` makes each architecture's config class small (2 layers, 64 wide,
a vocabulary of 128, 4 experts of which 2 are routed, one sliding and one full layer where the
config has ``layer_types``, windows of :data:`SLIDING_WINDOW` tokens so that test prompts slide);
:func:`tiny_checkpoint` builds the model from it, draws seeded weights whose logits are O(1)
(norm weights near 1, matrices scaled by their fan-in), and saves it with
``save_pretrained``. :func:`architectures` lists the causal-LM model types of the installed
transformers that declare ``_supports_attention_backend`` (or whose recurrent mixers graphrt
routes) and have a text config of their own
(a multimodal one is covered by its text model type, e.g. ``gemma3`` by ``gemma3_text``).

The matrix (``tools/transformers_matrix.py``) and the tests build their models here. A developer
tool, outside the installed package (tests put ``tools/`` on ``sys.path``); the seeded weights are
:mod:`graphrt.testing.random_weights`' (the installed hybrid sweep builds its models with them too).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from graphrt.testing.random_weights import SEED, saved_random_model

#: The shape every tiny model shares (keys a config does not have are left out).
TINY: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
    # MoE: 4 experts, 2 routed per token, small experts; layer 0 dense where the config says so
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1, moe_topk=2,
    # MLA
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    # partial rotary of GPT-J / CodeGen; decoders that are encoder classes too (BERT-likes)
    rotary_dim=8, is_decoder=True,
)
#: What a config class needs beyond :data:`TINY` to be tiny and consistent (its own field names).
ARCH_OVERRIDES: dict[str, dict[str, Any]] = {
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=256,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
    "xmod": dict(default_language="en_XX"),
    "zaya": dict(num_experts_per_tok=1),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "lfm2": dict(layer_types=["conv", "full_attention"]),      # its default layer_types are all attention
    # a Mamba2 layer beside an attention layer (its default layer_types are all Mamba2), SSD chunks of 4
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], mamba_chunk_size=4),
    "dots3_note_text": dict(num_key_value_heads=4),
    "recurrent_gemma": dict(layer_types=None, block_types=["recurrent", "attention"]),
    # Mamba1 models: layer_types is derived (Jamba's from its periods: a Mamba1 layer, then attention with experts)
    "mamba": dict(layer_types=None), "falcon_mamba": dict(layer_types=None),
    "jamba": dict(layer_types=None, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1),
    # Bamba: layers_block_type is derived from attn_layer_indices; Mamba2 heads of 32, SSD chunks of 4
    "bamba": dict(layer_types=None, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
                  mamba_n_groups=2, mamba_chunk_size=4),
    # Mamba2 hybrids outside the attention-backend flag: Mamba2 heads of 32, SSD chunks of 4. Nemotron-H: one layer
    # of each kind (Mamba2, experts, attention, MLP); Falcon-H1: attention beside a Mamba2 mixer in every layer;
    # Zamba2: two hybrid layers (a Mamba2 mixer each, after the shared attention block, whose adapters need KV
    # heads = heads and heads of 2 * hidden / heads); its head stays tied (untying unties the shared block too)
    "nemotron_h": dict(layer_types=["linear_attention", "moe", "full_attention", "mlp"], mamba_num_heads=4,
                       mamba_head_dim=32, ssm_state_size=16, n_groups=2, chunk_size=4,
                       moe_shared_expert_intermediate_size=32),
    "falcon_h1": dict(layer_types=None, mamba_d_ssm=128, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2,
                      mamba_d_state=16, mamba_chunk_size=4),
    "zamba2": dict(layer_types=None, layers_block_type=["hybrid", "hybrid"], num_hidden_layers=2,
                   num_key_value_heads=4, head_dim=32, n_mamba_heads=4, mamba_d_state=16, mamba_ngroups=2, chunk_size=4,
                   use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True),
    "gemma3n_text": dict(num_kv_shared_layers=0, intermediate_size=[128, 128], activation_sparsity_pattern=[0.0, 0.0]),
    # chunked local attention: RoPE layers in chunks of SLIDING_WINDOW tokens, NoPE layers full (Llama 4's pattern)
    "llama4_text": dict(layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0],
                        attention_chunk_size=8),
    # DSA: a top-k shorter than the prompts; 16 indexer heads (an exact tie of two keys' scores is unlikely)
    "deepseek_v32": dict(index_topk=4, index_n_heads=16, index_head_dim=16),
    "glm_moe_dsa": dict(index_topk=4, index_n_heads=16, index_head_dim=16),
    "axk2": dict(index_topk=4, index_n_heads=16, index_head_dim=16),
    "hy_v4": dict(index_topk=4, index_n_heads=16, index_head_dim=16, indexer_types=["full", "shared"]),  # 2nd reuses
    # block-sparse attention: a sparse layer then a dense one; blocks of 4 keys, the own block and the best other
    "minimax_m3_vl_text": dict(layer_types=["minimax_m3_sparse", "full_attention"], index_n_heads=2, index_head_dim=16,
                               index_block_size=4, index_topk_blocks=2, index_local_blocks=1),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}
#: Windows of the tiny models' sliding layers: shorter than most test prompts.
SLIDING_WINDOW = 8


def _config_class(model_type: str) -> type:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def causal_lm_name(model_type: str) -> str | None:
    """The ``*ForCausalLM`` class name transformers maps ``model_type`` to (None: none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


def architectures() -> dict[str, str | None]:
    """Every causal-LM model type whose class declares ``_supports_attention_backend`` or defines a
    recurrent mixer graphrt routes (Mamba, Jamba, Qwen3-Next, ...: ``transformers_impl/recurrent.py``):
    None where the matrix builds it, else why it does not (a multimodal config, a config that
    cannot be made)."""
    import transformers

    from graphrt.models.torch.transformers_impl.recurrent import routed_mixer_classes
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out: dict[str, str | None] = {}
    for model_type, name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        cls = getattr(transformers, name, None)
        if cls is None or not (getattr(cls, "_supports_attention_backend", False) or routed_mixer_classes(cls)):
            continue
        try:
            config = _config_class(model_type)()
            text = config.get_text_config(decoder=True)
        except Exception as exc:  # noqa: BLE001 - the reason goes into the matrix
            out[model_type] = f"its config class cannot be built with defaults ({type(exc).__name__}: {exc})"
            continue
        towers = [k for k in ("vision_config", "audio_config", "vision_tower") if getattr(config, k, None)]
        if text is not config or towers:
            out[model_type] = (f"a multimodal config ({type(config).__name__}); its decoder is "
                               f"{text.model_type!r}" if text is not config else
                               f"a multimodal config ({type(config).__name__}, with {towers})")
        else:
            out[model_type] = None
    return out


def _has(config: Any, key: str) -> bool:
    try:
        return hasattr(config, key)
    except Exception:  # noqa: BLE001 - per-layer configs raise on ambiguous globals
        return False


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """``model_type``'s config class made tiny (module docstring), ``overrides`` applied last."""
    cls = _config_class(model_type)
    default = cls()
    kwargs = {k: v for k, v in TINY.items() if _has(default, k)}
    if _has(default, "sliding_window") and getattr(default, "sliding_window", None):
        kwargs["sliding_window"] = SLIDING_WINDOW
    if _has(default, "first_k_dense_replace"):
        kwargs["first_k_dense_replace"] = 1
    if _has(default, "mlp_only_layers"):
        kwargs["mlp_only_layers"] = []
    if _has(default, "qk_rope_head_dim"):           # MLA: the rotary part is head_dim, K per query head
        kwargs["head_dim"] = TINY["qk_rope_head_dim"]
        kwargs["num_key_value_heads"] = TINY["num_attention_heads"]
    types = getattr(default, "layer_types", None) if _has(default, "layer_types") else None
    if types:       # two layers of the two first kinds: sliding and full where it has both
        kinds = sorted(dict.fromkeys(types), key=lambda k: ("sliding_attention", "full_attention", k).index(k))
        kwargs["layer_types"] = ((kinds[:2]) * 2)[:2]
    kwargs.update(ARCH_OVERRIDES.get(model_type, {}))
    kwargs.update(overrides)
    kwargs = {k: v for k, v in kwargs.items() if not (k == "layer_types" and v is None)}  # a derived property
    return cls(**kwargs)


@functools.lru_cache(maxsize=None)
def _build(model_type: str, seed: int, overrides_json: str) -> Path:
    import transformers

    config = tiny_config(model_type, **json.loads(overrides_json))
    return saved_random_model(lambda: getattr(transformers, causal_lm_name(model_type))(config), f"{model_type}-", seed)


def tiny_checkpoint(model_type: str, *, seed: int = SEED, **overrides: Any) -> Path:
    """A checkpoint directory of the tiny ``model_type`` model, built once per process per arguments
    (read-only; ``overrides`` are config fields, JSON values)."""
    return _build(model_type, seed, json.dumps(overrides, sort_keys=True))


def load_reference(model_dir: str | os.PathLike) -> Any:
    """The checkpoint as transformers runs it on its own: float32, eager attention, eval mode."""
    import torch
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    cls = getattr(transformers, causal_lm_name(config.model_type))
    return cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                               trust_remote_code=False).eval()


def reference_logits(model: Any, token_ids: list[int], position_offset: int = 0) -> Any:
    """transformers' float32 logits ``[len(token_ids), vocab]`` of one sequence, teacher-forced;
    token ``i`` at position ``position_offset + i`` (transformers' own numbering of a sequence
    without padding ids: RoBERTa-like models otherwise skip any padding id inside it)."""
    import torch

    ids = torch.as_tensor([token_ids], dtype=torch.long)
    positions = torch.arange(len(token_ids))[None] + position_offset
    with torch.no_grad():
        return model(input_ids=ids, position_ids=positions, use_cache=False).logits[0].float()


def reference_offset(model: Any) -> int:
    """The position offset of transformers' numbering for ``model`` (``facts.position_offset``)."""
    from graphrt.models.torch.transformers_impl.facts import position_offset
    from graphrt.models.torch.transformers_impl.model import body_of

    return position_offset(model, body_of(model))


__all__ = ["SEED", "SLIDING_WINDOW", "TINY", "architectures", "causal_lm_name", "load_reference",
           "reference_logits", "reference_offset", "tiny_checkpoint", "tiny_config"]
