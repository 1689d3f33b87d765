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
from graphrt.core.fields import INDEX_MAX

_Result = tuple[int, int, int, int]


class NumpyPrepare:
    """``host_loops.prepare_step`` in vectorised numpy, with its own persistent scratch.

    Request-level values are copied into one int64 ``[4, R]`` buffer (computed, rows,
    scheduled, seq_lens), clamped to the int32 range first as the compiled loops do (so no
    sum overflows), and every request bound is checked with a few reductions; index
    arithmetic is int64 (numpy's index type) and gathers use ``mode="clip"`` on validated
    indices. Tables are int32 or int64, C-contiguous; values read from them are checked in
    scratch of their own dtype before anything is narrowed into the int32 outputs.
    """

    def __init__(self, max_num_tokens: int, max_num_reqs: int) -> None:
        t, r = max_num_tokens, max_num_reqs
        self.max_num_tokens = t
        self.max_num_reqs = r
        self.arange = np.arange(max(t, r + 1), dtype=np.int64)
        self.req = np.zeros((4, r), dtype=np.int64)      # computed, rows, scheduled, seq_lens
        self.cu = np.zeros(r, dtype=np.int64)
        self.off = np.zeros(r, dtype=np.int64)
        self.first = np.zeros(r, dtype=np.int64)         # each row's first column holding a null block
        self.read = np.zeros(r, dtype=bool)
        self.pos = np.zeros(t, dtype=np.int64)           # position of each token
        self.idx = np.zeros(t, dtype=np.int64)           # flat block-table indices
        self.tok_idx = np.zeros(t, dtype=np.int64)       # flat token-table indices
        self.row_base = np.zeros((2, r), dtype=np.int64)  # rows * width, rows * max_model_len
        self.col = np.zeros(t, dtype=np.int64)           # block column / block offset
        self._scratch_key: tuple | None = None
        self._scratch: tuple[np.ndarray, ...] = ()

    def __call__(self, token_ids: np.ndarray, block_table: np.ndarray, rows_in: np.ndarray,
                 computed_in: np.ndarray, scheduled_in: np.ndarray, bs: int, max_tokens: int,
                 vocab_size: int, num_blocks: int, row_mark: np.ndarray, stamp: int,
                 input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
                 query_start_loc: np.ndarray, seq_lens: np.ndarray, num_computed: np.ndarray,
                 block_table_out: np.ndarray) -> _Result:
        """Check one step and, when every check passes, write it into the outputs:
        ``(E_OK, num_tokens, max_query_len, max_seq_len)`` or ``(code, detail, 0, 0)`` with
        nothing written. ``vocab_size`` / ``num_blocks`` must be > 0."""
        ok = codes.E_OK
        r = rows_in.shape[0]
        req = self.req[:, :r]
        computed, rows, scheduled, seq = req
        computed[:] = computed_in
        rows[:] = rows_in
        scheduled[:] = scheduled_in
        np.add(computed, scheduled, out=seq)
        lows, highs = req.min(axis=1).tolist(), req.max(axis=1).tolist()
        if min(lows[:3]) < -INDEX_MAX - 1 or max(highs[:3]) > INDEX_MAX:   # bound each operand to
            head = req[:3]                           # the int32 range first, as the loops do: then
            np.maximum(head, -INDEX_MAX - 1, out=head)   # no sum overflows (seq may have)
            np.minimum(head, INDEX_MAX, out=head)
            np.add(computed, scheduled, out=seq)
            lows, highs = req.min(axis=1).tolist(), req.max(axis=1).tolist()
        code, detail, max_sched, max_seq = self.check_requests(token_ids, block_table, req, bs, lows, highs)
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
            pos, idx, col = computed, self.idx[:t], self.col[:t]
            np.copyto(idx, row_blk)
            tok_idx = self.tok_idx[:t]
            np.add(row_tok, pos, out=tok_idx)
        else:                              # spread per-request values over each request's tokens
            cu = self.cu[:r]
            np.cumsum(scheduled, out=cu)
            t = int(cu[-1])
            if t > max_tokens:
                return codes.E_TOO_MANY_TOKENS, t, 0, 0
            pos, col = self.pos[:t], self.col[:t]
            off = self.off[:r]             # position minus token index, per request
            np.subtract(seq, cu, out=off)
            arange = self.arange[:t]
            np.add(arange, np.repeat(off, scheduled), out=pos)
            np.add(row_tok, off, out=row_tok)
            tok_idx = self.tok_idx[:t]
            np.add(arange, np.repeat(row_tok, scheduled), out=tok_idx)
            idx = np.repeat(row_blk, scheduled)   # np.repeat has no out=: one temporary per mixed step
        # Block ids of the scheduled rows, in scratch of the table's dtype.
        bt_rows, low, ids, blk = self.scratch(token_ids.dtype, block_table.dtype, width)
        bt_rows, ids, blk = bt_rows[:r], ids[:t], blk[:t]
        np.take(block_table, rows, axis=0, out=bt_rows, mode="clip")
        bad = self.first_null_block(bt_rows, low[:r], seq, bs)
        if bad >= 0:
            return codes.E_NULL_BLOCK, bad, 0, 0
        np.take(token_ids.reshape(-1), tok_idx, out=ids, mode="clip")
        if ids.min() < 0 or ids.max() >= vocab_size:
            return codes.E_TOKEN_OUT_OF_VOCAB, int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0]), 0, 0
        if bt_rows.max() >= num_blocks:
            return codes.E_BLOCK_OUT_OF_CACHE, int(np.flatnonzero((bt_rows >= num_blocks).any(axis=1))[0]), 0, 0

        # All checks passed: write the outputs.
        pow2 = bs & (bs - 1) == 0
        if pow2:
            np.right_shift(pos, bs.bit_length() - 1, out=col)
        else:
            np.floor_divide(pos, bs, out=col)
        np.add(idx, col, out=idx)
        np.take(block_table.reshape(-1), idx, out=blk, mode="clip")
        input_ids[:t] = ids
        block_table_out[:r] = bt_rows
        positions[:t] = pos
        slots = slot_mapping[:t]
        np.multiply(blk, bs, out=slots, dtype=np.int64)
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
    def check_requests(token_ids: np.ndarray, block_table: np.ndarray, req: np.ndarray, bs: int,
                       lows: list[int], highs: list[int]) -> _Result:
        """``host_loops.check_requests`` over ``req`` (computed, rows, scheduled, seq_lens;
        clamped) and the minimum / maximum of each of its rows: ``(E_OK, 0, max_query_len,
        max_seq_len)`` or ``(code, detail, 0, 0)``."""
        computed, rows, scheduled, seq = req
        min_computed, min_row, min_sched, _ = lows
        max_computed, max_row, max_sched, max_seq = highs
        num_rows, model_len = token_ids.shape
        if min_row < 0 or max_row >= num_rows:
            return codes.E_ROW_OUT_OF_RANGE, int(np.flatnonzero((rows < 0) | (rows >= num_rows))[0]), 0, 0
        if min_sched <= 0:
            return codes.E_SCHEDULED_NOT_POSITIVE, int(np.argmin(scheduled)), 0, 0
        if min_computed < 0:
            return codes.E_COMPUTED_NEGATIVE, int(np.argmin(computed)), 0, 0
        if max_computed >= model_len:
            return codes.E_COMPUTED_PAST_TABLE, int(np.argmax(computed)), 0, 0
        if max_seq > model_len:
            return codes.E_PAST_TOKEN_TABLE, int(np.argmax(seq)), 0, 0
        if -(-max_seq // bs) > block_table.shape[1]:
            return codes.E_TABLE_TOO_NARROW, int(np.argmax(seq)), 0, 0
        return codes.E_OK, 0, max_sched, max_seq

    def first_null_block(self, bt_rows: np.ndarray, low: np.ndarray, seq: np.ndarray, bs: int) -> int:
        """The first request whose attention reads a block id <= the null block (columns
        [0, ceil(seq_len / bs)) of its row), or -1. ``low``: bool scratch one column wider
        than ``bt_rows`` whose last column is always True, so each row's first null column
        (argmax) exists; the request reads it when ``column * bs < seq_len``."""
        r, width = bt_rows.shape
        first, read = self.first[:r], self.read[:r]
        np.less_equal(bt_rows, defaults.NULL_BLOCK, out=low[:, :width])
        np.argmax(low, axis=1, out=first)
        np.multiply(first, bs, out=first)
        np.less(first, seq, out=read)
        return int(np.argmax(read)) if read.any() else -1

    def scratch(self, token_dtype: np.dtype, block_dtype: np.dtype, width: int) -> tuple[np.ndarray, ...]:
        """Persistent scratch for tables of these dtypes and width (reallocated when they
        change): block-table rows [R, width], a bool mask one column wider (for
        ``first_null_block``), token ids and blocks [T]."""
        key = (token_dtype, block_dtype, width)
        if self._scratch_key != key:
            r, t = self.max_num_reqs, self.max_num_tokens
            self._scratch = (np.zeros((r, width), block_dtype), np.ones((r, width + 1), bool),
                             np.zeros(t, token_dtype), np.zeros(t, block_dtype))
            self._scratch_key = key
        return self._scratch
