"""The numba loops behind :mod:`graphrt.core.host_kernels` (imported only where numba imports).

Each function is the compiled form of one rule of input preparation or padding; the
vectorised-numpy code in :mod:`graphrt.core.inputs` and :mod:`graphrt.core.padding` is the reference
they are tested against. Indices are validated by ``check_step`` before any loop uses them:
the loops run without bounds checks.
"""

from __future__ import annotations

import numba
import numpy as np

from graphrt.core import defaults
from graphrt.core.step_codes import (E_BLOCK_OUT_OF_CACHE, E_COMPUTED_NEGATIVE, E_NULL_BLOCK, E_OK,
                                     E_PAST_TOKEN_TABLE, E_ROW_OUT_OF_RANGE, E_ROW_REPEATED,
                                     E_SCHEDULED_NOT_POSITIVE, E_TABLE_TOO_NARROW, E_TOKEN_OUT_OF_VOCAB,
                                     E_TOO_MANY_TOKENS)

jit = numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")


@jit
def check_step(token_ids, block_table, rows, computed, scheduled, block_size, max_tokens,
               vocab_size, num_blocks, row_mark, stamp):
    """Every bound of one step, writing nothing but ``row_mark`` (scratch). Returns
    ``(E_OK, num_tokens, max_query_len, max_seq_len)`` or ``(code, detail, 0, 0)``;
    ``vocab_size`` / ``num_blocks`` <= 0 skip those two checks."""
    r = rows.shape[0]
    num_rows = token_ids.shape[0]
    model_len = token_ids.shape[1]
    width = block_table.shape[1]
    bs = np.int64(block_size)
    # ---- request-level bounds, one pass ----
    bad_row = -1
    min_sched_i = 0
    min_comp_i = 0
    max_seq_i = 0
    max_sched = np.int64(0)
    max_seq = np.int64(0)
    total = np.int64(0)
    for i in range(r):
        row = np.int64(rows[i])
        c = np.int64(computed[i])
        n = np.int64(scheduled[i])
        if bad_row < 0 and (row < 0 or row >= num_rows):
            bad_row = i
        if n < np.int64(scheduled[min_sched_i]):
            min_sched_i = i
        if c < np.int64(computed[min_comp_i]):
            min_comp_i = i
        if n > max_sched:
            max_sched = n
        if c + n > max_seq or i == 0:
            max_seq = c + n
            max_seq_i = i
        total += n
    if bad_row >= 0:
        return E_ROW_OUT_OF_RANGE, bad_row, 0, 0
    if np.int64(scheduled[min_sched_i]) <= 0:
        return E_SCHEDULED_NOT_POSITIVE, min_sched_i, 0, 0
    if np.int64(computed[min_comp_i]) < 0:
        return E_COMPUTED_NEGATIVE, min_comp_i, 0, 0
    if max_seq > model_len:
        return E_PAST_TOKEN_TABLE, max_seq_i, 0, 0
    if (max_seq + bs - 1) // bs > width:
        return E_TABLE_TOO_NARROW, max_seq_i, 0, 0
    for i in range(r):
        row = np.int64(rows[i])
        if row_mark[row] == stamp:
            return E_ROW_REPEATED, i, 0, 0
        row_mark[row] = stamp
    if total > max_tokens:
        return E_TOO_MANY_TOKENS, total, 0, 0
    # ---- token-level bounds: every scheduled position has a block (and an id in the vocab) ----
    k = np.int64(0)
    for i in range(r):
        row = np.int64(rows[i])
        c = np.int64(computed[i])
        end = c + np.int64(scheduled[i])
        for col in range(c // bs, (end - 1) // bs + 1):
            if block_table[row, col] <= defaults.NULL_BLOCK:
                return E_NULL_BLOCK, k + max(col * bs - c, 0), 0, 0
        k += end - c
    if vocab_size > 0:
        k = 0
        for i in range(r):
            row = np.int64(rows[i])
            c = np.int64(computed[i])
            end = c + np.int64(scheduled[i])
            for q in range(c, end):
                tok = token_ids[row, q]
                if tok < 0 or tok >= vocab_size:
                    return E_TOKEN_OUT_OF_VOCAB, k + q - c, 0, 0
            k += end - c
    if num_blocks > 0:
        top = np.int64(block_table[np.int64(rows[0]), 0])
        for i in range(r):
            row = np.int64(rows[i])
            for col in range(width):
                if block_table[row, col] > top:
                    top = np.int64(block_table[row, col])
        if top >= num_blocks:
            return E_BLOCK_OUT_OF_CACHE, top, 0, 0
    return E_OK, total, max_sched, max_seq


@jit
def write_step(token_ids, block_table, rows, computed, scheduled, block_size, input_ids,
               positions, slot_mapping, query_start_loc, seq_lens, num_computed, block_table_out):
    """Write one checked step's inputs (as vLLM's ``_prepare_inputs``): ids, positions and slots per token, one
    block at a time; query_start_loc, seq_lens, computed and block-table rows per request."""
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


@jit
def fill_padding(num_tokens, num_reqs, padded_tokens, padded_reqs, fills, input_ids, positions,
                 slot_mapping, query_start_loc, seq_lens, num_computed, block_table):
    """The padding rules past the real rows: each field's fill (``fills``: ids, positions,
    slots, seq_lens, computed, block), ``query_start_loc`` repeating its last real value."""
    for k in range(num_tokens, padded_tokens):
        input_ids[k] = fills[0]
        positions[k] = fills[1]
        slot_mapping[k] = fills[2]
    last = query_start_loc[num_reqs]
    for i in range(num_reqs + 1, padded_reqs + 1):
        query_start_loc[i] = last
    width = block_table.shape[1]
    for i in range(num_reqs, padded_reqs):
        seq_lens[i] = fills[3]
        num_computed[i] = fills[4]
        for j in range(width):
            block_table[i, j] = fills[5]


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
                      padded_tokens, padded_reqs, fills, input_ids, positions, slot_mapping,
                      query_start_loc, seq_lens, num_computed, block_table_out):
    """``write_step`` then ``fill_padding``: a checked step straight into a bucket's buffers
    (the caller checked that every output holds the padded sizes). Returns False, writing
    nothing, if the request arrays no longer pass the bounds the loops index by (changed
    since ``check_step``)."""
    num_rows = token_ids.shape[0]
    model_len = token_ids.shape[1]
    width = block_table.shape[1]
    total = np.int64(0)
    for i in range(rows.shape[0]):
        row = np.int64(rows[i])
        c = np.int64(computed[i])
        n = np.int64(scheduled[i])
        if (row < 0 or row >= num_rows or c < 0 or n < 1 or c + n > model_len
                or (c + n - 1) // np.int64(block_size) >= width):
            return False
        total += n
    if total != num_tokens:
        return False
    write_step(token_ids, block_table, rows, computed, scheduled, block_size, input_ids,
               positions, slot_mapping, query_start_loc, seq_lens, num_computed, block_table_out)
    fill_padding(num_tokens, rows.shape[0], padded_tokens, padded_reqs, fills, input_ids,
                 positions, slot_mapping, query_start_loc, seq_lens, num_computed, block_table_out)
    return True


@jit
def pad_step(num_tokens, num_reqs, padded_tokens, padded_reqs, fills,
             input_ids, positions, slot_mapping, query_start_loc, seq_lens, num_computed,
             block_table, o_input_ids, o_positions, o_slot_mapping, o_query_start_loc,
             o_seq_lens, o_num_computed, o_block_table):
    """Copy the real rows of prepared inputs, then ``fill_padding``. Returns False, writing
    nothing, when an input is shorter than the real counts or an output shorter than the
    padded ones."""
    t = num_tokens
    r = num_reqs
    width = block_table.shape[1]
    if (input_ids.shape[0] < t or positions.shape[0] < t or slot_mapping.shape[0] < t
            or query_start_loc.shape[0] < r + 1 or seq_lens.shape[0] < r
            or num_computed.shape[0] < r or block_table.shape[0] < r
            or o_input_ids.shape[0] < padded_tokens or o_positions.shape[0] < padded_tokens
            or o_slot_mapping.shape[0] < padded_tokens
            or o_query_start_loc.shape[0] < padded_reqs + 1 or o_seq_lens.shape[0] < padded_reqs
            or o_num_computed.shape[0] < padded_reqs or o_block_table.shape[0] < padded_reqs
            or o_block_table.shape[1] != width):
        return False
    for k in range(t):
        o_input_ids[k] = input_ids[k]
        o_positions[k] = positions[k]
        o_slot_mapping[k] = slot_mapping[k]
    for i in range(r + 1):
        o_query_start_loc[i] = query_start_loc[i]
    for i in range(r):
        o_seq_lens[i] = seq_lens[i]
        o_num_computed[i] = num_computed[i]
        for j in range(width):
            o_block_table[i, j] = block_table[i, j]
    fill_padding(t, r, padded_tokens, padded_reqs, fills, o_input_ids, o_positions,
                 o_slot_mapping, o_query_start_loc, o_seq_lens, o_num_computed, o_block_table)
    return True
