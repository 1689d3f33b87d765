"""The numpy path of input preparation: vectorised numpy on persistent scratch, no per-token
Python loop.

It is the reference the compiled loops of :mod:`graphrt.core.host_loops` are tested against,
and the fallback where numba is missing. :class:`NumpyPrepare` is called exactly like
``host_loops.prepare_step`` and returns the same codes (:mod:`graphrt.core.step_codes`), so
:class:`graphrt.InputPreparer` drives both the same way.
"""

from __future__ import annotations

import numpy as np

from graphrt.core import defaults
from graphrt.core import step_codes as codes

_Result = tuple[int, int, int, int]


class NumpyPrepare:
    """``host_loops.prepare_step`` in vectorised numpy, with its own persistent scratch.

    Request-level values are copied into one int64 ``[4, R]`` buffer (computed, rows,
    scheduled, seq_lens) so every request bound is checked with two reductions; index
    arithmetic is int64 (numpy's index type) and gathers use ``mode="clip"`` on validated
    indices. Tables must be int32 (the gathers write int32 scratch).
    """

    def __init__(self, max_num_tokens: int, max_num_reqs: int) -> None:
        t, r = max_num_tokens, max_num_reqs
        self.max_num_reqs = r
        self.arange = np.arange(max(t, r + 1), dtype=np.int64)
        self.req = np.zeros((4, r), dtype=np.int64)      # computed, rows, scheduled, seq_lens
        self.cu = np.zeros(r, dtype=np.int64)
        self.off = np.zeros(r, dtype=np.int64)
        self.pos = np.zeros(t, dtype=np.int64)           # position of each token
        self.idx = np.zeros(t, dtype=np.int64)           # flat block-table indices
        self.tok_idx = np.zeros(t, dtype=np.int64)       # flat token-table indices
        self.row_base = np.zeros((2, r), dtype=np.int64)  # rows * width, rows * max_model_len
        self.col = np.zeros(t, dtype=np.int64)           # block column / block offset
        self.blk = np.zeros(t, dtype=np.int32)           # physical block of each token
        self.ids = np.zeros(t, dtype=np.int32)           # gathered token ids, checked before output
        self._rows = np.zeros((r, 0), dtype=np.int32)    # gathered block-table rows

    def __call__(self, token_ids: np.ndarray, block_table: np.ndarray, rows_in: np.ndarray,
                 computed_in: np.ndarray, scheduled_in: np.ndarray, bs: int, max_tokens: int,
                 vocab_size: int, num_blocks: int, row_mark: np.ndarray, stamp: int,
                 input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
                 query_start_loc: np.ndarray, seq_lens: np.ndarray, num_computed: np.ndarray,
                 block_table_out: np.ndarray) -> _Result:
        """Check one step and, when every check passes, write it into the outputs:
        ``(E_OK, num_tokens, max_query_len, max_seq_len)`` or ``(code, detail, 0, 0)`` with
        nothing written. ``vocab_size`` / ``num_blocks`` <= 0 skip those two checks."""
        ok = codes.E_OK
        r = rows_in.shape[0]
        req = self.req[:, :r]
        computed, rows, scheduled, seq = req
        computed[:] = computed_in
        rows[:] = rows_in
        scheduled[:] = scheduled_in
        np.add(computed, scheduled, out=seq)
        code, detail, max_sched, max_seq = self.check_requests(token_ids, block_table, req, bs)
        if code != ok:
            return code, detail, 0, 0
        mark = row_mark[:token_ids.shape[0]]
        mark[rows] = stamp
        if np.count_nonzero(mark == stamp) != r:
            repeat = np.ones(r, dtype=bool)
            repeat[np.unique(rows, return_index=True)[1]] = False
            return codes.E_ROW_REPEATED, int(np.flatnonzero(repeat)[0]), 0, 0
        width, model_len = block_table.shape[1], token_ids.shape[1]
        row_blk, row_tok = self.row_base[0, :r], self.row_base[1, :r]
        np.multiply(rows, width, out=row_blk)         # flat offset of each row in block_table
        np.multiply(rows, model_len, out=row_tok)     # flat offset of each row in token_ids
        if max_sched == 1:                 # decode: token i is request i, at position computed[i]
            t = r
            if t > max_tokens:
                return codes.E_TOO_MANY_TOKENS, t, 0, 0
            pos, idx, col, blk = computed, self.idx[:t], self.col[:t], self.blk[:t]
            np.copyto(idx, row_blk)
            tok_idx = self.tok_idx[:t]
            np.add(row_tok, pos, out=tok_idx)
        else:                              # spread per-request values over each request's tokens
            cu = self.cu[:r]
            np.cumsum(scheduled, out=cu)
            t = int(cu[-1])
            if t > max_tokens:
                return codes.E_TOO_MANY_TOKENS, t, 0, 0
            pos, col, blk = self.pos[:t], self.col[:t], self.blk[:t]
            off = self.off[:r]             # position minus token index, per request
            np.subtract(seq, cu, out=off)
            arange = self.arange[:t]
            np.add(arange, np.repeat(off, scheduled), out=pos)
            np.add(row_tok, off, out=row_tok)
            tok_idx = self.tok_idx[:t]
            np.add(arange, np.repeat(row_tok, scheduled), out=tok_idx)
            idx = np.repeat(row_blk, scheduled)   # np.repeat has no out=: one temporary per mixed step
        pow2 = bs & (bs - 1) == 0
        if pow2:
            np.right_shift(pos, bs.bit_length() - 1, out=col)
        else:
            np.floor_divide(pos, bs, out=col)
        np.add(idx, col, out=idx)
        np.take(block_table.reshape(-1), idx, out=blk, mode="clip")
        if blk.min() <= defaults.NULL_BLOCK:
            return codes.E_NULL_BLOCK, int(np.flatnonzero(blk <= defaults.NULL_BLOCK)[0]), 0, 0
        # With a bound to check, gather into scratch first: outputs stay untouched on error.
        ids = self.ids[:t] if vocab_size > 0 else input_ids[:t]
        np.take(token_ids.reshape(-1), tok_idx, out=ids, mode="clip")
        if vocab_size > 0 and (ids.min() < 0 or ids.max() >= vocab_size):
            bad = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
            return codes.E_TOKEN_OUT_OF_VOCAB, bad, 0, 0
        bt_rows = self.block_rows(width)[:r] if num_blocks > 0 else block_table_out[:r]
        np.take(block_table, rows, axis=0, out=bt_rows, mode="clip")
        if num_blocks > 0:
            top = int(bt_rows.max())
            if top >= num_blocks:
                return codes.E_BLOCK_OUT_OF_CACHE, top, 0, 0

        # All checks passed: write the outputs.
        if vocab_size > 0:
            input_ids[:t] = ids
        if num_blocks > 0:
            block_table_out[:r] = bt_rows
        positions[:t] = pos
        slots = slot_mapping[:t]
        np.multiply(blk, bs, out=slots)
        if pow2:
            np.bitwise_and(pos, bs - 1, out=col)
        else:
            np.multiply(col, bs, out=col)
            np.subtract(pos, col, out=col)
        np.add(slots, col, out=slots)
        qsl = query_start_loc[:r + 1]
        if max_sched == 1:
            qsl[:] = self.arange[:r + 1]
        else:
            qsl[0] = 0
            qsl[1:] = cu
        seq_lens[:r] = seq
        num_computed[:r] = computed
        return ok, t, max_sched, max_seq

    @staticmethod
    def check_requests(token_ids: np.ndarray, block_table: np.ndarray, req: np.ndarray,
                       bs: int) -> _Result:
        """``host_loops.check_requests`` in two reductions over ``req`` (computed, rows,
        scheduled, seq_lens): ``(E_OK, 0, max_query_len, max_seq_len)`` or ``(code, detail, 0, 0)``."""
        computed, rows, scheduled, seq = req
        min_computed, min_row, min_sched = req[:3].min(axis=1).tolist()
        max_row, max_sched, max_seq = req[1:].max(axis=1).tolist()
        num_rows = token_ids.shape[0]
        if min_row < 0 or max_row >= num_rows:
            return codes.E_ROW_OUT_OF_RANGE, int(np.flatnonzero((rows < 0) | (rows >= num_rows))[0]), 0, 0
        if min_sched <= 0:
            return codes.E_SCHEDULED_NOT_POSITIVE, int(np.argmin(scheduled)), 0, 0
        if min_computed < 0:
            return codes.E_COMPUTED_NEGATIVE, int(np.argmin(computed)), 0, 0
        if max_seq > token_ids.shape[1]:
            return codes.E_PAST_TOKEN_TABLE, int(np.argmax(seq)), 0, 0
        if -(-max_seq // bs) > block_table.shape[1]:
            return codes.E_TABLE_TOO_NARROW, int(np.argmax(seq)), 0, 0
        return codes.E_OK, 0, max_sched, max_seq

    def block_rows(self, width: int) -> np.ndarray:
        """Scratch for the scheduled block-table rows (reallocated when the width changes)."""
        if self._rows.shape[1] != width:
            self._rows = np.zeros((self.max_num_reqs, width), dtype=np.int32)
        return self._rows
