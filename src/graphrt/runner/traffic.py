"""Buckets fitted from live traffic: the step sizes a runner serves, re-fitted on a schedule.

With ``refit_interval=N`` the runner's step loop calls :meth:`TrafficFit.refit` at the end of
every ``N``-th step: it fits each bucket family to a decaying histogram of step sizes, so the
same traffic re-fits at the same steps. A new set is chosen only when it pads the window
``TRAFFIC_MIN_GAIN`` less (or as little with fewer keys); its keys are built in the background
while the old set serves. See docs/api.md, "Buckets that follow the traffic".
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from graphrt.config import GraphConfig
from graphrt.core import defaults
from graphrt.core.buckets import BucketPolicy
from graphrt.core.dispatch import Dispatcher, DispatchShape
from graphrt.core.dp_agreement import StepAgreement
from graphrt.core.errors import ConfigError
from graphrt.runner.features import Step, StepFeature
from graphrt.runner.keys import Job, ServingKeys
from graphrt.runner.warmup_plan import WarmupPlan

#: Traffic re-fit (graphrt/runner/traffic.py): the step-size histogram of earlier windows is weighted
#: by this at each re-fit (0: only the last window counts) ...
TRAFFIC_DECAY = 0.5
#: ... a re-fit installs the new buckets only when they pad the window's steps by this fraction
#: less than the current ones (no churn on noise); its window holds at least
#: ``defaults.MIN_REFIT_INTERVAL`` steps ...
TRAFFIC_MIN_GAIN = 0.05
#: ... and a family's histogram is binned to at most this many distinct sizes before the exact
#: fit (O(n^2 k): 256 sizes take milliseconds, 4096 take seconds), as the fit runs in the step loop.
TRAFFIC_MAX_SIZES = 256

logger = logging.getLogger(__name__)

#: A histogram of step sizes: size -> (decayed) count.
Histogram = dict[int, float]


def split_sizes(counts: dict[DispatchShape, int], decode_query_len: int) -> tuple[Histogram, Histogram]:
    """(decode steps by request count, mixed steps by token count) of per-shape step counts."""
    decode: Histogram = {}
    mixed: Histogram = {}
    for shape, n in counts.items():
        if shape.uniform_decode and shape.num_tokens == shape.num_reqs * decode_query_len:
            decode[shape.num_reqs] = decode.get(shape.num_reqs, 0) + n
        else:
            mixed[shape.num_tokens] = mixed.get(shape.num_tokens, 0) + n
    return decode, mixed


def fit_family(hist: Histogram, current: BucketPolicy, budget: int) -> BucketPolicy:
    """The at most ``budget`` sizes that pad ``hist`` least, the current largest size always one
    of them (steps above it stay above it; steps the window never saw stay covered)."""
    top = current.max_size
    within = {n: max(1, round(c * 1000)) for n, c in hist.items() if n <= top and c > 0}
    if not within or budget <= 1:
        return BucketPolicy([top])
    fitted = BucketPolicy.fit(binned(within, TRAFFIC_MAX_SIZES), budget - 1)
    return BucketPolicy(list(fitted.sizes) + [top])


def binned(counts: dict[int, int], max_sizes: int) -> dict[int, int]:
    """``counts`` with at most ``max_sizes`` distinct sizes: consecutive sizes merged into the
    largest of their run (a bucket chosen for it still covers every merged step)."""
    sizes = sorted(counts)
    if len(sizes) <= max_sizes:
        return counts
    per = -(-len(sizes) // max_sizes)
    return {run[-1]: sum(counts[n] for n in run) for run in (sizes[i:i + per] for i in range(0, len(sizes), per))}


def padded(hist: Histogram, policy: BucketPolicy | None) -> float:
    """Items ``hist`` runs under ``policy``, padding included (above the largest: unpadded)."""
    return sum(n * c for n, c in hist.items()) if policy is None else policy.padded_total(hist)


@dataclass
class Refit:
    """One re-fit's record (``runner.traffic.history``): the step that decided, the new and old
    bucket sizes, the window's padding waste under each, the keys queued to build and retired,
    and whether the new set is served yet (the record is updated when it is installed)."""

    step: int
    decode_buckets: list[int]
    token_buckets: list[int]
    old_decode_buckets: list[int]
    old_token_buckets: list[int]
    waste_before: float
    waste_after: float
    added: int = 0
    retired: int = 0
    installed: bool = False


class PendingSwitch(NamedTuple):
    """A chosen bucket set not served yet: its dispatcher and the jobs it retires once installed."""

    dispatcher: Dispatcher
    retire: list[Job]


class TrafficFit(StepFeature):
    """Step-size histograms of a runner and its bucket set re-fitted to them every ``interval`` steps.

    Reads the serving ``keys`` (dispatcher and caches) and switches them through ``warmup``
    (:meth:`WarmupPlan.replace_dispatcher`), whose :class:`BackgroundWarmup` builds the new keys
    and switches key sets at a turn with no launched step in flight when the step that decided
    had one. As a step feature it counts every step's dispatch shape (:attr:`step_sizes`) and
    decides at the end of every ``interval``-th step (:meth:`finish`): a function of the traffic alone.
    """

    def __init__(self, keys: ServingKeys, warmup: WarmupPlan, *, interval: int, max_buckets: int | None = None,
                 decay: float = TRAFFIC_DECAY) -> None:
        if warmup.background is None:
            raise ConfigError("refit_interval: a traffic re-fit builds its keys in the background; the runner "
                              "has no background warm-up")
        self.keys, self.warmup, self.background = keys, warmup, warmup.background
        self.interval = int(interval)
        self.max_buckets = max_buckets
        self.decay = float(decay)
        self.decode: Histogram = {}
        self.mixed: Histogram = {}
        #: Steps served per dispatch shape (what a re-fit reads).
        self.step_sizes: dict[DispatchShape, int] = {}
        self._seen: dict[DispatchShape, int] = {}
        self._until_refit = self.interval       # steps left before the step loop's next decision
        self.next_at = self.interval            # the step count of the next re-fit
        self.history: list[Refit] = []
        self._next: PendingSwitch | None = None     # built in the background, then installed
        d = keys.dispatcher              # the graph budget: the starting policy's sizes per family
        self.budget = {"decode": max_buckets or len(d.decode_buckets or ()),
                       "token": max_buckets or len(d.token_buckets or ())}
        warmup.when_complete(self._install_pending)

    @classmethod
    def attach(cls, keys: ServingKeys, warmup: WarmupPlan, config: GraphConfig,
               step_agreement: StepAgreement | None = None) -> "TrafficFit":
        """The re-fit of a runner's ``keys`` (``config``'s ``refit_interval`` / ``refit_max_buckets``),
        called by its step loop. Refused with data-parallel step agreement: every rank must keep one
        key set, and re-fits are per runner."""
        if step_agreement is not None:
            raise ConfigError("refit_interval: data-parallel ranks must keep one key set; re-fits are per "
                              "runner, so they cannot be combined with step_agreement")
        return cls(keys, warmup, interval=config.refit_interval, max_buckets=config.refit_max_buckets)

    # ---- the step feature ----------------------------------------------------------------
    def dispatched(self, step: Step) -> None:
        """Count the step's dispatch shape (the histogram a re-fit reads)."""
        sizes = self.step_sizes
        sizes[step.shape] = sizes.get(step.shape, 0) + 1
        self._until_refit -= 1

    def finish(self, step: Step) -> None:
        """After every ``interval``-th step: the re-fit decides, here (``step.wait``: nothing
        launched is in flight, so keys may be retired now)."""
        if self._until_refit <= 0:
            self._until_refit = self.interval
            self.refit(idle=step.wait)

    # ---- the re-fit ----------------------------------------------------------------------
    @property
    def target(self) -> Dispatcher:
        """The bucket set the last re-fit chose (the served one once it is installed): a re-fit
        compares against it, so its decision never depends on how far the builds got."""
        return self._next.dispatcher if self._next is not None else self.keys.dispatcher

    def window(self) -> int:
        """Fold the steps since the last look into the histograms; how many there were."""
        counts = dict(self.step_sizes)
        delta = {s: n - self._seen.get(s, 0) for s, n in counts.items() if n > self._seen.get(s, 0)}
        self._seen = counts
        decode, mixed = split_sizes(delta, self.keys.dispatcher.decode_query_len)
        for hist, new in ((self.decode, decode), (self.mixed, mixed)):
            for size in list(hist):
                hist[size] *= self.decay
                if hist[size] < 1e-3:
                    del hist[size]
            for size, n in new.items():
                hist[size] = hist.get(size, 0.0) + n
        return sum(delta.values())

    def refit(self, *, idle: bool = True) -> Refit | None:
        """Fit the bucket sets to the histograms and queue the new keys (or install at once);
        returns the re-fit's record, or None when nothing changed. The runner's step loop calls
        it every ``interval`` steps, its lock held; ``idle``: no launched step is in flight, so
        keys may be retired now (else the switch waits for the builder's next turn)."""
        keys, background = self.keys, self.background
        steps = keys.cache.stats.steps
        self.next_at = steps + self.interval
        if self.window() < defaults.MIN_REFIT_INTERVAL:
            return None
        old = self.target
        decode = tokens = None
        if old.decode_buckets is not None and old.separate_decode and self.decode:
            decode = fit_family(self.decode, old.decode_buckets, self.budget["decode"])
        if old.token_buckets is not None and self.mixed:
            tokens = fit_family(self.mixed, old.token_buckets, self.budget["token"])
        before = padded(self.decode, old.decode_buckets) + padded(self.mixed, old.token_buckets)
        after = (padded(self.decode, decode or old.decode_buckets) + padded(self.mixed, tokens or old.token_buckets))
        if decode in (None, old.decode_buckets) and tokens in (None, old.token_buckets):
            return None
        new = old.with_buckets(token_buckets=tokens, decode_buckets=decode)
        fewer = len(new.keys()) < len(old.keys())       # keys that no longer pay, at no padding cost
        if not (after <= (1 - TRAFFIC_MIN_GAIN) * before or (fewer and after <= before)):
            return None
        jobs, served = keys.jobs(new), keys.jobs()
        kept, serving = set(jobs), set(served)
        superseded = keys.jobs(old) if self._next is not None else []    # chosen, never installed
        retire = [job for job in dict.fromkeys(served + superseded) if job not in kept]
        background.drop(job for job in superseded if job not in kept and job not in serving)
        real = sum(n * c for n, c in self.decode.items()) + sum(n * c for n, c in self.mixed.items())
        record = Refit(step=steps, decode_buckets=list(new.decode_buckets or ()),
                       token_buckets=list(new.token_buckets or ()),
                       old_decode_buckets=list(old.decode_buckets or ()),
                       old_token_buckets=list(old.token_buckets or ()),
                       waste_before=round(1 - real / before, 4) if before else 0.0,
                       waste_after=round(1 - real / after, 4) if after else 0.0)
        self.history.append(record)
        self._next = PendingSwitch(new, retire)
        first = self._must_retire_first(jobs)      # the old keys go before the new ones are built
        if first and idle:
            self._install_pending()
        record.added = background.plan(jobs)
        logger.info("graphrt: traffic re-fit at step %d: decode buckets %s -> %s, token buckets %s -> %s; "
                    "padding waste over the window %.1f%% -> %.1f%%; %d keys to build in the background, %s",
                    steps, record.old_decode_buckets, record.decode_buckets, record.old_token_buckets,
                    record.token_buckets, 100 * record.waste_before, 100 * record.waste_after,
                    record.added, f"{record.retired} retired" if record.installed
                    else f"{len(retire)} to retire once they are built")
        if self._next is not None and (first or not background.active):    # switch before any build
            if idle:
                self._install_pending()
            else:           # a launched step may still run a key it retires: at the builder's turn
                background.at_idle(self._install_pending)
        return record

    def _must_retire_first(self, jobs: list[Job]) -> bool:
        """Whether the new keys would not fit beside the old ones in the admitted graph memory."""
        background = self.background
        cap = background.memory_cap
        if cap is None:
            return False
        cache = self.keys.cache
        built = [cache.stats.per_key[k].build_bytes for k in cache if k in cache.stats.per_key]
        per_key = sum(built) / len(built) if built else 0
        missing = sum(1 for job in jobs if not background.has(job))
        return background.built_bytes() + per_key * missing > cap

    def _install_pending(self) -> None:
        """Background warm-up completed: switch to the queued dispatcher and retire its old keys."""
        if self._next is None:
            return
        new, retire = self._next
        self._next = None
        retired = self.warmup.replace_dispatcher(new, retire)
        if self.history:
            self.history[-1].installed, self.history[-1].retired = True, retired
        logger.info("graphrt: traffic re-fit installed: decode buckets %s, token buckets %s; %d keys retired",
                    list(new.decode_buckets or ()), list(new.token_buckets or ()), retired)

    def report(self) -> dict[str, Any]:
        """The re-fit schedule and history (each :class:`Refit` as a dict), for stats."""
        d = self.keys.dispatcher
        return {"interval": self.interval, "next_at": self.next_at, "refits": len(self.history),
                "decode_buckets": list(d.decode_buckets or ()), "token_buckets": list(d.token_buckets or ()),
                "history": [asdict(record) for record in self.history[-8:]]}


__all__ = ["PendingSwitch", "Refit", "TrafficFit", "binned", "fit_family", "padded", "split_sizes"]
