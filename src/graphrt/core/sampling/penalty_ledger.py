"""Which device row holds each penalised request's token counts, and what a step adds to them.

A backend keeps per-row output counts and prompt-or-output flags as ``[slots + 1, vocab]``
buffers (row 0 stays zero for rows without penalties); this host ledger lends each penalised
request a row and says what each step folds in, without a per-token loop: every scheduled
token (by position: prompt or output; a position folded before is skipped), a request's tokens
before its first scheduled position once from the host table, zeros for a new row. When every
row is lent the least recently used request outside the step loses its row. An engine that
rewinds a request to other tokens frees it first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class PenaltyStep:
    """What one step adds to the device counts (views of the ledger's persistent arrays)."""

    row_slots: np.ndarray      # int64 [rows]: each sampler row's device row (0: none)
    reset: np.ndarray          # int64: device rows to zero before anything is added
    host_index: np.ndarray     # int64: ``slot * vocab + token`` of host-table tokens to add
    host_output: np.ndarray    # float32: 1 where such a token is an output token
    token_base: np.ndarray     # int64 [num_tokens]: ``slot * vocab`` per scheduled token (0: skip)
    token_output: np.ndarray   # float32 [num_tokens]: 1 where the token counts as output
    token_seen: np.ndarray     # float32 [num_tokens]: 1 where the token is folded in at all


class PenaltyLedger:
    """Device rows 1..``num_slots`` for penalised requests, and the positions each has folded in."""

    def __init__(self, num_slots: int, vocab_size: int, max_tokens: int, max_reqs: int) -> None:
        self.vocab_size = vocab_size
        self._slot: OrderedDict[int, int] = OrderedDict()      # request id -> row, least recent first
        self._free = list(range(num_slots, 0, -1))
        self._seen = np.zeros(num_slots + 1, np.int64)          # positions folded in, per row
        self._row_slots = np.zeros(max_reqs, np.int64)
        self._base = np.zeros(max_tokens, np.int64)
        self._weights = np.zeros((2, max_tokens), np.float32)   # output, seen

    def plan(self, sampling: Any, token_ids: np.ndarray, req_rows: np.ndarray, num_computed: np.ndarray,
             num_scheduled: np.ndarray, rows: int) -> PenaltyStep:
        """The step of a penalised ``sampling`` batch (``penalties`` and ``prompt_lens`` set) over
        ``rows`` padded sampler rows; the arrays are the runner's, checked."""
        n, vocab = sampling.num_reqs, self.vocab_size
        rep, pres, freq = sampling.penalties
        active = (rep != 1.0) | (pres != 0.0) | (freq != 0.0)
        ids = sampling.request_ids
        slots = self._row_slots[:rows]
        slots[:] = 0
        reset = []
        stepping = {ids[i] for i in np.flatnonzero(active)}
        for i in np.flatnonzero(active):                # one per request, not per token
            rid = ids[i]
            slot = self._slot.get(rid)
            if slot is None:
                slot = self._slot[rid] = self._take(stepping)
                self._seen[slot] = 0
                reset.append(slot)
            self._slot.move_to_end(rid)
            slots[i] = slot
        computed = np.asarray(num_computed[:n], np.int64)
        scheduled = np.asarray(num_scheduled[:n], np.int64)
        prompt = sampling.prompt_lens
        seen = np.where(active, self._seen[slots[:n]], 0)
        host_index, host_output = self._catch_up(np.flatnonzero(active & (seen < computed)), slots, seen,
                                                 computed, prompt, token_ids, req_rows)
        seen = np.maximum(seen, np.where(active, computed, 0))
        t = int(scheduled.sum())
        req = np.repeat(np.arange(n), scheduled)
        pos = computed[req] + np.arange(t) - (np.cumsum(scheduled) - scheduled)[req]
        take = active[req] & (pos >= seen[req])
        base, weights = self._base[:t], self._weights[:, :t]
        np.multiply(np.where(take, slots[req], 0), vocab, out=base)
        weights[0] = take & (pos >= prompt[req])
        weights[1] = take
        self._seen[slots[:n][active]] = np.maximum(seen, computed + scheduled)[active]
        return PenaltyStep(slots, np.array(reset, np.int64), host_index, host_output, base, weights[0], weights[1])

    def _catch_up(self, catch: np.ndarray, slots: np.ndarray, seen: np.ndarray, computed: np.ndarray,
                  prompt: np.ndarray, token_ids: np.ndarray, req_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Host-table tokens of the positions ``seen[i]..computed[i]`` of each row in ``catch``."""
        if not len(catch):
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        index, output = [], []
        for i in catch:                                  # rare: a request's first step after a cache hit
            positions = np.arange(seen[i], computed[i])
            tokens = np.clip(token_ids[req_rows[i], positions].astype(np.int64), 0, self.vocab_size - 1)
            index.append(slots[i] * self.vocab_size + tokens)
            output.append((positions >= prompt[i]).astype(np.float32))
        return np.concatenate(index), np.concatenate(output)

    def _take(self, stepping: set) -> int:
        """A free row, or the least recently used one of a request not in the step."""
        if self._free:
            return self._free.pop()
        victim = next(rid for rid in self._slot if rid not in stepping)
        return self._slot.pop(victim)

    def free(self, request_id: int) -> None:
        """Return a finished request's row."""
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)


__all__ = ["PenaltyLedger", "PenaltyStep"]
