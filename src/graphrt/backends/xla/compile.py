"""Counting XLA compiles through ``jax.monitoring``, and the persistent compilation cache.

JAX records ``/jax/core/compile/backend_compile_duration`` around every backend compile
(persistent-cache loads included, which also record ``/jax/compilation_cache/cache_hits``).
One listener, installed once per process, counts both per thread -- so the executor can
tell whether *its own* call compiled -- and for every open :class:`CompileCounter`.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import jax

#: Compiles at least this long are written to the persistent compilation cache; JAX's own
#: default (1 s) would skip every bucket of a small model.
XLA_PERSISTENT_CACHE_MIN_COMPILE_SECONDS = 0.0


logger = logging.getLogger(__name__)

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
PERSISTENT_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class _ThreadCounts(threading.local):
    compiles: int = 0
    cache_hits: int = 0
    last_compiled: str | None = None


_thread = _ThreadCounts()
_lock = threading.Lock()
_open_counters: list["CompileCounter"] = []
_installed = False


def _on_duration(event: str, duration: float, **kwargs: Any) -> None:
    if event != BACKEND_COMPILE_EVENT:
        return
    name = str(kwargs.get("fun_name", "?"))
    _thread.compiles += 1
    _thread.last_compiled = name
    with _lock:
        for counter in _open_counters:
            counter.compiles += 1
            counter.names.append(name)
            counter.seconds += duration


def _on_event(event: str, **kwargs: Any) -> None:
    if event != PERSISTENT_CACHE_HIT_EVENT:
        return
    _thread.cache_hits += 1
    with _lock:
        for counter in _open_counters:
            counter.persistent_cache_hits += 1


def install_listeners() -> None:
    """Register the compile listeners with ``jax.monitoring`` (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)
        _installed = True


def thread_counts() -> _ThreadCounts:
    """The per-thread counters object (``.compiles``, ``.cache_hits``, ``.last_compiled``):
    each thread reading an attribute sees its own values."""
    return _thread


def thread_compiles() -> int:
    """Backend compiles this thread has run so far (cheap: one attribute read)."""
    return _thread.compiles


def thread_cache_hits() -> int:
    """Persistent-cache loads this thread has run so far."""
    return _thread.cache_hits


def thread_last_compiled() -> str | None:
    """Name of the function this thread compiled last."""
    return _thread.last_compiled


class CompileCounter:
    """Counts every backend compile in the process (all threads) while open.

    ``with CompileCounter() as c: ...`` then ``c.compiles``, ``c.names``, ``c.seconds`` and
    ``c.persistent_cache_hits`` (compiles served from the persistent cache).
    """

    def __init__(self) -> None:
        self.compiles = 0
        self.persistent_cache_hits = 0
        self.seconds = 0.0
        self.names: list[str] = []

    def __enter__(self) -> "CompileCounter":
        install_listeners()
        with _lock:
            _open_counters.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        with _lock:
            _open_counters.remove(self)


def enable_persistent_cache(path: str) -> str:
    """Make compiled executables persist under ``path`` and be reused on restart.

    Process-wide (JAX has one cache): a second engine of the process with another directory
    moves every engine's cache there, with a warning naming both. Small compiles are kept too:
    JAX's default skips anything that compiled in under a second, which would be every bucket
    of a small model.
    """
    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(path, exist_ok=True)
    from jax.experimental.compilation_cache import compilation_cache as cc
    min_secs = XLA_PERSISTENT_CACHE_MIN_COMPILE_SECONDS
    current = jax.config.jax_compilation_cache_dir
    if current == path and jax.config.jax_persistent_cache_min_compile_time_secs == min_secs:
        return path
    if current and os.path.abspath(os.path.expanduser(current)) != path:
        logger.warning("graphrt: compilation_cache_dir=%s replaces %s as JAX's persistent compilation cache, "
                       "which is one per process: every engine of this process uses %s from now on (each "
                       "engine's own executable cache stays in its own directory)", path, current, path)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_secs)
    # JAX decides once per process whether the cache is in use; an earlier compile may
    # have decided "no". Resetting makes the next compile look again.
    cc.reset_cache()
    logger.info("graphrt: XLA persistent compilation cache at %s", path)
    return path
