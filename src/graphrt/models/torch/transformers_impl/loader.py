"""Load any transformers causal LM that supports attention backends as a graphrt model.

:func:`load_transformers_model` reads the checkpoint through transformers' own
``AutoModelForCausalLM.from_pretrained`` (graphrt reads no weight itself, only the safetensors
headers, checked first), with attention routed to graphrt (``interface.ATTENTION_NAME``) and the
MoE experts on a capturable implementation (``moe.py``); with ``tp_size > 1`` it then shards the
model by its ``base_model_tp_plan`` (``tensor_parallel.py``). What transformers would paper over
is refused with the file and the key named: a tensor missing (its random initialisation),
unexpected or misshapen (its loading report, :func:`check_loading_info`), a ``config.json``
without a known ``model_type``; a checkpoint's own code (``auto_map``) runs only with
``trust_remote_code`` and is never asked about on stdin. transformers is imported here, only
when this backend is used (``pip install graphrt[transformers]``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from safetensors import SafetensorError

from graphrt.core.errors import ConfigError, InputError
from graphrt.models.checkpoint import NAMES_SHOWN, names_with_files, tensor_files
from graphrt.models.model_impl import read_config_json
from graphrt.models.torch.transformers_impl.facts import (layer_facts, number_attention_by_layer, own_temperature,
                                                           position_offset, text_config)
from graphrt.models.torch.transformers_impl.experts import route_experts, routing_blocker
from graphrt.models.torch.transformers_impl.interface import ATTENTION_NAME, register_attention
from graphrt.models.torch.transformers_impl.model import TransformersForCausalLM, body_of
from graphrt.models.torch.transformers_impl.moe import experts_blocker, experts_implementation
from graphrt.models.torch.transformers_impl.recurrent import (check_attention_routed, recurrent_mixers,
                                                                route_recurrent_mixers, routed_mixer_classes,
                                                                served_types)
from graphrt.models.torch.transformers_impl.rope import route_length_rope
from graphrt.models.torch.weight_check import warn_non_finite

logger = logging.getLogger(__name__)

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


def causal_lm_class(config: Any, model_dir: str | None = None, trust_remote_code: bool = False) -> type:
    """The ``*ForCausalLM`` class transformers maps ``config`` to -- with ``trust_remote_code``,
    the class the checkpoint's ``auto_map`` names in ``model_dir``'s own code, as transformers'
    ``AutoModelForCausalLM`` takes it -- checked to support attention backends, or to be a
    recurrent or hybrid model whose mixers graphrt routes (``recurrent.py``: its attention layers
    are then checked in the layer probe, and the choice is logged)."""
    transformers = import_transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    ref = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM")
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if ref is not None and trust_remote_code and model_dir is not None:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        cls = get_class_from_dynamic_module(ref, model_dir)
        name = cls.__name__
    elif name is None:
        if ref is not None:
            raise ConfigError(remote_code_refusal(model_dir or "the checkpoint", {"AutoModelForCausalLM": ref}))
        raise ConfigError(f"model_type {config.model_type!r} has no causal-LM class in transformers "
                          f"{transformers.__version__}: model_impl='transformers' runs causal LMs only")
    else:
        cls = getattr(transformers, name)
    mixers = routed_mixer_classes(cls)
    if not getattr(cls, "_supports_attention_backend", False) and mixers:
        logger.info("graphrt: %s does not declare _supports_attention_backend; loading it anyway: graphrt routes its "
                    "recurrent mixers (%s) to its own kernels and checks that every attention layer of its "
                    "layer_types calls AttentionInterface", name, ", ".join(mixers))
    elif not getattr(cls, "_supports_attention_backend", False):
        raise ConfigError(f"{name} does not declare _supports_attention_backend in transformers "
                          f"{transformers.__version__}: its attention does not go through AttentionInterface, so "
                          "graphrt cannot give it a paged KV cache")
    return cls


def remote_code_refusal(model_dir: str, auto_map: dict[str, Any]) -> str:
    """Why a checkpoint whose ``auto_map`` needs its own code is refused, and how to opt in."""
    return (f"trust_remote_code: {os.path.join(model_dir, 'config.json')} maps {sorted(auto_map)} to code of the "
            f"checkpoint ({', '.join(sorted(set(map(str, auto_map.values()))))}) that transformers has no built-in "
            "class for; graphrt runs a checkpoint's code only when asked: read it, then pass "
            "trust_remote_code=True (graphrt.LLM, GraphConfig, --trust-remote-code)")


def transformers_config(model_dir: str, trust_remote_code: bool = False) -> Any:
    """transformers' config of the checkpoint ``model_dir``, read without ever asking on stdin:
    a checkpoint that needs its own code without ``trust_remote_code`` is a ConfigError saying
    how to opt in; a ``config.json`` that is not JSON, lacks ``model_type``, names one transformers
    does not know or holds values it refuses is an InputError naming the file and the key."""
    transformers = import_transformers()
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    raw = read_config_json(model_dir)
    file = os.path.join(model_dir, "config.json")
    auto_map = raw.get("auto_map") if isinstance(raw.get("auto_map"), dict) else {}
    model_type = raw.get("model_type")
    known = isinstance(model_type, str) and model_type in CONFIG_MAPPING
    if "AutoConfig" in auto_map and not known and not trust_remote_code:
        raise ConfigError(remote_code_refusal(model_dir, auto_map))
    if not (trust_remote_code and "AutoConfig" in auto_map):
        if model_type is None:
            raise InputError("model_type", f"{file} has none: transformers chooses the model's classes by it "
                                           "(e.g. \"llama\")")
        if not known:
            raise InputError("model_type", f"{model_type!r} in {file} is no model type transformers "
                                           f"{transformers.__version__} knows")
    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (ValueError, TypeError, KeyError) as exc:
        raise InputError("config.json", f"{file}: transformers refuses it ({type(exc).__name__}: {exc})") from None


def check_loading_info(model_dir: str, cls: type, info: dict[str, Any], files: dict[str, str]) -> None:
    """InputError listing every tensor transformers' ``from_pretrained`` did not load as it is:
    missing (transformers would serve its random initialisation), unexpected (no place in
    ``cls``), or of another shape than the config's. ``info`` is its ``output_loading_info``,
    already without what the class ignores by design (``_keys_to_ignore_on_load_*``, tied
    weights, old rotary buffers); ``files``: tensor -> file, to name each one's."""
    problems = []
    if info.get("missing_keys"):
        problems.append(f"missing tensors {names_with_files(info['missing_keys'], files)} (transformers would serve "
                        "its random initialisation for them)")
    if info.get("unexpected_keys"):
        problems.append(f"unexpected tensors {names_with_files(info['unexpected_keys'], files)} ({cls.__name__} "
                        "has no place for them)")
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda m: m[0])
    if mismatched:
        shown = "; ".join(f"{key}{f' ({files[key]})' if key in files else ''} has shape {tuple(ckpt)}, the config "
                          f"makes it {tuple(want)}" for key, ckpt, want in mismatched[:NAMES_SHOWN])
        problems.append(f"{len(mismatched)} tensor(s) of another shape than config.json's: {shown}")
    if info.get("error_msgs"):
        problems.append("; ".join(map(str, info["error_msgs"])))
    if problems:
        raise InputError("checkpoint", f"{model_dir} does not hold the {cls.__name__} its config.json describes: "
                                       + "; ".join(problems))


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


def wrap_transformers_model(hf_model: torch.nn.Module, tp_rank: int = 0, tp_size: int = 1,
                            experts: str | None = None) -> TransformersForCausalLM:
    """``hf_model`` (loaded with ``attn_implementation="graphrt"``) as a graphrt model: its layers
    probed (``facts.py``), its recurrent mixers routed to graphrt's kernels (``recurrent.py``),
    its experts modules of a known layout outside transformers' experts interface routed to
    graphrt's grouped path (``experts.py``; ``experts``: as :func:`load_transformers_model`'s)
    and what keeps it out of graphs named."""
    if getattr(hf_model.config, "_attn_implementation", None) != ATTENTION_NAME:
        raise ConfigError(f"{type(hf_model).__name__} attends with {hf_model.config._attn_implementation!r}; load it "
                          f"with attn_implementation={ATTENTION_NAME!r} (load_transformers_model does)")
    hf_model.eval().requires_grad_(False)
    silence_padding_check(hf_model)
    route_length_rope(hf_model)          # dynamic / longrope RoPE per token, not per step (rope.py)
    route_experts(hf_model, experts_implementation(experts))
    blocker = experts_blocker(hf_model) or routing_blocker(hf_model)
    body = body_of(hf_model)
    numbered = number_attention_by_layer(hf_model)
    if numbered:
        logger.info("graphrt: %s's attention modules %s take their layer from their caller; each is numbered by the "
                    "decoder layer holding it, so that each use keeps a KV cache of its own", type(hf_model).__name__,
                    numbered)
    found = recurrent_mixers(hf_model)
    _refuse_sharded_state(hf_model, found, tp_size)
    facts = layer_facts(hf_model, body, served_types(hf_model, text_config(hf_model.config), found))
    check_attention_routed(hf_model, text_config(hf_model.config), [f.layer_idx for f in facts])
    offset = position_offset(hf_model, body)
    if indexed := [f.path for f in facts if f.index]:
        logger.info("%s: the DSA indexers of %s return their projections to graphrt, which keeps their keys in the "
                    "paged cache and selects the top-k on the device (transformers_impl/indexer.py)",
                    type(hf_model).__name__, indexed)
    if patched := own_temperature(hf_model, facts):
        logger.info("%s: query temperature of %s applied by graphrt at each token's position (transformers' "
                    "numbers the packed row from 0)", type(hf_model).__name__, patched)
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
                            group: Any = None, experts: str | None = None,
                            trust_remote_code: bool = False) -> TransformersForCausalLM:
    """``model_dir`` through transformers' ``from_pretrained`` in ``dtype`` on ``device``, as a
    :class:`TransformersForCausalLM`; ``tp_size > 1``: rank ``tp_rank``'s shard over ``group`` by
    the model's ``base_model_tp_plan``. ``experts``: transformers' experts implementation
    (default :data:`moe.DEFAULT_EXPERTS`; "eager" runs, eagerly only), also for the experts
    modules graphrt routes itself (``experts.py``). ``trust_remote_code``: run
    the checkpoint's own code where its ``auto_map`` names some (never asked on stdin).

    A checkpoint that is not the model its config describes -- a tensor missing, unexpected or of
    another shape, a truncated file -- is an InputError naming the tensors and files
    (:func:`check_loading_info`), never a random initialisation; weights holding NaN or inf are
    named in a warning."""
    path = os.fspath(model_dir)
    config = transformers_config(path, trust_remote_code)
    cls = causal_lm_class(config, path, trust_remote_code)
    files = tensor_files(path)                 # every safetensors header checked: truncation named
    register_attention()
    if hasattr(text_config(config), "output_router_logits"):
        text_config(config).output_router_logits = False       # inference: no auxiliary loss
    kwargs = {}
    if cls._can_set_experts_implementation():             # a MoE model with transformers' experts interface
        kwargs["experts_implementation"] = experts_implementation(experts)
    try:
        hf_model, info = cls.from_pretrained(path, config=config, dtype=dtype, attn_implementation=ATTENTION_NAME,
                                             trust_remote_code=trust_remote_code, ignore_mismatched_sizes=True,
                                             output_loading_info=True, **kwargs)
    except (SafetensorError, OSError) as exc:
        raise InputError("checkpoint", f"transformers cannot read the weights of {path}: {exc}") from None
    check_loading_info(path, cls, info, files)
    hf_model = hf_model.to(device)
    warn_non_finite(hf_model, path)
    if tp_size > 1:
        from graphrt.models.torch.transformers_impl.tensor_parallel import (check_head_shards, shard_by_plan,
                                                                            without_collectives)

        _refuse_sharded_state(hf_model, recurrent_mixers(hf_model), tp_size)
        full = layer_facts(hf_model, body_of(hf_model))
        shard_by_plan(hf_model, tp_rank, tp_size, group)
        with without_collectives():      # rank 0 loads before the process group exists
            model = wrap_transformers_model(hf_model, tp_rank, tp_size, experts)
        check_head_shards(full, list(model.facts), tp_size)
    else:
        model = wrap_transformers_model(hf_model, experts=experts)
    model.source_dir = path
    model.trust_remote_code = trust_remote_code      # tensor-parallel ranks load the same way
    return model


__all__ = ["TRANSFORMERS_RANGE", "causal_lm_class", "check_loading_info",
           "import_transformers", "load_transformers_model", "remote_code_refusal", "transformers_config",
           "wrap_transformers_model"]
