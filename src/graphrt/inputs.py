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
    taken from the table on first use.
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
        self._arange = np.arange(t, dtype=np.int64)
        self._starts = np.zeros(t + 1, dtype=np.int64)   # scratch: request start markers
        self._req_idx = np.zeros(t, dtype=np.int64)      # scratch: request of each token
        self._pos = np.zeros(t, dtype=np.int64)          # scratch: position of each token
        self._scratch = np.zeros(t, dtype=np.int64)      # scratch: gather indices
        self._col = np.zeros(t, dtype=np.int64)          # scratch: block-table column of each token
        self._blk = np.zeros(t, dtype=np.int32)          # scratch: physical block of each token
        self._rows64 = np.zeros(r, dtype=np.int64)
        self._computed64 = np.zeros(r, dtype=np.int64)
        self._scheduled64 = np.zeros(r, dtype=np.int64)
        self._cu = np.zeros(r, dtype=np.int64)
        self.input_ids = np.zeros(t, dtype=np.int32)
        self.positions = np.zeros(t, dtype=np.int32)
        self.slot_mapping = np.zeros(t, dtype=np.int64)
        self.query_start_loc = np.zeros(r + 1, dtype=np.int32)
        self.seq_lens = np.zeros(r, dtype=np.int32)
        self.num_computed_tokens = np.zeros(r, dtype=np.int32)
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
        rows = _as_int_array("req_rows", req_rows, 1)
        computed = _as_int_array("num_computed_tokens", num_computed_tokens, 1)
        scheduled = _as_int_array("num_scheduled_tokens", num_scheduled_tokens, 1)
        num_reqs = rows.shape[0]
        self._check_requests(token_ids, block_table, rows, computed, scheduled, bs)

        r = num_reqs
        rows64, computed64, scheduled64 = self._rows64[:r], self._computed64[:r], self._scheduled64[:r]
        rows64[:] = rows
        computed64[:] = computed
        scheduled64[:] = scheduled
        cu = self._cu[:r]
        np.cumsum(scheduled, out=cu)
        t = int(cu[-1])
        if t > self.max_num_tokens:
            raise InputError("num_scheduled_tokens",
                             f"{t} tokens in one step exceed max_num_tokens={self.max_num_tokens}")

        # Request of each token: mark each request's first token, then a running sum.
        starts = self._starts[:t]
        starts[:] = 0
        starts[cu[:-1]] = 1
        req_idx = self._req_idx[:t]
        np.cumsum(starts, out=req_idx)
        # Position = computed tokens + offset within this step's tokens of the request.
        pos, tmp = self._pos[:t], self._scratch[:t]
        np.take(cu, req_idx, out=tmp)
        np.take(scheduled64, req_idx, out=pos)
        np.subtract(tmp, pos, out=tmp)                    # first token index of the request
        np.subtract(self._arange[:t], tmp, out=pos)       # offset within the request
        np.take(computed64, req_idx, out=tmp)
        np.add(pos, tmp, out=pos)
        # Physical block of each token: block_table[row, pos // bs].
        width = block_table.shape[1]
        blk = self._blk[:t]
        np.take(rows64, req_idx, out=tmp)
        np.multiply(tmp, width, out=tmp)
        col = self._col[:t]
        np.floor_divide(pos, bs, out=col)
        np.add(tmp, col, out=tmp)
        np.take(block_table.reshape(-1), tmp, out=blk)
        if (blk == defaults.NULL_BLOCK).any() or (blk < 0).any():
            bad = int(np.flatnonzero((blk == defaults.NULL_BLOCK) | (blk < 0))[0])
            req = int(req_idx[bad])
            raise InputError("block_table",
                             f"request {req} (row {int(rows[req])}) position {int(pos[bad])} maps to "
                             f"block {int(blk[bad])}: block {defaults.NULL_BLOCK} is the null block and "
                             f"never holds a request's KV; allocate a block before scheduling the token")

        # All checks passed: write the outputs.
        np.take(rows64, req_idx, out=tmp)
        np.multiply(tmp, token_ids.shape[1], out=tmp)
        np.add(tmp, pos, out=tmp)
        np.take(token_ids.reshape(-1), tmp, out=self.input_ids[:t])
        self.positions[:t] = pos
        slots = self.slot_mapping[:t]
        np.multiply(blk, bs, out=slots)
        np.remainder(pos, bs, out=col)
        np.add(slots, col, out=slots)
        qsl = self.query_start_loc[:r + 1]
        qsl[0] = 0
        qsl[1:] = cu
        np.add(computed, scheduled, out=self.seq_lens[:r], casting="unsafe")
        self.num_computed_tokens[:r] = computed
        if self.block_table is None or self.block_table.shape[1] != width:
            self.block_table = np.zeros((self.max_num_reqs, width), dtype=np.int32)
        np.take(block_table, rows64, axis=0, out=self.block_table[:r])
        max_query_len = int(scheduled.max())
        return ModelInputs(
            input_ids=self.input_ids[:t], positions=self.positions[:t], slot_mapping=slots,
            query_start_loc=qsl, seq_lens=self.seq_lens[:r],
            num_computed_tokens=self.num_computed_tokens[:r], block_table=self.block_table[:r],
            num_reqs=r, num_tokens=t, max_query_len=max_query_len,
            max_seq_len=int(self.seq_lens[:r].max()), uniform_decode=max_query_len == 1)

    def _check_requests(self, token_ids: np.ndarray, block_table: np.ndarray, rows: np.ndarray,
                        computed: np.ndarray, scheduled: np.ndarray, bs: int) -> None:
        """Request-level validation; token-level checks happen on scratch buffers."""
        r = rows.shape[0]
        if r == 0:
            raise InputError("req_rows", "empty batch: schedule at least one request")
        if r > self.max_num_reqs:
            raise InputError("req_rows", f"{r} requests exceed max_num_reqs={self.max_num_reqs}")
        for name, arr in (("num_computed_tokens", computed), ("num_scheduled_tokens", scheduled)):
            if arr.shape[0] != r:
                raise InputError(name, f"length {arr.shape[0]} does not match req_rows length {r}")
        num_rows = min(token_ids.shape[0], block_table.shape[0])
        if token_ids.shape[0] != block_table.shape[0]:
            raise InputError("block_table", f"{block_table.shape[0]} rows but token_ids has "
                                            f"{token_ids.shape[0]}: both tables are indexed by req_rows")
        if rows.min() < 0 or rows.max() >= num_rows:
            bad = int(rows[(rows < 0) | (rows >= num_rows)][0])
            raise InputError("req_rows", f"row {bad} out of range [0, {num_rows})")
        if np.unique(rows).shape[0] != r:
            raise InputError("req_rows", "a row is scheduled twice in one step")
        if scheduled.min() <= 0:
            i = int(np.argmin(scheduled))
            raise InputError("num_scheduled_tokens",
                             f"request {i} schedules {int(scheduled[i])} tokens; must be >= 1")
        if computed.min() < 0:
            i = int(np.argmin(computed))
            raise InputError("num_computed_tokens", f"request {i} has {int(computed[i])}; must be >= 0")
        seq = computed.astype(np.int64) + scheduled
        width = token_ids.shape[1]
        if seq.max() > width:
            i = int(np.argmax(seq))
            raise InputError("num_scheduled_tokens",
                             f"request {i} reaches {int(seq[i])} tokens, past the token table's width "
                             f"(max_model_len={width})")
        blocks_needed = -(-seq // bs)
        if blocks_needed.max() > block_table.shape[1]:
            i = int(np.argmax(blocks_needed))
            raise InputError("block_table",
                             f"request {i} needs {int(blocks_needed[i])} blocks of {bs} tokens but the "
                             f"table has {block_table.shape[1]} columns")


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
