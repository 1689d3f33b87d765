"""BucketPolicy: construction, lookup, the default lists, down-sampling and the exact fit."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrt import BucketPolicy, ConfigError
from support.fast_subset import examples

FAST = settings(max_examples=examples(200), deadline=None)
size_lists = st.lists(st.integers(1, 600), min_size=1, max_size=40)


# --------------------------------------------------------------------------------------
# Construction and lookup
# --------------------------------------------------------------------------------------

def test_constructor_sorts_and_dedups():
    p = BucketPolicy([8, 1, 4, 8, 2, 4])
    assert p.sizes == (1, 2, 4, 8)
    assert (p.min_size, p.max_size, len(p)) == (1, 8, 4)
    assert list(p) == [1, 2, 4, 8]
    assert 4 in p and 3 not in p
    assert p == BucketPolicy((1, 2, 4, 8)) and hash(p) == hash(BucketPolicy([2, 1, 8, 4]))
    assert p != BucketPolicy([1, 2, 4])
    assert "BucketPolicy" in repr(p) and "BucketPolicy" in repr(BucketPolicy(range(1, 100)))


@pytest.mark.parametrize("sizes", [[], (), [0], [4, 0], [-1, 2], [3, -8]])
def test_constructor_rejects_empty_and_non_positive(sizes):
    with pytest.raises(ConfigError):
        BucketPolicy(sizes)


@FAST
@given(size_lists)
def test_constructor_is_sorted_set(sizes):
    assert BucketPolicy(sizes).sizes == tuple(sorted(set(sizes)))


@FAST
@given(size_lists, st.integers(-5, 700))
def test_bucket_for_is_the_smallest_size_at_least_n(sizes, n):
    p = BucketPolicy(sizes)
    b = p.bucket_for(n)
    if n > max(sizes):
        assert b is None
    else:
        assert b == min(s for s in sizes if s >= n)


def test_bucket_for_examples():
    p = BucketPolicy([1, 2, 4, 8])
    assert [p.bucket_for(n) for n in range(0, 10)] == [1, 1, 2, 4, 4, 8, 8, 8, 8, None]


@FAST
@given(size_lists, st.dictionaries(st.integers(1, 800), st.integers(1, 50), max_size=20))
def test_padded_total(sizes, counts):
    p = BucketPolicy(sizes)
    expected = sum((p.bucket_for(n) or n) * c for n, c in counts.items())
    assert p.padded_total(counts) == expected
    assert p.padded_total(counts) >= sum(n * c for n, c in counts.items())


# --------------------------------------------------------------------------------------
# Default lists
# --------------------------------------------------------------------------------------

def test_vllm_default_512():
    p = BucketPolicy.vllm_default(512)
    expected = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))
    assert list(p) == expected
    assert len(p) == 51


def check_vllm_shape(p: BucketPolicy, m: int) -> None:
    sizes = set(p)
    assert p.max_size == m and all(s <= m for s in sizes)
    for s in sizes - {m}:
        if s < 8:
            assert s in (1, 2, 4)
        elif s < 256:
            assert s % 8 == 0
        else:
            assert s % 16 == 0
    # nothing of the documented pattern is missing
    assert {s for s in (1, 2, 4) if s <= m} <= sizes
    assert set(range(8, min(m, 255) + 1, 8)) <= sizes
    assert set(range(256, m + 1, 16)) <= sizes


@settings(max_examples=examples(300), deadline=None)
@given(st.integers(1, 5000))
def test_vllm_default_shape(m):
    check_vllm_shape(BucketPolicy.vllm_default(m), m)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 255, 256, 257, 271, 272, 8192])
def test_vllm_default_shape_edges(m):
    check_vllm_shape(BucketPolicy.vllm_default(m), m)


def test_sglang_default():
    expected = ([1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16))
                + list(range(512, 1025, 32)))
    assert list(BucketPolicy.sglang_default(1024)) == expected
    assert list(BucketPolicy.sglang_default(10)) == [1, 2, 4, 8, 10]
    assert list(BucketPolicy.sglang_default(300)) == (
        [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + [272, 288, 300])


@settings(max_examples=examples(200), deadline=None)
@given(st.integers(1, 5000))
def test_sglang_default_shape(m):
    p = BucketPolicy.sglang_default(m)
    sizes = set(p)
    assert p.max_size == m and all(s <= m for s in sizes)
    for s in sizes - {m}:
        assert (s in (1, 2, 4, 8, 12) or (16 <= s <= 256 and s % 8 == 0)
                or (272 <= s < 512 and s % 16 == 0) or (s >= 512 and s % 32 == 0))


def test_powers_of_two():
    assert list(BucketPolicy.powers_of_two(100)) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert list(BucketPolicy.powers_of_two(64, min_size=4)) == [4, 8, 16, 32, 64]
    assert list(BucketPolicy.powers_of_two(1)) == [1]
    assert list(BucketPolicy.powers_of_two(48, min_size=16)) == [16, 32, 48]


@settings(max_examples=examples(200), deadline=None)
@given(st.integers(1, 100_000), st.integers(1, 64))
def test_powers_of_two_shape(m, lo):
    lo = min(lo, m)
    p = BucketPolicy.powers_of_two(m, min_size=lo)
    assert p.max_size == m and p.min_size == lo
    for a, b in zip(p.sizes, p.sizes[1:-1]):
        assert b == 2 * a


def test_power_then_linear():
    assert list(BucketPolicy.power_then_linear(100, gap=16)) == (
        [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100])
    assert list(BucketPolicy.power_then_linear(64, gap=16)) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert list(BucketPolicy.power_then_linear(10, gap=16)) == [1, 2, 4, 8, 10]
    assert list(BucketPolicy.power_then_linear(5, gap=1)) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("call", [
    lambda: BucketPolicy.vllm_default(0),
    lambda: BucketPolicy.sglang_default(-1),
    lambda: BucketPolicy.powers_of_two(0),
    lambda: BucketPolicy.powers_of_two(8, min_size=0),
    lambda: BucketPolicy.powers_of_two(8, min_size=9),
    lambda: BucketPolicy.power_then_linear(0, gap=4),
    lambda: BucketPolicy.power_then_linear(64, gap=0),
    lambda: BucketPolicy([1, 2]).limit_to(0),
])
def test_factory_errors(call):
    with pytest.raises(ConfigError):
        call()


def test_capped():
    p = BucketPolicy([1, 2, 4, 8, 16])
    assert list(p.capped(6)) == [1, 2, 4, 6]
    assert list(p.capped(8)) == [1, 2, 4, 8]
    assert list(p.capped(100)) == [1, 2, 4, 8, 16, 100]


# --------------------------------------------------------------------------------------
# limit_to
# --------------------------------------------------------------------------------------

@FAST
@given(size_lists, st.integers(1, 50))
def test_limit_to(sizes, n):
    p = BucketPolicy(sizes)
    q = p.limit_to(n)
    assert set(q) <= set(p)
    assert len(q) <= n
    assert q.max_size == p.max_size
    if n >= len(p):
        assert q == p
    elif n >= 2:
        assert q.min_size == p.min_size
        assert len(q) == n
    else:
        assert list(q) == [p.max_size]


# --------------------------------------------------------------------------------------
# fit
# --------------------------------------------------------------------------------------

def brute_force(counts: dict[int, int], k: int, candidates) -> int:
    """Least padded total over all bucket sets of <= k candidates that include the largest."""
    top = max(counts)
    others = [c for c in candidates if c != top]
    best = None
    for m in range(0, k):
        for combo in itertools.combinations(others, m):
            total = BucketPolicy((*combo, top)).padded_total(counts)
            best = total if best is None else min(best, total)
    return best


histograms = st.dictionaries(st.integers(1, 60), st.integers(1, 30), min_size=1, max_size=8)


def check_fit(counts: dict[int, int], k: int) -> BucketPolicy:
    p = BucketPolicy.fit(counts, k)
    assert len(p) <= k
    assert p.max_size == max(counts)
    assert set(p) <= set(counts), "every bucket is an observed size"
    assert all(p.bucket_for(n) is not None for n in counts)
    expected_total = sum(p.bucket_for(n) * c for n, c in counts.items())
    assert p.padded_total(counts) == expected_total
    return p


@settings(max_examples=examples(150), deadline=None)
@given(histograms, st.integers(1, 6))
def test_fit_is_optimal_over_observed_sizes(counts, k):
    p = check_fit(counts, k)
    assert p.padded_total(counts) == brute_force(counts, k, sorted(counts))


@settings(max_examples=examples(100), deadline=None)
@given(st.dictionaries(st.integers(1, 9), st.integers(1, 20), min_size=1, max_size=9),
       st.integers(1, 4))
def test_fit_is_optimal_over_every_size(counts, k):
    """Even allowing sizes nobody observed, no bucket set does better."""
    p = check_fit(counts, k)
    assert p.padded_total(counts) == brute_force(counts, k, range(1, max(counts) + 1))


@settings(max_examples=examples(100), deadline=None)
@given(histograms, st.integers(1, 10))
def test_fit_with_enough_buckets_has_no_waste(counts, extra):
    p = check_fit(counts, len(counts) + extra - 1)
    assert set(p) == set(counts)
    assert p.padded_total(counts) == sum(n * c for n, c in counts.items())


@settings(max_examples=examples(100), deadline=None)
@given(histograms, st.dictionaries(st.integers(1, 80), st.integers(-3, 0), max_size=4),
       st.integers(1, 5))
def test_fit_ignores_non_positive_counts(counts, ignored, k):
    merged = {**ignored, **counts}
    assert BucketPolicy.fit(merged, k) == BucketPolicy.fit(counts, k)


def test_fit_examples():
    assert list(BucketPolicy.fit({1: 100, 2: 1, 64: 5}, 1)) == [64]
    assert list(BucketPolicy.fit({1: 100, 2: 1, 64: 5}, 2)) == [1, 64]   # 100 + 64 + 320
    assert list(BucketPolicy.fit({1: 1, 2: 100, 64: 5}, 2)) == [2, 64]   # 2 + 200 + 320
    assert list(BucketPolicy.fit({1: 100, 2: 1, 64: 5}, 3)) == [1, 2, 64]
    assert list(BucketPolicy.fit({7: 3}, 4)) == [7]


def test_fit_larger_histogram_is_fast_and_valid():
    counts = {n: (n * 7919) % 13 + 1 for n in range(1, 1500, 3)}
    p = check_fit(counts, 16)
    assert len(p) == 16


@pytest.mark.parametrize("counts,k", [
    ({4: 1}, 0), ({4: 1}, -1), ({}, 3), ({4: 0, 8: 0}, 3), ({0: 2, 4: 1}, 2), ({-3: 1}, 1),
])
def test_fit_errors(counts, k):
    with pytest.raises(ConfigError):
        BucketPolicy.fit(counts, k)
