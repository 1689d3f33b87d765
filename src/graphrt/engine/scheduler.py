"""Continuous-batching scheduler (SGLang's waiting queue and running batch, vLLM's token budget).

Each step: continuing prefills, then waiting requests in policy order (admission as SGLang's
``PrefillAdder``, the last one chunked), then decodes, within ``max_num_batched_tokens`` and
``max_num_seqs``. When a running request needs a block and none is free, the most recently
admitted request is preempted and later recomputed.
"""

from __future__ import annotations

import collections
import math
import numbers
from dataclasses import dataclass

from graphrt.core import defaults
from graphrt.core.errors import InputError
from graphrt.engine.block_allocator import BlockAllocator
from graphrt.engine.prefix_cache import Match, PrefixCache, block_keys
from graphrt.engine.request import Request, Status
from graphrt.engine.schedule_policy import SchedulePolicy
from graphrt.core.kv_spec import blocks_for


@dataclass
class ScheduledStep:
    """The requests of one step and their token counts: one-token decodes, and prefill work
    (new requests, chunks, recomputation) with its tokens."""

    requests: list[Request]
    num_scheduled: list[int]
    num_decodes: int = 0
    num_prefill_reqs: int = 0
    num_prefill_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled)

    def __len__(self) -> int:
        return len(self.requests)


def check_conservativeness(value: float) -> None:
    """Refuse a ``schedule_conservativeness`` that is not a finite number >= 0 (an int or a
    float; a bool or a string is not): InputError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (value >= 0 and math.isfinite(value)):
        raise InputError("schedule_conservativeness", f"must be a finite number >= 0, got {value!r}")


class Scheduler:
    """Waiting queue, running batch, token budget, chunked prefill, preemption, prefix cache."""

    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, block_size: int,
                 allocator: BlockAllocator, prefix_cache: PrefixCache | None = None,
                 schedule_policy: str = defaults.DEFAULT_SCHEDULE_POLICY,
                 schedule_conservativeness: float = defaults.DEFAULT_SCHEDULE_CONSERVATIVENESS,
                 clip_max_new_tokens: int = defaults.CLIP_MAX_NEW_TOKENS_ESTIMATION,
                 seed: int | None = defaults.SCHEDULE_RANDOM_SEED, num_state_slots: int | None = None) -> None:
        check_conservativeness(schedule_conservativeness)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.policy = SchedulePolicy(schedule_policy, prefix_cache, seed=seed)
        self.conservativeness = float(schedule_conservativeness)
        self.clip_max_new_tokens = clip_max_new_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        # Recurrent-state slots (hybrid models): one per running request, taken back with its
        # row, so a preempted request restarts from an empty state.
        self._free_slots = list(range(num_state_slots - 1, -1, -1)) if num_state_slots else None
        self.num_preemptions = 0
        self.num_recomputed = 0    # requests requeued because their KV was lost
        self.num_cached_tokens = 0     # tokens admitted from the prefix cache
        self.num_prefill_tokens = 0    # tokens scheduled other than one-token decodes
        self.num_decode_tokens = 0
        self.num_decode_steps = 0      # steps with one-token decodes (the engine's decode log lines)
        self._budget = 0
        self._rem_kv: int | None = None      # admission's estimated KV tokens left (c > 0)
        self._preempted_now: set[int] = set()   # request ids preempted in the current step

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow(self, req: Request, num_new: int) -> bool:
        """Give ``req`` the blocks it lacks to hold ``num_new`` more tokens; False if none are free."""
        extra = -(-(req.num_computed_tokens + num_new) // self.block_size) - len(req.blocks)   # blocks_for, inline: every step
        if extra <= 0:
            return True
        got = self.allocator.allocate(extra)
        if got is None:
            return False
        req.blocks.extend(got)
        return True

    # ---- prefix cache ---------------------------------------------------------------
    def keys(self, req: Request, num_blocks: int) -> list[bytes]:
        """The keys of ``req``'s first ``num_blocks`` full blocks (computed once, kept)."""
        have = len(req.block_keys)
        if have < num_blocks:
            bs = self.block_size
            req.block_keys.extend(block_keys(req.tokens(have * bs, num_blocks * bs), bs, num_blocks - have))
        return req.block_keys[:num_blocks]

    def match(self, req: Request, touch: bool = False) -> Match:
        """``req``'s longest cached prefix (capped: its last token is always computed)."""
        cache = self.prefix_cache
        assert cache is not None
        if req.prompt_logprobs is not None:     # it computes every prompt position (vLLM skips it too)
            return cache.match_keys([], touch=touch)
        return cache.match_keys(self.keys(req, cache.max_match_blocks(req.num_tokens)), touch=touch)

    def cache_computed(self, req: Request) -> None:
        """Insert ``req``'s newly full computed blocks into the prefix cache (SGLang's
        cache_unfinished_req); where the tree has the same tokens, ``req`` takes the tree's block
        and frees its copy (its block-table row is rewritten before its next step)."""
        cache = self.prefix_cache
        if cache is None or req.cache_private:
            return
        full = req.num_computed_tokens // self.block_size
        start = req.cached_blocks
        if full <= start:
            return
        if req.cache_node is None or req.cache_epoch != cache.epoch:
            req.cache_private = True     # the tree was reset under it: its blocks stay its own
            return
        node, path = cache.insert(req.cache_node, self.keys(req, full)[start:], req.blocks[start:full])
        swaps = [(i, b) for i, b in enumerate(path, start) if b != req.blocks[i]]
        if swaps:
            self.allocator.share([b for _, b in swaps])
            self.allocator.free([req.blocks[i] for i, _ in swaps])
            for i, b in swaps:
                req.blocks[i] = b
            req.blocks_in_row = 0       # rewrite the whole row
        req.cache_node, req.cached_blocks = node, full

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (the KV contents are gone, or a caller asked)."""
        if self.prefix_cache is not None:
            self.prefix_cache.reset()

    # ---- releasing ------------------------------------------------------------------
    def _release(self, req: Request, *, cache: bool) -> None:
        """Free ``req``'s row and its block references; ``cache``: its computed full blocks
        stay cached (its KV is valid)."""
        if cache:
            self.cache_computed(req)
        self.allocator.free(req.blocks)
        req.blocks = []
        if req.row >= 0:
            self._free_rows.append(req.row)
            req.row = -1
        if req.state_slot >= 0:
            self._free_slots.append(req.state_slot)
            req.state_slot = -1
        req.tokens_in_row = req.blocks_in_row = 0
        req.cache_node, req.cached_blocks, req.cache_private = None, 0, False

    def _preempt(self, victim: Request) -> None:
        """Free a running request's KV; it re-prefills everything it knows later."""
        self.running.remove(victim)
        self._release(victim, cache=True)
        victim.status = Status.WAITING
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        self._preempted_now.add(victim.request_id)

    # ---- scheduling -----------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        """The next step: continuing prefills, new prefills, then decodes, within the budgets."""
        self._budget = self.max_num_batched_tokens
        self._preempted_now.clear()
        step: dict[int, tuple[Request, int]] = {}
        decodes = []
        for req in list(self.running):          # continuing prefills first; decodes after admission
            pending = req.num_tokens - req.num_computed_tokens
            if pending > 1:
                self._schedule_running(req, step)
            elif pending == 1:
                decodes.append(req)
        # A request preempted this step goes back to the front; admitting now would take the
        # blocks the running requests need (a prefill preempting itself: livelock).
        if self.waiting and self._budget > 0 and not self._preempted_now:
            self._admit(step)
        for req in decodes:
            if req.request_id not in step:
                self._schedule_running(req, step)
        out = ScheduledStep([], [])
        for req, n in step.values():
            out.requests.append(req)
            out.num_scheduled.append(n)
            if n == 1 and req.num_computed_tokens + 1 == req.num_tokens and req.output_token_ids:
                out.num_decodes += 1
            else:
                out.num_prefill_reqs += 1
                out.num_prefill_tokens += n
        self.num_decode_tokens += out.num_decodes
        self.num_decode_steps += out.num_decodes > 0
        self.num_prefill_tokens += out.num_prefill_tokens
        return out

    def _admit(self, step: dict[int, tuple[Request, int]]) -> None:
        """Admit waiting requests in policy order while the budgets allow (PrefillAdder)."""
        fcfs = self.policy.active == "fcfs"
        order = self.waiting if fcfs else self.policy.order(self.waiting, self.match, self.keys)
        self._rem_kv = self._remaining_kv() if self.conservativeness > 0 else None
        admitted: list[Request] = []
        for req in order:
            if self._budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            n = self._admit_one(req)
            if n is None:
                break  # admission never preempts
            admitted.append(req)
            step[req.request_id] = (req, n)
            self._budget -= n
        if fcfs:
            for _ in admitted:
                self.waiting.popleft()
        elif admitted:
            ids = {r.request_id for r in admitted}
            self.waiting = collections.deque(r for r in self.waiting if r.request_id not in ids)

    def _estimate_out(self, req: Request) -> int:
        """Output tokens admission reserves for ``req``: c * min(max_tokens left, clip)."""
        left = max(req.params.max_tokens - len(req.output_token_ids), 0)
        return math.ceil(self.conservativeness * min(left, self.clip_max_new_tokens))

    def _remaining_kv(self) -> int:
        """Free KV tokens (cached idle blocks included) less the running requests' estimates."""
        rem = self.allocator.num_free * self.block_size
        for r in self.running:
            rem -= max(r.num_tokens + self._estimate_out(r) - len(r.blocks) * self.block_size, 0)
        return rem

    def _admit_one(self, req: Request) -> int | None:
        """Start ``req`` from its cached prefix with its first chunk; None if it cannot run now
        (then it holds nothing)."""
        match = self.match(req, touch=True) if self.prefix_cache is not None else None
        cached = match.num_blocks * self.block_size if match is not None else 0
        extend = req.num_tokens - cached
        if self._rem_kv is not None:
            need = blocks_for(extend, self.block_size) * self.block_size + self._estimate_out(req)
            if need > self._rem_kv and self.running:
                return None   # with nothing running, the head runs whatever the estimate
            self._rem_kv -= need
        n = min(extend, self._budget)
        shared = match.blocks if match is not None else []
        self.allocator.share(shared)
        req.blocks, req.num_computed_tokens = list(shared), cached
        try:
            ok = self._grow(req, n)
        except BaseException:
            ok = False
            raise
        finally:
            if not ok:
                self.allocator.free(req.blocks)
                req.blocks, req.num_computed_tokens = [], 0
        if not ok:
            return None
        if match is not None:
            req.cache_node, req.cache_epoch = match.node, self.prefix_cache.epoch
            req.cached_blocks, req.cache_private = match.num_blocks, False
        req.num_cached_tokens += cached
        self.num_cached_tokens += cached
        req.status = Status.RUNNING
        req.row = self._free_rows.pop()
        if self._free_slots is not None:
            req.state_slot = self._free_slots.pop()
        self.running.append(req)
        return n

    def _schedule_running(self, req: Request, step: dict[int, tuple[Request, int]]) -> None:
        """Give a running request its tokens, preempting the newest requests for blocks."""
        if self._budget == 0 or req.status is not Status.RUNNING or req.retiring:
            return
        n = min(req.num_tokens - req.num_computed_tokens, self._budget)
        while not self._grow(req, n):
            victim = self.running[-1]
            taken = step.pop(victim.request_id, None)
            if taken is not None:
                self._budget += taken[1]
            self._preempt(victim)
            if victim is req:
                return
            n = min(req.num_tokens - req.num_computed_tokens, self._budget)
        step[req.request_id] = (req, n)
        self._budget -= n

    def finish(self, req: Request, reason: str) -> None:
        """Mark ``req`` finished (running or waiting) and release its row and blocks; its full
        blocks stay cached unless it failed ("error"). Idempotent."""
        if req.status is Status.FINISHED:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self._release(req, cache=reason != "error")

    def requeue(self, requests: list[Request]) -> None:
        """Requeue requests whose KV was lost: free blocks and rows, recompute them first, in
        order; nothing cached (the caller resets the prefix cache)."""
        for req in reversed(requests):
            self.running.remove(req)
            self._release(req, cache=False)
            req.status = Status.WAITING
            req.num_computed_tokens = 0
            self.waiting.appendleft(req)
        self.num_recomputed += len(requests)
