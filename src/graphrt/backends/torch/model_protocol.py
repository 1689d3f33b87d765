"""What the torch executor asks of a model, checked when the runner is built, and its attention.

A torch model (docs/models.md) has ``forward(input_ids, positions)``, ``compute_logits(hidden)``,
``attention_layers()``, ``kv_cache_spec()`` and a ``config`` with ``vocab_size`` and
``hidden_size``; optionally ``attention_backend`` (the attention seam, docs/attention.md) and
``extra_inputs`` (per-step inputs it reads, :mod:`graphrt.core.extra_inputs`).
:func:`check_torch_model` names each missing or ill-typed member with what to implement, and
refuses a model of another framework with a sentence, before anything is allocated.

The model's attention is :func:`attention_backend`: its own, or graphrt's
:class:`~graphrt.models.torch.attention_backend.PagedAttentionBackend`, whose FULL-graph support
is the least its layers declare (``graph_support``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from graphrt.core.dispatch import AttentionGraphSupport
from graphrt.core.errors import ConfigError, GraphCaptureError
from graphrt.core.fields import ModelInputs
from graphrt.core.extra_inputs import check_extra_specs
from graphrt.models.torch.ascend_attention import ascend_backend
from graphrt.models.torch.attention_backend import KEYABLE_HOST_VALUES, HOST_VALUES, PagedAttentionBackend

#: Members every torch model has: name -> what it must be, for the error.
REQUIRED = {"forward": "forward(input_ids [T] int32, positions [T] int32) -> hidden [T, hidden]",
            "compute_logits": "compute_logits(hidden [N, hidden]) -> float32 logits [N, vocab]",
            "attention_layers": "attention_layers() -> the attention modules in layer order (each gets .kv_cache)",
            "kv_cache_spec": ("kv_cache_spec() -> a graphrt.KVCacheSpec (or the tuple (num_layers, num_kv_heads, "
                                  "head_dim)), to size the KV cache")}


def check_torch_model(model: Any, backend: str) -> None:
    """Refuse a model the torch backends cannot run, naming what to implement (ConfigError)."""
    if not isinstance(model, torch.nn.Module):
        kind = type(model).__module__.split(".")[0]
        hint = (" It looks like a JAX model: use backend='xla'." if kind in ("jax", "flax", "jaxlib")
                or hasattr(model, "params") or hasattr(model, "graphdef") else "")
        raise ConfigError(f"backend {backend!r} runs torch models (a torch.nn.Module following docs/models.md); "
                          f"got a {type(model).__module__}.{type(model).__name__}.{hint}")
    missing = [f"{name}: {what}" for name, what in REQUIRED.items() if not callable(getattr(model, name, None))]
    config = getattr(model, "config", None)
    for name in ("vocab_size", "hidden_size"):
        if not isinstance(getattr(config, name, None), int):
            missing.append(f"config.{name}: an int")
    if missing:
        raise ConfigError(f"the model ({type(model).__name__}) does not follow graphrt's torch model protocol "
                          f"(docs/models.md); implement {'; '.join(missing)}")
    layers = model.attention_layers()
    if not isinstance(layers, (list, tuple)) or not all(isinstance(m, torch.nn.Module) for m in layers):
        raise ConfigError(f"{type(model).__name__}.attention_layers() must return a list of torch modules, got "
                          f"{type(layers).__name__}")
    # kv_cache_spec()'s value is resolved and checked field by field in preflight
    # (backends/torch/kv_cache.model_kv_spec), also before anything is allocated.
    check_extra_specs(getattr(model, "extra_inputs", None) or {}, type(model).__name__)
    backend_obj = getattr(model, "attention_backend", None)
    if backend_obj is not None:
        _check_backend(backend_obj)


def _check_backend(backend: Any) -> None:
    name = getattr(backend, "name", type(backend).__name__)
    for member in ("build", "keyed_host_values", "before_replay"):
        if not callable(getattr(backend, member, None)):
            raise ConfigError(f"attention backend {name!r} has no {member}(): subclass "
                              "graphrt.models.torch.attention_backend.AttentionBackend (docs/attention.md)")
    refreshed = tuple(getattr(backend, "refreshed_host_values", ()))
    unknown = [v for v in refreshed if v not in HOST_VALUES]
    if unknown:
        raise ConfigError(f"attention backend {name!r}: refreshed_host_values {unknown} are not host values "
                          f"(one of {HOST_VALUES})")
    try:
        AttentionGraphSupport(getattr(backend, "graph_support", AttentionGraphSupport.ALWAYS))
    except ValueError as exc:
        raise ConfigError(f"attention backend {name!r}: graph_support must be an AttentionGraphSupport") from exc


#: ModelInputs' host scalars -> the host value a pre-replay hook reading it must have declared.
HOOK_SCALARS = {"num_reqs": "real_num_reqs", "num_tokens": "real_num_tokens", "max_query_len": "max_query_len",
                "max_seq_len": "max_seq_len", "uniform_decode": "uniform_decode"}


class GuardedInputs:
    """A padded step as pre-replay hooks see it while a graph is captured: its arrays as they
    are, its host scalars only where the attention declared them refreshed."""

    def __init__(self, padded: ModelInputs, backend: Any, key: Any) -> None:
        self._padded = padded
        self._allowed = set(getattr(backend, "refreshed_host_values", ()))
        self._backend = getattr(backend, "name", type(backend).__name__)
        self._key = key

    def __getattr__(self, name: str) -> Any:
        value = HOOK_SCALARS.get(name)
        if value is not None and value not in self._allowed:
            caller = sys._getframe(1)
            raise GraphCaptureError(
                f"a pre-replay hook read the host value {name!r} of the step while the graph of {self._key} was "
                f"captured "
                f"({caller.f_code.co_name} at {caller.f_code.co_filename}:{caller.f_lineno}), and attention "
                f"backend {self._backend!r} does not declare {value!r} refreshed: a value the hook hands the "
                f"forward would be baked into the graph. Declare it in refreshed_host_values and write it into "
                f"a device buffer the graph reads, or key it (docs/attention.md)")
        return getattr(self._padded, name)


def guard_host_scalars(padded: ModelInputs, backend: Any, key: Any) -> GuardedInputs:
    """``padded`` with its host scalars guarded for the capture of ``key`` (:class:`GuardedInputs`)."""
    return GuardedInputs(padded, backend, key)


def attention_backend(model: torch.nn.Module, device: torch.device | str | None = None,
                      dtype: torch.dtype | None = None, block_size: int | None = None) -> Any:
    """The model's attention backend: ``model.attention_backend``, else graphrt's: FlashInfer's where
    ``GRAPHRT_ATTENTION=flashinfer``, Ascend's fused attention where it runs on ``device``
    (``ascend_attention.ascend_backend``), else the paged one."""
    own = getattr(model, "attention_backend", None)
    if own is not None:
        return own
    layers = model.attention_layers() if hasattr(model, "attention_layers") else []
    from graphrt.models.torch.flashinfer_attention import FlashInferAttentionBackend, flashinfer_selected

    if flashinfer_selected():           # GRAPHRT_ATTENTION=flashinfer: FlashInfer plans graphrt's layers
        return FlashInferAttentionBackend(layers)
    head_dim = next((getattr(layer, "head_dim", None) for layer in layers), None)
    ascend = ascend_backend(layers, device, dtype, block_size) if device is not None else None
    return ascend if ascend is not None else PagedAttentionBackend(head_dim)


def keyed_host_values(backend: Any, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """What ``backend`` fixes when a graph is built, checked to be values a key holds."""
    keyed = tuple(sorted(backend.keyed_host_values(device, dtype)))
    bad = [v for v in keyed if v not in KEYABLE_HOST_VALUES]
    if bad:
        raise ConfigError(f"attention backend {getattr(backend, 'name', type(backend).__name__)!r} keys on {bad}, "
                          f"which no graph key holds: keyed_host_values may name {KEYABLE_HOST_VALUES}; refresh "
                          "the others in before_replay (refreshed_host_values)")
    return keyed


def attention_support(model: torch.nn.Module, backend: Any) -> AttentionGraphSupport:
    """What FULL graphs the attention supports: the backend's level, and the least its layers
    declare (``graph_support``)."""
    layers = model.attention_layers() if hasattr(model, "attention_layers") else []
    levels = [AttentionGraphSupport(getattr(layer, "graph_support", AttentionGraphSupport.ALWAYS))
              for layer in layers]
    levels.append(AttentionGraphSupport(getattr(backend, "graph_support", AttentionGraphSupport.ALWAYS)))
    return min(levels)


__all__ = ["GuardedInputs", "HOOK_SCALARS", "REQUIRED", "attention_backend", "attention_support", "check_torch_model",
           "guard_host_scalars", "keyed_host_values"]
