"""Schedule policies and admission (issue 13): each policy's order on constructed queues, and
the PrefillAdder-style budget of ``Scheduler.schedule``.

Orders: fcfs keeps arrival order; lof puts the largest ``max_tokens`` first (ties in arrival
order); random is a seeded permutation; lpm puts the longest cached prefix first and holds back
a request that shares an uncached prefix with one ahead of it; dfs-weight walks the tree
heaviest subtree first, deeper matches before their ancestors'. Cache-aware policies without
a cache, and lpm with a long queue, serve fcfs.
"""

from __future__ import annotations

import pytest

from graphrt import InputError, SamplingParams
from graphrt.engine.schedule_policy import IN_BATCH_PREFIX_DEPRIORITIZE_THRESHOLD, LPM_MAX_WAITING
from graphrt.engine.block_allocator import BlockAllocator
from graphrt.engine.prefix_cache import PrefixCache, block_keys
from graphrt.engine.schedule_policy import POLICIES, SchedulePolicy
from graphrt.engine.request import Request, Status
from graphrt.engine.scheduler import Scheduler

BS = 4


def req(i: int, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(i, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def scheduler(policy: str, *, cache: bool = True, num_blocks: int = 64, **kw) -> Scheduler:
    alloc = BlockAllocator(num_blocks)
    args = dict(max_num_seqs=8, max_num_batched_tokens=256, block_size=BS)
    args.update(kw)
    return Scheduler(**args, allocator=alloc, prefix_cache=PrefixCache(BS, alloc) if cache else None,
                     schedule_policy=policy)


def cache_prefix(sched: Scheduler, tokens: list[int]) -> None:
    """Put the full blocks of ``tokens`` in the scheduler's cache, as a finished request would."""
    cache, alloc = sched.prefix_cache, sched.allocator
    n = len(tokens) // BS
    keys = block_keys(tokens, BS, n)
    m = cache.match_keys(keys)
    alloc.share(m.blocks)
    blocks = m.blocks + alloc.allocate(n - m.num_blocks)
    cache.insert(m.node, keys[m.num_blocks:], blocks[m.num_blocks:])
    alloc.free(blocks)


def order(sched: Scheduler, queue: list[Request]) -> list[int]:
    return [r.request_id for r in sched.policy.order(queue, sched.match, sched.keys)]


A = [10] * 4 + [11] * 4 + [12] * 4 + [13] * 4      # a cached 16-token prefix
B = [20] * 4 + [21] * 4                             # another, 8 tokens


def test_fcfs_keeps_arrival_order():
    queue = [req(i, [i + 3] * (9 - i), max_tokens=i + 1) for i in range(6)]
    assert order(scheduler("fcfs"), queue) == [0, 1, 2, 3, 4, 5]


def test_lof_puts_the_largest_max_tokens_first_ties_in_arrival_order():
    queue = [req(i, [5], max_tokens=m) for i, m in enumerate([3, 9, 1, 9, 4, 16])]
    assert order(scheduler("lof"), queue) == [5, 1, 3, 4, 0, 2]


def test_random_is_a_seeded_permutation():
    queue = [req(i, [5]) for i in range(12)]
    first = order(scheduler("random"), queue)
    assert sorted(first) == list(range(12)) and first != list(range(12))
    assert order(scheduler("random"), queue) == first          # same seed, same order
    sched = scheduler("random")
    sched.policy = SchedulePolicy("random", None, seed=7)
    assert order(sched, queue) != first


def test_lpm_puts_the_longest_cached_prefix_first():
    sched = scheduler("lpm")
    cache_prefix(sched, A)
    cache_prefix(sched, B)
    queue = [req(0, [7] * 9), req(1, B + [1]), req(2, A + [1]), req(3, A[:9] + [2]), req(4, [30] * 3),
             req(5, A)]                     # 16 tokens: its match is capped at 12
    # Matches (tokens): 0, 8, 16, 8, 0, 12.
    assert order(sched, queue) == [2, 5, 1, 3, 0, 4]


def test_lpm_defers_requests_that_share_an_uncached_prefix_with_one_ahead():
    sched = scheduler("lpm")
    shared = list(range(40, 80))             # 40 tokens, not cached
    queue = [req(0, shared + [1]), req(1, [9] * 5), req(2, shared + [2]), req(3, shared[:36] + [3]),
             req(4, [8] * 12)]
    # 2 and 3 match >= 32 tokens of 0 (ahead of them): they wait; 0 computes the prefix.
    assert order(sched, queue) == [0, 1, 4]
    assert IN_BATCH_PREFIX_DEPRIORITIZE_THRESHOLD == 32
    # A cached prefix longer than the check threshold is no reason to wait: plain lpm order.
    cache_prefix(sched, shared)
    assert order(sched, queue) == [0, 2, 3, 1, 4]


def test_lpm_serves_fcfs_above_the_queue_limit():
    sched = scheduler("lpm")
    cache_prefix(sched, A)
    n = LPM_MAX_WAITING + 1
    queue = [req(i, [7, i % 50 + 3]) for i in range(n - 1)] + [req(n - 1, A + [1])]
    assert order(sched, queue) == list(range(n))
    assert order(sched, queue[-3:]) == [n - 1, n - 3, n - 2]


def test_dfs_weight_walks_the_heaviest_subtree_first():
    sched = scheduler("dfs-weight")
    cache_prefix(sched, A)                   # A0 -> A1 -> A2 -> A3
    cache_prefix(sched, A[:8] + [14] * 4)    # A1 -> C2
    cache_prefix(sched, B)                   # B0 -> B1
    queue = [req(0, [7] * 5),                # no match: the root
             req(1, B + [1]),                # B1
             req(2, A[:8] + [14] * 4 + [1]), # C2
             req(3, A + [1]),                # A3
             req(4, A[:12] + [1]),           # A2
             req(5, B + [2]),                # B1
             req(6, A + [2]),                # A3
             req(7, B[:4] + [3])]            # B0
    # Weights: A-subtree 4 (A3: 2, A2 subtree 3, C2: 1), B-subtree 3, root itself 1.
    # Heaviest first, then within A1: A2 (3) before C2 (1); children before their parent.
    assert order(sched, queue) == [3, 6, 4, 2, 1, 5, 7, 0]


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_cache_aware_policies_without_a_cache_serve_fcfs(policy):
    sched = scheduler(policy, cache=False)
    assert sched.policy.active == "fcfs"
    queue = [req(i, [5] * (i + 1)) for i in range(5)]
    assert order(sched, queue) == [0, 1, 2, 3, 4]


def test_unknown_policy_is_refused():
    with pytest.raises(InputError, match="schedule_policy: unknown policy 'sjf'"):
        scheduler("sjf")
    assert POLICIES == ("fcfs", "lof", "random", "lpm", "dfs-weight")


# ---- admission --------------------------------------------------------------------------------

def test_admission_follows_the_policy_and_chunks_the_last_request():
    sched = scheduler("lof", max_num_seqs=8, max_num_batched_tokens=20)
    for i, m in enumerate([2, 8, 5]):
        sched.add(req(i, [3 + i] * 9, max_tokens=m))
    step = sched.schedule()
    assert [r.request_id for r in step.requests] == [1, 2, 0]
    assert step.num_scheduled == [9, 9, 2]          # the last admitted is chunked
    assert not sched.waiting and all(r.status is Status.RUNNING for r in step.requests)


def test_admission_starts_from_the_cached_prefix():
    sched = scheduler("fcfs", max_num_batched_tokens=64)
    cache_prefix(sched, A)
    sched.add(req(0, A + [1, 2]))
    sched.add(req(1, A[:14]))
    step = sched.schedule()
    r0, r1 = step.requests
    assert (r0.num_computed_tokens, r1.num_computed_tokens) == (16, 12)
    assert step.num_scheduled == [2, 2]
    assert r0.blocks[:3] == r1.blocks[:3] and all(sched.allocator.refcount(b) == 2 for b in r0.blocks[:3])
    assert sched.num_cached_tokens == 28 and (r0.num_cached_tokens, r1.num_cached_tokens) == (16, 12)


def test_lpm_computes_a_shared_uncached_prefix_once():
    sched = scheduler("lpm", max_num_batched_tokens=256)
    shared = list(range(40, 80))
    for i in range(4):
        sched.add(req(i, shared + [i + 1] * 3))
    sched.add(req(4, [9] * 6))
    first = sched.schedule()
    assert [r.request_id for r in first.requests] == [0, 4]       # 1..3 wait for 0's prefix
    for r, n in zip(first.requests, first.num_scheduled):
        r.num_computed_tokens += n
        sched.cache_computed(r)
    second = sched.schedule()
    waiting = [r for r in second.requests if r.request_id in (1, 2, 3)]
    assert [r.num_computed_tokens for r in waiting] == [40, 40, 40]    # the prefix, cached
    assert sched.num_cached_tokens == 120


def test_the_kv_estimate_budget_with_conservativeness():
    """c = 1: a request is admitted only if its input plus min(max_tokens, clip) fits the free
    KV left after the running requests' own estimates; with nothing running the head always
    runs. c = 0 (the default): only this step's blocks count."""
    def build(c: float) -> Scheduler:
        alloc = BlockAllocator(11)                  # 10 usable blocks: 40 tokens
        s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, block_size=BS, allocator=alloc,
                      schedule_conservativeness=c, clip_max_new_tokens=8)
        s.add(req(0, [3] * 12, max_tokens=100))      # estimate 12 + 8 (clipped)
        s.add(req(1, [4] * 12, max_tokens=8))        # 12 + 8: 40 in all, fits
        s.add(req(2, [5] * 4, max_tokens=1))         # 4 + 1: over
        return s
    step = build(1.0).schedule()
    assert [r.request_id for r in step.requests] == [0, 1]
    step = build(0.0).schedule()
    assert [r.request_id for r in step.requests] == [0, 1, 2]
    alone = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, block_size=BS,
                      allocator=BlockAllocator(11), schedule_conservativeness=1.0)
    alone.add(req(0, [3] * 30, max_tokens=50))       # 30 + 50 > 40, but nothing else runs
    assert alone.schedule().num_scheduled == [30]
    with pytest.raises(InputError, match="schedule_conservativeness"):
        Scheduler(max_num_seqs=1, max_num_batched_tokens=1, block_size=1, allocator=BlockAllocator(2),
                  schedule_conservativeness=float("nan"))


def test_llm_with_conservativeness_avoids_the_preemptions_of_optimistic_admission(tmp_path):
    """tests/models/test_llm_parity.py's preemption workload: optimistic admission (c = 0, the
    default) preempts; with c = 1 admission reserves each request's estimated output and
    nothing is preempted. Greedy tokens are the same either way."""
    import numpy as np

    import graphrt
    from graphrt.models.random_checkpoint import write_random_checkpoint

    model = write_random_checkpoint(tmp_path / "qwen3", vocab_size=128, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=16, max_position_embeddings=256)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 128, n).tolist() for n in (18, 22, 26, 30, 20, 24, 28, 19)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    runs = {}
    for c in (0.0, 1.0):
        llm = graphrt.LLM(str(model), backend="eager", max_num_seqs=4, max_num_batched_tokens=32,
                          max_model_len=64, block_size=4, num_kv_blocks=14, schedule_conservativeness=c)
        runs[c] = ([o.token_ids for o in llm.generate(prompts, params)], llm.stats["preemptions"])
    assert runs[0.0][1] > 0 and runs[1.0][1] == 0
    assert runs[0.0][0] == runs[1.0][0]
