"""Dispatcher (which key a step runs under) and GraphCache (entries, statistics, strict mode)."""

from __future__ import annotations

import functools

import pytest

from graphrt.core.eager import EagerCause
from graphrt.core.errors import GraphrtError
from hypothesis import given, settings
from hypothesis import strategies as st

import graphrt
from graphrt.backends.xla.buckets import XlaBuckets
from graphrt import (BatchDescriptor, BucketPolicy, CacheMissError, ConfigError, Dispatcher,
                     GraphCache, GraphConfig, GraphMode, InputError, RuntimeMode)
from support.fast_subset import examples

TOKENS = BucketPolicy([1, 2, 4, 8, 16, 32])
SEQS = 8


def make(mode: GraphMode, **kw) -> Dispatcher:
    kw.setdefault("token_buckets", TOKENS)
    kw.setdefault("max_num_seqs", SEQS)
    return Dispatcher(mode, **kw)


def key(t, r, u) -> BatchDescriptor:
    return BatchDescriptor(t, r, u)


# --------------------------------------------------------------------------------------
# Routing per mode
# --------------------------------------------------------------------------------------

def test_graph_mode_tables():
    M, R = GraphMode, RuntimeMode
    assert [m.decode_mode() for m in M] == [R.NONE, R.PIECEWISE, R.FULL, R.FULL, R.FULL]
    assert [m.mixed_mode() for m in M] == [R.NONE, R.PIECEWISE, R.FULL, R.NONE, R.PIECEWISE]
    assert [m.separate_decode_graphs() for m in M] == [False, False, False, True, True]


def test_full_and_piecewise():
    d = make(GraphMode.FULL_AND_PIECEWISE)
    assert d.decode_buckets == BucketPolicy([1, 2, 4, 8])
    r = d.dispatch(3, 3, True)
    assert (r.mode, r.key) == (RuntimeMode.FULL, key(4, 4, True))
    r = d.dispatch(10, 3, False)
    assert (r.mode, r.key) == (RuntimeMode.PIECEWISE, key(16, None, False))
    r = d.dispatch(32, 8, False)
    assert (r.mode, r.key) == (RuntimeMode.PIECEWISE, key(32, None, False))


def test_full_decode_only():
    d = make(GraphMode.FULL_DECODE_ONLY)
    r = d.dispatch(5, 5, True)
    assert (r.mode, r.key) == (RuntimeMode.FULL, key(8, 8, True))
    r = d.dispatch(10, 3, False)
    assert (r.mode, r.key) == (RuntimeMode.NONE, key(10, 3, False))
    assert "FULL_DECODE_ONLY" in r.reason and "eager" in r.reason


def test_full():
    d = make(GraphMode.FULL)
    r = d.dispatch(3, 3, True)
    assert (r.mode, r.key) == (RuntimeMode.FULL, key(4, 4, False))
    r = d.dispatch(10, 3, False)
    assert (r.mode, r.key) == (RuntimeMode.FULL, key(16, 8, False))     # reqs = min(16, 8)
    r = d.dispatch(2, 1, False)
    assert (r.mode, r.key) == (RuntimeMode.FULL, key(2, 2, False))      # reqs = min(2, 8)


def test_piecewise():
    d = make(GraphMode.PIECEWISE)
    for shape, k in (((3, 3, True), key(4, None, False)), ((10, 3, False), key(16, None, False))):
        r = d.dispatch(*shape)
        assert (r.mode, r.key) == (RuntimeMode.PIECEWISE, k)


@pytest.mark.parametrize("buckets", [None, TOKENS])
def test_none_is_always_eager(buckets):
    d = make(GraphMode.NONE, token_buckets=buckets)
    for shape in ((1, 1, True), (3, 3, True), (10, 3, False), (1000, 8, False)):
        r = d.dispatch(*shape)
        assert (r.mode, r.key) == (RuntimeMode.NONE, key(*shape))
        assert r.reason
    assert d.keys() == []


@pytest.mark.parametrize("mode", [GraphMode.PIECEWISE, GraphMode.FULL, GraphMode.FULL_AND_PIECEWISE])
def test_eager_above_the_largest_bucket(mode):
    d = make(mode)
    r = d.dispatch(33, 4, False)
    assert (r.mode, r.key) == (RuntimeMode.NONE, key(33, 4, False))
    assert "33" in r.reason and "32" in r.reason and "eager" in r.reason


def test_decode_above_the_decode_buckets_is_handled_as_mixed():
    d = make(GraphMode.FULL_AND_PIECEWISE, decode_buckets=BucketPolicy([1, 2, 4]))
    r = d.dispatch(6, 6, True)
    assert (r.mode, r.key) == (RuntimeMode.PIECEWISE, key(8, None, False))
    d = make(GraphMode.FULL_DECODE_ONLY, decode_buckets=BucketPolicy([1, 2, 4]))
    r = d.dispatch(6, 6, True)
    assert r.mode is RuntimeMode.NONE and r.key == key(6, 6, True)


def test_graph_mode_needs_token_buckets():
    with pytest.raises(ConfigError):
        Dispatcher(GraphMode.FULL, token_buckets=None, max_num_seqs=8)


def test_keys_are_largest_first():
    d = make(GraphMode.FULL_AND_PIECEWISE)
    keys = d.keys()
    assert keys[0][1].num_tokens == 32
    sizes = [k.num_tokens for _, k in keys]
    assert sizes == sorted(sizes, reverse=True)
    assert len(keys) == len(set(keys))
    assert set(keys) == ({(RuntimeMode.FULL, key(b, b, True)) for b in (1, 2, 4, 8)}
                         | {(RuntimeMode.PIECEWISE, key(b, None, False)) for b in TOKENS})


def test_batch_descriptor_str():
    assert str(key(8, 8, True)) == "(decode, tokens=8, reqs=8)"
    assert str(key(16, None, False)) == "(mixed, tokens=16, reqs=any)"


# --------------------------------------------------------------------------------------
# XLA-style dispatcher
# --------------------------------------------------------------------------------------

def test_xla_dispatcher():
    c = GraphConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)   # one context bucket
    d = XlaBuckets.from_config(c).dispatcher()
    key = functools.partial(BatchDescriptor, max_seq_len=128)
    r = d.dispatch(3, 3, True)
    assert (r.mode, r.key) == (RuntimeMode.FULL, key(4, 4, True))
    r = d.dispatch(20, 3, False)
    assert (r.mode, r.key) == (RuntimeMode.FULL, key(32, 8, False))     # fixed batch size
    r = d.dispatch(2, 2, False)
    assert (r.mode, r.key) == (RuntimeMode.FULL, key(16, 8, False))
    with pytest.raises(InputError) as excinfo:
        d.dispatch(65, 8, False)
    assert excinfo.value.field == "num_scheduled_tokens"
    assert "65" in str(excinfo.value) and "64" in str(excinfo.value)


def test_fixed_mixed_batch_must_cover_max_num_seqs():
    with pytest.raises(ConfigError):
        make(GraphMode.FULL, mixed_num_reqs=4)


@st.composite
def xla_setups(draw):
    seqs = draw(st.integers(1, 64))
    tokens = draw(st.integers(seqs, 2048))
    kw = {}
    if draw(st.booleans()):
        kw["precompile_token_paddings"] = draw(st.lists(st.integers(1, tokens), max_size=5)) + [tokens]
    if draw(st.booleans()):
        kw["precompile_bs_paddings"] = draw(st.lists(st.integers(1, seqs), max_size=5)) + [seqs]
    return GraphConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens, **kw)


@st.composite
def step_shapes(draw, seqs: int, tokens: int):
    """(num_tokens, num_reqs, uniform_decode) a scheduler with these limits can form."""
    r = draw(st.integers(1, seqs))
    if draw(st.booleans()):
        return r, r, True
    t = draw(st.integers(r, tokens))
    return t, r, t == r and draw(st.booleans())


@settings(max_examples=examples(200), deadline=None)
@given(xla_setups(), st.data())
def test_xla_never_eager_and_keys_are_warm(c, data):
    d = XlaBuckets.from_config(c).dispatcher()
    keys = set(d.keys())
    for _ in range(5):
        t, r, u = data.draw(step_shapes(c.max_num_seqs, c.max_num_batched_tokens))
        longest = data.draw(st.integers(1, c.max_model_len))       # every context has a key too
        res = d.dispatch(t, r, u, 0, d.context_bucket(longest))
        assert res.mode is RuntimeMode.FULL
        assert (res.mode, res.key) in keys
        assert res.key.num_tokens >= t and res.key.num_reqs >= r
        assert longest <= res.key.max_seq_len <= max(longest * 4, 256)   # a bucket: at most 4x, from 256
        if u:
            assert (res.key.num_reqs, res.key.uniform_decode) == (res.key.num_tokens, True)
    too_many = c.max_num_batched_tokens + data.draw(st.integers(1, 100))
    with pytest.raises(InputError):
        d.dispatch(too_many, 1, False)


# --------------------------------------------------------------------------------------
# Every dispatched key was warmed up
# --------------------------------------------------------------------------------------

@st.composite
def graph_setups(draw):
    seqs = draw(st.integers(1, 96))
    tokens = draw(st.integers(seqs, 1024))
    kw = dict(max_num_seqs=seqs, max_num_batched_tokens=tokens)
    if draw(st.booleans()):
        kw["cudagraph_capture_sizes"] = draw(st.lists(st.integers(1, tokens), min_size=1, max_size=8))
    elif draw(st.booleans()):
        kw["max_cudagraph_capture_size"] = draw(st.integers(1, tokens))
    return GraphConfig(**kw)


@settings(max_examples=examples(300), deadline=None)
@given(graph_setups(), st.sampled_from(list(GraphMode)), st.data())
def test_dispatched_key_is_always_warmed_up(c, mode, data):
    d = c.graph_dispatcher(mode)
    keys = set(d.keys())
    largest = c.capture_policy().max_size
    for _ in range(6):
        t, r, u = data.draw(step_shapes(c.max_num_seqs, c.max_num_batched_tokens))
        res = d.dispatch(t, r, u)
        if res.mode is RuntimeMode.NONE:
            assert res.key == key(t, r, u) and res.reason
            runtime = mode.decode_mode() if u and not mode.separate_decode_graphs() else mode.mixed_mode()
            # eager only when the mode says so or the step is above every bucket
            assert mode is GraphMode.NONE or t > largest or runtime is RuntimeMode.NONE
            continue
        assert mode is not GraphMode.NONE
        assert (res.mode, res.key) in keys
        assert res.key.num_tokens >= t
        assert res.key.num_reqs is None or res.key.num_reqs >= r
        if res.key.num_reqs is not None:      # static request buffers hold max_num_seqs rows
            assert res.key.num_reqs <= c.max_num_seqs


@settings(max_examples=examples(200), deadline=None)
@given(graph_setups(), st.sampled_from([GraphMode.FULL_DECODE_ONLY, GraphMode.FULL_AND_PIECEWISE]),
       st.data())
def test_every_decode_batch_within_limits_gets_a_full_graph(c, mode, data):
    """The known failure: max_num_seqs missing from the capture list must not mean eager decode."""
    d = c.graph_dispatcher(mode)
    largest = c.capture_policy().max_size
    r = data.draw(st.integers(1, min(c.max_num_seqs, largest)))
    res = d.dispatch(r, r, True)
    assert res.mode is RuntimeMode.FULL, res.reason
    assert res.key.uniform_decode and res.key.num_reqs == res.key.num_tokens
    assert r <= res.key.num_reqs <= c.max_num_seqs


def test_dispatch_returns_only_what_the_key_set_holds():
    """The key set is data: dispatch pads a step to its candidate keys and returns one only if
    the set holds it, so a key dropped from the set is never dispatched (eager instead)."""
    d = GraphConfig(max_num_seqs=8, max_num_batched_tokens=64).graph_dispatcher(GraphMode.FULL_AND_PIECEWISE)
    decode, mixed = d.dispatch(5, 5, True), d.dispatch(11, 3, False)
    assert (decode.mode, mixed.mode) == (RuntimeMode.FULL, RuntimeMode.PIECEWISE)
    assert {(decode.mode, decode.key), (mixed.mode, mixed.key)} <= set(d.keys())
    del d._keys[decode.key], d._keys[mixed.key]
    assert (decode.mode, decode.key) not in d.keys()
    assert d.dispatch(5, 5, True).key != decode.key          # padded as a mixed step instead
    assert d.dispatch(11, 3, False).mode is RuntimeMode.NONE


def test_decode_at_max_num_seqs_not_in_capture_list():
    c = GraphConfig(max_num_seqs=100, max_num_batched_tokens=2048, mode="FULL_DECODE_ONLY")
    assert 100 not in c.capture_policy()
    d = c.graph_dispatcher()
    for r in (97, 100):
        res = d.dispatch(r, r, True)
        assert (res.mode, res.key) == (RuntimeMode.FULL, key(100, 100, True))
        assert (res.mode, res.key) in d.keys()


# --------------------------------------------------------------------------------------
# GraphCache
# --------------------------------------------------------------------------------------

def test_cache_hits_misses_entries():
    cache: GraphCache[str] = GraphCache()
    k1, k2 = key(8, 8, True), key(16, None, False)
    assert cache.get(k1) is None
    assert (cache.stats.hits, cache.stats.misses, cache.stats.entries) == (0, 1, 0)
    cache.put(k1, "g8", seconds=0.5, nbytes=1000)
    cache.put(k2, "g16", seconds=1.5, nbytes=3000)
    assert len(cache) == 2 and k1 in cache and set(cache) == {k1, k2} and cache.keys() == [k1, k2]
    assert cache.get(k1) == "g8" and cache.get(k1) == "g8" and cache.get(k2) == "g16"
    s = cache.stats
    assert (s.hits, s.misses, s.entries) == (3, 1, 2)
    assert s.per_key[k1].hits == 2 and s.per_key[k2].hits == 1
    assert s.per_key[k1].build_seconds == 0.5 and s.per_key[k1].build_bytes == 1000
    assert s.build_seconds == 2.0 and s.build_bytes == 4000
    assert s.unplanned_builds == 0
    report = {r["key"]: r for r in cache.report()}
    assert report[str(k1)] == {"key": str(k1), "seconds": 0.5, "bytes": 1000, "hits": 2, "failed": None}
    d = s.as_dict()
    assert (d["hits"], d["misses"], d["entries"], d["build_bytes"]) == (3, 1, 2, 4000)


def test_falsy_entries_are_hits():
    cache = GraphCache()
    cache.put("k", 0)
    assert cache.get("k") == 0 and cache.stats.hits == 1


def test_record_step_padding_waste():
    cache = GraphCache()
    assert cache.stats.padding_waste == 0.0
    cache.record_step(real_tokens=3, padded_tokens=4, real_reqs=3, padded_reqs=4)
    cache.record_step(real_tokens=10, padded_tokens=16, real_reqs=2, padded_reqs=8)
    above = EagerCause.ABOVE_LARGEST_BUCKET
    cache.record_step(real_tokens=40, padded_tokens=40, real_reqs=5, padded_reqs=5,
                      eager_reason="above the largest bucket", eager_cause=above)
    cache.record_step(real_tokens=7, padded_tokens=7, real_reqs=1, padded_reqs=1,
                      eager_reason="above the largest bucket", eager_cause=above)
    s = cache.stats
    assert (s.real_tokens, s.padded_tokens, s.real_reqs, s.padded_reqs) == (60, 67, 11, 18)
    assert s.padding_waste == pytest.approx(1 - 60 / 67)
    assert s.eager_steps == 2 and s.eager_reasons == {"above the largest bucket": 2}
    assert s.steps == 4 and s.graph_step_share == 0.5 and s.graph_token_share == pytest.approx(13 / 60)
    with pytest.raises(GraphrtError, match="eager step without a cause"):      # every eager step has one
        cache.record_step(real_tokens=1, padded_tokens=1, real_reqs=1, padded_reqs=1, eager_reason="why?")
    assert s.as_dict()["padding_waste"] == round(1 - 60 / 67, 4)


def test_strict_mode_raises_only_after_seal():
    cache = GraphCache(strict=True)
    k, missing = key(8, 8, True), key(16, None, False)
    assert cache.get(missing) is None            # warm-up: a miss is just a miss
    cache.put(k, "g")
    cache.seal()
    assert cache.get(k) == "g"
    with pytest.raises(CacheMissError) as excinfo:
        cache.get(missing, reason="token bucket 16 was skipped")
    err = excinfo.value
    assert err.key == missing
    assert "token bucket 16 was skipped" in err.reason
    assert str(missing) in str(err) and "token bucket 16 was skipped" in str(err)
    assert str(k) in str(err)                    # names what does exist
    assert cache.stats.misses == 2 and cache.stats.hits == 1
    with pytest.raises(CacheMissError, match="not built during warm-up"):
        cache.get(missing)


def test_non_strict_after_seal_returns_none():
    cache = GraphCache()
    cache.seal()
    assert cache.get("nope") is None
    assert cache.stats.misses == 1


def test_unplanned_builds_after_seal():
    cache = GraphCache(strict=True)
    cache.put("a", 1)
    assert cache.stats.unplanned_builds == 0
    cache.seal()
    cache.put("b", 2, seconds=3.0)
    assert cache.stats.unplanned_builds == 1
    assert cache.get("b") == 2
    cache.clear()
    assert len(cache) == 0 and not cache.sealed
    assert cache.stats.unplanned_builds == 1     # statistics survive a clear
    assert cache.get("a") is None                # not sealed any more: no raise


def test_planned_keys_seal_the_cache_and_unplanned_builds_follow_strict_mode(caplog):
    """XLA's compile bookkeeping is a GraphCache: planned keys seal it once all have entries,
    a new plan reopens it, and a build after that raises (strict) or is logged and counted once."""
    cache = GraphCache()
    cache.plan(["a", "b"])
    cache.put("a", 1)
    assert not cache.sealed
    cache.check_build("b", "never raised: warm-up")
    cache.put("b", 2)
    assert cache.sealed and cache.stats.unplanned_builds == 0
    cache.plan(["a"])                               # already built: stays sealed
    assert cache.sealed
    cache.plan(["c"])                               # a re-fit's new key reopens warm-up
    assert not cache.sealed and cache.planned == {"a", "b", "c"}
    cache.put("c", 3)
    assert cache.sealed
    with caplog.at_level("WARNING", logger="graphrt"):
        cache.check_build("d", lambda: "d was never planned")
        cache.put("d", 4)
        cache.unplanned("e", "compiled on the hot path")
    assert cache.stats.unplanned_builds == 2 and "never planned" in caplog.text and "hot path" in caplog.text
    strict = GraphCache(strict=True)
    strict.plan(["a"])
    strict.unplanned("x", "before warm-up ends: nothing to raise")
    strict.put("a", 1)
    with pytest.raises(CacheMissError, match="hot path"):
        strict.unplanned("x", "compiled on the hot path")
    with pytest.raises(CacheMissError, match="never planned"):
        strict.check_build("y", "y was never planned")
    assert strict.stats.unplanned_builds == 0


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "get"]), st.integers(0, 5)), max_size=40),
       st.integers(0, 40))
def test_cache_counters_model(ops, seal_at):
    """Counters agree with a plain model of the operations."""
    cache, stored, hits, misses, unplanned = GraphCache(), set(), 0, 0, 0
    for i, (op, k) in enumerate(ops):
        if i == seal_at:
            cache.seal()
        if op == "put":
            cache.put(k, f"e{k}")
            stored.add(k)
            unplanned += cache.sealed
        else:
            got = cache.get(k)
            assert got == (f"e{k}" if k in stored else None)
            hits += k in stored
            misses += k not in stored
    s = cache.stats
    assert (s.hits, s.misses, s.entries, s.unplanned_builds) == (hits, misses, len(stored), unplanned)


def test_lookup_and_count_account_like_get():
    """A caller that memoises lookups (the runner) counts each use itself: the totals match
    get()'s; a strict miss is counted once, where it raises; a hit on a key without an entry
    is a caller's bug and says so."""
    cache = GraphCache(strict=True)
    k, missing = key(8, 8, True), key(16, None, False)
    cache.put(k, "g")
    version = cache.version
    cache.seal()
    assert cache.version > version
    assert cache.lookup(k) == "g" and cache.stats.hits == 0      # lookup alone counts nothing
    cache.count(k, True)
    cache.record_step(real_tokens=5, padded_tokens=8, real_reqs=5, padded_reqs=8, key=k, hit=True)
    assert cache.stats.hits == 2 and cache.stats.per_key[k].hits == 2
    with pytest.raises(CacheMissError):
        cache.lookup(missing)
    assert cache.stats.misses == 1
    with pytest.raises(graphrt.GraphrtError, match="no entry"):
        cache.count(missing, True)
    assert cache.stats.hits == 2
