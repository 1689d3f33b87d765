"""Refusing what graphrt.LLM cannot run before it does anything: its configuration before the
model is loaded (:func:`engine_config`), a request before it is queued (prompt and params)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from graphrt.backends.preflight import check_engine
from graphrt.config import GraphConfig
from graphrt.core import defaults
from graphrt.core.errors import InputError
from graphrt.core.sampling.batch import check_logprobs_limit
from graphrt.engine.sampling_params import SamplingParams
from graphrt.models.hf_config import model_max_len
from graphrt.models.model_impl import checkpoint_limits
from graphrt.core.kv_spec import blocks_for


def engine_config(model: Any, config: GraphConfig | None, max_model_len: int | None, **fields: Any) -> GraphConfig:
    """graphrt.LLM's config, checked before anything is loaded: ``config`` as given, else one of
    ``fields`` whose ``max_model_len`` defaults to the model's ``max_position_embeddings`` (at
    most ``defaults.DEFAULT_MAX_MODEL_LEN``); the engine's host tables within physical RAM."""
    if config is None:
        if max_model_len is None:
            path = isinstance(model, str) or hasattr(model, "__fspath__")
            model_len = checkpoint_limits(model)[0] if path else model_max_len(model)   # any architecture's
            max_model_len = min(model_len or defaults.DEFAULT_MAX_MODEL_LEN, defaults.DEFAULT_MAX_MODEL_LEN)
        config = GraphConfig.create(max_model_len=max_model_len, **fields)
    check_engine(config)
    return config


def params_per_prompt(prompts: Sequence[Sequence[int]],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[SamplingParams]:
    """One SamplingParams per prompt: ``None`` (the defaults) or one object for all, or a
    sequence of exactly one per prompt (else InputError naming ``sampling_params``)."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * len(prompts)
    params = list(sampling_params)
    if len(params) != len(prompts):
        raise InputError("sampling_params", f"{len(params)} params for {len(prompts)} prompts")
    return params


def validate_request(prompt: Sequence[int], params: SamplingParams, where: str, *, config: GraphConfig,
                     vocab_size: int, kv_capacity: int) -> None:
    """Refuse a request before it is queued: params not a SamplingParams (which checked its
    own fields) or asking more logprobs than ``max_logprobs``, a prompt that is not a flat
    sequence of integer token ids, or one that cannot fit (``max_model_len``, ``kv_capacity``
    blocks). Raises InputError naming ``where`` (or the params' field)."""
    cfg = config
    if not isinstance(params, SamplingParams):
        raise InputError("sampling_params", f"expected graphrt.SamplingParams, got {type(params).__name__}")
    check_logprobs_limit(params.logprobs, cfg.max_logprobs)
    check_logprobs_limit(params.prompt_logprobs, cfg.max_logprobs, "prompt_logprobs")
    try:
        ids = np.asarray(prompt)
    except (ValueError, TypeError):   # ragged nesting
        raise InputError(where, "must be a flat sequence of integer token ids, got a ragged "
                                "nested sequence") from None
    if ids.ndim != 1:
        raise InputError(where, "must be a flat sequence of integer token ids, got "
                                + (f"{ids.ndim}-D nested sequences" if ids.ndim > 1 else repr(prompt)))
    if len(ids) == 0:
        raise InputError(where, "empty prompt: at least one token is needed")
    if ids.dtype.kind not in "iu":
        raise InputError(where, f"token ids must be integers, got {ids.dtype}")
    if len(ids) >= cfg.max_model_len:
        raise InputError(where, f"prompt of {len(ids)} tokens leaves no room to generate within "
                                f"max_model_len={cfg.max_model_len}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise InputError(where, f"token id {bad} outside the vocabulary [0, {vocab_size})")
    total = min(len(prompt) + params.max_tokens, cfg.max_model_len)
    blocks = blocks_for(total, cfg.block_size)
    if blocks > kv_capacity:
        raise InputError(where, f"needs {blocks} KV blocks for {total} tokens but the cache holds "
                                f"{kv_capacity}; lower max_tokens or add KV blocks")
