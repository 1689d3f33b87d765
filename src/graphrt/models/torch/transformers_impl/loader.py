"""Load any transformers causal LM that supports attention backends as a graphrt model.

:func:`load_transformers_model` reads the checkpoint through transformers' own
``AutoModelForCausalLM.from_pretrained`` (graphrt reads no weight itself), with attention routed
to graphrt (``interface.ATTENTION_NAME``) and the MoE experts on a capturable implementation
(``moe.py``); with ``tp_size > 1`` it then shards the model by its ``base_model_tp_plan``
(``tensor_parallel.py``). transformers is imported here, only when this backend is used
(``pip install graphrt[transformers]``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from graphrt.core.errors import ConfigError, InputError
from graphrt.models.torch.transformers_impl.facts import layer_facts, position_offset, text_config
from graphrt.models.torch.transformers_impl.interface import ATTENTION_NAME, register_attention
from graphrt.models.torch.transformers_impl.model import TransformersForCausalLM, body_of
from graphrt.models.torch.transformers_impl.moe import experts_blocker, experts_implementation
from graphrt.models.torch.transformers_impl.recurrent import recurrent_mixers, route_recurrent_mixers, served_types
from graphrt.models.torch.transformers_impl.rope import route_length_rope

#: Tested range of the optional dependency (pyproject's ``transformers`` extra says the same).
TRANSFORMERS_RANGE = ">=5.0,<6"


def import_transformers() -> Any:
    """The transformers package, or a ConfigError saying how to install it."""
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(f"model_impl='transformers' needs the transformers package ({TRANSFORMERS_RANGE}): "
                          f"pip install 'graphrt[transformers]' ({exc})") from None
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise ConfigError(f"model_impl='transformers' needs transformers {TRANSFORMERS_RANGE}, found "
                          f"{transformers.__version__}")
    return transformers


def causal_lm_class(config: Any) -> type:
    """The ``*ForCausalLM`` class transformers maps ``config`` to, checked to support attention backends."""
    transformers = import_transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if name is None:
        raise ConfigError(f"model_type {config.model_type!r} has no causal-LM class in transformers "
                          f"{transformers.__version__}: model_impl='transformers' runs causal LMs only")
    cls = getattr(transformers, name)
    if not getattr(cls, "_supports_attention_backend", False):
        raise ConfigError(f"{name} does not declare _supports_attention_backend in transformers "
                          f"{transformers.__version__}: its attention does not go through AttentionInterface, so "
                          "graphrt cannot give it a paged KV cache")
    return cls


def dynamic_rope_blocker(model: torch.nn.Module) -> str | None:
    """Why a dynamic RoPE keeps ``model`` out of graphs, or None: it recomputes its frequencies
    when a step's largest position exceeds what it cached, a host read of a device value."""
    for name, module in model.named_modules():
        rope = getattr(module, "rope_type", None)
        kinds = rope.values() if isinstance(rope, dict) else [rope]
        if any(isinstance(k, str) and "dynamic" in k for k in kinds):
            return (f"dynamic RoPE ({name}, rope_type {rope!r}) reads the step's largest position on the host "
                    "(torch.max(position_ids) compared in Python) to recompute its frequencies; no device graph "
                    "can hold it: run it eagerly (graph mode NONE)")
    return None


def silence_padding_check(hf_model: torch.nn.Module) -> None:
    """Turn off transformers' "input_ids may be padded" warning check on every model in ``hf_model``:
    it reads ids on the host (a host sync in a graph) and never applies -- graphrt's packed rows hold
    each request's own tokens, never padding between them."""
    from transformers import PreTrainedModel

    for module in hf_model.modules():
        if isinstance(module, PreTrainedModel):
            module.warn_if_padding_and_no_attention_mask = _no_padding_check


def _no_padding_check(*args: Any, **kwargs: Any) -> None:
    return None


def wrap_transformers_model(hf_model: torch.nn.Module, tp_rank: int = 0, tp_size: int = 1) -> TransformersForCausalLM:
    """``hf_model`` (loaded with ``attn_implementation="graphrt"``) as a graphrt model: its layers
    probed (``facts.py``), its recurrent mixers routed to graphrt's kernels (``recurrent.py``)
    and what keeps it out of graphs named."""
    if getattr(hf_model.config, "_attn_implementation", None) != ATTENTION_NAME:
        raise ConfigError(f"{type(hf_model).__name__} attends with {hf_model.config._attn_implementation!r}; load it "
                          f"with attn_implementation={ATTENTION_NAME!r} (load_transformers_model does)")
    hf_model.eval().requires_grad_(False)
    silence_padding_check(hf_model)
    route_length_rope(hf_model)          # dynamic / longrope RoPE per token, not per step (rope.py)
    blocker = dynamic_rope_blocker(hf_model) or experts_blocker(hf_model)
    body = body_of(hf_model)
    found = recurrent_mixers(hf_model)
    _refuse_sharded_state(hf_model, found, tp_size)
    facts = layer_facts(hf_model, body, served_types(hf_model, text_config(hf_model.config), found))
    offset = position_offset(hf_model, body)
    routed = route_recurrent_mixers(hf_model, found)
    return TransformersForCausalLM(hf_model, facts, blocker, tp_rank, tp_size, offset, routed)


def _refuse_sharded_state(hf_model: torch.nn.Module, found: list, tp_size: int) -> None:
    """Routed recurrent mixers run whole on one rank: refused under tensor parallelism."""
    if found and tp_size > 1:
        raise ConfigError(f"{type(hf_model).__name__}: tp_size={tp_size}, but its recurrent mixers "
                          f"({found[0][1]} ...) are not sharded by graphrt's transformers backend; run it with "
                          "tp_size=1 (or graphrt's own hybrid model, docs/hybrid.md)")


def load_transformers_model(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                            device: str | torch.device = "cpu", tp_rank: int = 0, tp_size: int = 1,
                            group: Any = None, experts: str | None = None) -> TransformersForCausalLM:
    """``model_dir`` through transformers' ``from_pretrained`` in ``dtype`` on ``device``, as a
    :class:`TransformersForCausalLM`; ``tp_size > 1``: rank ``tp_rank``'s shard over ``group`` by
    the model's ``base_model_tp_plan``. ``experts``: transformers' experts implementation
    (default :data:`moe.DEFAULT_EXPERTS`; "eager" runs, eagerly only)."""
    import_transformers()
    from transformers import AutoConfig

    path = os.fspath(model_dir)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise InputError("model_dir", f"{path} has no config.json")
    config = AutoConfig.from_pretrained(path)
    cls = causal_lm_class(config)
    register_attention()
    if hasattr(text_config(config), "output_router_logits"):
        text_config(config).output_router_logits = False       # inference: no auxiliary loss
    kwargs = {}
    if cls._can_set_experts_implementation():             # a MoE model with transformers' experts interface
        kwargs["experts_implementation"] = experts_implementation(experts)
    hf_model = cls.from_pretrained(path, config=config, dtype=dtype, attn_implementation=ATTENTION_NAME, **kwargs)
    hf_model = hf_model.to(device)
    if tp_size > 1:
        from graphrt.models.torch.transformers_impl.tensor_parallel import (check_head_shards, shard_by_plan,
                                                                            without_collectives)

        _refuse_sharded_state(hf_model, recurrent_mixers(hf_model), tp_size)
        full = layer_facts(hf_model, body_of(hf_model))
        shard_by_plan(hf_model, tp_rank, tp_size, group)
        with without_collectives():      # rank 0 loads before the process group exists
            model = wrap_transformers_model(hf_model, tp_rank, tp_size)
        check_head_shards(full, list(model.facts), tp_size)
    else:
        model = wrap_transformers_model(hf_model)
    model.source_dir = path
    return model


__all__ = ["TRANSFORMERS_RANGE", "causal_lm_class", "dynamic_rope_blocker", "import_transformers",
           "load_transformers_model", "wrap_transformers_model"]
