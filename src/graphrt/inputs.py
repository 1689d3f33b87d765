"""Input preparation: from the engine's persistent tables and this step's schedule to
everything the model and its attention need (seed 001's worked example, vectorised).

Token level (length T = total scheduled tokens): ``input_ids``, ``positions``,
``slot_mapping``. Request level (length R): ``seq_lens``, ``num_computed_tokens``,
``block_table`` rows, and ``query_start_loc`` (length R + 1).

``InputPreparer`` writes into persistent buffers (no allocation per step, results valid
until the next call); ``prepare_inputs`` is the allocating convenience with the same values.
Every bad input raises :class:`~graphrt.errors.InputError` before any output is written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from graphrt import defaults
from graphrt.errors import InputError

TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping")
REQUEST_FIELDS = ("seq_lens", "num_computed_tokens", "block_table")
ARRAY_FIELDS = TOKEN_FIELDS + ("query_start_loc",) + REQUEST_FIELDS
#: The dtype of every array field, for whoever allocates buffers for them.
FIELD_DTYPES: dict[str, type] = {
    "input_ids": np.int32, "positions": np.int32, "slot_mapping": np.int64,
    "query_start_loc": np.int32, "seq_lens": np.int32, "num_computed_tokens": np.int32,
    "block_table": np.int32}


@dataclass
class ModelInputs:
    """One step's model inputs. Arrays may be longer than the real counts after padding.

    ``num_tokens`` / ``num_reqs`` are always the real counts; the padded sizes are the
    array lengths (``padded_num_tokens`` / ``padded_num_reqs``).
    """

    input_ids: np.ndarray            # int32 [T]
    positions: np.ndarray            # int32 [T]
    slot_mapping: np.ndarray         # int64 [T], -1 for padding
    query_start_loc: np.ndarray      # int32 [R + 1]
    seq_lens: np.ndarray             # int32 [R]
    num_computed_tokens: np.ndarray  # int32 [R]
    block_table: np.ndarray          # int32 [R, max_blocks_per_req]
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    uniform_decode: bool

    @property
    def padded_num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def padded_num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def logits_indices(self) -> np.ndarray:
        """Index of each real request's last scheduled token (where a token is sampled)."""
        return self.query_start_loc[1:self.num_reqs + 1] - 1

    def copy(self) -> "ModelInputs":
        """A deep copy that survives the next ``prepare`` / ``pad`` call."""
        return dataclasses.replace(self, **{f: getattr(self, f).copy() for f in ARRAY_FIELDS})


def _as_int_array(name: str, value: object, ndim: int, dtype: type | None = None) -> np.ndarray:
    """Check shape and integer dtype; convert to ``dtype`` (copying only if it differs)."""
    arr = np.asarray(value)
    if arr.ndim != ndim:
        raise InputError(name, f"expected a {ndim}-d integer array, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise InputError(name, f"expected integers, got dtype {arr.dtype}")
    return arr if dtype is None or arr.dtype == dtype else arr.astype(dtype)


class InputPreparer:
    """Prepares model inputs into persistent host buffers (the fast path).

    ``max_num_reqs`` / ``max_num_tokens`` bound one step; the block-table width is
    taken from the table on first use. Request-level values are copied into one int64
    ``[4, max_num_reqs]`` buffer (computed, rows, scheduled, seq_lens) so that every bound
    is checked with two reductions; index arithmetic is int64 (numpy's index type, so
    gathers convert nothing) and gathers use ``mode="clip"`` on indices already validated.
    """

    def __init__(self, *, max_num_reqs: int, max_num_tokens: int, block_size: int) -> None:
        if block_size <= 0:
            raise InputError("block_size", f"must be > 0, got {block_size}")
        if max_num_reqs <= 0:
            raise InputError("max_num_reqs", f"must be > 0, got {max_num_reqs}")
        if max_num_tokens <= 0:
            raise InputError("max_num_tokens", f"must be > 0, got {max_num_tokens}")
        self.max_num_reqs = int(max_num_reqs)
        self.max_num_tokens = int(max_num_tokens)
        self.block_size = int(block_size)
        t, r = self.max_num_tokens, self.max_num_reqs
        self._arange = np.arange(max(t, r + 1), dtype=np.int64)
        self._req = np.zeros((4, r), dtype=np.int64)     # computed, rows, scheduled, seq_lens
        self._cu = np.zeros(r, dtype=np.int64)
        self._off = np.zeros(r, dtype=np.int64)
        self._pos = np.zeros(t, dtype=np.int64)          # scratch: position of each token
        self._idx = np.zeros(t, dtype=np.int64)          # scratch: flat block-table indices
        self._tok_idx = np.zeros(t, dtype=np.int64)      # scratch: flat token-table indices
        self._row_base = np.zeros((2, r), dtype=np.int64)  # rows * width, rows * max_model_len
        self._col = np.zeros(t, dtype=np.int64)          # scratch: block column / block offset
        self._blk = np.zeros(t, dtype=np.int32)          # scratch: physical block of each token
        self._row_mark = np.zeros(0, dtype=np.int64)     # last call's stamp per table row
        self._stamp = 0
        self.input_ids = np.zeros(t, dtype=FIELD_DTYPES["input_ids"])
        self.positions = np.zeros(t, dtype=FIELD_DTYPES["positions"])
        self.slot_mapping = np.zeros(t, dtype=FIELD_DTYPES["slot_mapping"])
        self.query_start_loc = np.zeros(r + 1, dtype=FIELD_DTYPES["query_start_loc"])
        self.seq_lens = np.zeros(r, dtype=FIELD_DTYPES["seq_lens"])
        self.num_computed_tokens = np.zeros(r, dtype=FIELD_DTYPES["num_computed_tokens"])
        self.block_table: np.ndarray | None = None

    def prepare(self, *, token_ids: np.ndarray, block_table: np.ndarray, req_rows: np.ndarray,
                num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray,
                block_size: int | None = None) -> ModelInputs:
        """Compute one step's inputs. Outputs are views of persistent buffers."""
        bs = self.block_size if block_size is None else int(block_size)
        if bs <= 0:
            raise InputError("block_size", f"must be > 0, got {bs}")
        token_ids = _as_int_array("token_ids", token_ids, 2, np.int32)
        block_table = _as_int_array("block_table", block_table, 2, np.int32)
        rows_in = _as_int_array("req_rows", req_rows, 1)
        computed_in = _as_int_array("num_computed_tokens", num_computed_tokens, 1)
        scheduled_in = _as_int_array("num_scheduled_tokens", num_scheduled_tokens, 1)
        r = self._check_shapes(token_ids, block_table, rows_in, computed_in, scheduled_in)
        req = self._req[:, :r]
        computed, rows, scheduled, seq = req
        computed[:] = computed_in
        rows[:] = rows_in
        scheduled[:] = scheduled_in
        np.add(computed, scheduled, out=seq)
        max_sched, max_seq = self._check_requests(token_ids, block_table, req, bs)

        uniform = max_sched == 1
        width, model_len = block_table.shape[1], token_ids.shape[1]
        row_blk, row_tok = self._row_base[0, :r], self._row_base[1, :r]
        np.multiply(rows, width, out=row_blk)         # flat offset of each row in block_table
        np.multiply(rows, model_len, out=row_tok)     # flat offset of each row in token_ids
        if uniform:                        # decode: token i is request i, at position computed[i]
            t = r
            pos, idx, col, blk = computed, self._idx[:t], self._col[:t], self._blk[:t]
            np.copyto(idx, row_blk)
            tok_idx = self._tok_idx[:t]
            np.add(row_tok, pos, out=tok_idx)
        else:                              # spread per-request values over each request's tokens
            cu = self._cu[:r]
            np.cumsum(scheduled, out=cu)
            t = int(cu[-1])
            if t > self.max_num_tokens:
                raise InputError("num_scheduled_tokens",
                                 f"{t} tokens in one step exceed max_num_tokens={self.max_num_tokens}")
            pos, col, blk = self._pos[:t], self._col[:t], self._blk[:t]
            off = self._off[:r]            # position minus token index, per request
            np.subtract(seq, cu, out=off)
            arange = self._arange[:t]
            np.add(arange, np.repeat(off, scheduled), out=pos)
            np.add(row_tok, off, out=row_tok)
            tok_idx = self._tok_idx[:t]
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
            self._raise_null_block(blk, pos, scheduled, rows)

        # All checks passed: write the outputs.
        idx = tok_idx
        np.take(token_ids.reshape(-1), idx, out=self.input_ids[:t], mode="clip")
        self.positions[:t] = pos
        slots = self.slot_mapping[:t]
        np.multiply(blk, bs, out=slots)
        if pow2:
            np.bitwise_and(pos, bs - 1, out=col)
        else:
            np.multiply(col, bs, out=col)
            np.subtract(pos, col, out=col)
        np.add(slots, col, out=slots)
        qsl = self.query_start_loc[:r + 1]
        if uniform:
            qsl[:] = self._arange[:r + 1]
        else:
            qsl[0] = 0
            qsl[1:] = cu
        self.seq_lens[:r] = seq
        self.num_computed_tokens[:r] = computed
        if self.block_table is None or self.block_table.shape[1] != width:
            self.block_table = np.zeros((self.max_num_reqs, width), dtype=FIELD_DTYPES["block_table"])
        np.take(block_table, rows, axis=0, out=self.block_table[:r], mode="clip")
        return ModelInputs(
            input_ids=self.input_ids[:t], positions=self.positions[:t], slot_mapping=slots,
            query_start_loc=qsl, seq_lens=self.seq_lens[:r],
            num_computed_tokens=self.num_computed_tokens[:r], block_table=self.block_table[:r],
            num_reqs=r, num_tokens=t, max_query_len=max_sched, max_seq_len=max_seq,
            uniform_decode=uniform)

    def _check_shapes(self, token_ids: np.ndarray, block_table: np.ndarray, rows: np.ndarray,
                      computed: np.ndarray, scheduled: np.ndarray) -> int:
        """Batch-size and table-shape checks; returns the number of requests."""
        r = rows.shape[0]
        if r == 0:
            raise InputError("req_rows", "empty batch: schedule at least one request")
        if r > self.max_num_reqs:
            raise InputError("req_rows", f"{r} requests exceed max_num_reqs={self.max_num_reqs}")
        if computed.shape[0] != r:
            raise InputError("num_computed_tokens", f"length {computed.shape[0]} does not match "
                                                    f"req_rows length {r}")
        if scheduled.shape[0] != r:
            raise InputError("num_scheduled_tokens", f"length {scheduled.shape[0]} does not match "
                                                     f"req_rows length {r}")
        if token_ids.shape[0] != block_table.shape[0]:
            raise InputError("block_table", f"{block_table.shape[0]} rows but token_ids has "
                                            f"{token_ids.shape[0]}: both tables are indexed by req_rows")
        return r

    def _check_requests(self, token_ids: np.ndarray, block_table: np.ndarray, req: np.ndarray,
                        bs: int) -> tuple[int, int]:
        """Every request-level bound in two reductions; returns (max scheduled, max seq_len)."""
        computed, rows, scheduled, seq = req
        min_computed, min_row, min_sched = req[:3].min(axis=1).tolist()
        max_row, max_sched, max_seq = req[1:].max(axis=1).tolist()
        num_rows = token_ids.shape[0]
        if min_row < 0 or max_row >= num_rows:
            bad = int(rows[(rows < 0) | (rows >= num_rows)][0])
            raise InputError("req_rows", f"row {bad} out of range [0, {num_rows})")
        if min_sched <= 0:
            i = int(np.argmin(scheduled))
            raise InputError("num_scheduled_tokens",
                             f"request {i} schedules {int(scheduled[i])} tokens; must be >= 1")
        if min_computed < 0:
            i = int(np.argmin(computed))
            raise InputError("num_computed_tokens", f"request {i} has {int(computed[i])}; must be >= 0")
        if max_seq > token_ids.shape[1]:
            i = int(np.argmax(seq))
            raise InputError("num_scheduled_tokens",
                             f"request {i} reaches {max_seq} tokens, past the token table's width "
                             f"(max_model_len={token_ids.shape[1]})")
        if -(-max_seq // bs) > block_table.shape[1]:
            i = int(np.argmax(seq))
            raise InputError("block_table",
                             f"request {i} needs {-(-max_seq // bs)} blocks of {bs} tokens but the "
                             f"table has {block_table.shape[1]} columns")
        if self._row_mark.shape[0] < num_rows:
            self._row_mark = np.zeros(num_rows, dtype=np.int64)
        self._stamp += 1
        mark = self._row_mark[:num_rows]
        mark[rows] = self._stamp
        if np.count_nonzero(mark == self._stamp) != rows.shape[0]:
            raise InputError("req_rows", "a row is scheduled twice in one step")
        return max_sched, max_seq

    @staticmethod
    def _raise_null_block(blk: np.ndarray, pos: np.ndarray, scheduled: np.ndarray,
                          rows: np.ndarray) -> None:
        bad = int(np.flatnonzero(blk <= defaults.NULL_BLOCK)[0])
        req = int(np.searchsorted(np.cumsum(scheduled), bad, side="right"))
        raise InputError("block_table",
                         f"request {req} (row {int(rows[req])}) position {int(pos[bad])} maps to "
                         f"block {int(blk[bad])}: block {defaults.NULL_BLOCK} is the null block and "
                         f"never holds a request's KV; allocate a block before scheduling the token")


def prepare_inputs(*, token_ids: np.ndarray, block_table: np.ndarray, req_rows: np.ndarray,
                   num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray,
                   block_size: int) -> ModelInputs:
    """Allocating convenience over :class:`InputPreparer`; the returned arrays are owned."""
    scheduled = _as_int_array("num_scheduled_tokens", num_scheduled_tokens, 1)
    rows = _as_int_array("req_rows", req_rows, 1)
    preparer = InputPreparer(max_num_reqs=max(int(rows.shape[0]), 1),
                             max_num_tokens=max(int(scheduled.clip(min=0).sum()), 1),
                             block_size=block_size)
    return preparer.prepare(token_ids=token_ids, block_table=block_table, req_rows=rows,
                            num_computed_tokens=num_computed_tokens,
                            num_scheduled_tokens=scheduled)
