"""Input preparation: from the engine's persistent tables and this step's schedule to
everything the model and its attention need (vLLM's GPU model runner's ``_prepare_inputs``, vectorised).

Token level (length T = total scheduled tokens): ``input_ids``, ``positions``,
``slot_mapping``. Request level (length R): ``seq_lens``, ``num_computed_tokens``,
``block_table`` rows, and ``query_start_loc`` (length R + 1).

``InputPreparer`` writes into persistent buffers (no allocation per step, results valid
until the next call); ``prepare_inputs`` is the allocating convenience with the same values.
Every bad input raises :class:`~graphrt.core.errors.InputError` before any output is written.
This module is the front: argument checks, the one form both implementations take the
step's arrays in (the compiled loops' variants, :mod:`graphrt.core.host_kernels`), the choice
of implementation (the compiled loops of :mod:`graphrt.core.host_loops`, or
:mod:`graphrt.core.prepare_numpy`), and the error messages for the codes both return.
"""

from __future__ import annotations

import logging
import time
from typing import Mapping, NamedTuple

import numpy as np

from graphrt.core import defaults, host_kernels
from graphrt.core import step_codes as codes
from graphrt.core.errors import GraphrtError, InputError
from graphrt.core.fields import FIELD_DTYPES, INDEX_MAX, ModelInputs, buffer_shapes
from graphrt.core.host_kernels import RequestArrays, as_int_array
from graphrt.core.padding import Padder
from graphrt.core.prepare_numpy import NumpyPrepare

logger = logging.getLogger(__name__)

_INT32, _INT64 = np.dtype(np.int32), np.dtype(np.int64)
_ARRAY = np.ndarray
_FLAGS = host_kernels.CANONICAL_FLAGS
#: Bound of token ids / block ids without a vocabulary / KV cache: the int32 outputs' range.
_ID_LIMIT = INDEX_MAX + 1


class StepShape(NamedTuple):
    """What :meth:`InputPreparer.check` learns of a step: enough to pick its bucket."""

    num_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    uniform_decode: bool


def _check_block_size(bs: int) -> int:
    """A block size in [1, INDEX_MAX] (slots are block * block_size + offset, in int64)."""
    if bs <= 0:
        raise InputError("block_size", f"must be > 0, got {bs}")
    if bs > INDEX_MAX:
        raise InputError("block_size", f"must be <= {INDEX_MAX} (positions are int32), got {bs}")
    return bs


class InputPreparer:
    """Prepares model inputs into persistent host buffers (the fast path).

    ``max_num_reqs`` / ``max_num_tokens`` bound one step; the block-table width is taken
    from the table on first use. ``vocab_size`` / ``num_blocks``, when given, bound every
    scheduled token id and every block id in the scheduled rows (a runner passes its
    model's vocabulary and its KV cache's size; without them the int32 outputs' range bounds
    them); ``table_width`` fixes the block table's number of columns. Every block-table
    column a scheduled request's attention reads ([0, ceil(seq_len / block_size))) must hold a
    block id >= 1 (block 0 is the null block). ``decode_query_len`` is the tokens per request
    of a uniform decode step (1, or 1 + num_speculative_tokens): a step is ``uniform_decode``
    when every request schedules exactly that many.

    ``kernel`` picks the implementation: ``numba`` (one compiled loop per step, see
    :mod:`graphrt.core.host_kernels`), ``numpy`` (vectorised numpy, the reference) or ``auto``
    (numba when it imports). Both give identical results and raise identical errors, and
    accept the same arrays: request arrays of any integer dtype and layout (copied as int32
    into persistent buffers unless they are int32 already), tables of int32 or int64,
    C-contiguous, writeable (the variants :meth:`compile_kernels` compiles). Any other table
    is copied to that form every step with a one-time warning, or with ``strict`` refused with
    an :class:`InputError` naming the field and what to pass, so nothing compiles after warm-up.
    """

    def __init__(self, *, max_num_reqs: int, max_num_tokens: int, block_size: int,
                 vocab_size: int | None = None, num_blocks: int | None = None,
                 table_width: int | None = None, kernel: str | None = None,
                 strict: bool = False, decode_query_len: int = 1) -> None:
        _check_block_size(block_size)
        if decode_query_len < 1:
            raise InputError("decode_query_len", f"must be >= 1, got {decode_query_len}")
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
        self.strict = bool(strict)
        self.decode_query_len = int(decode_query_len)
        self.kernel = host_kernels.resolve_kernel(kernel)
        t, r = self.max_num_tokens, self.max_num_reqs
        numba = self.kernel == "numba"
        # check + write in one call, the same contract on both paths; the numpy path has no
        # separate check / padded write (it prepares in check() and pads in write()).
        self._prepare_step = host_kernels.compiled("prepare_step") if numba else NumpyPrepare(t, r)
        self._check_step = host_kernels.compiled("check_step") if numba else None
        self._write_step = host_kernels.compiled("write_padded_step") if numba else None
        self._pending: tuple[tuple, StepShape] | None = None
        self._row_mark = np.zeros(0, dtype=np.int64)     # last call's stamp per table row
        self._stamp = 0
        self._requests = RequestArrays(r, numba=numba)    # request arrays, as the loops take them
        self._warned: set[tuple[str, str]] = set()
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
        self._vocab_bound = min(self.vocab_size or _ID_LIMIT, _ID_LIMIT)
        self._block_bound = min(self.num_blocks or _ID_LIMIT, _ID_LIMIT)

    def prepare(self, *, token_ids: np.ndarray, block_table: np.ndarray, req_rows: np.ndarray,
                num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray,
                block_size: int | None = None) -> ModelInputs:
        """Compute one step's inputs. Outputs are views of persistent buffers."""
        raw = (token_ids, block_table, req_rows, num_computed_tokens, num_scheduled_tokens)
        args = self._arguments(*raw, block_size)
        self._pending = None
        code, t, max_sched, max_seq = self._prepare_step(
            *args, self.max_num_tokens, self._vocab_bound, self._block_bound, self._row_mark,
            self._stamp, self.input_ids, self.positions, self.slot_mapping, self.query_start_loc,
            self.seq_lens, self.num_computed_tokens, self.block_table)
        if code != codes.E_OK:
            raise self._step_error(code, t, args[5], *raw)
        return self._result(t, args[2].shape[0], max_sched, max_seq)

    def check(self, *, token_ids: np.ndarray, block_table: np.ndarray, req_rows: np.ndarray,
              num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray,
              block_size: int | None = None) -> StepShape:
        """Validate one step (every check of :meth:`prepare`) and return its shape, so the
        caller can pick a bucket before anything is written; :meth:`write` then writes it,
        padded, straight into the bucket's buffers. (The numpy path prepares here, into the
        preparer's own buffers, and pads in :meth:`write`.)"""
        raw = (token_ids, block_table, req_rows, num_computed_tokens, num_scheduled_tokens)
        args = self._arguments(*raw, block_size)
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
            raise self._step_error(code, t, args[5], *raw)
        r = args[2].shape[0]
        shape = StepShape(t, r, max_sched, max_seq, self._uniform(t, r, max_sched))
        self._pending = (args, shape)
        return shape

    def write(self, padder: Padder, *, num_tokens: int, num_reqs: int,
              out: Mapping[str, np.ndarray] | None = None) -> ModelInputs:
        """Write the step of the last successful :meth:`check`, padded by ``padder`` to
        ``num_tokens`` / ``num_reqs``, into ``out`` (as :meth:`Padder.pad` would).

        The step's tables are read again here: don't change them in between (the compiled
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
        """Compile the loops of :meth:`check` / :meth:`write` (a runner's path) now, for every
        table variant the preparer passes them (token and block tables each int32 or int64;
        request arrays always reach them as int32, int64 ones through ``clamp_copy``), so no
        step waits for the JIT and strict mode never compiles; returns the seconds it took (0 on the numpy path). Compiled code
        is cached on disk, so later processes only load it. ``out``: the staging buffers
        ``write`` will get (they receive a one-token dummy step). :meth:`prepare`'s loop
        compiles on its first call."""
        if self._check_step is None:
            return 0.0
        start = time.perf_counter()
        width = self.table_width or 1
        for token_dtype in host_kernels.TABLE_DTYPES:
            for block_dtype in host_kernels.TABLE_DTYPES:      # (request arrays: int64 -> int32 too)
                self.check(token_ids=np.zeros((1, self.block_size), dtype=token_dtype),
                           block_table=np.ones((1, width), dtype=block_dtype),
                           req_rows=np.zeros(1, token_dtype), num_computed_tokens=np.zeros(1, token_dtype),
                           num_scheduled_tokens=np.ones(1, token_dtype))
                self.write(padder, num_tokens=1, num_reqs=1, out=out)
        self._requests.compile()
        self._pending = None
        return time.perf_counter() - start

    def _result(self, t: int, r: int, max_sched: int, max_seq: int) -> ModelInputs:
        """The preparer's own buffers as this step's :class:`ModelInputs`."""
        views = self._views.get((t, r))
        if views is None:
            views = self._step_views(t, r)
        return ModelInputs(*views, r, t, max_sched, max_seq, self._uniform(t, r, max_sched))

    def _uniform(self, t: int, r: int, max_sched: int) -> bool:
        """Every request schedules exactly ``decode_query_len`` tokens (each schedules >= 1, so
        the largest being q and the total r * q means all are q)."""
        q = self.decode_query_len
        return max_sched == q and t == r * q

    def _arguments(self, token_ids: object, block_table: object, req_rows: object,
                   num_computed_tokens: object, num_scheduled_tokens: object,
                   block_size: int | None) -> tuple:
        """The step's arrays in the one form both implementations take (tables int32 / int64
        C-contiguous, request arrays int32: see :mod:`graphrt.core.host_kernels`); sizes the
        persistent scratch for the tables and stamps this call."""
        bs = self.block_size if block_size is None else _check_block_size(int(block_size))
        a, b, c, d, e = token_ids, block_table, req_rows, num_computed_tokens, num_scheduled_tokens
        if not (type(a) is _ARRAY and type(b) is _ARRAY and a.ndim == 2 and b.ndim == 2
                and (a.dtype is _INT32 or a.dtype is _INT64) and (b.dtype is _INT32 or b.dtype is _INT64)
                and a.flags.num & _FLAGS == _FLAGS and b.flags.num & _FLAGS == _FLAGS):
            a, b = self._table("token_ids", a), self._table("block_table", b)
        if not (type(c) is _ARRAY and type(d) is _ARRAY and type(e) is _ARRAY and c.ndim == 1
                and d.ndim == 1 and e.ndim == 1 and c.dtype is _INT32 and d.dtype is _INT32
                and e.dtype is _INT32 and c.flags.num & _FLAGS == _FLAGS
                and d.flags.num & _FLAGS == _FLAGS and e.flags.num & _FLAGS == _FLAGS):
            c, d, e = self._requests.convert(c, d, e)
        num_rows, width = b.shape
        r = c.shape[0]
        if (r == 0 or r > self.max_num_reqs or d.shape[0] != r or e.shape[0] != r
                or a.shape[0] != num_rows or (self.table_width is not None and width != self.table_width)
                or num_rows >= INDEX_MAX or a.shape[1] >= INDEX_MAX):
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

    def _table(self, name: str, value: object) -> np.ndarray:
        """A table the loops have a compiled variant for: ``value`` itself, or (not strict)
        a converted copy with a one-time warning; strict mode raises instead."""
        arr = as_int_array(name, value, 2)
        why = host_kernels.table_variant(arr)
        if why is None:
            return arr
        if self.strict:
            raise InputError(name, f"{why}; strict mode runs only the host-kernel variants compiled "
                                   f"at warm-up: pass a C-contiguous, writeable int32 or int64 array, "
                                   f"e.g. np.array({name}, dtype=np.int32, order='C') (better: keep "
                                   f"the engine's table in that form)")
        if (name, why) not in self._warned:
            self._warned.add((name, why))
            logger.warning("graphrt: %s %s: copied to a C-contiguous int32 / int64 array on every "
                           "step (strict mode refuses it); pass one in that form instead", name, why)
        return host_kernels.canonical_table(arr)

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
        if max(token_ids.shape) >= INDEX_MAX:
            raise InputError("token_ids", f"shape {token_ids.shape}: rows and max_model_len must be "
                                          f"below {INDEX_MAX} (positions and rows are int32)")
        raise AssertionError("no shape error to report")

    def _step_error(self, code: int, detail: int, bs: int, *raw: object) -> InputError:
        """The :class:`InputError` for a failed check (``code``, ``detail`` as in step_codes),
        its values read from the caller's own arrays ``raw`` (not the clamped copies)."""
        token_ids, block_table, rows, computed, scheduled = (np.asarray(x) for x in raw)
        k = codes
        i = int(detail)
        if code == k.E_TOO_MANY_TOKENS:
            return InputError("num_scheduled_tokens",
                              f"{i} tokens in one step exceed max_num_tokens={self.max_num_tokens}")
        if code == k.E_TOKEN_OUT_OF_VOCAB:    # ``detail``: the token's index in the step
            req = int(np.searchsorted(np.cumsum(np.asarray(scheduled, dtype=np.int64)), i, side="right"))
            row = int(rows[req])
            pos = int(computed[req]) + i - (int(np.asarray(scheduled[:req], dtype=np.int64).sum()))
            vocab = (f"the vocabulary [0, {self.vocab_size})" if self.vocab_size == self._vocab_bound
                     else f"[0, {self._vocab_bound}): input_ids are int32")
            return InputError("token_ids", f"token id {int(token_ids[row, pos])} outside {vocab} "
                                           f"(request {req}, position {pos})")
        # The rest: ``detail`` is a request index.
        if code == k.E_ROW_OUT_OF_RANGE:
            return InputError("req_rows", f"row {int(rows[i])} out of range [0, {token_ids.shape[0]})")
        if code == k.E_SCHEDULED_NOT_POSITIVE:
            return InputError("num_scheduled_tokens",
                              f"request {i} schedules {int(scheduled[i])} tokens; must be >= 1")
        if code == k.E_COMPUTED_NEGATIVE:
            return InputError("num_computed_tokens", f"request {i} has {int(computed[i])}; must be >= 0")
        c, n, model_len = int(computed[i]), int(scheduled[i]), token_ids.shape[1]
        if code == k.E_COMPUTED_PAST_TABLE:
            return InputError("num_computed_tokens",
                              f"request {i} has {c} computed tokens, at or past the end of the token "
                              f"table (max_model_len={model_len}): no position is left to schedule")
        if code == k.E_PAST_TOKEN_TABLE:
            return InputError("num_scheduled_tokens",
                              f"request {i} schedules {n} tokens after {c}: {c + n} tokens, past the "
                              f"token table's width (max_model_len={model_len})")
        if code == k.E_TABLE_TOO_NARROW:
            return InputError("block_table",
                              f"request {i} needs {-(-(c + n) // bs)} blocks of {bs} tokens but the "
                              f"table has {block_table.shape[1]} columns")
        if code == k.E_ROW_REPEATED:
            return InputError("req_rows", f"row {int(rows[i])} is scheduled twice in one step "
                                          f"(request {i})")
        if code in (k.E_NULL_BLOCK, k.E_BLOCK_OUT_OF_CACHE):
            row = int(rows[i])
            used = -(-(c + n) // bs)
            if code == k.E_NULL_BLOCK:
                col = int(np.flatnonzero(block_table[row, :used] <= defaults.NULL_BLOCK)[0])
                return InputError("block_table",
                                  f"request {i} (row {row}) column {col} holds block "
                                  f"{int(block_table[row, col])}: its attention reads columns "
                                  f"[0, {used}) ({c + n} tokens), each a block id >= 1 (block "
                                  f"{defaults.NULL_BLOCK} is the null block and never holds a "
                                  f"request's KV); allocate the blocks before scheduling the tokens")
            col = int(np.flatnonzero(block_table[row] >= self._block_bound)[0])
            where = (f"the KV cache's {self.num_blocks} blocks" if self.num_blocks == self._block_bound
                     else f"[1, {self._block_bound}): block_table is int32")
            return InputError("block_table", f"block {int(block_table[row, col])} is outside {where} "
                                             f"(request {i}, row {row}, column {col})")
        raise AssertionError(f"unknown host-kernel code {code}")


def prepare_inputs(*, token_ids: np.ndarray, block_table: np.ndarray, req_rows: np.ndarray,
                   num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray,
                   block_size: int, kernel: str | None = None) -> ModelInputs:
    """Allocating convenience over :class:`InputPreparer`; the returned arrays are owned."""
    tokens = as_int_array("token_ids", token_ids, 2)
    scheduled = as_int_array("num_scheduled_tokens", num_scheduled_tokens, 1)
    rows = as_int_array("req_rows", req_rows, 1)
    # Sized by what a valid step can hold (no request past the token table), not by the
    # schedule: a hostile count must not allocate.
    counts = np.minimum(scheduled, tokens.shape[1]) if scheduled.dtype.kind == "u" else \
        np.clip(scheduled, 0, tokens.shape[1])
    preparer = InputPreparer(max_num_reqs=max(int(rows.shape[0]), 1),
                             max_num_tokens=max(int(counts.sum(dtype=np.int64)), 1),
                             block_size=block_size, kernel=kernel)
    return preparer.prepare(token_ids=tokens, block_table=block_table, req_rows=rows,
                            num_computed_tokens=num_computed_tokens,
                            num_scheduled_tokens=scheduled)
