"""Step tallies (issue 44, the step's files): a step of a remembered kind adds one to a
:class:`~graphrt.core.cache.StepTally` made once, and ``GraphCache.stats`` folds the tallies in
when read; the statistics are exactly those ``record_step`` gives for the same steps."""

from __future__ import annotations

import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrt import BatchDescriptor, GraphCache
from graphrt.core.eager import EagerCause
from graphrt.core.errors import GraphrtError
from support.fast_subset import examples

KEYS = [BatchDescriptor(8, 8, True), BatchDescriptor(16, None, False), 4, "sampler"]
CAUSES = [None, EagerCause.MISS, EagerCause.CAPTURE_FAILED, EagerCause.WARMING_UP, EagerCause.ABOVE_LARGEST_BUCKET]

#: One step's figures: (real tokens, padded tokens, real reqs, padded reqs, eager cause, key, hit).
steps = st.tuples(st.integers(0, 16), st.integers(0, 16), st.integers(0, 8), st.integers(0, 8),
                  st.sampled_from(CAUSES), st.sampled_from([None, *KEYS]), st.booleans())
operations = st.lists(st.one_of(
    st.tuples(st.just("step"), steps),
    st.tuples(st.sampled_from(["put", "put_failed", "retire", "replace"]), st.sampled_from(KEYS)),
    st.tuples(st.sampled_from(["read", "release"]), st.none())), max_size=60)


def figures(step: tuple, cache: GraphCache) -> dict:
    """``record_step``'s arguments of a drawn step (a hit only where the key has an entry's statistics)."""
    real_t, padded_t, real_r, padded_r, cause, key, hit = step
    return dict(real_tokens=real_t, padded_tokens=padded_t, real_reqs=real_r, padded_reqs=padded_r,
                eager_reason=None if cause is None else f"why: {cause.value}", eager_cause=cause, key=key,
                hit=hit and key is not None and key in cache.stats.per_key)


@settings(max_examples=examples(150), deadline=None)
@given(operations)
def test_tallies_give_the_statistics_record_step_gives(ops: list) -> None:
    """A random sequence of steps (shapes, hits, eager causes) with builds, failed builds,
    rebuilds and retirements between them, statistics read and tallies released at random: a
    cache counting through tallies held across those changes (as a runner's plans hold them)
    ends with the statistics of one counting every step with ``record_step``."""
    plain, tallied = GraphCache(), GraphCache()
    held: dict[tuple, object] = {}             # the tallies a runner's plan memo would hold
    for op, arg in ops:
        if op == "step":
            f = figures(arg, plain)
            plain.record_step(**f)
            made = tuple(f.values())
            tally = held.get(made)
            if tally is None:
                tally = held[made] = tallied.tally(**f)
            tally.steps += 1
        elif op == "read":
            assert tallied.stats.steps == plain.stats.steps
        elif op == "release":
            tallied.release_tallies()
            held.clear()
        else:
            for cache in (plain, tallied):
                if op == "put":
                    cache.put(arg, object(), seconds=0.5, nbytes=7)
                elif op == "put_failed":
                    cache.put_failed(arg, "boom")
                elif op == "retire":
                    cache.retire(arg)
                elif arg in cache:
                    cache.replace(arg, object(), seconds=0.25)
    assert tallied.stats.as_dict() == plain.stats.as_dict()
    assert tallied.report() == plain.report()
    assert len(held) <= len({tuple(figures(a, plain).values()) for o, a in ops if o == "step"})


def test_a_tally_is_checked_once_and_shared() -> None:
    """Made and checked as ``record_step`` checks a step; equal figures give one tally."""
    cache = GraphCache()
    with pytest.raises(GraphrtError, match="eager step without a cause"):
        cache.tally(real_tokens=1, padded_tokens=1, real_reqs=1, padded_reqs=1, eager_reason="why?")
    with pytest.raises(GraphrtError, match="which has no entry"):
        cache.tally(real_tokens=1, padded_tokens=1, real_reqs=1, padded_reqs=1, key="k", hit=True)
    cache.put("k", "graph")
    a = cache.tally(real_tokens=3, padded_tokens=4, real_reqs=3, padded_reqs=4, key="k", hit=True)
    b = cache.tally(real_tokens=3, padded_tokens=4, real_reqs=3, padded_reqs=4, key="k", hit=True)
    assert a is b
    a.steps += 5
    s = cache.stats
    assert (s.steps, s.hits, s.real_tokens, s.padded_tokens, s.per_key["k"].hits) == (5, 5, 15, 20, 5)
    cache.record_as(a, real_tokens=1, real_reqs=1)       # one of other real sizes (a dummy step)
    assert (cache.stats.steps, cache.stats.real_tokens, cache.stats.padded_tokens) == (6, 16, 24)


def test_a_fold_between_a_steps_read_and_write_keeps_the_count() -> None:
    """A step's ``tally.steps += 1`` is a read and a write; a fold (another thread reading the
    statistics) may come between them. The fold reads ``steps`` and never writes it, so the
    step's write neither loses a count nor counts one twice (a fold that took the steps and
    reset them to 0 would count this step's predecessors again)."""
    cache = GraphCache()
    cache.put("k", "graph")
    tally = cache.tally(real_tokens=2, padded_tokens=4, real_reqs=2, padded_reqs=4, key="k", hit=True)
    tally.steps += 3
    seen = tally.steps              # a step reads ...
    assert cache.stats.steps == 3   # ... a fold comes in between ...
    tally.steps = seen + 1          # ... and the step writes
    s = cache.stats
    assert (s.steps, s.hits, s.real_tokens, s.per_key["k"].hits) == (4, 4, 8, 4)


def test_stats_read_while_steps_count_end_exact() -> None:
    """Threads reading (folding) the statistics while another counts steps on tallies lose
    no step and count none twice: the totals are exact at the end."""
    cache = GraphCache()
    cache.put("k", "graph")
    hit = cache.tally(real_tokens=2, padded_tokens=4, real_reqs=2, padded_reqs=4, key="k", hit=True)
    eager = cache.tally(real_tokens=3, padded_tokens=3, real_reqs=1, padded_reqs=1, eager_reason="missing",
                        eager_cause=EagerCause.MISS, key="m")
    n, done, reads = 60_000, threading.Event(), [0]

    def read() -> None:
        while not done.is_set():
            assert cache.stats.steps <= 2 * n
            reads[0] += 1

    readers = [threading.Thread(target=read) for _ in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)             # the threads interleave as often as they can
    for reader in readers:
        reader.start()
    try:
        for _ in range(n):
            hit.steps += 1
            eager.steps += 1
    finally:
        done.set()
        for reader in readers:
            reader.join()
        sys.setswitchinterval(interval)
    s = cache.stats
    assert reads[0] > 1
    assert (s.steps, s.hits, s.misses, s.eager_steps, s.eager_tokens) == (2 * n, n, n, n, 3 * n)
    assert (s.real_tokens, s.padded_tokens, s.per_key["k"].hits) == (5 * n, 7 * n, n)
    assert s.eager_by_cause[EagerCause.MISS].steps == n
