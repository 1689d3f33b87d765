"""GraphCache: captured graphs / compiled executables by key, with statistics.

Backends store whatever their entry is (a torch graph with its static outputs, an XLA
executable); the cache counts hits and misses, warm-up cost per key, real versus padded
tokens, eager steps and tokens by cause (:class:`~graphrt.core.eager.EagerCause`) and their
reasons, and enforces strict mode: once warm-up is over, a
miss raises :class:`~graphrt.core.errors.CacheMissError` naming the key and why.

A step is counted with :meth:`GraphCache.record_step`, or, where every step of a kind records
the same figures (a runner's remembered plan), with a :class:`StepTally` made once by
:meth:`GraphCache.tally`: the step adds one to its ``steps`` and the cache folds the tallies
into its :class:`CacheStats` whenever ``stats`` is read.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Hashable, Iterable, Iterator, TypeVar

from graphrt.core.dispatch import BatchDescriptor, SamplerKey
from graphrt.core.eager import EagerCause, EagerCount, new_eager_counts
from graphrt.core.errors import CacheMissError, GraphrtError, InputError

E = TypeVar("E")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FailedBuild:
    """Cache entry of a key whose build (capture / compile) failed: steps of that key run
    eagerly, and ``reason`` says why."""

    reason: str


def describe_key(key: Hashable) -> str:
    """A readable key: ``FULL (decode, tokens=8, reqs=8)``, ``sampler (reqs=8, greedy)``."""
    if isinstance(key, SamplerKey):
        return f"sampler (reqs={key.num_reqs}, {key.kind})"
    if isinstance(key, tuple):
        return " ".join(describe_key(k) for k in key)
    if isinstance(key, enum.Enum):
        return str(key.value)
    return str(key)


def key_sizes(key: Hashable, num_tokens: int, num_reqs: int) -> tuple[int, int]:
    """(tokens, requests) a call of ``key`` runs, padding included, for a call of ``num_tokens``
    real tokens and ``num_reqs`` real requests: a :class:`BatchDescriptor`'s sizes (its request
    count, where it has one), an int key's tokens. Other keys carry no size: ``InputError``."""
    if isinstance(key, BatchDescriptor):
        tokens, reqs = key.num_tokens, key.num_reqs
    elif isinstance(key, int) and not isinstance(key, bool):
        tokens, reqs = key, None
    else:
        raise InputError("num_tokens", f"the key {describe_key(key)} carries no size to pad to: key pieces by a "
                                       f"BatchDescriptor or a token count to count their padding")
    for name, real, padded in (("num_tokens", num_tokens, tokens), ("num_reqs", num_reqs, reqs)):
        if real < 0 or (padded is not None and real > padded):
            bound = "be >= 0" if padded is None else f"be in [0, {padded}]"
            raise InputError(name, f"{real} real for key {describe_key(key)}: must {bound}")
    return tokens, num_reqs if reqs is None else reqs


@dataclass
class EntryStats:
    """Cost of building one entry and how often it ran."""

    build_seconds: float = 0.0
    build_bytes: int = 0
    hits: int = 0
    failed: str | None = None          # why its build failed (it runs eagerly), else None


@dataclass
class CacheStats:
    """Counters a serving engine wants on its dashboard."""

    hits: int = 0
    misses: int = 0
    steps: int = 0                     # every step counted (graph or eager)
    eager_steps: int = 0
    eager_tokens: int = 0              # real tokens of the eager steps
    unplanned_builds: int = 0          # captures / compiles after warm-up
    compiles: int = 0                  # builds the executor counted, those no lookup saw included (runner.stats)
    failed_builds: int = 0             # keys whose capture failed (they run eagerly)
    retired: int = 0                   # entries dropped by a traffic re-fit (their keys no longer pay)
    recaptured: int = 0                # entries built again over buffers that moved (a wake, runner.recapture)
    real_tokens: int = 0
    padded_tokens: int = 0             # tokens actually run, padding included
    real_reqs: int = 0
    padded_reqs: int = 0
    eager_reasons: collections.Counter = field(default_factory=collections.Counter)
    #: Eager steps and their tokens per cause (every cause present, zero until it happens).
    eager_by_cause: dict[EagerCause, EagerCount] = field(default_factory=new_eager_counts)
    per_key: dict[Hashable, EntryStats] = field(default_factory=dict)

    @property
    def entries(self) -> int:
        return len(self.per_key)

    @property
    def build_seconds(self) -> float:
        return sum(e.build_seconds for e in self.per_key.values())

    @property
    def build_bytes(self) -> int:
        return sum(e.build_bytes for e in self.per_key.values())

    @property
    def graph_step_share(self) -> float:
        """Fraction of the counted steps that ran on a graph / executable (1.0 before any step)."""
        return 1.0 if self.steps == 0 else 1.0 - self.eager_steps / self.steps

    @property
    def graph_token_share(self) -> float:
        """Fraction of the real tokens that ran on a graph / executable (1.0 before any token)."""
        return 1.0 if self.real_tokens == 0 else 1.0 - self.eager_tokens / self.real_tokens

    @property
    def padding_waste(self) -> float:
        """Fraction of run tokens that were padding."""
        return 0.0 if self.padded_tokens == 0 else 1.0 - self.real_tokens / self.padded_tokens

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers, for logs and JSON."""
        return {"hits": self.hits, "misses": self.misses, "entries": self.entries, "steps": self.steps,
                "eager_steps": self.eager_steps, "eager_tokens": self.eager_tokens,
                "graph_step_share": round(self.graph_step_share, 4),
                "graph_token_share": round(self.graph_token_share, 4),
                "eager_by_cause": {c.value: {"steps": n.steps, "tokens": n.tokens}
                                   for c, n in self.eager_by_cause.items()},
                "unplanned_builds": self.unplanned_builds, "compiles": self.compiles,
                "failed_builds": self.failed_builds, "retired": self.retired, "recaptured": self.recaptured,
                "real_tokens": self.real_tokens, "padded_tokens": self.padded_tokens,
                "padding_waste": round(self.padding_waste, 4),
                "build_seconds": round(self.build_seconds, 4), "build_bytes": self.build_bytes,
                "eager_reasons": dict(self.eager_reasons)}

    def summary(self) -> str:
        """One line for an engine's log: hits, misses, eager steps / tokens by cause, padding."""
        causes = ", ".join(f"{c.value} {n.steps}/{n.tokens}" for c, n in self.eager_by_cause.items() if n.steps)
        eager = f"eager {self.eager_steps} steps / {self.eager_tokens} tokens" + (f" ({causes})" if causes else "")
        return (f"hits {self.hits}, misses {self.misses}, {eager}, "
                f"on graphs {100 * self.graph_step_share:.1f}% of steps / {100 * self.graph_token_share:.1f}% "
                f"of tokens, padding waste {100 * self.padding_waste:.1f}%")


@dataclass(eq=False, slots=True)
class StepTally:
    """The figures every step of one kind records (what :meth:`GraphCache.record_step` takes),
    made and checked once by :meth:`GraphCache.tally`; a step of that kind only adds one to
    ``steps``, and the cache folds ``steps - folded`` into its statistics when they are read."""

    real_tokens: int
    padded_tokens: int
    real_reqs: int
    padded_reqs: int
    eager_reason: str | None
    eager_cause: EagerCause | None
    key: Hashable | None
    hit: bool
    steps: int = 0                     # steps of this kind counted (the step's one write)
    folded: int = 0                    # of which the cache's statistics hold


class GraphCache(Generic[E]):
    """Entries by key. ``strict``: after :meth:`seal`, a miss raises ``CacheMissError``.

    Warm-up is over once :meth:`seal` is called or, where keys were :meth:`plan`-ned, once
    every planned key has an entry."""

    def __init__(self, *, strict: bool = False) -> None:
        self.strict = strict
        self.sealed = False
        self._stats = CacheStats()
        #: The step tallies (:meth:`tally`) by their figures, folded into ``_stats`` under ``_lock``.
        self._tallies: dict[tuple, StepTally] = {}
        self._lock = threading.RLock()
        #: Bumped by every change of the entries or of ``sealed`` (for callers that memoise lookups).
        self.version = 0
        self._entries: dict[Hashable, E] = {}
        #: The keys warm-up was asked to build (:meth:`plan`; empty: sealing is :meth:`seal`'s alone).
        self.planned: frozenset[Hashable] = frozenset()

    @property
    def stats(self) -> CacheStats:
        """The statistics, every step counted so far included (the tallies folded in first)."""
        if self._tallies:
            self.fold()
        return self._stats

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._entries)

    def keys(self) -> list[Hashable]:
        return list(self._entries)

    def put(self, key: Hashable, entry: E, *, seconds: float = 0.0, nbytes: int = 0) -> None:
        """Store a built entry and what it cost; after warm-up it counts as unplanned."""
        if self.sealed:
            self._stats.unplanned_builds += 1
        if self._tallies:
            self.fold()                 # the hits so far go to the entry this one replaces
        self._entries[key] = entry
        self._stats.per_key[key] = EntryStats(build_seconds=seconds, build_bytes=int(nbytes))
        self.version += 1
        self._seal_if_planned()

    def plan(self, keys: Iterable[Hashable]) -> None:
        """Warm-up will build ``keys``: once every planned key has an entry the cache seals
        itself. Planning a key without an entry reopens warm-up (a re-fit's new keys are
        planned builds)."""
        new = frozenset(keys)
        self.planned |= new
        if not all(k in self._entries for k in new):
            self.reopen()
        self._seal_if_planned()

    def _seal_if_planned(self) -> None:
        if self.planned and not self.sealed and all(k in self._entries for k in self.planned):
            self.seal()

    def check_build(self, key: Hashable, reason: str | Callable[[], str]) -> None:
        """A build of ``key`` is about to run: after warm-up, strict mode raises
        ``CacheMissError`` with ``reason``, else it is logged (:meth:`put` counts it)."""
        if self.sealed:
            why = reason() if callable(reason) else reason
            if self.strict:
                raise CacheMissError(key, why)
            logger.warning("graphrt: unplanned build after warm-up: %s", why)

    def unplanned(self, key: Hashable, reason: str) -> None:
        """A build no :meth:`put` records (a compile on the hot path) after warm-up: raises in
        strict mode, else logged and counted in ``stats.unplanned_builds``."""
        if self.sealed:
            self.check_build(key, reason)
            self._stats.unplanned_builds += 1

    def put_failed(self, key: Hashable, reason: str, *, seconds: float = 0.0) -> FailedBuild:
        """Record that ``key``'s build failed: its entry is a :class:`FailedBuild` (the step
        runs eagerly, counted under ``capture_failed`` with this reason, not as a miss), and
        the report and ``stats.failed_builds`` show it."""
        entry = FailedBuild(reason)
        self.put(key, entry, seconds=seconds)  # type: ignore[arg-type]
        self._stats.per_key[key].failed = reason
        self._stats.failed_builds += 1
        return entry

    def get(self, key: Hashable, *, reason: str | Callable[[], str] = "") -> E | None:
        """The entry for ``key`` (a hit) or ``None`` (a miss; raises in strict mode once sealed)."""
        entry = self.lookup(key, reason=reason)
        self.count(key, entry is not None)
        return entry

    def lookup(self, key: Hashable, *, reason: str | Callable[[], str] = "") -> E | None:
        """:meth:`get` without counting, for callers that memoise the answer and count each
        use with :meth:`count` or :meth:`record_step`. A strict miss still raises, and is
        counted here: the step it served ends with the error, so no later count comes."""
        entry = self._entries.get(key)
        if entry is None and self.strict and self.sealed:
            self.count(key, False)
            known = ", ".join(describe_key(k) for k in list(self._entries)[:6])
            more = ", ..." if len(self._entries) > 6 else ""
            why = reason() if callable(reason) else reason
            raise CacheMissError(key, (why or "not built during warm-up")
                                 + f"; {len(self._entries)} entries exist ({known}{more})",
                                 description=describe_key(key))
        return entry

    def count(self, key: Hashable, hit: bool) -> None:
        """Count one use of ``key``: a hit (it has an entry) or a miss."""
        with self._lock:
            if hit:
                per_key = self._stats.per_key.get(key)
                if per_key is None:
                    raise GraphrtError(f"GraphCache.count: a hit on {describe_key(key)}, which has no entry")
                self._stats.hits += 1
                per_key.hits += 1
            else:
                self._stats.misses += 1

    def seal(self) -> None:
        """Warm-up is over: from now on a build is unplanned, and strict mode raises on a miss."""
        self.sealed = True
        self.version += 1

    def reopen(self) -> None:
        """A warm-up starts again (a traffic re-fit plans new keys): builds are planned and a
        miss runs eagerly, strict mode included, until :meth:`seal`."""
        self.sealed = False
        self.version += 1

    def retire(self, key: Hashable) -> bool:
        """Drop ``key``'s entry (a re-fit found it no longer pays), freeing what it holds; its
        statistics stay in ``per_key`` (hits so far) and ``stats.retired`` counts it. False if
        it had no entry."""
        if self._entries.pop(key, None) is None:
            return False
        self._stats.retired += 1
        self.version += 1
        return True

    def replace(self, key: Hashable, entry: E, *, seconds: float = 0.0, nbytes: int = 0) -> None:
        """Swap ``key``'s entry for one built again over buffers that moved (the old one is
        dropped): counted in ``stats.recaptured``, not as an unplanned build; hits are kept."""
        if key not in self._entries:
            raise GraphrtError(f"GraphCache.replace: {describe_key(key)} has no entry")
        self._entries[key] = entry
        stats = self._stats.per_key.setdefault(key, EntryStats())
        stats.build_seconds += seconds
        stats.build_bytes = int(nbytes)
        self._stats.recaptured += 1
        self.version += 1

    def record_step(self, *, real_tokens: int, padded_tokens: int, real_reqs: int,
                    padded_reqs: int, eager_reason: str | None = None,
                    eager_cause: EagerCause | None = None,
                    key: Hashable | None = None, hit: bool = False) -> None:
        """Account one step's padding (and, if it ran eagerly, why: ``eager_reason`` in words,
        ``eager_cause`` its :class:`EagerCause`, which an eager step must have; its real tokens
        count as eager); with ``key``, also count the step's lookup of it (see :meth:`count`) --
        except a key whose capture failed, which is counted under ``capture_failed``, not as a miss.
        Steps that all record the same figures count faster through a :meth:`tally`."""
        figures = (real_tokens, padded_tokens, real_reqs, padded_reqs, eager_reason, eager_cause, key, hit)
        with self._lock:
            self._check_step(*figures)
            self._account(1, *figures)

    def tally(self, *, real_tokens: int, padded_tokens: int, real_reqs: int, padded_reqs: int,
              eager_reason: str | None = None, eager_cause: EagerCause | None = None,
              key: Hashable | None = None, hit: bool = False) -> StepTally:
        """A :class:`StepTally` of steps that each record these figures (:meth:`record_step`'s,
        checked now as it checks them): a step adds one to its ``steps``, nothing else. Tallies
        of equal figures are one object, so there are no more of them than kinds of step."""
        figures = (real_tokens, padded_tokens, real_reqs, padded_reqs, eager_reason, eager_cause, key, hit)
        with self._lock:
            found = self._tallies.get(figures)
            if found is None:
                self._check_step(*figures)
                found = self._tallies[figures] = StepTally(*figures)
            return found

    def record_as(self, tally: StepTally, *, real_tokens: int, real_reqs: int) -> None:
        """Account one step of ``tally``'s kind that had other real sizes (:meth:`record_step`
        with the tally's figures but these): a dummy step, a data-parallel step run at the group's
        agreed shape."""
        self.record_step(real_tokens=real_tokens, padded_tokens=tally.padded_tokens, real_reqs=real_reqs,
                         padded_reqs=tally.padded_reqs, eager_reason=tally.eager_reason,
                         eager_cause=tally.eager_cause, key=tally.key, hit=tally.hit)

    def fold(self) -> None:
        """Add every tally's steps since the last fold to the statistics (``stats`` does, when read).
        A step counting while this runs is never lost: what a tally counted after its read here
        is folded next time."""
        with self._lock:
            for t in self._tallies.values():
                n = t.steps
                if n != t.folded:
                    self._account(n - t.folded, t.real_tokens, t.padded_tokens, t.real_reqs, t.padded_reqs,
                                  t.eager_reason, t.eager_cause, t.key, t.hit)
                    t.folded = n

    def release_tallies(self) -> None:
        """Fold the tallies and forget them: for their maker, once nothing counts on them any more
        (a runner's plan memo dropped its plans), so their number stays bounded like its memo."""
        with self._lock:
            self.fold()
            self._tallies.clear()

    def _check_step(self, real_tokens: int, padded_tokens: int, real_reqs: int, padded_reqs: int,
                    eager_reason: str | None, eager_cause: EagerCause | None, key: Hashable | None,
                    hit: bool) -> None:
        """Refuse a step's figures that cannot be counted: an eager step without a cause, a hit
        on a key without an entry."""
        if eager_reason is not None and eager_cause is None:
            raise GraphrtError(f"an eager step without a cause ({eager_reason}): every eager step is "
                               "counted under one EagerCause (graphrt.core.eager)")
        if key is not None and hit and key not in self._stats.per_key:
            raise GraphrtError(f"GraphCache.count: a hit on {describe_key(key)}, which has no entry")

    def _account(self, n: int, real_tokens: int, padded_tokens: int, real_reqs: int, padded_reqs: int,
                 eager_reason: str | None, eager_cause: EagerCause | None, key: Hashable | None,
                 hit: bool) -> None:
        """Add ``n`` steps of these (checked) figures to the statistics (the lock held)."""
        s = self._stats
        s.steps += n
        s.real_tokens += n * real_tokens
        s.padded_tokens += n * padded_tokens
        s.real_reqs += n * real_reqs
        s.padded_reqs += n * padded_reqs
        if eager_reason is not None:
            s.eager_steps += n
            s.eager_tokens += n * real_tokens
            s.eager_reasons[eager_reason] += n
            by_cause = s.eager_by_cause[eager_cause]
            by_cause.steps += n
            by_cause.tokens += n * real_tokens
        if key is None:
            return
        if hit:                         # :meth:`count`'s, for n steps
            s.hits += n
            s.per_key[key].hits += n
        elif eager_reason is None or eager_cause is not EagerCause.CAPTURE_FAILED:
            s.misses += n               # a failed capture is no miss: it counts under its cause

    def record_call(self, key: Hashable, *, hit: bool | None, num_tokens: int | None = None,
                    num_reqs: int | None = None, eager_cause: EagerCause | None = None,
                    eager_reason: str | None = None) -> None:
        """Account one call of a piece (``Backend.graphs``) of ``key``: a hit or a miss (``hit=None``:
        no lookup to count, an eager-only backend's call); with the call's real ``num_tokens`` /
        ``num_reqs``, its padding to the key's sizes (:func:`key_sizes`); with ``eager_cause``, an
        eager call of that cause (``eager_reason`` in words; its real tokens, where told)."""
        real_t = real_r = padded_t = padded_r = 0
        if num_tokens is not None or num_reqs is not None:
            real_t, real_r = int(num_tokens or 0), int(num_reqs or 0)
            padded_t, padded_r = key_sizes(key, real_t, real_r)
        reason = None if eager_cause is None else (eager_reason or eager_cause.value)
        self.record_step(real_tokens=real_t, padded_tokens=padded_t, real_reqs=real_r, padded_reqs=padded_r,
                         eager_reason=reason, eager_cause=eager_cause, key=None if hit is None else key,
                         hit=bool(hit))

    def clear(self) -> None:
        """Drop every entry (statistics are kept)."""
        self._entries.clear()
        self.sealed = False
        self.version += 1

    def report(self) -> list[dict[str, Any]]:
        """Per key: build seconds and bytes, hits, and why its build failed (None: it did not);
        for warm-up reports."""
        return [{"key": describe_key(k), "seconds": round(v.build_seconds, 4), "bytes": v.build_bytes,
                 "hits": v.hits, "failed": v.failed} for k, v in self.stats.per_key.items()]
