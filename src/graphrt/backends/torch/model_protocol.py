"""What the torch executor asks of a model, checked when the runner is built, and its attention.

A torch model (docs/models.md) has ``forward(input_ids, positions)``, ``compute_logits(hidden)``,
``attention_layers()``, ``kv_cache_spec()`` and a ``config`` with ``vocab_size`` and
``hidden_size``; optionally ``attention_backend`` and ``extra_inputs``.
:func:`check_torch_model` names what is missing before anything is allocated. The attention is
chosen by the selector (layers/torch/attention/selector.py: the one place a kernel is chosen); its
FULL-graph support is the least of its layers'."""

from __future__ import annotations

from typing import Any

import torch

from graphrt.core.attention_decl import backend_name, check_declarations, checked_keyed, least_support
from graphrt.core.errors import ConfigError
from graphrt.core.inputs.extra_inputs import check_extra_specs
from graphrt.core.graph_modes import AttentionGraphSupport

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
    if extra := getattr(model, "extra_inputs", None):      # declared per-step inputs (none: nothing to check)
        check_extra_specs(extra, type(model).__name__)
    backend_obj = getattr(model, "attention_backend", None)
    if backend_obj is not None:
        _check_backend(backend_obj)


def _check_backend(backend: Any) -> None:
    name = backend_name(backend)
    for member in ("build", "keyed_host_values", "before_replay"):
        if not callable(getattr(backend, member, None)):
            raise ConfigError(f"attention backend {name!r} has no {member}(): subclass graphrt.AttentionBackend "
                              "(docs/attention.md)")
    check_declarations(backend)


def keyed_host_values(backend: Any, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """``backend``'s setup phase (once): what it fixes when a graph is built, checked to be
    values a key holds."""
    return checked_keyed(backend, device, dtype)


def attention_support(model: torch.nn.Module, backend: Any) -> AttentionGraphSupport:
    """What FULL graphs the attention supports: the backend's level, and the least its layers
    declare (``graph_support``)."""
    return least_support(backend, model.attention_layers() if hasattr(model, "attention_layers") else [])


__all__ = ["REQUIRED", "attention_support", "check_torch_model", "keyed_host_values"]
