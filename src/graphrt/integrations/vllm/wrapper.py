"""vLLM's static-graph-wrapper seam on graphrt's device graphs: :class:`GraphrtGraphWrapper`.

vLLM wraps each PIECEWISE piece of its fx split (``Platform.get_static_graph_wrapper_cls``) and,
in graphrt's runner, the whole model for FULL keys. Per call it reads the forward context: a
runtime mode other than the wrapper's runs the callable as it is; the wrapper's mode replays the
graph of the context's ``BatchDescriptor``, captured the first time -- which graphrt allows only
inside ``capture_model`` (warm-up); afterwards a missing key raises
:class:`~graphrt.core.errors.CacheMissError` naming the key and the module. A capture graphrt
refuses (a host sync, a data-dependent shape) raises :class:`~graphrt.core.errors.GraphCaptureError`
naming the module and the key. vLLM keeps the inputs at fixed addresses (its persistent buffers
and the previous piece's outputs), as a replay needs.

On a CPU a FULL graph records vLLM's attention ops (``vllm::unified_attention_with_output``, whose
Python looks up the step's metadata in the forward context) op by op, as a CUDA graph holds the
kernels they launch: a replay then reads the metadata tensors captured, so an attention backend
whose metadata is not in persistent buffers goes stale, as it would on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from graphrt.backends.torch.recording_graph import inline_ops
from graphrt.core.errors import GraphCaptureError
from graphrt.integrations.vllm.session import SESSION
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available


@functools.lru_cache(maxsize=1)
def attention_kernels() -> dict[Any, Callable[..., Any]]:
    """vLLM's attention ops and their Python kernels, recorded op by op in a CPU capture."""
    from vllm.model_executor.layers.attention import attention as vllm_attention

    ops = torch.ops.vllm
    return {ops.unified_attention_with_output.default: vllm_attention.unified_attention_with_output,
            ops.unified_kv_cache_update.default: vllm_attention.unified_kv_cache_update}


@dataclass
class _Entry:
    graph: Any
    output: Any
    cache_key: tuple[str, Any]        # the key in graphrt's cache: (runtime mode, BatchDescriptor)


def module_name(runnable: Any, vllm_config: VllmConfig) -> str:
    """What a wrapper holds, for errors: a piece (``submod_2 of LlamaForCausalLM``) or the model."""
    model_config = vllm_config.model_config
    arch = model_config.architecture if model_config is not None else type(runnable).__name__
    piece = getattr(runnable, "submod_name", None)
    if piece is not None:
        return f"piece {piece} of {arch}'s fx split"
    return f"{arch} ({type(runnable).__name__})"


class GraphrtGraphWrapper:
    """vLLM's ``AbstractStaticGraphWrapper`` on graphrt's graph API (the module docstring).
    Attribute reads fall through to the wrapped callable, as with vLLM's ``CUDAGraphWrapper``."""

    def __init__(self, runnable: Callable[..., Any], vllm_config: VllmConfig, runtime_mode: CUDAGraphMode,
                 cudagraph_options: Any = None, **kwargs: Any) -> None:
        if runtime_mode not in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
            raise ValueError(f"GraphrtGraphWrapper: runtime_mode {runtime_mode.name}; FULL or PIECEWISE")
        self.runnable = runnable
        self.runtime_mode = runtime_mode
        self.device_type = vllm_config.device_config.device_type if vllm_config.device_config else "cpu"
        self.name = module_name(runnable, vllm_config)
        # vLLM marks its first piece (debug_log_enable); that piece counts PIECEWISE and eager steps.
        self.first_piece = bool(getattr(cudagraph_options, "debug_log_enable", True))
        self.entries: dict[Any, _Entry] = {}

    def __getattr__(self, key: str) -> Any:
        runnable = self.__dict__.get("runnable")
        if runnable is None:
            raise AttributeError(key)
        return getattr(runnable, key)

    def unwrap(self) -> Callable[..., Any]:
        runnable = self.runnable
        return runnable.unwrap() if hasattr(runnable, "unwrap") else runnable

    @property
    def counts_steps(self) -> bool:
        """Whether this wrapper counts a step (see :mod:`.session`)."""
        if self.runtime_mode is CUDAGraphMode.FULL:
            return True
        return self.first_piece

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not is_forward_context_available():
            return self.runnable(*args, **kwargs)
        context = get_forward_context()
        mode, key = context.cudagraph_runtime_mode, context.batch_descriptor
        if mode != self.runtime_mode:
            if mode == CUDAGraphMode.NONE and self._counts_eager():
                num_tokens = key.num_tokens if key is not None else SESSION.step.tokens
                SESSION.ran_eagerly(num_tokens, bool(key is not None and key.uniform))
            return self.runnable(*args, **kwargs)
        entry = self.entries.get(key)
        if entry is None:
            return self._capture(key, args, kwargs)
        if self.counts_steps:
            SESSION.replayed(entry.cache_key, key.num_tokens, key.num_reqs)
        entry.graph.replay()
        return entry.output

    def _counts_eager(self) -> bool:
        if self.runtime_mode is CUDAGraphMode.PIECEWISE:
            return self.first_piece
        return not SESSION.has_piecewise

    def _cache_key(self, key: Any) -> tuple[str, Any]:
        return (self.runtime_mode.name, key)

    def _capture(self, key: Any, args: tuple, kwargs: dict) -> Any:
        SESSION.check_capture(self._cache_key(key), self.name)
        pool = SESSION.pool(self.device_type)
        outputs: list[Any] = []
        t0 = time.perf_counter()
        inline = inline_ops(attention_kernels()) if self.device_type == "cpu" else contextlib.nullcontext()
        try:
            with inline:
                graph, nbytes, _ = pool.record(lambda: outputs.append(self.runnable(*args, **kwargs)))
        except GraphCaptureError as exc:
            raise GraphCaptureError(f"graphrt cannot capture {self.name} as a {self.runtime_mode.name} graph for "
                                    f"{key}: {exc}. Fix that module, or run vLLM without graphrt's graphs "
                                    f"(enforce_eager=True or cudagraph_mode NONE)") from exc
        cache_key = self._cache_key(key)
        SESSION.captured(cache_key, seconds=time.perf_counter() - t0, nbytes=nbytes, first=self.counts_steps)
        self.entries[key] = _Entry(graph, outputs[-1], cache_key)
        return outputs[-1]


__all__ = ["GraphrtGraphWrapper", "module_name"]
