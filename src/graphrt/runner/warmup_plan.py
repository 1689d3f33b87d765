"""A runner's warm-up as one feature object: which keys it builds, when (upfront or in the
background), the capture plan that remembers them across restarts, and the dispatcher it serves
under. The pieces keep their own modules (:mod:`graphrt.runner.warmup`, :mod:`graphrt.runner.background`,
:mod:`graphrt.runner.capture_plan`, :mod:`graphrt.runner.traffic`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from graphrt.runner.background import BackgroundWarmup
from graphrt.runner.capture_plan import CapturePlanStore, SavedPlan, describe_device, save_runner_plan
from graphrt.core.errors import ConfigError
from graphrt.runner.warmup import Job, compile_host_kernels, job_target, warmup_keys, warmup_report


class WarmupPlan:
    """What ``runner`` builds and serves. Reads the runner's public parts and writes
    ``runner.dispatcher`` (a re-fit) and ``runner.warmup_report``; ``step_plans`` is the runner's
    plan memo (cleared when the dispatcher changes); ``lock`` its step lock. It makes the
    capture plan store (:attr:`store`) and ``background`` (:meth:`background`)."""

    def __init__(self, runner: Any, step_plans: dict, lock: Any) -> None:
        self.runner, self._step_plans, self._lock = runner, step_plans, lock
        cfg = runner.config
        #: The capture plan's file (with ``compilation_cache_dir``; None: no plan kept, or its path
        #: is taken by something that is not a plan file: logged).
        store = (CapturePlanStore(cfg.compilation_cache_dir, backend=runner.backend.name,
                                  device=describe_device(runner.executor), model=runner.model, config=cfg)
                 if cfg.compilation_cache_dir and not cfg.disable_capture_plan
                 and cfg.tensor_parallel_size == 1 else None)
        self.store = store if store is not None and store.off is None else None

    def jobs(self, dispatcher: Any = None) -> list[Job]:
        """Every key warm-up builds under ``dispatcher`` (default: the runner's), largest first,
        with the configured sampler kinds: warm-up, the capture plan and re-fits all use this."""
        cfg = self.runner.config
        return warmup_keys(dispatcher if dispatcher is not None else self.runner.dispatcher,
                           logprobs=cfg.max_logprobs > 0, penalties=cfg.enable_penalties)

    def background(self, warmup: str | None, idle: Callable[[], bool], *,
                   data_parallel: bool) -> BackgroundWarmup | None:
        """The runner's ``background`` where warm-up runs there or re-fits build there (None
        otherwise); ``idle()`` says no launched step is in flight."""
        r, cfg = self.runner, self.runner.config
        if warmup == "background" and data_parallel:
            raise ConfigError("warmup='background': data-parallel ranks that step together must run one key "
                              "per step, and each rank's builds progress on their own; warm up upfront")
        if warmup != "background" and not cfg.refit_interval:
            return None
        return BackgroundWarmup(r.executor, r.cache, r.sampler_cache, self._lock, idle,
                                memory_cap=r.graph_memory.admitted,
                                raise_failures=cfg.strict or not r.executor.capabilities.eager_fallback,
                                label=r.backend.name, on_complete=self.background_complete)

    def begin(self, warmup: str | None, saved: SavedPlan | None) -> None:
        """The constructor's warm-up: every key now (``"upfront"``), queued in the ``saved`` plan's
        demand order (``"background"``), or none yet (None); then start the background builder."""
        r = self.runner
        if warmup == "upfront":
            r.warmup()
        elif warmup == "background":
            self.start_background(saved.demand if saved is not None else None)
        if r.background is not None:
            r.background.start()

    def start_background(self, prior: Mapping[Job, int] | None = None) -> int:
        """Queue every warm-up key for the background, most demanded first (``prior``: saved
        demand); the host kernels compile now, the first step needs them. Returns how many."""
        r = self.runner
        if r.background is None:
            raise ConfigError("background warm-up needs a ModelRunner built with warmup='background'")
        compile_host_kernels(r.preparer, r.padder, r.executor)
        with self._lock:
            return r.background.plan(self.jobs(), prior, seal_if_none=True)

    def background_complete(self) -> None:
        """Background warm-up completed (the lock held): the report, graph memory, the plan saved."""
        r = self.runner
        r.warmup_report = warmup_report(r.executor, r.cache, r.sampler_cache)
        r.graph_memory.built(r.cache.stats.build_bytes, r.sampler_cache.stats.build_bytes,
                             r.executor.sampler_buffer_bytes, r.executor.scratch_bytes)
        self.save()

    def save(self) -> Path | None:
        """Write the capture plan (keys, order, demand) beside the compilation cache; its path, or
        None without ``compilation_cache_dir`` (:func:`graphrt.runner.capture_plan.save_runner_plan`)."""
        return save_runner_plan(self.runner) if self.store is not None else None

    def replace_dispatcher(self, dispatcher: Any, retire: Sequence[Job] = ()) -> int:
        """Serve under ``dispatcher`` from the next step (a traffic re-fit; call with the lock held)
        and drop the entries of ``retire`` (keys it no longer has); returns how many were dropped."""
        r = self.runner
        r.dispatcher = dispatcher
        self._step_plans.clear()
        retired = 0
        for job in retire:
            target, cache_key = job_target(job, r.cache, r.sampler_cache)
            retired += target.retire(cache_key)
        if r.background is not None:
            r.background.drop(retire)
        self.save()
        return retired

    def close(self) -> None:
        """The runner closes: stop the background builder, save the plan where steps ran (idempotent)."""
        r = self.runner
        if r.background is not None:
            r.background.stop()
        if self.store is not None and r.cache.stats.steps:
            with self._lock:
                self.save()


__all__ = ["WarmupPlan"]
