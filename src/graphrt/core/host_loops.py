"""The numba loops behind :mod:`graphrt.core.host_kernels` (imported only where numba imports).

Each function is the compiled form of one rule of input preparation or padding; the
vectorised-numpy code in :mod:`graphrt.core.prepare_numpy` and :mod:`graphrt.core.padding` is
the reference they are tested against. Every index a loop uses is validated first, by
``check_requests`` (the request-level bounds every loop here indexes by: ``check_step`` starts
with it, ``write_padded_step`` runs it again), so the loops run without bounds checks; it
clamps each request value to the int32 range before any sum, so no bound overflows.
Padding applies the padder's rule table (``Padder.kernel_rules``): no field's fill or length
is written here.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.extending import overload

from graphrt.core import defaults, fields
from graphrt.core.step_codes import (E_BLOCK_OUT_OF_CACHE, E_COMPUTED_NEGATIVE, E_COMPUTED_PAST_TABLE,
                                     E_NULL_BLOCK, E_OK, E_PAST_TOKEN_TABLE, E_ROW_OUT_OF_RANGE,
                                     E_ROW_REPEATED, E_SCHEDULED_NOT_POSITIVE, E_TABLE_TOO_NARROW,
                                     E_TOKEN_OUT_OF_VOCAB, E_TOO_MANY_TOKENS)

_OPTIONS = dict(nogil=True, boundscheck=False, error_model="numpy")
jit = numba.njit(cache=True, **_OPTIONS)

#: :func:`graphrt.core.fields.field_rows`, compiled: the rows of a field's level in a step.
field_rows = jit(fields.field_rows)

_LOW = -fields.INDEX_MAX - 1
_HIGH = fields.INDEX_MAX


@jit
def clamp(x):
    """``x`` as int64, bounded to the int32 range: every request value passes here before
    it is summed, so no check overflows (see ``step_codes``)."""
    return min(max(np.int64(x), np.int64(_LOW)), np.int64(_HIGH))


@jit
def clamp_copy(src, out, k):
    """``out[k, i] = clamp(src[i])``: an int64 request array into row ``k`` of the preparer's
    int32 request buffer, the form the loops take (one compiled variant: the preparer calls it
    for C-contiguous int64 arrays only, with its whole buffer)."""
    for i in range(src.shape[0]):
        out[k, i] = clamp(src[i])


@jit
def clamp_requests(rows, computed, scheduled, out):
    """``clamp_copy`` of all three request arrays in one call (when all are int64)."""
    clamp_copy(rows, out, 0)
    clamp_copy(computed, out, 1)
    clamp_copy(scheduled, out, 2)


@jit
def check_requests(token_ids, block_table, rows, computed, scheduled, block_size):
    """The request-level bounds, in one pass: every row inside the tables, every request
    scheduling >= 1 token from a computed length >= 0, within the token table and the block
    table. Returns ``(E_OK, num_tokens, max_query_len, max_seq_len)`` or ``(code, detail, 0, 0)``."""
    r = rows.shape[0]
    num_rows = token_ids.shape[0]
    model_len = token_ids.shape[1]
    width = block_table.shape[1]
    bs = np.int64(block_size)
    bad_row = -1
    min_sched_i = 0
    min_comp_i = 0
    max_comp_i = 0
    max_seq_i = 0
    min_sched = np.int64(_HIGH)
    min_comp = np.int64(_HIGH)
    max_comp = np.int64(_LOW)
    max_sched = np.int64(_LOW)
    max_seq = np.int64(2 * _LOW)
    total = np.int64(0)
    for i in range(r):
        row = np.int64(rows[i])
        c = clamp(computed[i])
        n = clamp(scheduled[i])
        if bad_row < 0 and (row < 0 or row >= num_rows):
            bad_row = i
        if n < min_sched:
            min_sched, min_sched_i = n, i
        if c < min_comp:
            min_comp, min_comp_i = c, i
        if c > max_comp:
            max_comp, max_comp_i = c, i
        if n > max_sched:
            max_sched = n
        if c + n > max_seq:
            max_seq, max_seq_i = c + n, i
        total += n
    if bad_row >= 0:
        return E_ROW_OUT_OF_RANGE, bad_row, 0, 0
    if min_sched <= 0:
        return E_SCHEDULED_NOT_POSITIVE, min_sched_i, 0, 0
    if min_comp < 0:
        return E_COMPUTED_NEGATIVE, min_comp_i, 0, 0
    if max_comp >= model_len:
        return E_COMPUTED_PAST_TABLE, max_comp_i, 0, 0
    if max_seq > model_len:
        return E_PAST_TOKEN_TABLE, max_seq_i, 0, 0
    if (max_seq + bs - 1) // bs > width:
        return E_TABLE_TOO_NARROW, max_seq_i, 0, 0
    return E_OK, total, max_sched, max_seq


@jit
def check_step(token_ids, block_table, rows, computed, scheduled, block_size, max_tokens,
               vocab_size, num_blocks, row_mark, stamp):
    """Every bound of one step, writing nothing but ``row_mark`` (scratch): ``check_requests``,
    then rows scheduled once, the token budget, a block id in [1, num_blocks) in every
    column the step's attention reads ([0, ceil(seq_len / block_size)) of each scheduled row)
    and none >= num_blocks anywhere in those rows, and every scheduled token id in
    [0, vocab_size). Returns ``(E_OK, num_tokens, max_query_len, max_seq_len)`` or
    ``(code, detail, 0, 0)``. The bounds must be > 0 (the preparer passes the int32 range
    when it has none)."""
    result = check_requests(token_ids, block_table, rows, computed, scheduled, block_size)
    if result[0] != E_OK:
        return result
    total = result[1]
    r = rows.shape[0]
    width = block_table.shape[1]
    bs = np.int64(block_size)
    for i in range(r):
        row = np.int64(rows[i])
        if row_mark[row] == stamp:
            return E_ROW_REPEATED, i, 0, 0
        row_mark[row] = stamp
    if total > max_tokens:
        return E_TOO_MANY_TOKENS, total, 0, 0
    # ---- block ids, per scheduled row: min over the columns attention reads, max over all
    # (a captured graph's static block table may be read anywhere); two plain loops in the
    # table's own dtype, which LLVM vectorises ----
    high_i = -1
    for i in range(r):
        row = np.int64(rows[i])
        used = (np.int64(computed[i]) + np.int64(scheduled[i]) + bs - 1) // bs   # >= 1
        lo = block_table[row, 0]
        for col in range(used):
            b = block_table[row, col]
            if b < lo:
                lo = b
        if lo <= defaults.NULL_BLOCK:
            return E_NULL_BLOCK, i, 0, 0
        hi = block_table[row, 0]
        for col in range(width):
            b = block_table[row, col]
            if b > hi:
                hi = b
        if high_i < 0 and hi >= num_blocks:
            high_i = i
    # ---- token ids: every scheduled position's id in the vocabulary ----
    k = np.int64(0)
    for i in range(r):
        row = np.int64(rows[i])
        c = np.int64(computed[i])
        end = c + np.int64(scheduled[i])
        for q in range(c, end):
            tok = np.int64(token_ids[row, q])
            if tok < 0 or tok >= vocab_size:
                return E_TOKEN_OUT_OF_VOCAB, k + q - c, 0, 0
        k += end - c
    if high_i >= 0:
        return E_BLOCK_OUT_OF_CACHE, high_i, 0, 0
    return result


@jit
def write_step(token_ids, block_table, rows, computed, scheduled, block_size, input_ids,
               positions, slot_mapping, query_start_loc, seq_lens, num_computed, block_table_out):
    """Write one checked step's inputs (as vLLM's ``_prepare_inputs``): ids, positions and
    slots per token, one block at a time; query_start_loc, seq_lens, computed and block-table
    rows per request."""
    r = rows.shape[0]
    width = block_table.shape[1]
    bs = np.int64(block_size)
    k = np.int64(0)
    query_start_loc[0] = 0
    for i in range(r):
        row = np.int64(rows[i])
        c = np.int64(computed[i])
        n = np.int64(scheduled[i])
        end = c + n
        num_computed[i] = c
        seq_lens[i] = end
        for col in range(width):
            block_table_out[i, col] = block_table[row, col]
        if n == 1:                                   # decode: one token, no inner loops
            col = c // bs
            positions[k] = c
            input_ids[k] = token_ids[row, c]
            slot_mapping[k] = np.int64(block_table[row, col]) * bs + (c - col * bs)
        else:
            ids_out = input_ids[k:k + n]
            pos_out = positions[k:k + n]
            slots_out = slot_mapping[k:k + n]
            for j in range(n):
                pos_out[j] = c + j
                ids_out[j] = token_ids[row, c + j]
            p = c
            while p < end:                           # one block at a time: consecutive slots
                col = p // bs
                stop = min((col + 1) * bs, end)
                base = np.int64(block_table[row, col]) * bs - col * bs
                for q in range(p, stop):
                    slots_out[q - c] = base + q
                p = stop
        k += n
        query_start_loc[i + 1] = k


def copy_row(dst, i, src, j):
    """``dst[i] = src[j]`` for one row of a field: a value, or a block-table row (compiled
    per array rank below; numba's own array assignment is several times slower)."""


def fill_row(dst, i, value):
    """``dst[i] = value`` for one row of a field, as :func:`copy_row`."""


@overload(copy_row, jit_options=_OPTIONS)
def _copy_row(dst, i, src, j):
    if dst.ndim == 1:
        def impl(dst, i, src, j):
            dst[i] = src[j]
    else:
        def impl(dst, i, src, j):
            for col in range(dst.shape[1]):
                dst[i, col] = src[j, col]
    return impl


@overload(fill_row, jit_options=_OPTIONS)
def _fill_row(dst, i, value):
    if dst.ndim == 1:
        def impl(dst, i, value):
            dst[i] = value
    else:
        def impl(dst, i, value):
            for col in range(dst.shape[1]):
                dst[i, col] = value
    return impl


@jit
def pad_rows(arr, rule, num_tokens, num_reqs):
    """One field's padding rule on its bucket-sized ``arr``: the rows past the real ones get
    the fill, or a copy of the last real row. ``rule`` is the field's row of
    ``Padder.kernel_rules``: its level (per token, per request, extra), fill, repeat_last."""
    real = field_rows((rule[0], rule[1], rule[2]), num_tokens, num_reqs)
    if rule[4]:
        for i in range(real, arr.shape[0]):
            copy_row(arr, i, arr, real - 1)
    else:
        for i in range(real, arr.shape[0]):
            fill_row(arr, i, rule[3])


@jit
def fill_padding(num_tokens, num_reqs, rules, input_ids, positions, slot_mapping,
                 query_start_loc, seq_lens, num_computed, block_table):
    """The padding rules (``rules``: one row per field, in ``fields.ARRAY_FIELDS`` order) on a
    step written into bucket-sized arrays."""
    pad_rows(input_ids, rules[0], num_tokens, num_reqs)
    pad_rows(positions, rules[1], num_tokens, num_reqs)
    pad_rows(slot_mapping, rules[2], num_tokens, num_reqs)
    pad_rows(query_start_loc, rules[3], num_tokens, num_reqs)
    pad_rows(seq_lens, rules[4], num_tokens, num_reqs)
    pad_rows(num_computed, rules[5], num_tokens, num_reqs)
    pad_rows(block_table, rules[6], num_tokens, num_reqs)


@jit
def prepare_step(token_ids, block_table, rows, computed, scheduled, block_size, max_tokens,
                 vocab_size, num_blocks, row_mark, stamp, input_ids, positions, slot_mapping,
                 query_start_loc, seq_lens, num_computed, block_table_out):
    """``check_step``, then ``write_step`` when every check passed (one call per step)."""
    result = check_step(token_ids, block_table, rows, computed, scheduled, block_size, max_tokens,
                        vocab_size, num_blocks, row_mark, stamp)
    if result[0] == E_OK:
        write_step(token_ids, block_table, rows, computed, scheduled, block_size, input_ids,
                   positions, slot_mapping, query_start_loc, seq_lens, num_computed,
                   block_table_out)
    return result


@jit
def write_padded_step(token_ids, block_table, rows, computed, scheduled, block_size, num_tokens,
                      rules, input_ids, positions, slot_mapping, query_start_loc, seq_lens,
                      num_computed, block_table_out):
    """``write_step`` then ``fill_padding``: a checked step of ``num_tokens`` tokens straight
    into a bucket's buffers (the caller checked that they hold the step). The loops index by
    the request arrays, so ``check_requests`` runs again first: returns False, writing
    nothing, if the step no longer passes it or no longer has ``num_tokens`` tokens (it
    changed since ``check_step``)."""
    result = check_requests(token_ids, block_table, rows, computed, scheduled, block_size)
    if result[0] != E_OK or result[1] != num_tokens:
        return False
    write_step(token_ids, block_table, rows, computed, scheduled, block_size, input_ids,
               positions, slot_mapping, query_start_loc, seq_lens, num_computed, block_table_out)
    fill_padding(num_tokens, rows.shape[0], rules, input_ids, positions, slot_mapping,
                 query_start_loc, seq_lens, num_computed, block_table_out)
    return True


@jit
def holds(src, dst, rule, num_tokens, num_reqs):
    """Whether ``src`` has a field's real rows and ``dst`` room for them, rows equally wide."""
    real = field_rows((rule[0], rule[1], rule[2]), num_tokens, num_reqs)
    return src.shape[0] >= real and dst.shape[0] >= real and src.shape[1:] == dst.shape[1:]


@jit
def copy_rows(src, dst, rule, num_tokens, num_reqs):
    """A field's real rows from ``src`` into ``dst``."""
    for i in range(field_rows((rule[0], rule[1], rule[2]), num_tokens, num_reqs)):
        copy_row(dst, i, src, i)


@jit
def pad_step(num_tokens, num_reqs, rules, input_ids, positions, slot_mapping, query_start_loc,
             seq_lens, num_computed, block_table, o_input_ids, o_positions, o_slot_mapping,
             o_query_start_loc, o_seq_lens, o_num_computed, o_block_table):
    """Copy the real rows of prepared inputs into bucket-sized outputs, then ``fill_padding``.
    Returns False, writing nothing, when an input is shorter than the real counts or an
    output is."""
    if not (holds(input_ids, o_input_ids, rules[0], num_tokens, num_reqs)
            and holds(positions, o_positions, rules[1], num_tokens, num_reqs)
            and holds(slot_mapping, o_slot_mapping, rules[2], num_tokens, num_reqs)
            and holds(query_start_loc, o_query_start_loc, rules[3], num_tokens, num_reqs)
            and holds(seq_lens, o_seq_lens, rules[4], num_tokens, num_reqs)
            and holds(num_computed, o_num_computed, rules[5], num_tokens, num_reqs)
            and holds(block_table, o_block_table, rules[6], num_tokens, num_reqs)):
        return False
    copy_rows(input_ids, o_input_ids, rules[0], num_tokens, num_reqs)
    copy_rows(positions, o_positions, rules[1], num_tokens, num_reqs)
    copy_rows(slot_mapping, o_slot_mapping, rules[2], num_tokens, num_reqs)
    copy_rows(query_start_loc, o_query_start_loc, rules[3], num_tokens, num_reqs)
    copy_rows(seq_lens, o_seq_lens, rules[4], num_tokens, num_reqs)
    copy_rows(num_computed, o_num_computed, rules[5], num_tokens, num_reqs)
    copy_rows(block_table, o_block_table, rules[6], num_tokens, num_reqs)
    fill_padding(num_tokens, num_reqs, rules, o_input_ids, o_positions, o_slot_mapping,
                 o_query_start_loc, o_seq_lens, o_num_computed, o_block_table)
    return True
