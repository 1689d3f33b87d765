"""The numpy path of input preparation: :mod:`graphrt.core.inputs.host_loops`' checks interpreted, then
vectorised numpy writes on persistent scratch.

Its writes are independent of the compiled ``write_step`` (the oracle it is tested against);
its checks are the host loops' own, so both paths refuse the same steps alike. It is also the
fallback where numba does not import (about 1 ms per 256-request step)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from graphrt.core.inputs import host_loops
from graphrt.core.inputs.step_codes import E_OK

Report = tuple[int, int, int, int, int, int]


class NumpyPrepare:
    """``host_loops.prepare_step`` / ``write_checked_step`` with numpy writes.

    Request values are copied into one int64 ``[4, R]`` scratch (computed, rows, scheduled,
    seq_lens); index arithmetic is int64 (numpy's index type) and gathers use ``mode="clip"``
    on indices the checks validated.
    """

    def __init__(self, max_num_tokens: int, max_num_reqs: int) -> None:
        t, r = max_num_tokens, max_num_reqs
        self.max_num_tokens = t
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
        self._scratch_key: tuple | None = None
        self._scratch: tuple[np.ndarray, ...] = ()

    def prepare_step(self, token_ids: np.ndarray, block_table: np.ndarray, rows: np.ndarray,
                     computed: np.ndarray, scheduled: np.ndarray, block_size: int, max_tokens: int,
                     vocab_size: int, num_blocks: int, row_mark: np.ndarray, state_table: np.ndarray,
                     slot_mark: np.ndarray, *outputs: np.ndarray) -> Report:
        """``host_loops.check_step``, then, when it passes, the step written into ``outputs``
        (the eight fields, in ``fields.ARRAY_FIELDS`` order; the block table's first columns,
        as many as its output has)."""
        report = host_loops.check_step(token_ids, block_table, rows, computed, scheduled, block_size,
                                       max_tokens, vocab_size, num_blocks, row_mark, state_table, slot_mark,
                                       outputs[-2].shape[1])
        code, _, _, num_tokens, max_query_len, _ = report
        if code == E_OK:
            self.write(token_ids, block_table, rows, computed, scheduled, block_size, num_tokens,
                       max_query_len, state_table, outputs)
        return report

    def write_checked_step(self, token_ids: np.ndarray, block_table: np.ndarray, rows: np.ndarray,
                           computed: np.ndarray, scheduled: np.ndarray, block_size: int,
                           num_tokens: int, state_table: np.ndarray, slot_mark: np.ndarray,
                           *outputs: np.ndarray) -> bool:
        """``host_loops.write_checked_step``: False, writing nothing, when the step no longer
        passes ``check_requests`` / ``check_state_slots`` or no longer has ``num_tokens`` tokens."""
        code, _, _, total, max_query_len, _ = host_loops.check_requests(
            token_ids, block_table, rows, computed, scheduled, block_size, outputs[-2].shape[1])
        if code != E_OK or total != num_tokens:
            return False
        if host_loops.check_state_slots(state_table, rows, slot_mark)[0] != E_OK:
            return False
        self.write(token_ids, block_table, rows, computed, scheduled, block_size, num_tokens,
                   max_query_len, state_table, outputs)
        return True

    def write(self, token_ids: np.ndarray, block_table: np.ndarray, rows_in: np.ndarray,
              computed_in: np.ndarray, scheduled_in: np.ndarray, bs: int, t: int, max_sched: int,
              state_table: np.ndarray, outputs: Sequence[np.ndarray]) -> None:
        """Write a checked step of ``t`` tokens (the longest request ``max_sched``) into the
        first rows of ``outputs``."""
        (input_ids, positions, slot_mapping, query_start_loc, seq_lens, num_computed, block_table_out,
         state_slots) = outputs
        r = rows_in.shape[0]
        computed, rows, scheduled, seq = self.req[:, :r]
        computed[:] = computed_in
        rows[:] = rows_in
        scheduled[:] = scheduled_in
        np.add(computed, scheduled, out=seq)
        width, model_len = block_table.shape[1], token_ids.shape[1]
        row_blk, row_tok = self.row_base[0, :r], self.row_base[1, :r]
        np.multiply(rows, width, out=row_blk)         # flat offset of each row in block_table
        np.multiply(rows, model_len, out=row_tok)     # flat offset of each row in token_ids
        if max_sched == 1:                 # decode: token i is request i, at position computed[i]
            pos, idx, col = computed, self.idx[:t], self.col[:t]
            np.copyto(idx, row_blk)
            tok_idx = self.tok_idx[:t]
            np.add(row_tok, pos, out=tok_idx)
        else:                              # spread per-request values over each request's tokens
            cu = self.cu[:r]
            np.cumsum(scheduled, out=cu)
            pos, col = self.pos[:t], self.col[:t]
            off = self.off[:r]             # position minus token index, per request
            np.subtract(seq, cu, out=off)
            arange = self.arange[:t]
            np.add(arange, np.repeat(off, scheduled), out=pos)
            np.add(row_tok, off, out=row_tok)
            tok_idx = self.tok_idx[:t]
            np.add(arange, np.repeat(row_tok, scheduled), out=tok_idx)
            idx = np.repeat(row_blk, scheduled)   # np.repeat has no out=: one temporary per mixed step
        bt_rows, ids, blk = self.scratch(token_ids.dtype, block_table.dtype, width)
        bt_rows, ids, blk = bt_rows[:r], ids[:t], blk[:t]
        np.take(token_ids.reshape(-1), tok_idx, out=ids, mode="clip")
        pow2 = bs & (bs - 1) == 0
        if pow2:
            np.right_shift(pos, bs.bit_length() - 1, out=col)
        else:
            np.floor_divide(pos, bs, out=col)
        np.add(idx, col, out=idx)
        np.take(block_table.reshape(-1), idx, out=blk, mode="clip")
        input_ids[:t] = ids
        np.take(block_table, rows, axis=0, out=bt_rows, mode="clip")
        block_table_out[:r] = bt_rows[:, :block_table_out.shape[1]]     # a wider table's extra columns: ignored
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
        if state_table.shape[0]:
            np.take(state_table, rows_in, out=state_slots[:r], mode="clip")
        else:
            state_slots[:r] = -1

    def scratch(self, token_dtype: np.dtype, block_dtype: np.dtype, width: int) -> tuple[np.ndarray, ...]:
        """Persistent scratch in the tables' dtypes (reallocated when they or the width
        change): block-table rows [R, width], token ids and blocks [T]."""
        key = (token_dtype, block_dtype, width)
        if self._scratch_key != key:
            r, t = self.max_num_reqs, self.max_num_tokens
            self._scratch = (np.zeros((r, width), block_dtype), np.zeros(t, token_dtype),
                             np.zeros(t, block_dtype))
            self._scratch_key = key
        return self._scratch
