"""The prefix cache (issue 13): a radix tree over full KV blocks, shared by reference count.

* The tree and the allocator alone: matches are capped so the last token is always computed,
  references share and free blocks, unreferenced leaves are evicted least recently used
  first, a reset forgets everything.
* The scheduler driven by a fake runner that keeps a fake KV cache (each slot holds the token
  written there): hypothesis streams of requests with shared prefixes, every policy, few
  blocks (eviction, preemption). Every step, no written block is shared or cached; every
  sampled token reads exactly its request's tokens back from the KV; every cached block holds
  its key's tokens; outputs equal a run without the cache; every block comes back.
* graphrt.LLM on ``eager``, ``cpu`` and ``xla``: greedy tokens identical with and without the
  cache (no step writes a shared block: checked on the runner's inputs), cached tokens
  counted per request and in ``stats``, eviction under pressure, preemption, a lost KV cache
  drops the prefix cache, and hypothesis streams against a no-cache engine.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphrt
from graphrt import SamplingParams
from graphrt.engine.block_allocator import BlockAllocator
from graphrt.engine.prefix_cache import PrefixCache, block_keys
from graphrt.engine.schedule_policy import POLICIES
from graphrt.engine.request import Request, Status
from graphrt.engine.scheduler import Scheduler
from graphrt.models.random_checkpoint import write_random_checkpoint
from support.fast_subset import examples, slow_except

# ---- the tree and the allocator ------------------------------------------------------------


def cache_of(num_blocks: int = 16, bs: int = 4) -> tuple[BlockAllocator, PrefixCache]:
    alloc = BlockAllocator(num_blocks)
    return alloc, PrefixCache(bs, alloc)


def cache_tokens(cache: PrefixCache, alloc: BlockAllocator, tokens: list[int]) -> list[int]:
    """What a request of ``tokens`` does: share its cached prefix, compute (allocate) the rest
    of its full blocks, insert them below the match, and let go of them all."""
    n = len(tokens) // cache.block_size
    keys = block_keys(tokens, cache.block_size, n)
    m = cache.match_keys(keys)
    alloc.share(m.blocks)
    blocks = m.blocks + alloc.allocate(n - m.num_blocks)
    cache.insert(m.node, keys[m.num_blocks:], blocks[m.num_blocks:])
    alloc.free(blocks)
    return blocks


def test_match_is_capped_so_the_last_token_is_always_computed():
    alloc, cache = cache_of()
    blocks = cache_tokens(cache, alloc, list(range(12)))          # three full blocks cached
    assert alloc.num_cached == 3 and alloc.num_used == 0 and alloc.num_free == alloc.capacity
    assert cache.match_prefix(list(range(12))).blocks == blocks[:2]        # 11 // 4: not the last
    assert cache.match_prefix(list(range(13))).blocks == blocks            # 12 // 4
    assert cache.match_prefix(list(range(9))).blocks == blocks[:2]
    assert cache.match_prefix(list(range(4))).blocks == []                 # 3 // 4
    assert cache.match_prefix([0, 1, 2, 3, 9, 9, 9, 9, 9]).blocks == blocks[:1]
    assert cache.match_prefix([7] * 20).blocks == []


def test_blocks_are_shared_and_freed_by_reference_count():
    alloc, cache = cache_of()
    blocks = cache_tokens(cache, alloc, list(range(8)))
    m = cache.match_prefix(list(range(9)))
    alloc.share(m.blocks)                    # two requests take the cached prefix
    alloc.share(m.blocks)
    assert [alloc.refcount(b) for b in blocks] == [2, 2] and alloc.num_used == 2
    assert alloc.num_free == alloc.capacity - 2 and alloc.num_evictable == 0
    alloc.free(m.blocks)
    assert [alloc.refcount(b) for b in blocks] == [1, 1]
    assert cache.evict(2) == 0               # referenced: never evicted
    alloc.free(m.blocks)
    assert alloc.num_used == 0 and alloc.num_evictable == 2 and alloc.num_free == alloc.capacity
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(m.blocks)                 # a double free still raises, and frees nothing
    with pytest.raises(ValueError, match="neither allocated nor cached"):
        alloc.share([blocks[-1] + 1])
    with pytest.raises(ValueError, match="cannot be cached"):
        alloc.mark_cached([blocks[0]])       # unreferenced


def test_unreferenced_leaves_are_evicted_least_recently_used_first():
    alloc, cache = cache_of(num_blocks=8)     # 7 usable
    a = cache_tokens(cache, alloc, [1] * 4 + [2] * 4)             # a0 -> a1
    b = cache_tokens(cache, alloc, [1] * 4 + [3] * 4 + [4] * 4)   # shares a0: b1 -> b2 under it
    assert b[0] == a[0] and alloc.num_cached == 4
    cache.match_prefix([1] * 4 + [2] * 4 + [0])                   # a's path is now the most recent
    held = alloc.allocate(3)                  # 3 uncached free blocks: no eviction yet
    assert alloc.num_cached == 4 and cache.num_evicted == 0
    got = alloc.allocate(2)                   # evicts two leaves: b2 first (LRU), then b1
    assert got is not None and cache.num_evicted == 2
    assert cache.match_prefix([1] * 4 + [3] * 4 + [4] * 4 + [0]).blocks == [a[0]]
    assert cache.match_prefix([1] * 4 + [2] * 4 + [0]).blocks == a
    alloc.free(got)
    alloc.free(held)
    ref = cache.match_prefix([1] * 4 + [2] * 4 + [0])
    alloc.share(ref.blocks[:1])               # a0 referenced: a1 goes, a0 and below stay
    assert alloc.allocate(alloc.num_free) is not None
    assert cache.match_prefix([1] * 4 + [2] * 4 + [0]).blocks == [a[0]]
    assert alloc.allocate(1) is None          # nothing left: a0 is referenced


def test_a_block_the_tree_already_holds_is_kept_and_returned_for_a_swap():
    alloc, cache = cache_of()
    a = cache_tokens(cache, alloc, [1] * 4 + [2] * 4)
    twin = alloc.allocate(3)                  # computed [1]*4 + [2]*4 + [5]*4 without a match
    node, path = cache.insert(cache.root, block_keys([1] * 4 + [2] * 4 + [5] * 4, 4, 3), twin)
    assert path == [a[0], a[1], twin[2]] and node.block == twin[2]
    assert alloc.num_cached == 3 and not alloc.is_cached(twin[0])
    assert cache.match_prefix([1] * 4 + [2] * 4 + [5] * 4 + [0]).blocks == path


def test_reset_forgets_every_block_and_keeps_referenced_ones_with_their_holder():
    alloc, cache = cache_of()
    blocks = cache_tokens(cache, alloc, list(range(12)))
    alloc.share(blocks[:1])
    cache.reset()
    assert alloc.num_cached == 0 and cache.match_prefix(list(range(13))).blocks == []
    assert alloc.num_used == 1 and alloc.num_free == alloc.capacity - 1
    alloc.free(blocks[:1])
    assert alloc.num_free == alloc.capacity and alloc.num_used == 0


# ---- the scheduler with a fake KV cache ------------------------------------------------------

FAKE_VOCAB = 7          # a tiny vocabulary: identical blocks and prompts are common


def fake_token(tokens: list[int]) -> int:
    """What the fake model samples: a function of every token the request's KV holds."""
    return int(np.dot(np.asarray(tokens, np.int64) % 1009, np.arange(1, len(tokens) + 1)) % FAKE_VOCAB)


def assert_no_shared_write(sched: Scheduler, req: Request, n: int) -> np.ndarray:
    """The slots ``req`` writes this step; none lies in a shared or cached block."""
    bs = sched.block_size
    pos = np.arange(req.num_computed_tokens, req.num_computed_tokens + n)
    blocks = np.asarray(req.blocks, np.int64)[pos // bs]
    for b in np.unique(blocks).tolist():
        assert sched.allocator.refcount(b) == 1, f"request {req.request_id} writes shared block {b}"
        assert not sched.allocator.is_cached(b), f"request {req.request_id} writes cached block {b}"
    return blocks * bs + pos % bs


def assert_tree_holds_its_keys(cache: PrefixCache, kv: np.ndarray) -> None:
    bs = cache.block_size
    for node in cache._nodes():
        want = np.frombuffer(node.key, dtype=np.int64)
        assert (kv[node.block * bs:(node.block + 1) * bs] == want).all(), "a cached block lost its KV"


def run_fake(sched: Scheduler, stream: list[tuple[list[int], int, int]], kv_slots: int,
             max_steps: int = 3000) -> dict[int, list[int]]:
    """Run ``stream`` ((prompt, max_tokens, arrival step)) to completion; outputs by index."""
    kv = np.full(kv_slots, -1, np.int64)
    pending = sorted((arr, i) for i, (_, _, arr) in enumerate(stream))
    reqs: dict[int, Request] = {}
    step_no = 0
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= step_no:
            _, i = pending.pop(0)
            prompt, max_tokens, _ = stream[i]
            reqs[i] = Request(i, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            sched.add(reqs[i])
        step = sched.schedule()
        alloc = sched.allocator
        assert alloc.num_free + alloc.num_used == alloc.capacity
        for req, n in zip(step.requests, step.num_scheduled):
            assert req.status is Status.RUNNING and n <= req.num_pending
            slots = assert_no_shared_write(sched, req, n)
            kv[slots] = req.tokens(req.num_computed_tokens, req.num_computed_tokens + n)
        for req, n in zip(step.requests, step.num_scheduled):
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                sched.cache_computed(req)
                continue
            bs, pos = sched.block_size, np.arange(req.num_tokens)
            seen = kv[np.asarray(req.blocks, np.int64)[pos // bs] * bs + pos % bs]
            assert seen.tolist() == req.tokens(0, req.num_tokens), "a request read wrong KV"
            req.output_token_ids.append(fake_token(seen.tolist()))
            req.num_tokens += 1
            if len(req.output_token_ids) >= req.params.max_tokens:
                sched.finish(req, "length")
            else:
                sched.cache_computed(req)
        if sched.prefix_cache is not None:
            assert_tree_holds_its_keys(sched.prefix_cache, kv)
        step_no += 1
        assert step_no < max_steps, "requests did not finish"
    assert sched.allocator.num_used == 0 and sched.allocator.num_free == sched.allocator.capacity
    assert all(r.status is Status.FINISHED for r in reqs.values())
    return {i: r.output_token_ids for i, r in reqs.items()}


@st.composite
def shared_prefix_stream(draw, tokens, *, prefix: int, suffix: int, requests: int, max_tokens: int,
                         arrival: int) -> list[tuple[list[int], int, int]]:
    """1 to ``requests`` (prompt, max_tokens, arrival step): each prompt one of up to three
    shared prefixes (up to ``prefix`` tokens) plus a distinct suffix of 1 to ``suffix``."""
    prefixes = draw(st.lists(st.lists(tokens, max_size=prefix), min_size=1, max_size=3))
    return [(draw(st.sampled_from(prefixes)) + draw(st.lists(tokens, min_size=1, max_size=suffix)),
             draw(st.integers(1, max_tokens)), draw(st.integers(0, arrival)))
            for _ in range(draw(st.integers(1, requests)))]


@st.composite
def fake_workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4]))
    stream = draw(shared_prefix_stream(st.integers(0, FAKE_VOCAB - 1), prefix=16, suffix=8, requests=12,
                                       max_tokens=5, arrival=8))
    need = max(-(-(len(p) + m) // bs) for p, m, _ in stream)
    seqs = draw(st.integers(1, 4))
    limits = dict(max_num_seqs=seqs, max_num_batched_tokens=draw(st.integers(seqs, 32)), block_size=bs)
    return (stream, limits, draw(st.integers(need + 1, 3 * need + 2)), draw(st.sampled_from(POLICIES)),
            draw(st.sampled_from([0.0, 1.0])))


@settings(max_examples=examples(120), deadline=None)
@given(fake_workloads())
def test_scheduler_shares_only_full_computed_blocks_and_reads_exact_kv(w):
    stream, limits, num_blocks, policy, conservativeness = w
    outs = {}
    for cached in (True, False):
        alloc = BlockAllocator(num_blocks)
        cache = PrefixCache(limits["block_size"], alloc) if cached else None
        sched = Scheduler(**limits, allocator=alloc, prefix_cache=cache, schedule_policy=policy,
                          schedule_conservativeness=conservativeness)
        outs[cached] = run_fake(sched, stream, num_blocks * limits["block_size"])
    assert outs[True] == outs[False]


def test_fake_run_hits_the_cache_and_evicts_under_pressure():
    prefix = [1, 2, 3, 4, 5, 6, 1, 2]
    stream = [(prefix + [i % FAKE_VOCAB, 3], 3, i) for i in range(10)]
    stream += [([6 - j % 5] * 6 + [j % FAKE_VOCAB], 2, 12 + j) for j in range(8)]   # other prefixes
    alloc = BlockAllocator(9)
    cache = PrefixCache(2, alloc)
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=16, block_size=2, allocator=alloc,
                      prefix_cache=cache)
    run_fake(sched, stream, 9 * 2)
    assert sched.num_cached_tokens >= 9 * len(prefix)       # every later request found the prefix
    assert cache.num_evicted > 0


# ---- graphrt.LLM ---------------------------------------------------------------------------

#: Not 128 (most files) nor 96 (test_engine_faults): an xla engine here compiles its own
#: programs, so JAX's in-process compile cache does not make other files' compiles look free.
VOCAB = 112
LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4)
BACKEND_ARGS = {"eager": {}, "cpu": dict(cudagraph_capture_sizes=[4, 8, 32]),
                "xla": dict(precompile_token_paddings=[32], precompile_bs_paddings=[4])}   # one program
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


def prompts_with_shared_prefixes(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    sys_a, sys_b = rng.integers(3, VOCAB, 10).tolist(), rng.integers(3, VOCAB, 21).tolist()
    out = [sys_a + rng.integers(3, VOCAB, n).tolist() for n in (1, 3, 6, 2)]
    out += [sys_b + rng.integers(3, VOCAB, n).tolist() for n in (4, 15)]   # 36: chunked prefill
    out += [sys_a[:8], sys_a[:8], sys_b[:12]]     # whole-block prompts, one repeated
    return out


#: tests/support/hf_models.py's tiny shapes, written without transformers (graphrt's own writer).
MODEL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


@functools.cache
def model_dir() -> str:
    root = Path(tempfile.mkdtemp(prefix="graphrt-prefix-cache-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return str(write_random_checkpoint(root / "qwen3", **MODEL))


def make_llm(backend: str, **kw) -> graphrt.LLM:
    if backend == "xla":
        pytest.importorskip("jax")
    args = {**LIMITS, **BACKEND_ARGS[backend], **kw}
    return graphrt.LLM(model_dir(), backend=backend, **args)


class WriteGuard:
    """Wraps the runner's execute (execute_async where the engine overlaps its steps): no real
    token of a step may write a block that is shared or cached when it is launched (read from
    the step's own block table and the allocator)."""

    def __init__(self, mp: pytest.MonkeyPatch, llm: graphrt.LLM) -> None:
        self.llm, self.steps, self.shared_reads = llm, 0, 0
        name = "execute_async" if llm.overlap else "execute"
        self._execute = getattr(llm.runner, name)
        mp.setattr(llm.runner, name, self)

    def __call__(self, **kw):
        alloc, bs = self.llm.allocator, self.llm.config.block_size
        for row, c, n in zip(kw["req_rows"], kw["num_computed_tokens"], kw["num_scheduled_tokens"]):
            written = np.unique(kw["block_table"][row, np.arange(c, c + n) // bs]).tolist()
            for b in written:
                assert b != 0 and alloc.refcount(b) == 1 and not alloc.is_cached(b), (
                    f"row {row} writes block {b} (refcount {alloc.refcount(b)}, cached {alloc.is_cached(b)})")
            read = kw["block_table"][row, :c // bs].tolist()
            self.shared_reads += sum(alloc.refcount(b) > 1 or alloc.is_cached(b) for b in read)
        self.steps += 1
        return self._execute(**kw)


def tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


_ENGINES: dict[str, tuple[graphrt.LLM, graphrt.LLM]] = {}


def engines(backend: str) -> tuple[graphrt.LLM, graphrt.LLM]:
    """(with the prefix cache, without), built once per backend for this module."""
    if backend not in _ENGINES:
        _ENGINES[backend] = make_llm(backend), make_llm(backend, enable_prefix_caching=False)
    return _ENGINES[backend]


@pytest.fixture(scope="module", autouse=True)
def _drop_engines():
    yield
    _ENGINES.clear()


@pytest.mark.parametrize("backend", slow_except(["eager", "cpu", "xla"], "cpu"))
def test_greedy_tokens_identical_with_and_without_the_prefix_cache(backend):
    prompts = prompts_with_shared_prefixes(seed=0)
    llm, plain = engines(backend)
    assert plain.prefix_cache is None
    ref = tokens(plain.generate(prompts, GREEDY))
    assert plain.stats["prefix_cache_hit_tokens"] == 0
    with pytest.MonkeyPatch.context() as mp:
        guard = WriteGuard(mp, llm)
        first = llm.generate(prompts, GREEDY)
        second = llm.generate(prompts[::-1], GREEDY)       # everything cached now
    assert tokens(first) == ref and tokens(second) == ref[::-1]
    assert guard.steps > 0 and guard.shared_reads > 0
    stats = llm.stats
    hits = sum(o.num_cached_tokens for o in first + second)
    assert hits == stats["prefix_cache_hit_tokens"] > 0
    # Second pass: each prompt's whole-block prefix, capped to leave its last token.
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // 4 * 4 for p in prompts[::-1]]
    assert stats["prefill_tokens"] < 2 * plain.stats["prefill_tokens"]
    assert llm.allocator.num_used == 0 and llm.allocator.num_free == llm.allocator.capacity
    assert stats["prefix_cache_blocks"] == llm.allocator.num_cached > 0


def test_eviction_and_preemption_under_pressure_keep_tokens_exact():
    prompts = [p for s in (1, 2) for p in prompts_with_shared_prefixes(seed=s)]
    ref = tokens(make_llm("eager", enable_prefix_caching=False).generate(prompts, GREEDY))
    # 19 usable blocks of 4 tokens; admission without the KV estimate, so requests preempt
    llm = make_llm("eager", num_kv_blocks=20, schedule_conservativeness=0.0)
    with pytest.MonkeyPatch.context() as mp:
        WriteGuard(mp, llm)
        assert tokens(llm.generate(prompts, GREEDY)) == ref
    stats = llm.stats
    assert stats["prefix_cache_evictions"] > 0 and stats["preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert llm.allocator.num_used == 0 and llm.allocator.num_free == llm.allocator.capacity


def test_reset_prefix_cache_and_the_step_api():
    llm = make_llm("eager")
    prompts = prompts_with_shared_prefixes(seed=4)
    ref = tokens(llm.generate(prompts, GREEDY))
    assert llm.allocator.num_cached > 0
    llm.reset_prefix_cache()
    assert llm.allocator.num_cached == 0 and llm.allocator.num_free == llm.allocator.capacity
    ids = [llm.add_request(p, GREEDY) for p in prompts]
    done = {}
    while llm.has_unfinished():
        done.update((o.request_id, o) for o in llm.step())
    assert [done[i].token_ids for i in ids] == ref


def test_a_lost_kv_cache_drops_the_prefix_cache():
    """xla re-creates a lost (donated, deleted) KV cache zeroed: cached blocks would then hold
    zeros, so the engine must forget them before the next step, not serve them."""
    if "xla" not in _ENGINES:
        pytest.importorskip("jax")
    llm, plain = engines("xla")
    prompts = prompts_with_shared_prefixes(seed=5)
    ref = tokens(plain.generate(prompts, GREEDY))
    assert tokens(llm.generate(prompts, GREEDY)) == ref
    assert llm.allocator.num_cached > 0
    epoch = llm.prefix_cache.epoch
    llm.runner.executor.kv_cache.delete()
    assert llm.runner.executor.recover_kv_cache()
    assert tokens(llm.generate(prompts, GREEDY)) == ref
    assert llm.prefix_cache.epoch == epoch + 1


def test_bad_schedule_arguments_are_refused():
    with pytest.raises(graphrt.InputError, match="schedule_policy"):
        make_llm("eager", schedule_policy="sjf")
    with pytest.raises(graphrt.InputError, match="schedule_conservativeness"):
        make_llm("eager", schedule_conservativeness=-1.0)


@pytest.fixture(scope="module")
def llm_pair():
    return make_llm("eager", num_kv_blocks=24), make_llm("eager", enable_prefix_caching=False)


@st.composite
def llm_streams(draw):
    stream = draw(shared_prefix_stream(st.integers(3, VOCAB - 1), prefix=14, suffix=6, requests=8,
                                       max_tokens=4, arrival=4))
    return stream, draw(st.sampled_from(POLICIES))


def run_stream(llm: graphrt.LLM, stream) -> list[list[int]]:
    pending = sorted((arr, i) for i, (_, _, arr) in enumerate(stream))
    ids, done, step = {}, {}, 0
    while pending or llm.has_unfinished():
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            ids[i] = llm.add_request(stream[i][0], SamplingParams(max_tokens=stream[i][1], ignore_eos=True))
        done.update((o.request_id, o.token_ids) for o in llm.step())
        step += 1
    return [done[ids[i]] for i in range(len(stream))]


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(llm_streams())
def test_random_streams_with_shared_prefixes_match_a_run_without_the_cache(llm_pair, w):
    stream, policy = w
    llm, plain = llm_pair
    llm.scheduler.policy = type(llm.scheduler.policy)(policy, llm.prefix_cache)
    with pytest.MonkeyPatch.context() as mp:
        WriteGuard(mp, llm)
        assert run_stream(llm, stream) == run_stream(plain, stream)
    assert llm.allocator.num_used == 0 and llm.allocator.num_free == llm.allocator.capacity
