"""The keys a runner serves, in one owner: the dispatcher (which key a step shape runs under),
the forward and sampler graph caches (the entries built for those keys), and the plan memo
(each dispatch shape's :class:`~graphrt.runner.plans.StepPlan`).

:class:`ServingKeys` is the only writer of the dispatcher (:meth:`ServingKeys.serve`: a saved
capture plan's buckets at start, a traffic re-fit's later); warm-up, background warm-up, the
re-fit and the capture plan store read the keys here, never through the runner.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Sequence

from graphrt.core.cache import GraphCache
from graphrt.core.dispatch import BatchDescriptor, Dispatcher, DispatchShape, SamplerKey
from graphrt.core.graph_modes import RuntimeMode
from graphrt.runner.plans import BuildMissing, Pending, StepPlan, plan_step

#: Distinct step shapes whose plan (dispatch + cache entries) the keys remember.
STEP_PLAN_MEMO_LIMIT = 1 << 16


class Job(NamedTuple):
    """One key to build: its runtime mode and its forward or sampler key (equal to, and hashed
    as, the plain ``(mode, key)`` tuple the dispatcher and the caches use)."""

    mode: RuntimeMode
    key: BatchDescriptor | SamplerKey


def warmup_keys(dispatcher: Dispatcher, logprobs: bool = False, penalties: bool = False) -> list[Job]:
    """Every key warm-up builds, largest first: the dispatcher's, then a greedy and a random
    sampler per FULL request count, plus the logprobs graph (``logprobs``) and the penalised
    sampler (``penalties``) of that count."""
    keys = dispatcher.keys()
    sampler_reqs = sorted({k.num_reqs for m, k in keys if m is RuntimeMode.FULL}, reverse=True)
    kinds = ([SamplerKey(0, True), SamplerKey(0, False)] + ([SamplerKey(0, False, True)] if logprobs else [])
             + ([SamplerKey(0, False, penalties=True)] if penalties else []))
    return ([Job(mode, key) for mode, key in keys]
            + [Job(RuntimeMode.FULL, dataclasses.replace(kind, num_reqs=r)) for r in sampler_reqs for kind in kinds])


def job_target(job: tuple[RuntimeMode, Any], cache: GraphCache, sampler_cache: GraphCache) -> tuple[GraphCache, Any]:
    """Where a job's entry is kept: ``(sampler_cache, key)`` for a sampler key, else
    ``(cache, (mode, key))``."""
    mode, key = job
    return (sampler_cache, key) if isinstance(key, SamplerKey) else (cache, (mode, key))


class ServingKeys:
    """The dispatcher, the forward and sampler caches and the plan memo of one runner.

    ``degraded``: step kinds whose graphs the attention backend or model could not hold;
    ``build_missing``: builds a key warm-up did not (no eager path: XLA), else None;
    ``logprobs`` / ``penalties``: the sampler kinds warm-up builds beside the forward keys.
    """

    def __init__(self, dispatcher: Dispatcher, *, strict: bool, degraded: frozenset[bool] = frozenset(),
                 build_missing: BuildMissing | None = None, logprobs: bool = False,
                 penalties: bool = False) -> None:
        self._dispatcher = dispatcher
        self.cache: GraphCache = GraphCache(strict=strict)
        self.sampler_cache: GraphCache = GraphCache(strict=False)
        self.degraded = degraded
        self.build_missing = build_missing
        self.logprobs, self.penalties = logprobs, penalties
        self._plans: dict[DispatchShape, StepPlan] = {}
        #: The last context bucket asked for and the lengths it covers: ``(low, high, bucket)``, a
        #: step whose longest request reads ``low < n <= high`` tokens is in it (a decode's context
        #: grows one token a step, so it leaves its bucket rarely).
        self._context = (0, -1, 0)

    @property
    def dispatcher(self) -> Dispatcher:
        """The dispatcher served now (replaced only by :meth:`serve`)."""
        return self._dispatcher

    def serve(self, dispatcher: Dispatcher, retire: Sequence[tuple[RuntimeMode, Any]] = ()) -> int:
        """Serve under ``dispatcher`` from the next step (call with the step lock held): the plan
        memo is cleared and the entries of ``retire`` (keys it no longer has) dropped; returns
        how many were dropped."""
        self._dispatcher = dispatcher
        self._forget_plans()
        self._context = (0, -1, 0)
        return sum(target.retire(cache_key) for target, cache_key in map(self.target, retire))

    def jobs(self, dispatcher: Dispatcher | None = None) -> list[Job]:
        """Every key warm-up builds under ``dispatcher`` (default: the one served), largest first,
        with the configured sampler kinds: warm-up, the capture plan and re-fits all use this."""
        return warmup_keys(dispatcher if dispatcher is not None else self._dispatcher,
                           logprobs=self.logprobs, penalties=self.penalties)

    def target(self, job: tuple[RuntimeMode, Any]) -> tuple[GraphCache, Any]:
        """``(cache, cache key)`` where ``job``'s entry is kept (:func:`job_target`)."""
        return job_target(job, self.cache, self.sampler_cache)

    def has(self, job: tuple[RuntimeMode, Any]) -> bool:
        """Whether ``job`` has an entry (built, or failed)."""
        target, cache_key = self.target(job)
        return cache_key in target

    def plan(self, shape: DispatchShape, pending: Pending | None = None) -> StepPlan:
        """The plan of every step of ``shape`` (:func:`~graphrt.runner.plans.plan_step`),
        remembered until either cache changes; ``pending``: background warm-up."""
        plan = self._plans.get(shape)
        if plan is not None and plan.version == self.cache.version + self.sampler_cache.version:
            return plan
        if len(self._plans) >= STEP_PLAN_MEMO_LIMIT:
            self._forget_plans()
        plan = plan_step(shape, self._dispatcher, self.cache, self.sampler_cache, self.build_missing,
                         pending=pending, degraded=self.degraded)
        self._plans[shape] = plan
        return plan

    def _forget_plans(self) -> None:
        """Drop the remembered plans and, with them, the caches' step tallies they counted on
        (folded into the statistics first): no more tallies than remembered kinds of step."""
        self._plans.clear()
        self.cache.release_tallies()
        self.sampler_cache.release_tallies()

    def context(self, max_seq_len: int) -> int:
        """The context bucket of a step whose longest request reads ``max_seq_len`` tokens (0
        without context buckets; -1 above them): the last one while the step is in its range,
        else the dispatcher's (:meth:`Dispatcher.context_bucket`), remembered with its range."""
        low, high, bucket = self._context
        if low < max_seq_len <= high:
            return bucket
        sizes = self._dispatcher.context_sizes
        if not sizes:
            self._context = (-1, math.inf, 0)
            return 0
        bucket = self._dispatcher.context_bucket(max_seq_len)
        if bucket < 0:
            self._context = (sizes[-1], math.inf, bucket)
        else:
            i = sizes.index(bucket)
            self._context = (sizes[i - 1] if i else -1, bucket, bucket)
        return bucket


__all__ = ["Job", "STEP_PLAN_MEMO_LIMIT", "ServingKeys", "job_target", "warmup_keys"]
