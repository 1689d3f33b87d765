"""``graphrt.LLM``'s own arguments, checked before anything is loaded or started.

:func:`check_engine_args` is every check ``graphrt.LLM`` makes of its arguments that needs no
model: the :class:`~graphrt.config.GraphConfig` it runs with (its limits and graph fields; an
unknown keyword is refused naming the close names it may have meant), the KV cache's size
(``num_kv_blocks`` / ``kv_cache_memory``, as ``ModelRunner`` checks them), the schedule policy and conservativeness, the
decode log interval, the watchdog, the boolean flags (strictly booleans), and the bytes the
engine's host tables imply. ``LLM`` calls it first, so a bad
argument costs no load or warm-up; ``graphrt.DataParallelLLM`` calls it at the front with its
workers' keywords (:data:`ENGINE_ARGS`, by name), so a bad one is refused there, as ``LLM``
refuses it, before any worker process starts.
"""

from __future__ import annotations

from typing import Any, Collection

from graphrt.config import GraphConfig, check_flags, check_unknown_fields
from graphrt.core.errors import ConfigError
from graphrt.core.graph_memory import check_kv_args
from graphrt.engine.metrics import check_decode_log_interval
from graphrt.engine.schedule_policy import check_policy
from graphrt.engine.scheduler import check_conservativeness
from graphrt.engine.validation import engine_config
from graphrt.engine.watchdog import check_watchdog_args

#: The keywords of ``graphrt.LLM`` that :func:`check_engine_args` checks besides ``model``,
#: ``config`` and the graph fields.
ENGINE_ARGS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "strict",
               "schedule_policy", "schedule_conservativeness", "decode_log_interval", "watchdog_timeout",
               "watchdog_action", "disable_overlap_schedule", "enable_prefix_caching", "progress",
               "num_kv_blocks", "kv_cache_memory")


def check_engine_args(model: Any, config: GraphConfig | None, *, max_num_seqs: int, max_num_batched_tokens: int,
                      max_model_len: int | None, block_size: int, strict: bool, schedule_policy: str,
                      schedule_conservativeness: float, decode_log_interval: int, watchdog_timeout: float | None,
                      watchdog_action: str, disable_overlap_schedule: bool, enable_prefix_caching: bool | None,
                      progress: bool, graph_fields: dict[str, Any], num_kv_blocks: int | None = None,
                      kv_cache_memory: int | None = None, keywords: Collection[str] = ()) -> GraphConfig:
    """Refuse what ``graphrt.LLM(model, ...)`` would refuse of these arguments (ConfigError or
    InputError naming the argument, as ``LLM`` raises them); return the config it runs with:
    ``config`` as given, else one from the limits and ``graph_fields`` whose ``max_model_len``
    defaults to the model's (``validation.engine_config``). ``model``: a Hugging Face directory
    (only its ``config.json`` is read) or a loaded model. ``keywords``: the caller's own keyword
    names, offered with :class:`GraphConfig`'s fields when a keyword is neither."""
    check_unknown_fields(graph_fields, keywords, "graphrt.LLM")
    check_kv_args(num_kv_blocks, kv_cache_memory)
    check_flags(disable_overlap_schedule=disable_overlap_schedule, progress=progress,
                **({} if enable_prefix_caching is None else {"enable_prefix_caching": enable_prefix_caching}))
    check_policy(schedule_policy)
    check_conservativeness(schedule_conservativeness)
    check_decode_log_interval(decode_log_interval)
    check_watchdog_args(watchdog_timeout, watchdog_action)
    if config is not None and not isinstance(config, GraphConfig):
        raise ConfigError(f"config must be a graphrt.GraphConfig, got {type(config).__name__}")
    return engine_config(model, config, max_model_len, max_num_seqs=max_num_seqs, strict=strict,
                         max_num_batched_tokens=max_num_batched_tokens, block_size=block_size, **graph_fields)


__all__ = ["ENGINE_ARGS", "check_engine_args"]
