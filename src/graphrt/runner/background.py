"""Background warm-up: serve from the first step; build missing keys between steps, most
demanded first.

Until a key is built, a step runs under the smallest built key that covers it, else eagerly (on
XLA it builds its key), and adds to the key's demand. The builder never runs while a launched step
is unresolved: a capture writes the static buffers it still reads. See docs/api.md, "Warm-up:
upfront or in the background".
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Mapping, Sequence

from graphrt.backends.base import Executor
from graphrt.core.collector import collector_paused
from graphrt.core.cache import FailedBuild, describe_key
from graphrt.core.eager import EagerCause
from graphrt.runner.keys import Job, ServingKeys
from graphrt.runner.warmup import build_one

#: After a step, the builder keeps building this long (at least one key) before the next step ...
BACKGROUND_SLICE_S = 0.05
#: ... and builds without a step once the runner is idle this long (this long before its first
#: step: a request that comes right after the engine is built runs first).
BACKGROUND_IDLE_S = 0.05
BACKGROUND_START_IDLE_S = 1.0
#: How long the builder thread waits for a step's end before it looks for due work (a traffic
#: re-fit's switch of key sets) when nothing is left to build.
BACKGROUND_POLL_S = 0.25

logger = logging.getLogger(__name__)


class BackgroundWarmup:
    """The jobs a runner still has to build, their demand, and the thread that builds them.

    ``keys``: the runner's serving keys (whose caches the builds fill). ``lock``: the runner's step lock (held while building). ``idle()``: nothing launched is in
    flight. ``memory_cap``: graph bytes the KV budget admitted (None: no budget). ``prior``:
    demand per job from a saved plan. ``raise_failures``: a failed build is kept in
    :attr:`error` and raised from the next step instead of running that key eagerly.
    """

    def __init__(self, executor: Executor, keys: ServingKeys, lock: threading.Lock,
                 idle: Callable[[], bool], *, memory_cap: int | None = None, raise_failures: bool = False,
                 label: str = "", on_complete: Callable[[], None] | None = None) -> None:
        self.executor = executor
        self.keys = keys
        self.cache = keys.cache
        self.sampler_cache = keys.sampler_cache
        self.lock = lock
        self.idle = idle
        self.memory_cap = memory_cap
        self.raise_failures = raise_failures
        self.label = label
        #: Steps that wanted each job while it was missing (the runner adds to it on such steps).
        self.demand: collections.Counter[Job] = collections.Counter()
        self.prior: dict[Job, int] = {}
        self._order: dict[Job, int] = {}               # pending job -> its place in warm-up's order
        self._over_memory: set[Job] = set()
        #: Set by the runner after each step while :attr:`active`: the builder's turn.
        self.turn = threading.Event()
        #: True while jobs are pending (a plain attribute: the step path reads it).
        self.active = False
        #: True once every planned job is built, failed or left out for memory (a plain attribute).
        self.complete = True
        #: A failed build in strict mode / without an eager path, raised from the next step.
        self.error: BaseException | None = None
        self.built = self.failed = 0
        self.build_seconds = 0.0
        self.started_at: float | None = None
        self.completed_at: float | None = None
        #: Called (with the lock held) each time warm-up completes.
        self.on_complete: list[Callable[[], None]] = [on_complete] if on_complete is not None else []
        #: Called once (with the lock held) at the builder's next turn with nothing launched in
        #: flight, before it builds (:meth:`at_idle`: a traffic re-fit's switch of key sets).
        self._due: list[Callable[[], None]] = []
        self._thread: threading.Thread | None = None
        self._started = False
        self._stop = threading.Event()

    # ---- the plan ------------------------------------------------------------------------
    def plan(self, jobs: Sequence[Job], prior: Mapping[Job, int] | None = None, *,
             seal_if_none: bool = False) -> int:
        """Queue the ``jobs`` the caches lack (``prior``: saved demand), reopening warm-up; with
        none queued and ``seal_if_none``, seal the caches. Returns how many were queued."""
        if prior:
            self.prior.update(prior)
        new = [job for job in dict.fromkeys(jobs) if not self.has(job) and job not in self._order]
        if new:
            logger.info("graphrt: %s background warm-up: %d keys queued, serving meanwhile (eagerly, or under a "
                        "built key that covers the step)", self.label, len(new))
        if not new:
            if seal_if_none:
                self.cache.seal()
                self.sampler_cache.seal()
            return 0
        base = len(self._order)
        self._order.update((job, base + i) for i, job in enumerate(new))
        self.executor.expect_builds(new)
        self.cache.reopen()
        self.sampler_cache.reopen()
        self.active, self.complete = True, False
        self.completed_at = None
        self.started_at = self.started_at or time.perf_counter()
        if self._started:
            self.start()
        return len(new)

    @property
    def pending(self) -> list[Job]:
        """The jobs left to build, in the order they would be built now."""
        return sorted(self._order, key=self._rank)

    def _rank(self, job: Job) -> tuple[int, int, int]:
        return (-self.demand[job], -self.prior.get(job, 0), self._order[job])

    def cause_of(self, job: Job) -> EagerCause | None:
        """``WARMING_UP`` while ``job`` is pending, ``GRAPH_MEMORY`` if left out; else None."""
        if job in self._order:
            return EagerCause.WARMING_UP
        if job in self._over_memory:
            return EagerCause.GRAPH_MEMORY
        return None

    def has(self, job: Job) -> bool:
        """Whether ``job`` has an entry (built, or failed)."""
        return self.keys.has(job)

    def at_idle(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` (lock held) at the builder's next turn with no launched step in flight,
        before any build: work that must not touch a key a launched step may still run. Marks
        warm-up :attr:`active` meanwhile, so the runner hands the builder its turn after each
        step and ``graphrt.LLM`` runs its plain loop until then."""
        self._due.append(callback)
        self.active = True
        if self._started:
            self.start()

    def _run_due(self) -> None:
        """The :meth:`at_idle` callbacks, once each; inactive after them when nothing is pending."""
        due, self._due = self._due, []
        for callback in due:
            callback()
        if not self._order and self.complete:
            self.active = False

    def drop(self, jobs: Iterable[Job]) -> None:
        """Forget pending jobs (a re-fit that no longer wants them)."""
        for job in jobs:
            self._order.pop(job, None)
            self._over_memory.discard(job)

    # ---- building ------------------------------------------------------------------------
    def build_next(self, max_seconds: float = BACKGROUND_SLICE_S) -> int:
        """Build pending jobs, most demanded first, for ``max_seconds`` (at least one); lock held,
        nothing in flight. Returns how many were built or failed."""
        start, done = time.perf_counter(), 0
        while self._order and (done == 0 or time.perf_counter() - start < max_seconds):
            job = min(self._order, key=self._rank)
            del self._order[job]
            if self.has(job):                   # built on a step meanwhile (no eager path)
                continue
            if self._over_budget():
                self._over_memory.add(job)
                self._over_memory.update(self._order)
                logger.warning("graphrt: background warm-up stops: graphs hold %d bytes, the KV budget "
                               "admitted %d; %d keys stay unbuilt (eager: graph_memory)",
                               self.built_bytes(), self.memory_cap, len(self._order) + 1)
                self._order.clear()
                break
            done += self._build(job)
        if not self._order and not self.complete:
            self._finish()
        return done

    def _build(self, job: Job) -> int:
        mode, key = job
        target, cache_key = self.keys.target(job)
        t0 = time.perf_counter()
        try:
            with collector_paused():
                ok = build_one(self.executor, target, cache_key, mode, key, strict=self.raise_failures)
        except Exception as exc:  # noqa: BLE001 - raised from the next step (this is not its thread)
            self.error = exc
            target.put_failed(cache_key, str(exc), seconds=time.perf_counter() - t0)
            ok = False
        self.build_seconds += time.perf_counter() - t0
        self.built += ok
        self.failed += not ok
        logger.debug("graphrt: background %s %s in %.3f s", "built" if ok else "failed to build",
                     describe_key(key), time.perf_counter() - t0)
        return 1

    def built_bytes(self) -> int:
        """Bytes every built forward and sampler entry holds."""
        return self.cache.stats.build_bytes + self.sampler_cache.stats.build_bytes

    def _over_budget(self) -> bool:
        return self.memory_cap is not None and self.built_bytes() >= self.memory_cap

    def _finish(self) -> None:
        self.active, self.complete = False, True
        self.completed_at = time.perf_counter()
        self.cache.seal()
        self.sampler_cache.seal()
        failed = sum(isinstance(self.cache.lookup(k), FailedBuild) for k in self.cache)
        logger.info("graphrt: %s background warm-up complete: %d built, %d failed%s, %.2f s building over "
                    "%.2f s", self.label, self.built, failed,
                    f", {len(self._over_memory)} left out for graph memory" if self._over_memory else "",
                    self.build_seconds, self.completed_at - (self.started_at or self.completed_at))
        for callback in list(self.on_complete):
            callback()

    def build_all(self) -> int:
        """Run what is due (:meth:`at_idle`), then build every pending job now, in demand order
        (the caller holds the lock, nothing launched in flight)."""
        self._run_due()
        n = 0
        while self._order or not self.complete:
            n += self.build_next(max_seconds=float("inf"))
        return n

    # ---- the thread ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the daemon builder thread (idempotent). It holds this object weakly, so an
        unclosed runner is still collected, and ends when idle; :meth:`plan` restarts it."""
        self._started = True
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=_builder, args=(weakref.ref(self), self._stop, self.turn),
                                            name="graphrt-background-warmup", daemon=True)
            _LIVE.add(self)
            self._thread.start()

    def stop(self) -> None:
        """Stop the builder thread and wait for its current build (idempotent)."""
        self._started = False
        self._stop.set()
        self.turn.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until warm-up is complete (for benchmarks and tests); whether it is."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        while not self.complete and (deadline is None or time.perf_counter() < deadline):
            if self._thread is None or not self._thread.is_alive():
                break
            time.sleep(0.005)
        return self.complete

    def _turn(self) -> bool:
        """One builder turn (lock taken): what is due, then a slice of builds; False when done."""
        with self.lock:
            if self._stop.is_set():
                return False
            if self.idle():
                self._run_due()
                if self._order or not self.complete:
                    self.build_next()
            return bool(self._order or self._due or not self.complete)

    def report(self) -> dict[str, Any]:
        """Numbers for stats and logs: built, failed, pending, left out for memory, seconds spent
        building, whether complete, and the most demanded pending keys."""
        pending = self.pending
        return {"complete": self.complete, "built": self.built, "failed": self.failed, "pending": len(pending),
                "over_memory": len(self._over_memory), "build_seconds": round(self.build_seconds, 4),
                "seconds_to_complete": (None if self.completed_at is None or self.started_at is None
                                        else round(self.completed_at - self.started_at, 4)),
                "next": [describe_key(key) for _, key in pending[:4]]}


def _builder(ref: "weakref.ref[BackgroundWarmup]", stop: threading.Event, turn: threading.Event) -> None:
    """The builder thread: wait for a step to end (or the idle time), take a turn."""
    first = True
    while not stop.is_set():
        background = ref()
        if background is None:
            return
        timeout = (BACKGROUND_START_IDLE_S if first else BACKGROUND_IDLE_S) if background._order \
            else BACKGROUND_POLL_S
        del background
        turn.wait(timeout)            # first: the first step's end, so the first request never waits on a build
        first = False
        turn.clear()
        background = ref()
        if background is None or not background._turn():
            return
        del background


#: Warm-ups whose thread may run: stopped (their current build finished) at interpreter exit,
#: before torch or jax are torn down under a running build.
_LIVE: "weakref.WeakSet[BackgroundWarmup]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for background in list(_LIVE):
        background.stop()


def demand_of(job: Job, background: BackgroundWarmup | None, keys: ServingKeys) -> int:
    """Steps that used or wanted ``job``: its hits so far plus its demand while missing."""
    target, cache_key = keys.target(job)
    per_key = target.stats.per_key.get(cache_key)
    return (per_key.hits if per_key is not None else 0) + (background.demand[job] if background else 0)


__all__ = ["BackgroundWarmup", "demand_of"]
