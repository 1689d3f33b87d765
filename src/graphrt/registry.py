"""Backend registry: names to backend classes, imported lazily.

``available_backends()`` says, for every backend, ``None`` (usable here) or why not, and which
one ``auto`` picks and why (``.auto``, ``.auto_reason``); ``select_backend(name)`` returns a
backend instance or raises :class:`~graphrt.core.errors.BackendUnavailableError` with that
reason. Importing this module imports neither torch, jax nor torch_npu.

``auto`` picks with start-up in mind (docs/backends.md): ``cuda`` or ``npu`` where one is
visible; ``xla`` where JAX sees an accelerator (a TPU) or for a JAX model; on a host without an
accelerator ``eager``, which serves the first token at once, for a checkpoint directory or a
torch model (``xla`` there compiles every bucket before serving -- minutes on a CPU, even for a
two-layer toy -- and ``cpu``'s recording graph replays the kernels op by op on padded shapes);
``xla`` only without torch. Each pick is logged with its reason (``graphrt.registry``, INFO).
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
#: Why ``auto`` picks what it picks, in ``available_backends().auto_reason`` and the log line.
AUTO_REASONS: dict[str, str] = {
    "cuda": "a CUDA GPU is visible: captured CUDA graphs remove per-kernel launch overhead",
    "npu": "an Ascend NPU is visible: captured ACL graphs remove per-kernel launch overhead",
    "xla": "JAX sees an accelerator ({platform}): XLA compiles each bucket's whole forward into one executable",
    "xla-model": "a JAX model: xla is the backend that runs it (disable_precompile=True compiles each bucket on "
                 "first use instead of before serving)",
    "eager": "no accelerator, so start-up decides: eager serves the first token at once (nothing to capture or "
             "compile); xla would compile every bucket before serving (minutes on a CPU, even for a two-layer "
             "toy), for more tokens/s on a small model afterwards (docs/benchmarks.md): pass backend='xla' "
             "(warmup='background' serves while it compiles); backend='cpu' captures the correctness tests' graphs",
    "xla-no-torch": "no accelerator and no torch: xla runs it, compiling each bucket before serving "
                    "(disable_precompile=True: on first use)",
    "cpu": "only the CPU recording graph can run here",
}
#: The modules whose presence means JAX may see an accelerator (TPU: libtpu; GPU plugins
#: register under the ``jax_plugins`` entry points): only then is jax imported to ask.
JAX_ACCELERATOR_MODULES = ("libtpu",)


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


def available_backends(model: Any = None) -> Availability:
    """Every backend name -> ``None`` if usable here, or the reason it is not; ``.auto`` and
    ``.auto_reason`` say which one ``auto`` picks here (for ``model``, where given) and why."""
    out = Availability((name, unavailable_reason(name)) for name in BACKENDS)
    out.auto, out.auto_reason = auto_choice(model, out.get)
    return out


def is_jax_model(model: Any) -> bool:
    """Whether ``model`` is a JAX model (an ``XlaModel``, a ``(DecoderConfig, params)`` pair, a
    flax module), without importing jax or flax (a JAX model's modules are loaded already)."""
    programs = sys.modules.get("graphrt.backends.xla.programs")
    if programs is not None and isinstance(model, programs.XlaModel):
        return True
    if isinstance(model, tuple) and len(model) == 2 and type(model[0]).__name__ == "DecoderConfig":
        return True
    return type(model).__module__.split(".")[0] in ("flax", "jax", "jaxlib")


def jax_accelerator() -> str | None:
    """The platform of JAX's default device where it is an accelerator ("tpu", "gpu"), else None.
    jax is imported (seconds) only where an accelerator plugin is installed."""
    import importlib.metadata
    import importlib.util

    plugins = list(importlib.metadata.entry_points(group="jax_plugins"))
    if not plugins and not any(importlib.util.find_spec(name) for name in JAX_ACCELERATOR_MODULES):
        return None
    try:
        import jax
        platform = jax.devices()[0].platform
    except Exception:                  # noqa: BLE001 -- a broken plugin: no accelerator to pick
        return None
    return None if platform == "cpu" else platform


def auto_choice(model: Any = None, unavailable: Any = None) -> tuple[str | None, str]:
    """(backend, why) ``auto`` picks for ``model`` (None: a checkpoint directory), from the
    backends' ``unavailable(name)`` reasons (default: :func:`unavailable_reason`); the module
    docstring has the rule."""
    unavailable = unavailable or unavailable_reason
    reasons: dict[str, str] = {}

    def usable(name: str) -> bool:
        reason = unavailable(name)
        if reason is not None:
            reasons[name] = reason
        return reason is None

    torch = sys.modules.get("torch")
    torch_model = torch is not None and isinstance(model, torch.nn.Module)
    if is_jax_model(model):
        if usable("xla"):
            return "xla", AUTO_REASONS["xla-model"]
    else:
        for name in ("cuda", "npu"):
            if usable(name):
                return name, AUTO_REASONS[name]
        platform = None if torch_model else jax_accelerator()       # imports jax only where it may see one
        if platform is not None and usable("xla"):
            return "xla", AUTO_REASONS["xla"].format(platform=platform)
        for name in ("eager", "cpu") if torch_model else ("eager", "xla", "cpu"):
            if usable(name):
                return name, AUTO_REASONS["xla-no-torch" if name == "xla" else name]
    return None, "no backend is available: " + "; ".join(f"{k}: {v}" for k, v in reasons.items())


def select_backend(name: str = "auto", *, model: Any = None, **options: Any) -> Any:
    """A backend instance by name (``cuda``, ``npu``/``acl``, ``xla``/``jax``, ``cpu``, ``eager``, ``auto``);
    ``model`` (what will run on it) narrows ``auto`` to its framework. ``auto`` logs what it
    picked and why (INFO)."""
    if name.lower() == "auto":
        picked, why = auto_choice(model)
        if picked is None:
            raise BackendUnavailableError(why)
        logger.info("graphrt: backend auto -> %s: %s", picked, why)
        return _load(picked)(**options)
    key = canonical_name(name)
    reason = unavailable_reason(key)
    if reason is not None:
        raise BackendUnavailableError(f"backend {key!r} is unavailable: {reason}")
    return _load(key)(**options)
