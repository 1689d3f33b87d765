"""Input preparation: from the engine's persistent tables and this step's schedule to everything
the model and its attention need (vLLM's ``_prepare_inputs``).

Token level: ``input_ids``, ``positions``, ``slot_mapping``; request level: ``seq_lens``,
``num_computed_tokens``, ``block_table`` rows, ``state_slots``, ``query_start_loc`` (R + 1).
``InputPreparer`` writes persistent buffers (valid until the next call); ``prepare_inputs``
allocates. Every bad input raises :class:`~graphrt.core.errors.InputError` before any write.
This module is the front: argument checks, the one array form, and the choice between the
compiled loops (:mod:`graphrt.core.inputs.host_loops`) and the numpy path (:mod:`graphrt.core.inputs.prepare_numpy`)."""

from __future__ import annotations

import time
from typing import Mapping, NamedTuple

import numpy as np

from graphrt.core import defaults

from graphrt.core.inputs import host_kernels, host_loops
from graphrt.core.errors import GraphrtError, InputError
from graphrt.core.inputs.fields import ARRAY_FIELDS, FIELD_DTYPES, FIELDS, INDEX_MAX, ModelInputs, buffer_shapes, field_rows
from graphrt.core.inputs.host_kernels import RequestArrays, as_int_array
from graphrt.core.inputs.forms import compiled_table, shape_error
from graphrt.core.inputs.padding import Padder
from graphrt.core.inputs.prepare_numpy import NumpyPrepare
from graphrt.core.inputs.step_codes import E_OK, StepArrays, StepLimits, StepReport, step_error

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


class _CheckedStep(NamedTuple):
    """The last successful :meth:`InputPreparer.check`: its arrays in the loops' form, and its shape."""

    token_ids: np.ndarray
    block_table: np.ndarray
    req_rows: np.ndarray
    num_computed_tokens: np.ndarray
    num_scheduled_tokens: np.ndarray
    block_size: int
    state_table: np.ndarray
    shape: StepShape


class _Outputs:
    """One set of the preparer's output buffers (every field, in ``ARRAY_FIELDS`` order) and
    their views per step shape (a serving engine sees few shapes; slicing seven arrays costs a
    microsecond)."""

    def __init__(self, max_tokens: int, max_reqs: int, width: int) -> None:
        shapes = buffer_shapes(max_tokens, max_reqs, width)
        self.arrays = tuple(np.zeros(shapes[name], dtype=FIELD_DTYPES[name]) for name in ARRAY_FIELDS)
        self._views: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}

    def views(self, num_tokens: int, num_reqs: int) -> tuple[np.ndarray, ...]:
        """The buffers cut to a step of ``num_tokens`` tokens and ``num_reqs`` requests."""
        views = self._views.get((num_tokens, num_reqs))
        if views is None:
            if len(self._views) >= defaults.PREPARE_VIEW_MEMO_LIMIT:
                self._views.clear()
            views = self._views[(num_tokens, num_reqs)] = tuple(
                arr[:field_rows(FIELDS[name].level, num_tokens, num_reqs)]
                for name, arr in zip(ARRAY_FIELDS, self.arrays))
        return views


def _check_block_size(bs: int) -> int:
    """A block size in [1, INDEX_MAX] (slots are block * block_size + offset, in int64)."""
    if bs <= 0:
        raise InputError("block_size", f"must be > 0, got {bs}")
    if bs > INDEX_MAX:
        raise InputError("block_size", f"must be <= {INDEX_MAX} (positions are int32), got {bs}")
    return bs


class InputPreparer:
    """Prepares model inputs into persistent host buffers (the fast path).

    ``max_num_reqs`` / ``max_num_tokens`` bound one step. ``vocab_size`` / ``num_blocks`` bound
    every scheduled token id and block id (without them: the int32 range). ``table_width``
    fixes the outputs' block-table columns (a wider table's extra columns are checked, never
    written). Every column a request's attention reads must hold a block id >= 1 (0 is the null
    block). ``decode_query_len``: tokens per request of a uniform decode step.
    ``num_state_slots``: a model with recurrent state maps each request to a slot through
    ``state_slots`` (default: its row), distinct within a step.

    ``kernel``: ``numba``, ``numpy`` (the reference) or ``auto``; both give identical results
    and errors. Request arrays of any integer dtype are copied as int32; tables must be int32 or
    int64, C-contiguous and writeable (the variants :meth:`compile_kernels` compiles), else they
    are copied with a one-time warning, or refused with ``strict``, so nothing compiles after
    warm-up.
    """

    def __init__(self, *, max_num_reqs: int, max_num_tokens: int, block_size: int,
                 vocab_size: int | None = None, num_blocks: int | None = None,
                 table_width: int | None = None, kernel: str | None = None,
                 strict: bool = False, decode_query_len: int = 1,
                 num_state_slots: int | None = None, padder: Padder | None = None) -> None:
        _check_block_size(block_size)
        if num_state_slots is not None and not 0 < num_state_slots < INDEX_MAX:
            raise InputError("num_state_slots", f"must be in [1, {INDEX_MAX}) (or None: no state), "
                                                f"got {num_state_slots}")
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
        #: The padder :meth:`write` pads with (default: ``Padder(kernel=kernel)``, the default fills).
        self.padder = padder if padder is not None else Padder(kernel=self.kernel)
        self._vocab_bound = min(self.vocab_size or _ID_LIMIT, _ID_LIMIT)
        self._block_bound = min(self.num_blocks or _ID_LIMIT, _ID_LIMIT)
        self.num_state_slots = int(num_state_slots) if num_state_slots is not None else None
        self._limits = StepLimits(self.max_num_tokens, self.vocab_size, self._vocab_bound,
                                  self.num_blocks, self._block_bound, self.table_width,
                                  self.num_state_slots or 0)
        # Per state slot, the stamp of the last check that scheduled it; last entry: the stamp.
        self._slot_mark = np.zeros((self.num_state_slots or 0) + 1, dtype=np.int64)
        self._no_state = np.zeros(0, dtype=np.int32)          # a model without state: no slot
        self._state_rows = np.zeros(0, dtype=np.int32)        # the default table: row i -> slot i
        self._state_copy = np.zeros(0, dtype=np.int32)        # a table of another form, as int32
        self._state_wide = np.zeros(0, dtype=np.int64)        # its clamping scratch
        numba = self.kernel == "numba"
        numpy_path = None if numba else NumpyPrepare(self.max_num_tokens, self.max_num_reqs)
        # The same three entry points on both paths (host_loops' signatures).
        self._check_step = host_kernels.compiled("check_step") if numba else host_loops.check_step
        self._prepare_step = host_kernels.compiled("prepare_step") if numba else numpy_path.prepare_step
        self._write_step = host_kernels.compiled("write_checked_step") if numba else numpy_path.write_checked_step
        #: The padder's compiled loop, called here (the numpy path goes through ``Padder.fill``).
        self._fill_padding = host_kernels.compiled("fill_padding") if numba else None
        self._targets: dict[tuple[int, int, int], tuple[object, object, tuple[np.ndarray, ...]]] = {}
        self._requests = RequestArrays(self.max_num_reqs, compiled_copy=numba)
        self._pending: _CheckedStep | None = None
        # Per table row, the stamp of the last check that scheduled it; last entry: the stamp.
        self._row_mark = np.zeros(1, dtype=np.int64)
        self._warned: set[tuple[str, str]] = set()
        # prepare() writes into the spare set and hands it out only when the step passed, so
        # a refused step leaves the previous result as it was (allocated by its first call).
        self._outputs: tuple[_Outputs, ...] = ()
        self._spare = 0
        self._width = -1                                  # the outputs' block-table width

    def prepare(self, *, token_ids: np.ndarray, block_table: np.ndarray, req_rows: np.ndarray,
                num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray,
                block_size: int | None = None, state_slots: np.ndarray | None = None) -> ModelInputs:
        """Compute one step's inputs. Outputs are views of persistent buffers, valid until the
        next call; a refused step leaves them as they were."""
        self._pending = None
        tokens, blocks, rows, computed, scheduled = self._step_arrays(
            token_ids, block_table, req_rows, num_computed_tokens, num_scheduled_tokens,
            int64_requests=True)
        states = (self._no_state if state_slots is None and self.num_state_slots is None else
                  self._state_table(state_slots, blocks.shape[0]))
        bs = self.block_size if block_size is None else _check_block_size(int(block_size))
        width = self.table_width or blocks.shape[1]         # a wider table's extra columns: not written
        if width != self._width:
            self._width = width
            self._outputs = (_Outputs(self.max_num_tokens, self.max_num_reqs, width),
                             _Outputs(self.max_num_tokens, self.max_num_reqs, width))
        out = self._outputs[self._spare]
        code, request, at, num_tokens, max_query_len, max_seq_len = self._prepare_step(
            tokens, blocks, rows, computed, scheduled, bs, self.max_num_tokens, self._vocab_bound,
            self._block_bound, self._row_mark, states, self._slot_mark, *out.arrays)
        if code != E_OK:
            raise step_error(StepReport(code, request, at, num_tokens, max_query_len, max_seq_len),
                             StepArrays(token_ids, block_table, req_rows, num_computed_tokens,
                                        num_scheduled_tokens, bs,
                                        states if state_slots is None else state_slots), self._limits)
        self._spare = 1 - self._spare
        num_reqs = rows.shape[0]
        query_len = self.decode_query_len
        return ModelInputs(*out.views(num_tokens, num_reqs), num_reqs, num_tokens, max_query_len,
                           max_seq_len, max_query_len == query_len and num_tokens == num_reqs * query_len)

    def check(self, *, token_ids: np.ndarray, block_table: np.ndarray, req_rows: np.ndarray,
              num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray,
              block_size: int | None = None, state_slots: np.ndarray | None = None) -> StepShape:
        """Validate one step (every check of :meth:`prepare`), writing nothing, and return its
        shape, so the caller can pick a bucket first; :meth:`write` then writes it, padded,
        straight into the bucket's buffers."""
        self._pending = None
        tokens, blocks, rows, computed, scheduled = self._step_arrays(
            token_ids, block_table, req_rows, num_computed_tokens, num_scheduled_tokens,
            int64_requests=False)
        states = (self._no_state if state_slots is None and self.num_state_slots is None else
                  self._state_table(state_slots, blocks.shape[0]))
        bs = self.block_size if block_size is None else _check_block_size(int(block_size))
        code, request, at, num_tokens, max_query_len, max_seq_len = self._check_step(
            tokens, blocks, rows, computed, scheduled, bs, self.max_num_tokens, self._vocab_bound,
            self._block_bound, self._row_mark, states, self._slot_mark, self.table_width or blocks.shape[1])
        if code != E_OK:
            raise step_error(StepReport(code, request, at, num_tokens, max_query_len, max_seq_len),
                             StepArrays(token_ids, block_table, req_rows, num_computed_tokens,
                                        num_scheduled_tokens, bs,
                                        states if state_slots is None else state_slots), self._limits)
        num_reqs = rows.shape[0]
        query_len = self.decode_query_len
        shape = StepShape(num_tokens, num_reqs, max_query_len, max_seq_len,
                          max_query_len == query_len and num_tokens == num_reqs * query_len)
        self._pending = _CheckedStep(tokens, blocks, rows, computed, scheduled, bs, states, shape)
        return shape

    def write(self, *, num_tokens: int, num_reqs: int,
              out: Mapping[str, np.ndarray] | None = None) -> ModelInputs:
        """Write the step of the last successful :meth:`check`, padded by the preparer's
        :attr:`padder` to ``num_tokens`` / ``num_reqs``, into ``out`` (as :meth:`Padder.pad` would).

        The step's tables are read again here: don't change them in between (the request
        check of :meth:`check`, ``host_loops.check_requests``, runs again, and a step that no
        longer passes it, or has another token count, is refused with nothing written)."""
        step = self._pending
        if step is None:
            raise GraphrtError("InputPreparer.write needs a successful check() of this step first")
        shape, padder = step.shape, self.padder
        if num_tokens < shape.num_tokens or num_reqs < shape.num_reqs:
            padder.check_targets(shape.num_tokens, shape.num_reqs, num_tokens, num_reqs)
        width = self.table_width or step.block_table.shape[1]
        memo = self._targets.get((num_tokens, num_reqs, width))
        if memo is not None and memo[0] is out and memo[1] is padder:
            targets = memo[2]
        else:                       # the padder's views of ``out``, remembered per bucket
            targets = padder.targets(out, num_tokens, num_reqs, width)
            if len(self._targets) >= defaults.PREPARE_VIEW_MEMO_LIMIT:
                self._targets.clear()
            self._targets[(num_tokens, num_reqs, width)] = (out, padder, targets)
        if not self._write_step(step.token_ids, step.block_table, step.req_rows, step.num_computed_tokens,
                                step.num_scheduled_tokens, step.block_size, shape.num_tokens, step.state_table,
                                self._slot_mark, *targets):
            self._pending = None
            raise GraphrtError("the step's request arrays changed between InputPreparer.check() "
                               "and write(); check the step again")
        if self._fill_padding is not None:
            self._fill_padding(shape.num_tokens, shape.num_reqs, padder.kernel_rules, *targets)
        else:
            padder.fill(shape.num_tokens, shape.num_reqs, targets)
        return ModelInputs(*targets, shape.num_reqs, shape.num_tokens, shape.max_query_len,
                           shape.max_seq_len, shape.uniform_decode)

    def compile_kernels(self, out: Mapping[str, np.ndarray] | None = None) -> float:
        """Compile the loops of :meth:`check` / :meth:`write` (a runner's path) now, for every
        table variant the preparer passes them (token and block tables each int32 or int64;
        request arrays always reach them as int32, int64 ones through ``clamp_requests``), so no
        step waits for the JIT and strict mode never compiles; returns the seconds it took (0
        on the numpy path). Compiled code is cached on disk, so later processes only load it.
        ``out``: the staging buffers ``write`` will get (they receive a one-token dummy step).
        :meth:`prepare`'s loop compiles on its first call."""
        if self.kernel != "numba":
            return 0.0
        start = time.perf_counter()
        width = self.table_width or 1
        for token_dtype in host_kernels.TABLE_DTYPES:
            for block_dtype in host_kernels.TABLE_DTYPES:      # (request arrays: int64 -> int32 too)
                self.check(token_ids=np.zeros((1, self.block_size), dtype=token_dtype),
                           block_table=np.ones((1, width), dtype=block_dtype),
                           req_rows=np.zeros(1, token_dtype), num_computed_tokens=np.zeros(1, token_dtype),
                           num_scheduled_tokens=np.ones(1, token_dtype))
                self.write(num_tokens=1, num_reqs=1, out=out)
        self._requests.compile()
        self._pending = None
        return time.perf_counter() - start

    def _step_arrays(self, token_ids: object, block_table: object, req_rows: object,
                     num_computed_tokens: object, num_scheduled_tokens: object, *,
                     int64_requests: bool) -> tuple[np.ndarray, ...]:
        """The step's arrays in the one form both implementations take (tables int32 / int64
        C-contiguous; request arrays int32, or all three int64 when ``int64_requests``: see
        :mod:`graphrt.core.inputs.host_kernels`), their shapes checked; sizes the row scratch."""
        tokens, blocks = token_ids, block_table
        if not (type(tokens) is _ARRAY and type(blocks) is _ARRAY and tokens.ndim == 2 and blocks.ndim == 2
                and (tokens.dtype is _INT32 or tokens.dtype is _INT64)
                and (blocks.dtype is _INT32 or blocks.dtype is _INT64)
                and tokens.flags.num & blocks.flags.num & _FLAGS == _FLAGS):
            tokens = compiled_table("token_ids", tokens, self.strict, self._warned)
            blocks = compiled_table("block_table", blocks, self.strict, self._warned)
        rows, computed, scheduled = req_rows, num_computed_tokens, num_scheduled_tokens
        if not (type(rows) is _ARRAY and type(computed) is _ARRAY and type(scheduled) is _ARRAY
                and rows.ndim == 1 and computed.ndim == 1 and scheduled.ndim == 1
                and (rows.dtype is _INT32 or (int64_requests and rows.dtype is _INT64))
                and computed.dtype is rows.dtype and scheduled.dtype is rows.dtype
                and rows.flags.num & computed.flags.num & scheduled.flags.num & _FLAGS == _FLAGS):
            rows, computed, scheduled = self._requests.convert(rows, computed, scheduled)
        num_rows, width = blocks.shape
        num_reqs = rows.shape[0]
        if (num_reqs == 0 or num_reqs > self.max_num_reqs or computed.shape[0] != num_reqs
                or scheduled.shape[0] != num_reqs or tokens.shape[0] != num_rows
                or (self.table_width is not None and width < self.table_width)
                or num_rows >= INDEX_MAX or tokens.shape[1] >= INDEX_MAX):
            raise shape_error(tokens, blocks, rows, computed, scheduled, self.max_num_reqs, self.table_width)
        if num_rows >= self._row_mark.shape[0]:
            self._row_mark = np.zeros(num_rows + 1, dtype=np.int64)
        return tokens, blocks, rows, computed, scheduled

    def _state_table(self, state_slots: object, num_rows: int) -> np.ndarray:
        """The step's state slots per table row as the loops take them (int32, C-contiguous):
        empty for a model without state; the rows themselves when none are passed."""
        if self.num_state_slots is None:
            if state_slots is not None:
                raise InputError("state_slots", "this step's model keeps no recurrent state "
                                                "(num_state_slots=None): pass no state_slots")
            return self._no_state
        if state_slots is None:
            if self._state_rows.shape[0] < num_rows:
                self._state_rows = np.arange(max(num_rows, 2 * self._state_rows.shape[0]), dtype=np.int32)
            return self._state_rows[:num_rows]
        table = state_slots
        if not (type(table) is _ARRAY and table.dtype is _INT32 and table.ndim == 1
                and table.flags.num & _FLAGS == _FLAGS):
            arr = as_int_array("state_slots", table, 1)
            if self._state_copy.shape[0] < arr.shape[0]:
                self._state_copy = np.zeros(arr.shape[0], dtype=np.int32)
                self._state_wide = np.zeros(arr.shape[0], dtype=np.int64)
            table = self._state_copy[:arr.shape[0]]
            host_kernels.clamp_into(arr, table, self._state_wide[:arr.shape[0]])
        if table.shape[0] != num_rows:
            raise InputError("state_slots", f"{table.shape[0]} entries but the tables have {num_rows} rows: "
                                            f"one state slot per table row (indexed by req_rows)")
        return table


def prepare_inputs(*, token_ids: np.ndarray, block_table: np.ndarray, req_rows: np.ndarray,
                   num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray,
                   block_size: int, kernel: str | None = None, state_slots: np.ndarray | None = None,
                   num_state_slots: int | None = None) -> ModelInputs:
    """Allocating convenience over :class:`InputPreparer`; the returned arrays are owned.
    ``state_slots`` (one per table row) need ``num_state_slots`` (default: the table's rows)."""
    tokens = as_int_array("token_ids", token_ids, 2)
    scheduled = as_int_array("num_scheduled_tokens", num_scheduled_tokens, 1)
    rows = as_int_array("req_rows", req_rows, 1)
    # Sized by what a valid step can hold (no request past the token table), not by the
    # schedule: a hostile count must not allocate.
    counts = np.minimum(scheduled, tokens.shape[1]) if scheduled.dtype.kind == "u" else \
        np.clip(scheduled, 0, tokens.shape[1])
    preparer = InputPreparer(max_num_reqs=max(int(rows.shape[0]), 1),
                             max_num_tokens=max(int(counts.sum(dtype=np.int64)), 1),
                             block_size=block_size, kernel=kernel,
                             num_state_slots=(num_state_slots if num_state_slots is not None or state_slots is None
                                              else max(int(tokens.shape[0]), 1)))
    return preparer.prepare(token_ids=tokens, block_table=block_table, req_rows=rows,
                            num_computed_tokens=num_computed_tokens,
                            num_scheduled_tokens=scheduled, state_slots=state_slots)
