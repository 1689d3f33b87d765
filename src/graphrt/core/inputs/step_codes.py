"""What a step check found and what it says: the codes ``host_loops`` returns, one message each.

A report is six ints (:class:`StepReport`): the code, the request it names (-1: none), what in
that request (column, position, blocks; -1: none), then num_tokens, max_query_len,
max_seq_len. :func:`step_error` turns a failed report into the :class:`~graphrt.InputError`
naming the field and quoting the caller's arrays. Request values are clamped to the int32
range before any sum and summed in int64: nothing overflows, and a clamped value fails exactly
the checks its true value fails."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from graphrt.core import defaults
from graphrt.core.errors import InputError

# In the order the checks are reported; the request each names. Codes 1-6 are the
# request-level bounds every loop indexes by (``check_requests``), the rest the step's.
E_OK = 0
E_ROW_OUT_OF_RANGE = 1      # the first request whose row is outside the tables
E_SCHEDULED_NOT_POSITIVE = 2  # first minimum of scheduled
E_COMPUTED_NEGATIVE = 3     # first minimum of computed
E_COMPUTED_PAST_TABLE = 4   # first maximum of computed (>= the token table's width)
E_PAST_TOKEN_TABLE = 5      # first maximum of seq_lens
E_TABLE_TOO_NARROW = 6      # first maximum of seq_lens; ``at``: the blocks it needs
E_ROW_REPEATED = 7          # the second occurrence
E_TOO_MANY_TOKENS = 8       # none; ``num_tokens``: the step's total
E_NULL_BLOCK = 9            # the first whose attention reads a block id <= 0; ``at``: that column
E_TOKEN_OUT_OF_VOCAB = 10   # the first with a token outside the bound; ``at``: its position
E_BLOCK_OUT_OF_CACHE = 11   # the first whose row holds a block id >= the bound; ``at``: that column
# Recurrent-state slots (``state_slots``, one per table row), checked right after the schedule
# (before codes 9-11): a slot outside the preparer's slots, or one slot held by two requests.
E_STATE_SLOT_OUT_OF_RANGE = 12  # the first request whose slot is outside [0, num_state_slots)
E_STATE_SLOT_REPEATED = 13      # the second request holding a slot


class StepReport(NamedTuple):
    """A check's result, as the loops return it (a plain tuple of these six ints)."""

    code: int
    request: int
    at: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int


class StepArrays(NamedTuple):
    """A step as its caller passed it: what the messages quote."""

    token_ids: object
    block_table: object
    req_rows: object
    num_computed_tokens: object
    num_scheduled_tokens: object
    block_size: int
    state_slots: object = None


class StepLimits(NamedTuple):
    """A preparer's bounds: the configured ones (None: unbounded) and the ones the loops
    check (the int32 outputs' range where none is configured); ``table_width``: the block-table
    columns written out (a wider table's extra columns are checked, never read)."""

    max_num_tokens: int
    vocab_size: int | None
    vocab_bound: int
    num_blocks: int | None
    block_bound: int
    table_width: int | None = None
    num_state_slots: int = 0


def step_error(report: StepReport, step: StepArrays, limits: StepLimits) -> InputError:
    """The :class:`InputError` of a failed check, naming the field and the bound."""
    code, i, at = report.code, report.request, report.at
    token_ids, block_table, rows, computed, scheduled = (
        np.asarray(x) for x in (step.token_ids, step.block_table, step.req_rows,
                                step.num_computed_tokens, step.num_scheduled_tokens))
    if code == E_TOO_MANY_TOKENS:
        return InputError("num_scheduled_tokens", f"{report.num_tokens} tokens in one step exceed "
                                                  f"max_num_tokens={limits.max_num_tokens}")
    if code == E_ROW_OUT_OF_RANGE:
        return InputError("req_rows", f"row {int(rows[i])} out of range [0, {token_ids.shape[0]})")
    if code == E_SCHEDULED_NOT_POSITIVE:
        return InputError("num_scheduled_tokens",
                          f"request {i} schedules {int(scheduled[i])} tokens; must be >= 1")
    if code == E_COMPUTED_NEGATIVE:
        return InputError("num_computed_tokens", f"request {i} has {int(computed[i])}; must be >= 0")
    row, c, n, model_len, bs = int(rows[i]), int(computed[i]), int(scheduled[i]), token_ids.shape[1], step.block_size
    if code == E_COMPUTED_PAST_TABLE:
        return InputError("num_computed_tokens",
                          f"request {i} has {c} computed tokens, at or past the end of the token "
                          f"table (max_model_len={model_len}): no position is left to schedule")
    if code == E_PAST_TOKEN_TABLE:
        return InputError("num_scheduled_tokens",
                          f"request {i} schedules {n} tokens after {c}: {c + n} tokens, past the "
                          f"token table's width (max_model_len={model_len})")
    if code == E_TABLE_TOO_NARROW:
        width = block_table.shape[1]
        if limits.table_width is None or limits.table_width >= width:
            return InputError("block_table", f"request {i} needs {at} blocks of {bs} tokens but the "
                                             f"table has {width} columns")
        return InputError("block_table", f"request {i} needs {at} blocks of {bs} tokens but only the first "
                                         f"{limits.table_width} columns of the table's {width} are read "
                                         f"(table_width: max_model_len / block_size)")
    if code == E_ROW_REPEATED:
        return InputError("req_rows", f"row {row} is scheduled twice in one step (request {i})")
    if code in (E_STATE_SLOT_OUT_OF_RANGE, E_STATE_SLOT_REPEATED):
        slot = int(np.asarray(step.state_slots)[row])
        if code == E_STATE_SLOT_REPEATED:
            return InputError("state_slots", f"state slot {slot} is held by two requests of one step (the second: "
                                             f"request {i}, row {row}): each running request owns its own slot")
        return InputError("state_slots", f"request {i} (row {row}) has state slot {slot}, outside [0, "
                                         f"{limits.num_state_slots}): one slot per running request; slot "
                                         f"{limits.num_state_slots} is the trash slot, padding's alone")
    if code == E_NULL_BLOCK:
        return InputError("block_table",
                          f"request {i} (row {row}) column {at} holds block {int(block_table[row, at])}: "
                          f"its attention reads columns [0, {-(-(c + n) // bs)}) ({c + n} tokens), each "
                          f"a block id >= 1 (block {defaults.NULL_BLOCK} is the null block and never "
                          f"holds a request's KV); allocate the blocks before scheduling the tokens")
    if code == E_TOKEN_OUT_OF_VOCAB:
        vocab = (f"the vocabulary [0, {limits.vocab_size})" if limits.vocab_size == limits.vocab_bound
                 else f"[0, {limits.vocab_bound}): input_ids are int32")
        return InputError("token_ids", f"token id {int(token_ids[row, at])} outside {vocab} "
                                       f"(request {i}, position {at})")
    if code == E_BLOCK_OUT_OF_CACHE:
        where = (f"the KV cache's {limits.num_blocks} blocks" if limits.num_blocks == limits.block_bound
                 else f"[1, {limits.block_bound}): block_table is int32")
        return InputError("block_table", f"block {int(block_table[row, at])} is outside {where} "
                                         f"(request {i}, row {row}, column {at})")
    raise AssertionError(f"unknown host-loop code {code}")
