"""Warm-up: every key a runner's dispatcher can return, built ahead of serving, largest first;
then the caches are sealed. Objects alive before the builds are frozen out of the garbage
collector's sight (vLLM #21146: a collection between captures costs seconds).

A failed build runs its key eagerly with a warning; in strict mode, or without an eager path
(XLA), it raises :class:`~graphrt.core.errors.GraphCaptureError`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from tqdm.auto import tqdm

from graphrt.backends.base import Executor
from graphrt.core.cache import GraphCache, describe_key
from graphrt.core.collector import objects_frozen
from graphrt.core.dispatch import BatchDescriptor, SamplerKey
from graphrt.core.errors import ConfigError, GraphCaptureError
from graphrt.core.graph_modes import GraphMode, RuntimeMode
from graphrt.runner.keys import Job

#: ``warmup=`` values of ``graphrt.LLM`` / ``ModelRunner``, and the LLM's default (docs/api.md,
#: "Warm-up": why).
WARMUP_MODES = ("upfront", "background")

logger = logging.getLogger(__name__)

def compile_host_kernels(preparer: Any, executor: Executor) -> None:
    """Compile (or load from numba's disk cache) the host kernels before the first step."""
    seconds = preparer.compile_kernels(out=executor.host_buffers)
    if seconds:
        logger.info("graphrt: host kernels (%s) ready in %.2f s", preparer.kernel, seconds)


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
        if strict or not executor.capabilities.eager_fallback:
            raise GraphCaptureError(f"building {describe_key(key)} failed: {reason}") from exc
        logger.warning("graphrt: capture of %s failed, it will run eagerly: %s", key, reason)
        target.put_failed(cache_key, reason, seconds=time.perf_counter() - t0)
        return False
    target.put(cache_key, entry, seconds=time.perf_counter() - t0, nbytes=nbytes)
    return True


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


__all__ = ["build_every_key", "build_one", "compile_host_kernels", "graphs_for", "warmup_mode", "warmup_report"]
