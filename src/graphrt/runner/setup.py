"""What a :class:`~graphrt.runner.ModelRunner` runs on, decided once before its first step:
the backend, the model loaded and checked against it, the executor, the graph mode the
executor can hold (and the step kinds that lost their graphs), and the dispatcher of that
mode. The runner's own job is the step; this module's is getting everything it needs to
start (docs/architecture.md)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from graphrt.backends.base import Backend, Executor
from graphrt.backends.preflight import check_before_loading, check_memory
from graphrt.config import GraphConfig
from graphrt.core.dispatch import Dispatcher
from graphrt.core.graph_memory import check_kv_args
from graphrt.core.graph_modes import GraphMode, resolve_mode
from graphrt.registry import select_backend
from graphrt.runner.warmup import graphs_for

logger = logging.getLogger("graphrt.runner")


@dataclass(frozen=True)
class Opened:
    """The backend, executor and mode a runner serves with (:func:`open_executor`)."""

    backend: Backend
    executor: Executor
    model: Any                     # the model object (rank 0's shard under tensor parallelism)
    mode: GraphMode
    #: The step kinds (uniform_decode values) the configured mode had graphs for and the
    #: resolved one has not: their eager steps count as ``unsupported_by_attention``.
    degraded: frozenset[bool]
    dispatcher: Dispatcher


def open_executor(model: Any, cfg: GraphConfig, backend: str | Backend, dtype: Any, *,
                  num_kv_blocks: int | None, kv_cache_memory: int | None) -> Opened:
    """Select the backend, check the setting before loading anything (sharding, dtype,
    ``max_model_len``, memory), load and check the model, create the executor (with
    ``tensor_parallel_size > 1`` the backend starts the worker ranks, each loading its own
    shard), and resolve the graph mode the executor's attention can hold."""
    check_kv_args(num_kv_blocks, kv_cache_memory)
    chosen = select_backend(backend, model=model) if isinstance(backend, str) else backend
    tp = cfg.tensor_parallel_size
    chosen = chosen.for_tensor_parallel(tp)
    dtype = check_before_loading(chosen, model, cfg, dtype)   # sharding, dtype, max_model_len
    if isinstance(model, (str, os.PathLike)) and tp == 1:
        model = chosen.load_model(os.fspath(model), dtype, model_impl=cfg.model_impl,
                                  trust_remote_code=cfg.trust_remote_code)
    if tp == 1 and not isinstance(model, (str, os.PathLike)):
        chosen.check_model(model)                # the model protocol, named member by member
    check_memory(chosen, model, cfg, num_kv_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory)
    executor = chosen.create_executor(model, cfg, dtype=dtype)
    if tp > 1:
        model = executor.model
    mode, degraded = resolve_mode(cfg.mode, attention=executor.capabilities.attention_support,
                                  piecewise=executor.capabilities.supports_piecewise)
    if not executor.capabilities.has_graphs and mode is not GraphMode.NONE:
        mode, degraded = GraphMode.NONE, f"backend {chosen.name} runs every step eagerly"
    if degraded:
        logger.info("graphrt: %s", degraded)
    dispatcher = chosen.dispatcher(cfg, mode, model, executor.capabilities.keyed_host_values)
    lost = frozenset(u for u in (True, False) if degraded and executor.capabilities.has_graphs
                     and not cfg.enforce_eager and graphs_for(cfg.mode, u) and not graphs_for(mode, u))
    return Opened(chosen, executor, model, mode, lost, dispatcher)


__all__ = ["Opened", "open_executor"]
