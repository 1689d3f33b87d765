"""Step plans: how every step of one dispatch shape runs, decided once and remembered.

A plan holds the dispatcher's mode and key, the cache entry (or why the step runs eagerly), the
padded request count and the sampler entries; it is reused until either cache changes
(``version``). What a step of the plan records in a cache's statistics (its sizes, hit or miss,
eager cause) is decided with it, as a :class:`~graphrt.core.cache.StepTally` each step adds one to.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol

from graphrt.core.cache import FailedBuild, GraphCache, StepTally
from graphrt.core.dispatch import BatchDescriptor, Dispatch, Dispatcher, DispatchShape, SamplerKey, logprobs_key
from graphrt.core.eager import EagerCause
from graphrt.core.graph_modes import RuntimeMode

logger = logging.getLogger("graphrt.runner")

#: The key of a plan's logprobs graph in :attr:`StepPlan.sampler` (``SamplerKey.kind`` of its key).
LOGPROBS = "logprobs"


class SamplerEntry(NamedTuple):
    """A plan's sampler for one :attr:`SamplerKey.kind`: the key looked up, its entry (None: it
    runs eagerly), and if so why (in words, and the counted cause); ``tally``: what each FULL step
    of the plan that samples with it records in the sampler cache (:func:`sampler_entry`)."""

    key: SamplerKey
    entry: Any
    eager_reason: str | None
    eager_cause: EagerCause | None
    tally: StepTally

#: ``build_missing(cache, cache_key, mode, key) -> entry``: builds a key warm-up did not
#: (backends without an eager path, XLA); None where a missing key runs eagerly.
BuildMissing = Callable[[GraphCache, Any, RuntimeMode, Any], Any]


@dataclass
class StepInfo:
    """What the last step ran as (for tests, logs and the CLI)."""

    dispatch: Dispatch
    mode: RuntimeMode
    key: BatchDescriptor
    num_tokens: int
    num_reqs: int
    eager_reason: str | None
    seconds: float
    eager_cause: EagerCause | None = None   # why it ran eagerly, grouped (None: it did not)
    #: The key it wanted and lacked (background warm-up is building it): it ran eagerly, or under
    #: ``key``, a larger built key that covers it. None: it ran as planned.
    wanted: tuple[RuntimeMode, BatchDescriptor] | None = None


@dataclass(frozen=True)
class StepPlan:
    """How every step of one dispatch shape runs (:func:`plan_step`)."""

    dispatch: Dispatch
    mode: RuntimeMode
    key: BatchDescriptor
    entry: Any
    eager_reason: str | None
    padded_reqs: int
    cache_key: tuple | None          # the forward cache's key looked up (None: eager by dispatch)
    hit: bool
    #: :attr:`SamplerKey.kind` -> its :class:`SamplerEntry` (random variants added on first use,
    #: :func:`plan_sampler`).
    sampler: dict[str, SamplerEntry]
    version: int                     # cache.version + sampler_cache.version when planned
    eager_cause: EagerCause | None = None
    #: The job the step wants built and lacks (it ran eagerly or under a larger key); None: none.
    wanted: tuple[RuntimeMode, BatchDescriptor] | None = None
    #: What each step of the shape records in the forward cache (:func:`plan_step` sets it; its
    #: real sizes are the shape's: a step of other real sizes, a dummy or data-parallel one,
    #: records its own with ``GraphCache.record_step``).
    tally: StepTally | None = None


class StepArgs(NamedTuple):
    """One step as :meth:`ModelRunner.execute` takes it (the caller's arrays, unchecked)."""

    token_ids: Any
    block_table: Any
    req_rows: Any
    num_computed_tokens: Any
    num_scheduled_tokens: Any
    sampling: Any = None               # a SamplingBatch, or None: nothing sampled
    lora_ids: Any = None
    future_rows: Any = None
    extra_inputs: Any = None
    prompt_logprobs: Any = None
    state_slots: Any = None


class LastStep(NamedTuple):
    """What the runner keeps of its last step (``ModelRunner.last_step`` describes it)."""

    plan: StepPlan
    num_tokens: int
    num_reqs: int
    seconds: float


class SamplerChoice(NamedTuple):
    """The sampler a batch runs at a padded size, remembered while the same (frozen) batch
    samples: the batch, the padded rows, its :class:`SamplerKey` and that key's ``kind``."""

    batch: Any
    padded_reqs: int
    key: SamplerKey
    kind: str


class OnDemandBuilds:
    """Builds a key warm-up did not, now, into the cache that looks it up: the one way a step
    gets an entry on a backend without an eager path (XLA); a graph backend runs it eagerly."""

    def __init__(self, executor: Any) -> None:
        self.executor = executor

    def __call__(self, cache: GraphCache, cache_key: Any, mode: RuntimeMode, key: Any) -> Any:
        if cache.sealed:
            logger.warning("graphrt: unplanned build of %s after warm-up", key)
        t0 = time.perf_counter()
        entry, nbytes = self.executor.build(mode, key)
        cache.put(cache_key, entry, seconds=time.perf_counter() - t0, nbytes=nbytes)
        return entry


class Pending(Protocol):
    """What planning asks of background warm-up (:class:`~graphrt.runner.background.BackgroundWarmup`)."""

    def cause_of(self, job: tuple[RuntimeMode, Any]) -> EagerCause | None:
        """Why ``job`` has no entry yet (``WARMING_UP``, ``GRAPH_MEMORY``), or None: not its job."""


def plan_step(shape: DispatchShape, dispatcher: Dispatcher, cache: GraphCache, sampler_cache: GraphCache,
              build_missing: BuildMissing | None, *, pending: Pending | None = None,
              degraded: frozenset[bool] = frozenset()) -> StepPlan:
    """The plan of ``shape``: the dispatcher's key, its entry in ``cache`` (or the reason to run
    eagerly), the padded sizes and the sampler entries.

    ``pending``: background warm-up; an unbuilt key is stood in for by the smallest built covering
    key, else the step runs eagerly (or, without an eager path, the key is built now).
    ``degraded``: step kinds whose graphs the attention backend or model could not hold."""
    t, r, uniform, n, context = shape
    d = dispatcher.dispatch(t, r, uniform, n, context)
    mode, key, entry, eager_reason, cache_key, hit = d.mode, d.key, None, None, None, False
    eager_cause, wanted = None, None
    if mode is RuntimeMode.NONE:
        eager_reason = d.reason
        eager_cause = d.cause or EagerCause.MODE    # a dispatcher that says eager, not why
        if eager_cause is EagerCause.MODE and uniform in degraded:
            eager_cause = EagerCause.UNSUPPORTED
    else:
        cache_key = (mode, key)
        entry = cache.lookup(cache_key, reason=lambda: f"{d.reason}, not built during warm-up")
        waiting = pending.cause_of(cache_key) if pending is not None and entry is None else None
        if waiting is not None:
            wanted = cache_key
            for stand_in in dispatcher.covering(t, r, uniform, key.num_loras, context):
                found = cache.lookup(stand_in) if stand_in in cache else None
                if found is not None and not isinstance(found, FailedBuild):
                    cache_key, (mode, key), entry = stand_in, stand_in, found
                    break
        if entry is None and build_missing is not None:
            entry = build_missing(cache, cache_key, mode, key)
            wanted = None
        hit = entry is not None and not isinstance(entry, FailedBuild)
        if not hit:
            eager_reason = (entry.reason if entry is not None else
                            f"{key} is not built yet ({waiting.value})" if waiting is not None else
                            f"{key} was not captured")
            eager_cause = (EagerCause.CAPTURE_FAILED if entry is not None else waiting or EagerCause.MISS)
            mode, key, entry = RuntimeMode.NONE, BatchDescriptor(t, r, uniform, n), None
    padded_reqs = key.num_reqs if key.num_reqs is not None else r
    tally = cache.tally(real_tokens=t, padded_tokens=key.num_tokens, real_reqs=r, padded_reqs=padded_reqs,
                        eager_reason=eager_reason, eager_cause=eager_cause, key=cache_key, hit=hit)
    sampler: dict[str, SamplerEntry] = {}
    for sampler_key in (SamplerKey(padded_reqs, True), SamplerKey(padded_reqs, False), logprobs_key(padded_reqs)):
        sampler[sampler_key.kind] = _sampler_lookup(sampler_cache, sampler_key, r, pending)
    return StepPlan(d, mode, key, entry, eager_reason, padded_reqs, cache_key, hit, sampler,
                    cache.version + sampler_cache.version, eager_cause, wanted, tally)


def sampler_entry(sampler_cache: GraphCache, key: SamplerKey, entry: Any, eager_reason: str | None,
                  eager_cause: EagerCause | None, real_reqs: int) -> SamplerEntry:
    """The :class:`SamplerEntry` of ``key`` for steps of ``real_reqs`` requests, with the tally
    each of them adds one to (a hit where it has an entry, else an eager step of that cause)."""
    tally = sampler_cache.tally(real_tokens=0, padded_tokens=0, real_reqs=real_reqs, padded_reqs=key.num_reqs,
                                eager_reason=eager_reason, eager_cause=eager_cause, key=key, hit=entry is not None)
    return SamplerEntry(key, entry, eager_reason, eager_cause, tally)


def _sampler_lookup(sampler_cache: GraphCache, key: SamplerKey, real_reqs: int,
                    pending: Pending | None = None) -> SamplerEntry:
    """The :class:`SamplerEntry` of a sampler key for steps of ``real_reqs`` requests."""
    entry = sampler_cache.lookup(key)
    if isinstance(entry, FailedBuild):
        return sampler_entry(sampler_cache, key, None, f"sampler capture failed: {entry.reason}",
                             EagerCause.CAPTURE_FAILED, real_reqs)
    if entry is None:
        why = pending.cause_of((RuntimeMode.FULL, key)) if pending is not None else None
        built_ahead = key.kind in ("greedy", "random", "logprobs")
        reason = f"{key} was not captured" if built_ahead else f"the {key.kind} sampler is not built at warm-up"
        return sampler_entry(sampler_cache, key, None, reason, why or EagerCause.MISS, real_reqs)
    return sampler_entry(sampler_cache, key, entry, None, None, real_reqs)


def plan_sampler(plan: StepPlan, key: SamplerKey, sampler_cache: GraphCache,
                 pending: Pending | None = None) -> SamplerEntry:
    """The :class:`SamplerEntry` of sampler ``key`` in ``plan``, looked up on first use for the
    variants a plan does not list ahead (wide top-k, penalties)."""
    kind = key.kind
    got = plan.sampler.get(kind)
    if got is None:
        got = plan.sampler[kind] = _sampler_lookup(sampler_cache, key, plan.tally.real_reqs, pending)
    return got


__all__ = ["BuildMissing", "LOGPROBS", "LastStep", "OnDemandBuilds", "Pending", "SamplerChoice", "SamplerEntry",
           "StepArgs", "StepInfo", "StepPlan", "plan_sampler", "sampler_entry",
           "plan_step"]
