"""graphrt: one graph runtime for LLM inference engines.

Run a model's forward pass and sampler as captured device graphs (CUDA Graph, Ascend ACL
Graph, a CPU recording graph) or ahead-of-time compiled XLA executables, behind one
interface: ``BucketPolicy`` (which shapes), ``Padder`` (pad every input safely),
``GraphCache`` (graphs / executables by key, with statistics) and the ``ModelRunner``
front end. ``import graphrt`` imports neither torch nor jax; names that need them load lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

from graphrt.config import GraphConfig, add_cli_args, from_cli_args
from graphrt.core import __version__
from graphrt.core.attention_decl import AttentionDeclarations
from graphrt.core.buckets import BucketPolicy
from graphrt.core.cache import CacheStats, GraphCache
from graphrt.core.dispatch import BatchDescriptor, Dispatch, Dispatcher, SamplerKey
from graphrt.core.errors import (BackendUnavailableError, CacheMissError, ConfigError, EngineAsleepError,
                                 GenerationError, GraphCaptureError, GraphrtError, InputError, KVCacheLostError,
                                 RequestsInFlightError, StaleBufferError, WatchdogTimeout)
from graphrt.core.errors import CollectiveMismatchError, RankLostError, StepMismatchError
from graphrt.core.inputs.extra_inputs import ExtraInput
from graphrt.core.inputs.fields import ModelInputs
from graphrt.core.graph_modes import AttentionGraphSupport, GraphMode, RuntimeMode
from graphrt.core.inputs.preparer import InputPreparer, prepare_inputs
from graphrt.core.kv_spec import KVCacheGroup, KVCacheSpec
from graphrt.core.numerics import Tolerance, reduction_tolerance, tolerance
from graphrt.core.inputs.padding import Padder
from graphrt.core.state_spec import StateGroup, StateSpec, StateTensor
from graphrt.registry import available_backends, select_backend

_LAZY = {
    "AttentionBackend": "graphrt.layers.torch.attention.backend",
    "ModelRunner": "graphrt.runner",
    "LLM": "graphrt.engine.llm",
    "DataParallelLLM": "graphrt.engine.data_parallel",
    "RequestOutput": "graphrt.engine.outputs",
    "SamplingParams": "graphrt.engine.sampling_params",
    "launch": "graphrt.engine.launch",
    "detect_world": "graphrt.engine.launch",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'graphrt' has no attribute {name!r}")


__all__ = [
    "AttentionBackend", "AttentionDeclarations", "AttentionGraphSupport",
    "BackendUnavailableError", "BatchDescriptor", "BucketPolicy", "CacheMissError", "CacheStats",
    "DataParallelLLM",
    "ConfigError", "Dispatch", "Dispatcher", "EngineAsleepError", "ExtraInput", "GenerationError", "GraphCache",
    "GraphCaptureError",
    "GraphConfig", "GraphMode", "GraphrtError", "InputError", "InputPreparer", "KVCacheGroup", "KVCacheLostError",
    "KVCacheSpec", "LLM",
    "ModelInputs",
    "ModelRunner", "Padder", "RequestOutput", "RequestsInFlightError", "RuntimeMode", "SamplerKey", "SamplingParams",
    "StaleBufferError", "StateGroup",
    "StateSpec", "StateTensor", "add_cli_args",
    "Tolerance", "__version__", "available_backends", "from_cli_args", "prepare_inputs", "select_backend",
    "tolerance", "reduction_tolerance", "WatchdogTimeout",
]
__all__ += ["CollectiveMismatchError", "RankLostError", "StepMismatchError", "detect_world", "launch"]
