"""Backend registry: names to backend classes, imported lazily.

``available_backends()`` says, for every backend, ``None`` (usable here) or why not;
``select_backend(name)`` returns a backend instance or raises
:class:`~graphrt.core.errors.BackendUnavailableError` with that reason. Importing this module
imports neither torch, jax nor torch_npu.
"""

from __future__ import annotations

import importlib
from typing import Any

from graphrt.core.errors import BackendUnavailableError

#: name -> "module:Class"
BACKENDS: dict[str, str] = {
    "cuda": "graphrt.backends.torch.cuda:CudaGraphBackend",
    "npu": "graphrt.backends.torch.npu:NpuGraphBackend",
    "cpu": "graphrt.backends.torch.cpu:CpuGraphBackend",
    "xla": "graphrt.backends.xla.backend:XlaBackend",
    "eager": "graphrt.backends.torch.eager:EagerBackend",
}
ALIASES: dict[str, str] = {"acl": "npu", "jax": "xla"}
#: ``select_backend("auto")`` takes the first available of these.
AUTO_ORDER: tuple[str, ...] = ("cuda", "npu", "cpu", "xla", "eager")


def canonical_name(name: str) -> str:
    """Resolve aliases; unknown names raise ``ValueError`` listing the valid ones."""
    key = name.lower()
    key = ALIASES.get(key, key)
    if key not in BACKENDS:
        valid = sorted(BACKENDS) + sorted(ALIASES) + ["auto"]
        raise ValueError(f"unknown backend {name!r}; valid names: {', '.join(valid)}")
    return key


def _load(name: str) -> type:
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def unavailable_reason(name: str) -> str | None:
    """``None`` when backend ``name`` can run here, else a sentence saying why not."""
    key = canonical_name(name)
    try:
        cls = _load(key)
    except ImportError as e:
        return f"{key} backend cannot be imported: {e}"
    return cls.unavailable_reason()


def available_backends() -> dict[str, str | None]:
    """Every backend name -> ``None`` if usable here, or the reason it is not."""
    return {name: unavailable_reason(name) for name in BACKENDS}


def select_backend(name: str = "auto", **options: Any) -> Any:
    """A backend instance by name (``cuda``, ``npu``/``acl``, ``xla``/``jax``, ``cpu``, ``eager``, ``auto``)."""
    if name.lower() == "auto":
        reasons = {}
        for candidate in AUTO_ORDER:
            reason = unavailable_reason(candidate)
            if reason is None:
                return _load(candidate)(**options)
            reasons[candidate] = reason
        raise BackendUnavailableError("no backend is available: " +
                                      "; ".join(f"{k}: {v}" for k, v in reasons.items()))
    key = canonical_name(name)
    reason = unavailable_reason(key)
    if reason is not None:
        raise BackendUnavailableError(f"backend {key!r} is unavailable: {reason}")
    return _load(key)(**options)
