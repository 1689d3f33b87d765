"""The embedded engine: block allocator, scheduler invariants, and LLM input validation.

The allocator and the scheduler are tested with hypothesis (a state machine; random
workloads driven to completion by a fake runner that samples nothing but a counter). The
LLM tests check that bad input raises ``InputError`` naming the prompt, and that the
engine keeps serving afterwards (``generate`` and the step API).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

import graphrt
from graphrt import InputError, SamplingParams
from graphrt.engine.block_allocator import BlockAllocator
from graphrt.engine.request import Request, Status
from graphrt.engine.scheduler import Scheduler
from support.hf_models import tiny_hf_model_dir
from support.fast_subset import examples

# ---- BlockAllocator ----------------------------------------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / free sequences against a model of which blocks are held."""

    groups = Bundle("groups")

    def __init__(self) -> None:
        super().__init__()
        self.allocator: BlockAllocator | None = None
        self.held: set[int] = set()

    @rule(num_blocks=st.integers(2, 40))
    def create(self, num_blocks):
        if self.allocator is None:
            self.allocator = BlockAllocator(num_blocks)

    @rule(target=groups, n=st.integers(0, 12))
    def allocate(self, n):
        if self.allocator is None:
            self.allocator = BlockAllocator(16)
        free_before = self.allocator.num_free
        got = self.allocator.allocate(n)
        if n > free_before:
            assert got is None and self.allocator.num_free == free_before   # nothing taken
            return []
        assert got is not None and len(got) == n
        assert 0 not in got, "the null block was handed out"
        assert len(set(got)) == n and not (set(got) & self.held), "a block was handed out twice"
        assert all(1 <= b < self.allocator.num_blocks for b in got)
        self.held |= set(got)
        return got

    @rule(group=consumes(groups))
    def free(self, group):
        self.allocator.free(group)
        self.held -= set(group)

    @rule(group=groups)
    def double_free_raises(self, group):
        if group and self.allocator is not None and not (set(group) & self.held):
            with pytest.raises(ValueError, match="not allocated"):
                self.allocator.free(group[:1])

    @rule()
    def freeing_the_null_block_raises(self):
        if self.allocator is not None:
            with pytest.raises(ValueError):
                self.allocator.free([0])

    @invariant()
    def accounting(self):
        if self.allocator is not None:
            assert self.allocator.num_free + len(self.held) == self.allocator.capacity
            assert self.allocator.capacity == self.allocator.num_blocks - 1


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=examples(60), stateful_step_count=40, deadline=None)


def test_allocator_reuses_freed_blocks_and_rejects_tiny_caches():
    alloc = BlockAllocator(5)
    a = alloc.allocate(4)
    assert sorted(a) == [1, 2, 3, 4] and alloc.allocate(1) is None
    alloc.free(a[1:3])
    b = alloc.allocate(2)
    assert sorted(b) == sorted(a[1:3])
    with pytest.raises(ValueError):
        BlockAllocator(1)


# ---- Scheduler -----------------------------------------------------------------------------


@dataclass
class Workload:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int
    requests: list[tuple[int, int, int]]     # (prompt length, max_tokens, arrival step)


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_num_seqs = draw(st.integers(1, 6))
    max_num_batched_tokens = draw(st.integers(max_num_seqs, 48))
    n = draw(st.integers(1, 12))
    requests = [(draw(st.integers(1, 40)), draw(st.integers(1, 8)), draw(st.integers(0, 10)))
                for _ in range(n)]
    # Every request must fit the cache on its own (the LLM rejects the others up front).
    need = max(-(-(p + m) // block_size) for p, m, _ in requests)
    num_blocks = draw(st.integers(need + 1, need + 1 + 3 * need))
    return Workload(max_num_seqs, max_num_batched_tokens, block_size, num_blocks, requests)


def check_step(sched: Scheduler, step, w: Workload) -> None:
    assert step.num_tokens <= w.max_num_batched_tokens
    assert len(step) <= w.max_num_seqs
    assert len({r.request_id for r in step.requests}) == len(step)
    assert all(n >= 1 for n in step.num_scheduled)
    for req, n in zip(step.requests, step.num_scheduled):
        assert req.status is Status.RUNNING and req in sched.running
        assert n <= req.num_pending, "scheduled tokens the request does not know yet"
        assert req.num_tokens == len(req.prompt_token_ids) + len(req.output_token_ids), "stale token count"
        assert len(req.blocks) * w.block_size >= req.num_computed_tokens + n, "blocks do not cover the step"
        assert 0 <= req.row < w.max_num_seqs
    held = [b for r in sched.running for b in r.blocks]
    assert len(held) == len(set(held)), "a block is shared between running requests"
    assert 0 not in held
    assert sched.allocator.num_free + len(held) == sched.allocator.capacity
    rows = [r.row for r in sched.running]
    assert len(rows) == len(set(rows))
    for r in sched.waiting:
        assert r.blocks == [] and r.row == -1 and r.status is Status.WAITING


def drive(w: Workload, max_steps: int = 2000, conservativeness: float = 0.0
          ) -> tuple[Scheduler, dict[int, Request], int]:
    """Run the workload to completion with a fake runner: each sampled token is a counter.
    ``conservativeness`` 0 admits without the KV estimate, so short caches preempt."""
    alloc = BlockAllocator(w.num_blocks)
    sched = Scheduler(max_num_seqs=w.max_num_seqs, max_num_batched_tokens=w.max_num_batched_tokens,
                      block_size=w.block_size, allocator=alloc, schedule_conservativeness=conservativeness)
    pending = sorted(((arr, i, p, m) for i, (p, m, arr) in enumerate(w.requests)))
    reqs: dict[int, Request] = {}
    step_no = preempted_seen = 0
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= step_no:
            _, i, p, m = pending.pop(0)
            reqs[i] = Request(i, list(range(100, 100 + p)), SamplingParams(max_tokens=m, ignore_eos=True))
            sched.add(reqs[i])
        before = sched.num_preemptions
        step = sched.schedule()
        check_step(sched, step, w)
        if sched.num_preemptions > before:
            preempted_seen += sched.num_preemptions - before
            for r in reqs.values():     # a preempted request holds nothing and starts over
                if r.status is Status.WAITING and r.num_preemptions:
                    assert r.blocks == [] and r.num_computed_tokens == 0 and r.row == -1
        if not step.requests:
            assert not sched.has_unfinished() or pending, "the scheduler stalled with work left"
        for req, n in zip(step.requests, step.num_scheduled):
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:          # the fake runner samples
                req.output_token_ids.append(len(req.output_token_ids))
                req.num_tokens += 1
                if len(req.output_token_ids) >= req.params.max_tokens:
                    sched.finish(req, "length")
        step_no += 1
        assert step_no < max_steps, "requests did not finish"
    return sched, reqs, preempted_seen


@settings(max_examples=examples(150), deadline=None)
@given(workloads(), st.sampled_from([0.0, 1.0]))
def test_scheduler_invariants_and_every_request_finishes(w, conservativeness):
    sched, reqs, _ = drive(w, conservativeness=conservativeness)
    assert all(r.status is Status.FINISHED and r.finish_reason == "length" for r in reqs.values())
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in reqs.values())
    assert sched.allocator.num_free == sched.allocator.capacity      # every block came back
    assert sorted(sched._free_rows) == list(range(w.max_num_seqs))
    assert not sched.running and not sched.waiting


def test_scheduler_preempts_and_frees_blocks_when_the_cache_is_short():
    w = Workload(max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_blocks=12,
                 requests=[(14, 8, 0), (13, 8, 0), (15, 8, 0), (12, 8, 0)])
    sched, reqs, preempted = drive(w)
    assert preempted > 0 and sched.num_preemptions == preempted
    assert sum(r.num_preemptions for r in reqs.values()) == preempted
    assert sched.allocator.num_free == sched.allocator.capacity


def test_scheduler_does_not_livelock_when_a_prefill_preempts_itself():
    """Found by the property test above. A long prompt C is chunk-prefilled while an older
    request A waits to decode; C then needs the blocks A holds, so C (the newest) preempts
    itself. Re-admitting C in the same step took back the freed blocks and the whole token
    budget, A never ran, and C re-prefilled into the same wall forever. Now a request
    preempted in a step is not re-admitted in that step, so A decodes and both finish."""
    w = Workload(max_num_seqs=2, max_num_batched_tokens=2, block_size=1, num_blocks=32,
                 requests=[(1, 4, 0), (1, 1, 0), (28, 3, 0)])
    sched, reqs, preempted = drive(w, max_steps=200)
    assert preempted > 0
    assert all(r.status is Status.FINISHED for r in reqs.values())


def test_scheduler_chunks_a_long_prompt_within_the_budget():
    alloc = BlockAllocator(64)
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, allocator=alloc)
    req = Request(0, list(range(40)), SamplingParams(max_tokens=2))
    sched.add(req)
    chunks = []
    while req.num_computed_tokens < 40:
        step = sched.schedule()
        chunks.append(step.num_scheduled[0])
        req.num_computed_tokens += step.num_scheduled[0]
    assert chunks == [16, 16, 8]


# ---- LLM: bad input, and the engine keeps serving -------------------------------------------

NUM_KV_BLOCKS = 12           # 11 usable blocks of 4 tokens: 44 tokens per request at most
GOOD_PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20]]
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return graphrt.LLM(str(tiny_hf_model_dir("qwen3")), backend="eager", max_num_seqs=4,
                       max_num_batched_tokens=32, max_model_len=64, block_size=4,
                       num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture(scope="module")
def reference(llm):
    return [o.token_ids for o in llm.generate(GOOD_PROMPTS, PARAMS)]


BAD_PROMPTS = {
    "empty prompt": ([], PARAMS, "empty prompt"),
    "longer than max_model_len": (list(range(3, 73)), PARAMS, "prompt of 70 tokens"),
    "exactly max_model_len": ([3] * 64, PARAMS, "max_model_len=64"),
    "token id out of vocabulary": ([5, 128, 7], PARAMS, "token id 128 outside the vocabulary [0, 128)"),
    "negative token id": ([5, -1], PARAMS, "token id -1 outside the vocabulary"),
    "float token ids": ([5.0, 6.0], PARAMS, "must be integers"),
    "more KV than the cache holds": ([3] * 40, SamplingParams(max_tokens=10),
                                     "needs 13 KV blocks for 50 tokens but the cache holds 11"),
}


@pytest.mark.parametrize("kind", list(BAD_PROMPTS))
def test_bad_prompt_raises_naming_its_index_and_the_engine_keeps_serving(llm, reference, kind):
    prompt, params, fragment = BAD_PROMPTS[kind]
    prompts = [GOOD_PROMPTS[0], prompt, GOOD_PROMPTS[1]]
    with pytest.raises(InputError) as err:
        llm.generate(prompts, params)
    assert isinstance(err.value, ValueError)
    assert err.value.field == "prompt_token_ids[1]"
    assert str(err.value).startswith("prompt_token_ids[1]: ") and fragment in str(err.value), str(err.value)
    assert not llm.has_unfinished(), "a prompt of the rejected batch was queued"
    assert [o.token_ids for o in llm.generate(GOOD_PROMPTS, PARAMS)] == reference


def test_max_tokens_below_one_is_rejected_by_sampling_params():
    for bad in (0, -3):
        with pytest.raises(InputError, match="max_tokens: must be >= 1"):
            SamplingParams(max_tokens=bad)


@pytest.mark.parametrize("kwargs, field", [({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                           ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k"),
                                           ({"top_k": -2}, "top_k")])
def test_other_bad_sampling_params(kwargs, field):
    with pytest.raises(InputError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field


def test_generate_rejects_mismatched_params_and_wrong_types(llm, reference):
    with pytest.raises(InputError, match="2 params for 3 prompts"):
        llm.generate(GOOD_PROMPTS, [PARAMS, PARAMS])
    with pytest.raises(InputError, match="expected graphrt.SamplingParams"):
        llm.generate(GOOD_PROMPTS, [PARAMS, {"max_tokens": 4}, PARAMS])
    assert not llm.has_unfinished()
    assert [o.token_ids for o in llm.generate(GOOD_PROMPTS, PARAMS)] == reference


def test_in_flight_requests_continue_after_a_bad_add_request(llm, reference):
    ids = [llm.add_request(p, PARAMS) for p in GOOD_PROMPTS]
    finished = {}
    for o in llm.step():                           # prefill (and first token) of all three
        finished[o.request_id] = o
    for bad in ([], [7, 999], [3] * 40):
        with pytest.raises(InputError, match=r"^prompt_token_ids: "):
            llm.add_request(bad, SamplingParams(max_tokens=10))
    assert len(llm.scheduler.waiting) + len(llm.scheduler.running) == len(ids) - len(finished)
    late = llm.add_request(GOOD_PROMPTS[2], PARAMS)   # a good request joins mid-flight
    while llm.has_unfinished():
        for o in llm.step():
            finished[o.request_id] = o
    assert [finished[i].token_ids for i in ids] == reference
    assert finished[late].token_ids == reference[2]
    assert llm.allocator.num_free == llm.allocator.capacity


def test_llm_finishes_a_workload_that_used_to_livelock():
    """The scheduler livelock above, through graphrt.LLM (bounded: a regression fails, not hangs)."""
    llm = graphrt.LLM(str(tiny_hf_model_dir("qwen3")), backend="eager", max_num_seqs=2,
                      max_num_batched_tokens=2, max_model_len=64, block_size=1, num_kv_blocks=32,
                      schedule_conservativeness=0.0)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (4, 1, 3)]
    ids = [llm.add_request(p, sp) for p, sp in zip([[5], [6], list(range(3, 31))], params)]
    done = {}
    for _ in range(300):
        done.update((o.request_id, o) for o in llm.step())
        if not llm.has_unfinished():
            break
    assert not llm.has_unfinished(), "the engine stopped making progress"
    assert [len(done[i].token_ids) for i in ids] == [4, 1, 3]
    assert llm.stats["preemptions"] > 0
