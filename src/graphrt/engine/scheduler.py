"""Continuous-batching scheduler (SGLang's waiting queue and running batch, vLLM's token budget).

Each step: prefills first (continuing chunked prefills, then waiting requests in arrival
order), then decodes, all within ``max_num_batched_tokens`` tokens and ``max_num_seqs``
requests. A prompt longer than the remaining budget is prefilled in chunks. When a
running request needs a block and none is free, the most recently admitted request is
preempted: its blocks are freed and it is recomputed later (its generated tokens become
part of what it re-prefills).
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field

from graphrt.engine.block_allocator import BlockAllocator
from graphrt.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One generation request and its progress."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    row: int = -1
    finish_reason: str | None = None
    num_preemptions: int = 0
    tokens_in_row: int = 0   # tokens already written to the engine's token table at ``row``
    blocks_in_row: int = 0   # blocks already written to the engine's block table at ``row``

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """Known tokens whose KV is not computed yet."""
        return self.num_tokens - self.num_computed_tokens

    def tokens(self, start: int, end: int) -> list[int]:
        """Known token ids ``[start, end)`` (prompt, then generated)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]


@dataclass
class ScheduledStep:
    """The requests of one step and how many tokens each computes."""

    requests: list[Request]
    num_scheduled: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    """Waiting queue, running batch, token budget, chunked prefill, preemption."""

    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, block_size: int,
                 allocator: BlockAllocator) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.allocator = allocator
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0
        self.num_recomputed = 0    # requests requeued because their KV was lost
        self._budget = 0
        self._preempted_now: set[int] = set()   # request ids preempted in the current step

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_for(self, req: Request, num_new: int) -> int:
        """Additional blocks ``req`` needs to hold ``num_new`` more tokens."""
        total = -(-(req.num_computed_tokens + num_new) // self.block_size)
        return max(total - len(req.blocks), 0)

    def _grow(self, req: Request, num_new: int) -> bool:
        extra = self._blocks_for(req, num_new)
        if extra == 0:
            return True
        got = self.allocator.allocate(extra)
        if got is None:
            return False
        req.blocks.extend(got)
        return True

    def _release(self, req: Request) -> None:
        self.allocator.free(req.blocks)
        req.blocks = []
        if req.row >= 0:
            self._free_rows.append(req.row)
            req.row = -1
        req.tokens_in_row = req.blocks_in_row = 0

    def _preempt(self, victim: Request) -> None:
        """Free a running request's KV; it re-prefills everything it knows later."""
        self.running.remove(victim)
        self._release(victim)
        victim.status = Status.WAITING
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        self._preempted_now.add(victim.request_id)

    def schedule(self) -> ScheduledStep:
        """The next step: continuing prefills, new prefills, then decodes, within the budgets."""
        self._budget = self.max_num_batched_tokens
        self._preempted_now.clear()
        step: dict[int, tuple[Request, int]] = {}
        for req in [r for r in self.running if r.num_pending > 1]:
            self._schedule_running(req, step)
        while self.waiting and self._budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.request_id in self._preempted_now:
                # Preempted this step for want of blocks: re-admitting it now would take back
                # the blocks and the budget the running requests need; a prefill preempting
                # itself would then starve the decodes holding the rest forever (livelock).
                break
            n = min(req.num_pending, self._budget)
            if not self._grow(req, n):
                break  # admission never preempts
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.row = self._free_rows.pop()
            self.running.append(req)
            step[req.request_id] = (req, n)
            self._budget -= n
        for req in [r for r in self.running if r.num_pending == 1 and r.request_id not in step]:
            self._schedule_running(req, step)
        return ScheduledStep([r for r, _ in step.values()], [n for _, n in step.values()])

    def _schedule_running(self, req: Request, step: dict[int, tuple[Request, int]]) -> None:
        """Give a running request its tokens, preempting the newest requests for blocks."""
        if self._budget == 0 or req.status is not Status.RUNNING:
            return
        n = min(req.num_pending, self._budget)
        while not self._grow(req, n):
            victim = self.running[-1]
            taken = step.pop(victim.request_id, None)
            if taken is not None:
                self._budget += taken[1]
            self._preempt(victim)
            if victim is req:
                return
            n = min(req.num_pending, self._budget)
        step[req.request_id] = (req, n)
        self._budget -= n

    def finish(self, req: Request, reason: str) -> None:
        """Mark ``req`` finished -- running or still waiting (an abort) -- and release its row
        and blocks. Finishing a finished request does nothing."""
        if req.status is Status.FINISHED:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self._release(req)

    def requeue(self, requests: list[Request]) -> None:
        """Requests whose computed KV was lost (not for want of blocks): free their blocks and
        rows and recompute them first, in their current order, like a preemption."""
        for req in reversed(requests):
            self.running.remove(req)
            self._release(req)
            req.status = Status.WAITING
            req.num_computed_tokens = 0
            self.waiting.appendleft(req)
        self.num_recomputed += len(requests)
