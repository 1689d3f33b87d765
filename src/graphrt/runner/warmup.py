"""Warm-up: every key a runner's dispatcher can return, built ahead of serving, largest first;
then the caches are sealed. Objects alive before the builds are frozen out of the garbage
collector's sight (vLLM #21146: a collection between captures costs seconds).

A failed build runs its key eagerly with a warning; in strict mode, or without an eager path
(XLA), it raises :class:`~graphrt.core.errors.GraphCaptureError`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Sequence

from tqdm.auto import tqdm

from graphrt.backends.base import Executor
from graphrt.core.cache import GraphCache, describe_key
from graphrt.core.collector import objects_frozen
from graphrt.core.dispatch import BatchDescriptor, Dispatcher, SamplerKey
from graphrt.core.errors import ConfigError, GraphCaptureError
from graphrt.core.graph_modes import GraphMode, RuntimeMode

#: ``warmup=`` values of ``graphrt.LLM`` / ``ModelRunner``, and the LLM's default (docs/api.md,
#: "Warm-up": why).
WARMUP_MODES = ("upfront", "background")

logger = logging.getLogger(__name__)

Job = tuple[RuntimeMode, BatchDescriptor | SamplerKey]


def warmup_keys(dispatcher: Dispatcher, logprobs: bool = False, penalties: bool = False) -> list[Job]:
    """Every key warm-up builds, largest first: the dispatcher's, then a greedy and a random
    sampler per FULL request count, plus the logprobs graph (``logprobs``) and the penalised
    sampler (``penalties``) of that count."""
    keys = dispatcher.keys()
    sampler_reqs = sorted({k.num_reqs for m, k in keys if m is RuntimeMode.FULL}, reverse=True)
    kinds = ([SamplerKey(0, True), SamplerKey(0, False)] + ([SamplerKey(0, False, True)] if logprobs else [])
             + ([SamplerKey(0, False, penalties=True)] if penalties else []))
    return list(keys) + [(RuntimeMode.FULL, dataclasses.replace(kind, num_reqs=r)) for r in sampler_reqs for kind in kinds]


def compile_host_kernels(preparer: Any, padder: Any, executor: Executor) -> None:
    """Compile (or load from numba's disk cache) the host kernels before the first step."""
    seconds = preparer.compile_kernels(padder, out=executor.host_buffers)
    if seconds:
        logger.info("graphrt: host kernels (%s) ready in %.2f s", preparer.kernel, seconds)


def warm_up(runner: Any) -> list[dict[str, Any]]:
    """``ModelRunner.warmup``: the host kernels, then every key of ``runner.dispatcher`` built into
    its caches (:func:`build_every_key`), logged with seconds, MiB and failures; the report."""
    ex, cfg = runner.executor, runner.config
    if not ex.eager_fallback and cfg.disable_precompile:
        logger.info("graphrt: disable_precompile set: %s compiles each bucket on first use", runner.backend.name)
        return []
    compile_host_kernels(runner.preparer, runner.padder, ex)
    cache, sampler = runner.cache, runner.sampler_cache
    keys = runner.warmup_plan.jobs()
    total = build_every_key(ex, keys, cache, sampler,
                            strict=cfg.strict, progress=runner.progress, label=runner.backend.name)
    runner.warmup_report = warmup_report(ex, cache, sampler)
    failed = cache.stats.failed_builds + sampler.stats.failed_builds
    runner.graph_memory.built(cache.stats.build_bytes, sampler.stats.build_bytes, ex.sampler_buffer_bytes,
                              ex.scratch_bytes)
    logger.info("graphrt: %s warm-up built %d forward and %d sampler entries in %.2f s, %s%s",
                runner.backend.name, len(cache), len(sampler), total, runner.graph_memory.split(),
                f"; {failed} failed and run eagerly" if failed else "")
    logger.info("graphrt: %s", runner.graph_memory.summary())
    return runner.warmup_report


def warmup_report(executor: Executor, *caches: GraphCache) -> list[dict[str, Any]]:
    """The rows of ``caches``' reports (key, seconds, bytes, hits, failed), each with what the
    executor's compiler says its entry takes (:meth:`Executor.entry_memory`; on XLA
    ``temp_bytes``, ``alias_bytes``, ``code_bytes``)."""
    rows = []
    for cache in caches:
        entries = [cache.lookup(key) if key in cache else None for key in cache.stats.per_key]
        rows += [{**row, **executor.entry_memory(entry)} for row, entry in zip(cache.report(), entries)]
    return rows


def build_every_key(executor: Executor, jobs: Sequence[Job], cache: GraphCache, sampler_cache: GraphCache, *,
                    strict: bool, progress: bool, label: str) -> float:
    """Build ``jobs`` in order into ``cache`` / ``sampler_cache``, then seal both; returns the
    seconds taken. Executors that build faster at once (XLA) get the missing keys through
    ``build_many``; the others build one at a time."""
    entries = [(sampler_cache, key, mode, key) if isinstance(key, SamplerKey) else (cache, (mode, key), mode, key)
               for mode, key in jobs]
    missing = [(target, cache_key, mode, key) for target, cache_key, mode, key in entries
               if cache_key not in target]
    start = time.perf_counter()
    with objects_frozen():      # every object alive now out of the collector's sight while graphs are built
        _build_missing(executor, missing, entries, strict=strict, progress=progress, label=label)
    cache.seal()
    sampler_cache.seal()
    return time.perf_counter() - start


def _build_missing(executor: Executor, missing: list, entries: list, *, strict: bool, progress: bool,
                   label: str) -> None:
    """:func:`build_every_key`'s builds: ahead where the executor can, else one key at a time."""
    try:
        ahead = executor.build_many([(mode, key) for _, _, mode, key in missing], progress=progress)
    except Exception as exc:  # noqa: BLE001 - said once, with the reason, like a single build
        raise GraphCaptureError(f"building ahead failed: {executor.describe_build_failure(exc)}") from exc
    if ahead is not None:
        for (target, cache_key, _, _), built in zip(missing, ahead):
            target.put(cache_key, built.entry, seconds=built.seconds, nbytes=built.nbytes)
        entries = []
    bar = tqdm(entries, desc=f"graphrt {label} warm-up", unit="graph", disable=not progress or not entries,
               leave=False)
    for target, cache_key, mode, key in bar:
        bar.set_postfix_str(str(key))
        build_one(executor, target, cache_key, mode, key, strict=strict)


def build_one(executor: Executor, target: GraphCache, cache_key: Any, mode: RuntimeMode,
              key: BatchDescriptor | SamplerKey, *, strict: bool) -> bool:
    """Build one key into ``target``; True when built. A failure is stored as a
    :class:`FailedBuild` with a warning, or raised as GraphCaptureError in strict mode / on XLA."""
    t0 = time.perf_counter()
    try:
        entry, nbytes = executor.build(mode, key)
    except Exception as exc:  # noqa: BLE001 - any capture failure degrades to eager
        reason = executor.describe_build_failure(exc)
        if strict or not executor.eager_fallback:
            raise GraphCaptureError(f"building {describe_key(key)} failed: {reason}") from exc
        logger.warning("graphrt: capture of %s failed, it will run eagerly: %s", key, reason)
        target.put_failed(cache_key, reason, seconds=time.perf_counter() - t0)
        return False
    target.put(cache_key, entry, seconds=time.perf_counter() - t0, nbytes=nbytes)
    return True


def job_target(job: Job, cache: GraphCache, sampler_cache: GraphCache) -> tuple[GraphCache, Any]:
    """Where a job's entry is kept: ``(sampler_cache, key)`` for a sampler key, else
    ``(cache, (mode, key))``."""
    mode, key = job
    return (sampler_cache, key) if isinstance(key, SamplerKey) else (cache, (mode, key))


def warmup_mode(warmup: bool | str | None) -> str | None:
    """``"upfront"`` (True), ``"background"``, or None (False: deferred to ``runner.warmup()``);
    anything else is a ConfigError naming ``warmup``."""
    if warmup is True or warmup == "upfront":
        return "upfront"
    if warmup is False or warmup is None:
        return None
    if warmup == "background":
        return "background"
    raise ConfigError(f"warmup: must be one of {list(WARMUP_MODES)}, True or False; got {warmup!r}")


def graphs_for(mode: GraphMode, uniform: bool) -> bool:
    """Whether graph mode ``mode`` gives steps of this kind (uniform decode or not) graphs."""
    mode = GraphMode(mode)
    return (mode.decode_mode() if uniform else mode.mixed_mode()) is not RuntimeMode.NONE


__all__ = ["Job", "build_every_key", "build_one", "compile_host_kernels", "graphs_for", "job_target", "warm_up",
           "warmup_keys", "warmup_mode", "warmup_report"]
