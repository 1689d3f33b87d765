"""A runner's warm-up as one object: which keys it builds, when (upfront or in the background),
the capture plan that remembers them across restarts, and the report of what was built. It
takes the runner's serving keys and executor, never the runner. The pieces keep their own
modules (:mod:`graphrt.runner.warmup`, :mod:`graphrt.runner.background`,
:mod:`graphrt.runner.capture_plan`, :mod:`graphrt.runner.traffic`).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from graphrt.backends.base import Executor
from graphrt.config import GraphConfig
from graphrt.core.dispatch import Dispatcher
from graphrt.core.errors import ConfigError
from graphrt.core.graph_memory import GraphMemory
from graphrt.core.inputs.preparer import InputPreparer
from graphrt.runner.background import BackgroundWarmup
from graphrt.runner.capture_plan import CapturePlanStore, SavedPlan, save_plan
from graphrt.runner.keys import Job, ServingKeys
from graphrt.runner.warmup import build_every_key, compile_host_kernels, warmup_report

logger = logging.getLogger("graphrt.runner.warmup")


class WarmupPlan:
    """What a runner builds and serves: ``keys`` (its dispatcher, caches and plan memo) filled by
    ``executor``; ``lock`` the runner's step lock; ``store`` the capture plan's file (None: no
    plan kept); ``graph_memory`` the graph budget the KV cache was sized with; ``preparer`` (with its
    padder) the host kernels compiled before the first step. It makes :attr:`background`
    (:meth:`open_background`) and keeps :attr:`report` (the rows of the last warm-up)."""

    def __init__(self, keys: ServingKeys, executor: Executor, config: GraphConfig, lock: threading.Lock, *,
                 store: CapturePlanStore | None, graph_memory: GraphMemory, preparer: InputPreparer,
                 label: str, progress: bool = True) -> None:
        self.keys, self.executor, self.config, self._lock = keys, executor, config, lock
        #: The capture plan's file (with ``compilation_cache_dir``; None: no plan kept, or its path
        #: is taken by something that is not a plan file: logged).
        self.store = store
        self.graph_memory = graph_memory
        self.preparer = preparer
        self.label, self.progress = label, progress
        #: The last warm-up's rows (key, seconds, bytes, hits, failed; ``runner.warmup_report``).
        self.report: list[dict[str, Any]] = []
        #: Background warm-up (None: warm-up neither runs there nor re-fits build there).
        self.background: BackgroundWarmup | None = None
        self._when_complete: list[Callable[[], None]] = []

    def jobs(self, dispatcher: Dispatcher | None = None) -> list[Job]:
        """Every key warm-up builds under ``dispatcher`` (default: the one served), largest first
        (:meth:`ServingKeys.jobs`): warm-up, the capture plan and re-fits all use this."""
        return self.keys.jobs(dispatcher)

    def open_background(self, warmup: str | None, idle: Callable[[], bool], *,
                        data_parallel: bool) -> BackgroundWarmup | None:
        """:attr:`background`, where warm-up runs there or re-fits build there (None otherwise);
        ``idle()`` says no launched step is in flight."""
        cfg = self.config
        if warmup == "background" and data_parallel:
            raise ConfigError("warmup='background': data-parallel ranks that step together must run one key "
                              "per step, and each rank's builds progress on their own; warm up upfront")
        if warmup != "background" and not cfg.refit_interval:
            return None
        self.background = BackgroundWarmup(self.executor, self.keys, self._lock, idle,
                                           memory_cap=self.graph_memory.admitted,
                                           raise_failures=cfg.strict or not self.executor.capabilities.eager_fallback,
                                           label=self.label, on_complete=self.background_complete)
        return self.background

    def begin(self, warmup: str | None, saved: SavedPlan | None) -> None:
        """The constructor's warm-up: every key now (``"upfront"``), queued in the ``saved`` plan's
        demand order (``"background"``), or none yet (None); then start the background builder."""
        if warmup == "upfront":
            self.warm_up()
        elif warmup == "background":
            self.start_background(saved.demand if saved is not None else None)
        if self.background is not None:
            self.background.start()

    def warm_up(self) -> list[dict[str, Any]]:
        """``ModelRunner.warmup``: the host kernels, then every key of the dispatcher built into the
        caches (:func:`~graphrt.runner.warmup.build_every_key`), logged with seconds, MiB and
        failures; the report."""
        ex, cfg, keys = self.executor, self.config, self.keys
        if not ex.capabilities.eager_fallback and cfg.disable_precompile:
            logger.info("graphrt: disable_precompile set: %s compiles each bucket on first use", self.label)
            return []
        compile_host_kernels(self.preparer, ex)
        cache, sampler = keys.cache, keys.sampler_cache
        total = build_every_key(ex, self.jobs(), cache, sampler, strict=cfg.strict, progress=self.progress,
                                label=self.label)
        self._built()
        failed = cache.stats.failed_builds + sampler.stats.failed_builds
        logger.info("graphrt: %s warm-up built %d forward and %d sampler entries in %.2f s, %s%s",
                    self.label, len(cache), len(sampler), total, self.graph_memory.split(),
                    f"; {failed} failed and run eagerly" if failed else "")
        logger.info("graphrt: %s", self.graph_memory.summary())
        return self.report

    def _built(self) -> None:
        """After a warm-up: the report and the graph memory the entries hold."""
        ex, keys = self.executor, self.keys
        self.report = warmup_report(ex, keys.cache, keys.sampler_cache)
        self.graph_memory.built(keys.cache.stats.build_bytes, keys.sampler_cache.stats.build_bytes,
                                ex.sampler_buffer_bytes, ex.scratch_bytes)

    def start_background(self, prior: Mapping[Job, int] | None = None) -> int:
        """Queue every warm-up key for the background, most demanded first (``prior``: saved
        demand); the host kernels compile now, the first step needs them. Returns how many."""
        if self.background is None:
            raise ConfigError("background warm-up needs a ModelRunner built with warmup='background'")
        compile_host_kernels(self.preparer, self.executor)
        with self._lock:
            return self.background.plan(self.jobs(), prior, seal_if_none=True)

    def when_complete(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (the lock held) each time background warm-up completes, after the
        report and the plan are saved: a traffic re-fit installs its new keys then."""
        self._when_complete.append(callback)

    def background_complete(self) -> None:
        """Background warm-up completed (the lock held): the report, graph memory, the plan saved,
        then what waits for it (:meth:`when_complete`)."""
        self._built()
        self.save()
        for callback in list(self._when_complete):
            callback()

    def save(self) -> Path | None:
        """Write the capture plan (keys, order, demand) beside the compilation cache; its path, or
        None without ``compilation_cache_dir`` (:func:`graphrt.runner.capture_plan.save_plan`)."""
        return save_plan(self.store, self.keys, self.background) if self.store is not None else None

    def replace_dispatcher(self, dispatcher: Dispatcher, retire: Sequence[Job] = ()) -> int:
        """Serve under ``dispatcher`` from the next step (a traffic re-fit; call with the lock held)
        and drop the entries of ``retire`` (keys it no longer has); returns how many were dropped."""
        retired = self.keys.serve(dispatcher, retire)
        if self.background is not None:
            self.background.drop(retire)
        self.save()
        return retired

    def close(self) -> None:
        """The runner closes: stop the background builder, save the plan where steps ran (idempotent)."""
        if self.background is not None:
            self.background.stop()
        if self.store is not None and self.keys.cache.stats.steps:
            with self._lock:
                self.save()


__all__ = ["WarmupPlan"]
