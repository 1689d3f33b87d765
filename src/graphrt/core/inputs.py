"""Input preparation: from the engine's persistent tables and this step's schedule to
everything the model and its attention need (vLLM's GPU model runner's ``_prepare_inputs``, vectorised).

Token level (length T = total scheduled tokens): ``input_ids``, ``positions``,
``slot_mapping``. Request level (length R): ``seq_lens``, ``num_computed_tokens``,
``block_table`` rows, and ``query_start_loc`` (length R + 1).

``InputPreparer`` writes into persistent buffers (no allocation per step, results valid
until the next call); ``prepare_inputs`` is the allocating convenience with the same values.
Every bad input raises :class:`~graphrt.core.errors.InputError` before any output is written.
This module is the front: argument checks, the choice of implementation (the compiled loops
of :mod:`graphrt.core.host_loops`, or :mod:`graphrt.core.prepare_numpy`), and the error
messages for the codes both return.
"""

from __future__ import annotations

import time
from typing import Mapping, NamedTuple

import numpy as np

from graphrt.core import defaults, host_kernels
from graphrt.core import step_codes as codes
from graphrt.core.errors import GraphrtError, InputError
from graphrt.core.fields import FIELD_DTYPES, ModelInputs, buffer_shapes
from graphrt.core.padding import Padder
from graphrt.core.prepare_numpy import NumpyPrepare

_INT32, _INT64 = np.dtype(np.int32), np.dtype(np.int64)
_ARRAY = np.ndarray


class StepShape(NamedTuple):
    """What :meth:`InputPreparer.check` learns of a step: enough to pick its bucket."""

    num_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    uniform_decode: bool


def _as_int_array(name: str, value: object, ndim: int, dtype: type | None = None) -> np.ndarray:
    """Check shape and integer dtype; int32 / int64 pass as they are, other integers are
    converted to ``dtype`` (int64 when None); with ``dtype`` given, anything else is too."""
    arr = value if type(value) is np.ndarray else np.asarray(value)
    if arr.ndim != ndim:
        raise InputError(name, f"expected a {ndim}-d integer array, got shape {arr.shape}")
    dt = arr.dtype
    if dtype is None and (dt is _INT64 or dt is _INT32):   # the per-step fast path
        return arr
    if dt.kind not in "iu":
        raise InputError(name, f"expected integers, got dtype {dt}")
    if dtype is not None:
        return arr if dt == dtype else arr.astype(dtype)
    return arr if dt == _INT32 or dt == _INT64 else arr.astype(np.int64)


class InputPreparer:
    """Prepares model inputs into persistent host buffers (the fast path).

    ``max_num_reqs`` / ``max_num_tokens`` bound one step; the block-table width is taken
    from the table on first use. ``vocab_size`` / ``num_blocks``, when given, also bound
    every scheduled token id and every block id in the scheduled rows (a runner passes its
    model's vocabulary and its KV cache's size); ``table_width`` fixes the block table's
    number of columns.

    ``kernel`` picks the implementation: ``numba`` (one compiled loop per step, see
    :mod:`graphrt.core.host_kernels`), ``numpy`` (vectorised numpy, the reference) or ``auto``
    (numba when it imports). Both give identical results and raise identical errors.
    """

    def __init__(self, *, max_num_reqs: int, max_num_tokens: int, block_size: int,
                 vocab_size: int | None = None, num_blocks: int | None = None,
                 table_width: int | None = None, kernel: str | None = None) -> None:
        if block_size <= 0:
            raise InputError("block_size", f"must be > 0, got {block_size}")
        if max_num_reqs <= 0:
            raise InputError("max_num_reqs", f"must be > 0, got {max_num_reqs}")
        if max_num_tokens <= 0:
            raise InputError("max_num_tokens", f"must be > 0, got {max_num_tokens}")
        for name, bound in (("vocab_size", vocab_size), ("num_blocks", num_blocks),
                            ("table_width", table_width)):
            if bound is not None and bound <= 0:
                raise InputError(name, f"must be > 0 (or None: unbounded), got {bound}")
        self.max_num_reqs = int(max_num_reqs)
        self.max_num_tokens = int(max_num_tokens)
        self.block_size = int(block_size)
        self.vocab_size = int(vocab_size) if vocab_size is not None else None
        self.num_blocks = int(num_blocks) if num_blocks is not None else None
        self.table_width = int(table_width) if table_width is not None else None
        self.kernel = host_kernels.resolve_kernel(kernel)
        t, r = self.max_num_tokens, self.max_num_reqs
        numba = self.kernel == "numba"
        # check + write in one call, the same contract on both paths; the numpy path has no
        # separate check / padded write (it prepares in check() and pads in write()).
        self._prepare_step = host_kernels.compiled("prepare_step") if numba else NumpyPrepare(t, r)
        self._check_step = host_kernels.compiled("check_step") if numba else None
        self._write_step = host_kernels.compiled("write_padded_step") if numba else None
        self._table_dtypes = (_INT32, _INT64) if numba else (_INT32,)
        self._pending: tuple[tuple, StepShape] | None = None
        self._row_mark = np.zeros(0, dtype=np.int64)     # last call's stamp per table row
        self._stamp = 0
        shapes = buffer_shapes(t, r, 0)
        self.input_ids = np.zeros(shapes["input_ids"], dtype=FIELD_DTYPES["input_ids"])
        self.positions = np.zeros(shapes["positions"], dtype=FIELD_DTYPES["positions"])
        self.slot_mapping = np.zeros(shapes["slot_mapping"], dtype=FIELD_DTYPES["slot_mapping"])
        self.query_start_loc = np.zeros(shapes["query_start_loc"], dtype=FIELD_DTYPES["query_start_loc"])
        self.seq_lens = np.zeros(shapes["seq_lens"], dtype=FIELD_DTYPES["seq_lens"])
        self.num_computed_tokens = np.zeros(shapes["num_computed_tokens"],
                                            dtype=FIELD_DTYPES["num_computed_tokens"])
        self.block_table: np.ndarray | None = None       # allocated once the table's width is seen
        self._width = -1                                  # the block table's width, once seen
        self._views: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}
        self._vocab_bound = self.vocab_size if self.vocab_size is not None else 0   # 0: unchecked
        self._block_bound = self.num_blocks if self.num_blocks is not None else 0

    def prepare(self, *, token_ids: np.ndarray, block_table: np.ndarray, req_rows: np.ndarray,
                num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray,
                block_size: int | None = None) -> ModelInputs:
        """Compute one step's inputs. Outputs are views of persistent buffers."""
        args = self._arguments(token_ids, block_table, req_rows, num_computed_tokens,
                               num_scheduled_tokens, block_size)
        self._pending = None
        code, t, max_sched, max_seq = self._prepare_step(
            *args, self.max_num_tokens, self._vocab_bound, self._block_bound, self._row_mark,
            self._stamp, self.input_ids, self.positions, self.slot_mapping, self.query_start_loc,
            self.seq_lens, self.num_computed_tokens, self.block_table)
        if code != codes.E_OK:
            raise self._step_error(code, t, *args)
        return self._result(t, args[2].shape[0], max_sched, max_seq)

    def check(self, *, token_ids: np.ndarray, block_table: np.ndarray, req_rows: np.ndarray,
              num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray,
              block_size: int | None = None) -> StepShape:
        """Validate one step (every check of :meth:`prepare`) and return its shape, so the
        caller can pick a bucket before anything is written; :meth:`write` then writes it,
        padded, straight into the bucket's buffers. (The numpy path prepares here, into the
        preparer's own buffers, and pads in :meth:`write`.)"""
        args = self._arguments(token_ids, block_table, req_rows, num_computed_tokens,
                               num_scheduled_tokens, block_size)
        self._pending = None
        if self._check_step is not None:
            code, t, max_sched, max_seq = self._check_step(
                *args, self.max_num_tokens, self._vocab_bound, self._block_bound, self._row_mark,
                self._stamp)
        else:     # the numpy path prepares into the preparer's buffers now, pads in write()
            code, t, max_sched, max_seq = self._prepare_step(
                *args, self.max_num_tokens, self._vocab_bound, self._block_bound, self._row_mark,
                self._stamp, self.input_ids, self.positions, self.slot_mapping,
                self.query_start_loc, self.seq_lens, self.num_computed_tokens, self.block_table)
        if code != codes.E_OK:
            raise self._step_error(code, t, *args)
        shape = StepShape(t, args[2].shape[0], max_sched, max_seq, max_sched == 1)
        self._pending = (args, shape)
        return shape

    def write(self, padder: Padder, *, num_tokens: int, num_reqs: int,
              out: Mapping[str, np.ndarray] | None = None) -> ModelInputs:
        """Write the step of the last successful :meth:`check`, padded by ``padder`` to
        ``num_tokens`` / ``num_reqs``, into ``out`` (as :meth:`Padder.pad` would).

        The step's arrays are read again here: don't change them in between (the compiled
        path runs the request check of :meth:`check` again, ``host_loops.check_requests``, and
        raises, writing nothing, if the step no longer passes it)."""
        if self._pending is None:
            raise GraphrtError("InputPreparer.write needs a successful check() of this step first")
        args, shape = self._pending
        t, r = shape.num_tokens, shape.num_reqs
        if self._write_step is None:
            inputs = self._result(t, r, shape.max_query_len, shape.max_seq_len)
            return padder.pad(inputs, num_tokens=num_tokens, num_reqs=num_reqs, out=out)
        if num_tokens < t or num_reqs < r:
            padder.check_targets(t, r, num_tokens, num_reqs)
        dst = padder.targets(out, num_tokens, num_reqs, self._width)
        if not self._write_step(*args, t, padder.kernel_rules, *dst):
            self._pending = None
            raise GraphrtError("the step's request arrays changed between InputPreparer.check() "
                               "and write(); check the step again")
        return ModelInputs(*dst, r, t, shape.max_query_len, shape.max_seq_len, shape.uniform_decode)

    def compile_kernels(self, padder: Padder, out: Mapping[str, np.ndarray] | None = None) -> float:
        """Compile the loops of :meth:`check` / :meth:`write` (a runner's path) now, for int32
        tables and int32 / int64 request arrays (the usual engine types), so the first real
        step does not wait for the JIT; returns the seconds it took (0 on the numpy path).
        Compiled code is cached on disk, so later processes only load it (~0.2 s here).
        ``out``: the staging buffers ``write`` will get (they receive a one-token dummy step).
        :meth:`prepare`'s loop compiles on its first call."""
        if self._check_step is None:
            return 0.0
        start = time.perf_counter()
        width = self.table_width or 1
        token_ids = np.zeros((1, self.block_size), dtype=np.int32)
        block_table = np.ones((1, width), dtype=np.int32)
        for dtype in (np.int32, np.int64):
            step = dict(token_ids=token_ids, block_table=block_table, req_rows=np.zeros(1, dtype),
                        num_computed_tokens=np.zeros(1, dtype), num_scheduled_tokens=np.ones(1, dtype))
            self.check(**step)
            self.write(padder, num_tokens=1, num_reqs=1, out=out)
        self._pending = None
        return time.perf_counter() - start

    def _result(self, t: int, r: int, max_sched: int, max_seq: int) -> ModelInputs:
        """The preparer's own buffers as this step's :class:`ModelInputs`."""
        views = self._views.get((t, r))
        if views is None:
            views = self._step_views(t, r)
        return ModelInputs(*views, r, t, max_sched, max_seq, max_sched == 1)

    def _arguments(self, token_ids: object, block_table: object, req_rows: object,
                   num_computed_tokens: object, num_scheduled_tokens: object,
                   block_size: int | None) -> tuple:
        """The step's arrays, checked (and converted where needed) for the kernel in use;
        sizes the persistent scratch for the tables and stamps this call."""
        bs = self.block_size if block_size is None else int(block_size)
        if bs <= 0:
            raise InputError("block_size", f"must be > 0, got {bs}")
        a, b, c, d, e = token_ids, block_table, req_rows, num_computed_tokens, num_scheduled_tokens
        tables = self._table_dtypes
        if not (type(a) is _ARRAY and type(b) is _ARRAY and type(c) is _ARRAY and type(d) is _ARRAY
                and type(e) is _ARRAY and a.ndim == 2 and b.ndim == 2 and c.ndim == 1
                and d.ndim == 1 and e.ndim == 1 and a.dtype in tables and b.dtype in tables
                and (c.dtype is _INT32 or c.dtype is _INT64) and (d.dtype is _INT32 or d.dtype is _INT64)
                and (e.dtype is _INT32 or e.dtype is _INT64)):    # one test on the per-step path
            table_dtype = None if self._check_step is not None else np.int32
            a = _as_int_array("token_ids", a, 2, table_dtype)
            b = _as_int_array("block_table", b, 2, table_dtype)
            c = _as_int_array("req_rows", c, 1)
            d = _as_int_array("num_computed_tokens", d, 1)
            e = _as_int_array("num_scheduled_tokens", e, 1)
        num_rows, width = b.shape
        r = c.shape[0]
        if (r == 0 or r > self.max_num_reqs or d.shape[0] != r or e.shape[0] != r
                or a.shape[0] != num_rows or (self.table_width is not None and width != self.table_width)):
            self._raise_shape_error(a, b, c, d, e)
        if width != self._width:
            shape = buffer_shapes(self.max_num_tokens, self.max_num_reqs, width)["block_table"]
            self.block_table = np.zeros(shape, dtype=FIELD_DTYPES["block_table"])
            self._width = width
            self._views.clear()
        if num_rows > self._row_mark.shape[0]:
            self._row_mark = np.zeros(num_rows, dtype=np.int64)
        self._stamp += 1
        return a, b, c, d, e, bs

    def _step_views(self, t: int, r: int) -> tuple[np.ndarray, ...]:
        """The output buffers' views for ``t`` tokens and ``r`` requests (remembered: a
        serving engine sees few distinct shapes, and slicing seven arrays costs a microsecond)."""
        views = (self.input_ids[:t], self.positions[:t], self.slot_mapping[:t],
                 self.query_start_loc[:r + 1], self.seq_lens[:r], self.num_computed_tokens[:r],
                 self.block_table[:r])
        if len(self._views) >= defaults.PREPARE_VIEW_MEMO_LIMIT:
            self._views.clear()
        self._views[(t, r)] = views
        return views

    def _raise_shape_error(self, token_ids: np.ndarray, block_table: np.ndarray, rows: np.ndarray,
                           computed: np.ndarray, scheduled: np.ndarray) -> None:
        """The error of a failed batch-size or table-shape check."""
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
        if self.table_width is not None and block_table.shape[1] != self.table_width:
            raise InputError("block_table", f"{block_table.shape[1]} columns; this preparer was "
                                            f"configured for {self.table_width} "
                                            f"(max_model_len / block_size)")
        raise AssertionError("no shape error to report")

    def _step_error(self, code: int, detail: int, token_ids: np.ndarray, block_table: np.ndarray,
                    rows: np.ndarray, computed: np.ndarray, scheduled: np.ndarray,
                    bs: int) -> InputError:
        """The :class:`InputError` for a failed check (``code``, ``detail`` as in step_codes)."""
        k = codes
        i = int(detail)
        if code == k.E_ROW_OUT_OF_RANGE:
            return InputError("req_rows", f"row {int(rows[i])} out of range [0, {token_ids.shape[0]})")
        if code == k.E_SCHEDULED_NOT_POSITIVE:
            return InputError("num_scheduled_tokens",
                              f"request {i} schedules {int(scheduled[i])} tokens; must be >= 1")
        if code == k.E_COMPUTED_NEGATIVE:
            return InputError("num_computed_tokens", f"request {i} has {int(computed[i])}; must be >= 0")
        seq = int(computed[i]) + int(scheduled[i]) if code in (k.E_PAST_TOKEN_TABLE,
                                                                k.E_TABLE_TOO_NARROW) else 0
        if code == k.E_PAST_TOKEN_TABLE:
            return InputError("num_scheduled_tokens",
                              f"request {i} reaches {seq} tokens, past the token table's width "
                              f"(max_model_len={token_ids.shape[1]})")
        if code == k.E_TABLE_TOO_NARROW:
            return InputError("block_table",
                              f"request {i} needs {-(-seq // bs)} blocks of {bs} tokens but the "
                              f"table has {block_table.shape[1]} columns")
        if code == k.E_ROW_REPEATED:
            return InputError("req_rows", f"row {int(rows[i])} is scheduled twice in one step "
                                          f"(request {i})")
        if code == k.E_TOO_MANY_TOKENS:
            return InputError("num_scheduled_tokens",
                              f"{i} tokens in one step exceed max_num_tokens={self.max_num_tokens}")
        if code == k.E_BLOCK_OUT_OF_CACHE:
            return InputError("block_table", f"block {i} is outside the KV cache's "
                                              f"{self.num_blocks} blocks")
        # Token-level codes: ``detail`` is the token's index in the step.
        req = int(np.searchsorted(np.cumsum(np.asarray(scheduled, dtype=np.int64)), i, side="right"))
        row = int(rows[req])
        pos = int(computed[req]) + i - (int(np.asarray(scheduled[:req], dtype=np.int64).sum()))
        if code == k.E_NULL_BLOCK:
            blk = int(block_table[row, pos // bs])
            return InputError("block_table",
                              f"request {req} (row {row}) position {pos} maps to block {blk}: block "
                              f"{defaults.NULL_BLOCK} is the null block and never holds a request's "
                              f"KV; allocate a block before scheduling the token")
        if code == k.E_TOKEN_OUT_OF_VOCAB:
            return InputError("token_ids", f"token id {int(token_ids[row, pos])} outside the "
                                           f"vocabulary [0, {self.vocab_size}) (request {req}, "
                                           f"position {pos})")
        raise AssertionError(f"unknown host-kernel code {code}")


def prepare_inputs(*, token_ids: np.ndarray, block_table: np.ndarray, req_rows: np.ndarray,
                   num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray,
                   block_size: int, kernel: str | None = None) -> ModelInputs:
    """Allocating convenience over :class:`InputPreparer`; the returned arrays are owned."""
    scheduled = _as_int_array("num_scheduled_tokens", num_scheduled_tokens, 1)
    rows = _as_int_array("req_rows", req_rows, 1)
    preparer = InputPreparer(max_num_reqs=max(int(rows.shape[0]), 1),
                             max_num_tokens=max(int(scheduled.clip(min=0).sum()), 1),
                             block_size=block_size, kernel=kernel)
    return preparer.prepare(token_ids=token_ids, block_table=block_table, req_rows=rows,
                            num_computed_tokens=num_computed_tokens,
                            num_scheduled_tokens=scheduled)
