"""Backend registry: names to backend classes, imported lazily.

``available_backends()`` says, for every backend, ``None`` (usable here) or why not, and which
one ``auto`` picks and why (``.auto``, ``.auto_reason``); ``select_backend(name)`` returns a
backend instance or raises :class:`~graphrt.core.errors.BackendUnavailableError` with that
reason. Importing this module imports neither torch, jax nor torch_npu.

``auto`` picks what serves fastest where it runs: ``cuda`` or ``npu`` where one is visible; without
an accelerator ``xla`` for a checkpoint directory or a JAX model, ``eager`` for a torch model
object (or without jax). Never ``cpu``: the recording graph replays the same CPU kernels op by op
on padded shapes, slower than running them (docs/backends.md; docs/benchmarks.md, "The default
that serves fastest"); it stays what the correctness tests name.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

from graphrt.core.errors import BackendUnavailableError

logger = logging.getLogger(__name__)

#: name -> "module:Class"
BACKENDS: dict[str, str] = {
    "cuda": "graphrt.backends.torch.cuda:CudaGraphBackend",
    "npu": "graphrt.backends.torch.npu:NpuGraphBackend",
    "cpu": "graphrt.backends.torch.cpu:CpuGraphBackend",
    "xla": "graphrt.backends.xla.backend:XlaBackend",
    "eager": "graphrt.backends.torch.eager:EagerBackend",
}
ALIASES: dict[str, str] = {"acl": "npu", "jax": "xla"}
#: ``select_backend("auto")`` takes the first available of these (the module docstring: why) ...
AUTO_ORDER: tuple[str, ...] = ("cuda", "npu", "xla", "eager", "cpu")
#: ... and for a torch model object, of these.
AUTO_ORDER_TORCH: tuple[str, ...] = ("cuda", "npu", "eager", "cpu")
#: Why ``auto`` picks each backend, in ``available_backends().auto_reason``.
AUTO_REASONS: dict[str, str] = {
    "cuda": "a CUDA GPU is visible: captured CUDA graphs remove per-kernel launch overhead",
    "npu": "an Ascend NPU is visible: captured ACL graphs remove per-kernel launch overhead",
    "xla": "no accelerator: XLA compiles each bucket's whole forward into one fused CPU executable, fastest here "
           "(the CPU recording graph replays the same kernels op by op on padded shapes: 0.05-0.6x xla's tokens/s "
           "on the peer benchmark, eager 0.04-0.95x, docs/benchmarks.md); a torch model object runs on eager; "
           "backend='cpu' still captures (the correctness tests' graph)",
    "eager": "no accelerator, and a torch model (or no jax): its steps run eagerly, faster than the CPU recording "
             "graph's padded replay (docs/benchmarks.md)",
    "cpu": "only the CPU recording graph can run here",
}


class Availability(dict):
    """``available_backends()``: backend name -> None (usable) or why not, plus :attr:`auto` (what
    ``select_backend("auto")`` picks here, None when nothing can run) and :attr:`auto_reason`."""

    auto: str | None = None
    auto_reason: str = ""


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


def available_backends() -> Availability:
    """Every backend name -> ``None`` if usable here, or the reason it is not; ``.auto`` and
    ``.auto_reason`` say which one ``auto`` picks here and why."""
    out = Availability((name, unavailable_reason(name)) for name in BACKENDS)
    out.auto = next((name for name in AUTO_ORDER if out[name] is None), None)
    out.auto_reason = AUTO_REASONS[out.auto] if out.auto is not None else "no backend can run here"
    return out


def auto_order(model: Any = None) -> tuple[str, ...]:
    """The backends ``auto`` tries for ``model``: :data:`AUTO_ORDER_TORCH` for a torch module
    (without importing torch: it is already imported when there is one), else :data:`AUTO_ORDER`."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        return AUTO_ORDER_TORCH
    return AUTO_ORDER


def select_backend(name: str = "auto", *, model: Any = None, **options: Any) -> Any:
    """A backend instance by name (``cuda``, ``npu``/``acl``, ``xla``/``jax``, ``cpu``, ``eager``, ``auto``);
    ``model`` (what will run on it) narrows ``auto`` to its framework."""
    if name.lower() == "auto":
        reasons = {}
        for candidate in auto_order(model):
            reason = unavailable_reason(candidate)
            if reason is None:
                logger.info("graphrt: backend auto -> %s: %s", candidate, AUTO_REASONS[candidate])
                return _load(candidate)(**options)
            reasons[candidate] = reason
        raise BackendUnavailableError("no backend is available: " +
                                      "; ".join(f"{k}: {v}" for k, v in reasons.items()))
    key = canonical_name(name)
    reason = unavailable_reason(key)
    if reason is not None:
        raise BackendUnavailableError(f"backend {key!r} is unavailable: {reason}")
    return _load(key)(**options)
