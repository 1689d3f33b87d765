"""Turning graphrt on and off for a transformers model's continuous batching: the one patch.

transformers builds a batch processor (its scheduler, paged cache, static IOs and
``ModelRunner``) in ``ContinuousBatchingManager._create_batch_processor``, the single place
every entry point goes through (``generate_batch``, ``continuous_batching_context_manager``,
``init_continuous_batching``, a manager's ``warmup`` and its generation thread). While at least
one model is enabled, that method is wrapped (:func:`_install`): for a manager whose model is
enabled, the wrapper adjusts the processor's config (below), lets transformers build the
processor, and puts a :class:`~.runner.GraphrtCBRunner` in place of its ``model_runner``; for
any other model it calls transformers' method unchanged. The last :func:`disable` puts
transformers' method back. No other transformers function is patched.

The config of an enabled model's processor, before transformers builds it: transformers' own
accelerator graphs off (``use_cuda_graph``: graphrt's graphs replace them), asynchronous batching
off (its two IO pairs would each need their graphs), and the decode fast path off
(``max_blocks_per_request=0``: flash's block-table kernel, CUDA or XPU only), so every step is a
varlen step under a graphrt key. A compile config or tensor parallelism is refused.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from transformers.generation.continuous_batching import continuous_api

from graphrt.core.cache import CacheStats
from graphrt.core.errors import ConfigError
from graphrt.integrations.transformers_cb.runner import GraphrtCBRunner
from graphrt.registry import canonical_name, select_backend

logger = logging.getLogger(__name__)

#: The transformers class and method the one patch wraps.
PATCHED = (continuous_api.ContinuousBatchingManager, "_create_batch_processor")
#: graphrt backends whose graphs capture a torch module on its own device.
DEVICE_OF_BACKEND = {"cpu": "cpu", "cuda": "cuda", "npu": "npu", "eager": None}


@dataclass(frozen=True)
class Settings:
    """What :func:`enable` was given for one model."""

    backend: str
    capture_sizes: Sequence[int] | None
    context_buckets: Sequence[int] | None
    ahead: bool
    strict: bool


_LOCK = threading.Lock()
_ENABLED: "weakref.WeakKeyDictionary[torch.nn.Module, Settings]" = weakref.WeakKeyDictionary()
#: The latest graphrt runner of each enabled model (its statistics outlive the manager).
_RUNNERS: "weakref.WeakKeyDictionary[torch.nn.Module, GraphrtCBRunner]" = weakref.WeakKeyDictionary()
_ORIGINAL: Any = None


def enable(model: torch.nn.Module, backend: str = "cpu", *, capture_sizes: Sequence[int] | None = None,
           context_buckets: Sequence[int] | None = None, ahead: bool = False, strict: bool = False) -> None:
    """Run ``model``'s continuous batching on graphrt's graphs from its next batch processor on.

    ``backend``: a torch graph backend of graphrt on the model's device (``cpu``: the recording
    graph; ``cuda``; ``npu``/``acl``; ``eager``: graphrt's padding and keys, no graph).
    ``capture_sizes``: token buckets (default: graphrt's capture sizes for the processor's
    ``max_requests_per_batch`` and ``max_batch_tokens``); ``context_buckets``: buckets of the
    cache tokens a step reads (default: every 256 tokens up to 8192, then doubling, the whole cache last).
    ``ahead``: capture every key at transformers' warm-up (else each on first use);
    ``strict`` (needs ``ahead``): a step whose key was not captured then raises
    :class:`~graphrt.CacheMissError`.
    """
    if not hasattr(model, "generate_batch") or not hasattr(model, "init_continuous_batching"):
        raise ConfigError(f"model: a {type(model).__name__} has no continuous batching (transformers' "
                          "ContinuousMixin: generate_batch, init_continuous_batching)")
    name = canonical_name(backend)
    if name not in DEVICE_OF_BACKEND:
        raise ConfigError(f"backend={backend!r}: transformers' model is a torch module; use one of "
                          f"{', '.join(sorted(DEVICE_OF_BACKEND))}")
    select_backend(name)                               # BackendUnavailableError saying why, now
    device = DEVICE_OF_BACKEND[name]
    model_device = getattr(model, "device", torch.device("cpu")).type
    if device is not None and model_device != device:
        raise ConfigError(f"backend={backend!r} captures on {device}, but the model is on {model_device}: "
                          f"move the model or pick that device's backend")
    if strict and not ahead:
        raise ConfigError("strict=True needs ahead=True: keys captured on first use are never missing")
    settings = Settings(name, None if capture_sizes is None else tuple(capture_sizes),
                        None if context_buckets is None else tuple(context_buckets), bool(ahead), bool(strict))
    with _LOCK:
        _ENABLED[model] = settings
        _install()


def disable(model: torch.nn.Module) -> None:
    """Batch processors made for ``model`` from now on are transformers' own; with no model
    left enabled, transformers' method is restored. A processor already made keeps its runner
    (a persistent manager: call ``destroy_cached_continuous_batching_manager``)."""
    with _LOCK:
        _ENABLED.pop(model, None)
        if not len(_ENABLED):
            _uninstall()


@contextlib.contextmanager
def enabled(model: torch.nn.Module, backend: str = "cpu", **options: Any) -> Iterator[None]:
    """:func:`enable` for the block, :func:`disable` after it."""
    enable(model, backend, **options)
    try:
        yield
    finally:
        disable(model)


def is_enabled(model: torch.nn.Module) -> bool:
    """Whether batch processors made for ``model`` now run on graphrt."""
    return model in _ENABLED


def is_patched() -> bool:
    """Whether transformers' method is wrapped now (some model is enabled)."""
    return _ORIGINAL is not None


def runner_of(model: torch.nn.Module) -> GraphrtCBRunner | None:
    """The latest graphrt runner made for ``model`` (None before its first batch processor)."""
    return _RUNNERS.get(model)


def stats(model: torch.nn.Module) -> CacheStats:
    """graphrt's statistics of ``model``'s latest batch processor: ``entries`` (keys captured),
    ``hits`` (steps that replayed a graph), ``eager_steps`` and ``eager_by_cause``, padding."""
    found = _RUNNERS.get(model)
    if found is None:
        raise ConfigError("model: no batch processor ran on graphrt for it yet (enable it, then generate)")
    return found.graph_cache.stats


def _install() -> None:
    """Wrap transformers' ``_create_batch_processor`` (once)."""
    global _ORIGINAL
    if _ORIGINAL is not None:
        return
    cls, name = PATCHED
    original = cls.__dict__[name]

    def _create_batch_processor(self: Any) -> Any:
        settings = _ENABLED.get(self.model)
        if settings is None:
            return original(self)
        _adjust(self.continuous_batching_config, self)
        processor = original(self)
        if not isinstance(processor.model_runner, GraphrtCBRunner):
            processor.model_runner = GraphrtCBRunner(processor.model_runner, self.model, settings)
            _RUNNERS[self.model] = processor.model_runner
        return processor

    _create_batch_processor.__wrapped__ = original            # type: ignore[attr-defined]
    _create_batch_processor.__doc__ = original.__doc__
    setattr(cls, name, _create_batch_processor)
    _ORIGINAL = original


def _uninstall() -> None:
    """Put transformers' method back."""
    global _ORIGINAL
    if _ORIGINAL is None:
        return
    cls, name = PATCHED
    setattr(cls, name, _ORIGINAL)
    _ORIGINAL = None


def _adjust(cb_config: Any, manager: Any) -> None:
    """The processor config graphrt runs (the module docstring), or a ConfigError naming what
    it cannot honour."""
    for field in ("varlen_compile_config", "decode_compile_config"):
        if getattr(cb_config, field, None) is not None:
            raise ConfigError(f"continuous_batching_config.{field}: graphrt captures transformers' forward as it "
                              "is, not a torch.compile of it; leave it None (and default_compile_level 0)")
    tp_size = getattr(getattr(manager, "distributed_helper", None), "tp_size", 1)
    if tp_size != 1:
        raise ConfigError(f"tensor parallelism (tp_size={tp_size}) is not run on graphrt's graphs here")
    if any(cb_config.cuda_graph_booleans):
        logger.info("graphrt: transformers' own accelerator graphs are off, graphrt's replace them")
    cb_config.use_cuda_graph = (False, False)
    cb_config.use_async_batching = False
    cb_config.max_blocks_per_request = 0
