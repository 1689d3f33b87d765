"""``graphrt.LLM``'s own arguments, checked before anything is loaded or started.

:func:`check_engine_args` is every check ``graphrt.LLM`` makes of its arguments that needs no
model: the :class:`~graphrt.config.GraphConfig` it runs with (its limits and graph fields; an
unknown keyword is a field pydantic refuses), the schedule policy and conservativeness, the
decode log interval, the watchdog and the overlap flag. ``LLM`` calls it first, so a bad
argument costs no load or warm-up; ``graphrt.DataParallelLLM`` calls it at the front with its
workers' keywords (:data:`ENGINE_ARGS`, by name), so a bad one is refused there, as ``LLM``
refuses it, before any worker process starts.
"""

from __future__ import annotations

from typing import Any

from graphrt.config import GraphConfig
from graphrt.core import defaults
from graphrt.core.errors import ConfigError
from graphrt.engine.metrics import check_decode_log_interval
from graphrt.engine.overlap import check_overlap_flag
from graphrt.engine.schedule_policy import check_policy
from graphrt.engine.scheduler import check_conservativeness
from graphrt.engine.watchdog import check_watchdog_args
from graphrt.models.hf_config import DecoderConfig, model_max_len

#: The keywords of ``graphrt.LLM`` that :func:`check_engine_args` checks besides ``model``,
#: ``config`` and the graph fields.
ENGINE_ARGS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "strict",
               "schedule_policy", "schedule_conservativeness", "decode_log_interval", "watchdog_timeout",
               "watchdog_action", "disable_overlap_schedule")


def check_engine_args(model: Any, config: GraphConfig | None, *, max_num_seqs: int, max_num_batched_tokens: int,
                      max_model_len: int | None, block_size: int, strict: bool, schedule_policy: str,
                      schedule_conservativeness: float, decode_log_interval: int, watchdog_timeout: float | None,
                      watchdog_action: str, disable_overlap_schedule: bool,
                      graph_fields: dict[str, Any]) -> GraphConfig:
    """Refuse what ``graphrt.LLM(model, ...)`` would refuse of these arguments (ConfigError or
    InputError naming the argument, as ``LLM`` raises them); return the config it runs with:
    ``config`` as given, else one from the limits and ``graph_fields``. ``model``: a Hugging
    Face directory (only its ``config.json`` is read, for the default ``max_model_len``) or a
    loaded model."""
    check_policy(schedule_policy)
    check_conservativeness(schedule_conservativeness)
    check_decode_log_interval(decode_log_interval)
    check_watchdog_args(watchdog_timeout, watchdog_action)
    check_overlap_flag(disable_overlap_schedule)
    if config is not None:
        if not isinstance(config, GraphConfig):
            raise ConfigError(f"config must be a graphrt.GraphConfig, got {type(config).__name__}")
        return config
    if max_model_len is None:      # the model's own limit, at most the default
        model_len = (DecoderConfig.from_dir(model).max_position_embeddings
                     if isinstance(model, str) or hasattr(model, "__fspath__") else model_max_len(model))
        max_model_len = min(model_len or defaults.DEFAULT_MAX_MODEL_LEN, defaults.DEFAULT_MAX_MODEL_LEN)
    return GraphConfig.create(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              max_model_len=max_model_len, block_size=block_size, strict=strict, **graph_fields)


__all__ = ["ENGINE_ARGS", "check_engine_args"]
