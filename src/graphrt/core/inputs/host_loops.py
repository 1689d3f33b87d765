"""Every host loop of input preparation, written once: plain Python over numpy arrays in the
subset numba compiles (:mod:`graphrt.core.inputs.host_kernels` compiles them; the numpy path runs the
checks interpreted; both return :mod:`graphrt.core.inputs.step_codes` reports). The padding loops
apply the padder's rule table (``Padder.kernel_rules``): no fill or length is written here.
``check_requests`` runs first everywhere: it validates every index and clamps request values
to int32 before any sum, so the other loops run without bounds checks."""

from __future__ import annotations

from graphrt.core.defaults import NULL_BLOCK
from graphrt.core.inputs.loop_primitives import HIGH, LOW, block_of, block_shift, can_reach, clamp, highest, lowest
from graphrt.core.inputs.pad_loops import copy_rows, holds, pad_rows
from graphrt.core.inputs.step_codes import (E_BLOCK_OUT_OF_CACHE, E_COMPUTED_NEGATIVE, E_COMPUTED_PAST_TABLE,
                                     E_NULL_BLOCK, E_OK, E_PAST_TOKEN_TABLE, E_ROW_OUT_OF_RANGE,
                                     E_ROW_REPEATED, E_SCHEDULED_NOT_POSITIVE, E_STATE_SLOT_OUT_OF_RANGE,
                                     E_STATE_SLOT_REPEATED, E_TABLE_TOO_NARROW, E_TOKEN_OUT_OF_VOCAB,
                                     E_TOO_MANY_TOKENS)

# How host_kernels compiles the loops: this file's and the helpers of ``loop_primitives`` and
# ``pad_loops`` compiled into them (their disk cache is stamped with every module whose code or
# constants they compile: ``host_kernels.LOOP_SOURCES``).
#: No GIL, no bounds checks, numpy's division (no zero branch), no reference counting
#: (``_nrt``): the loops allocate nothing, and numba would count every array argument of every
#: helper call atomically (4x slower loops).
JIT_OPTIONS = dict(nogil=True, boundscheck=False, error_model="numpy", _nrt=False)
#: The per-request rules and writes, inlined into their loops at numba's level (a call passes
#: each array as a dozen scalars; the small primitives they call, LLVM inlines itself).
#: Inlining more only slows compilation (every helper: 6x).
INLINED = ("reads_null_block", "holds_block_past", "token_outside", "write_request")
#: numpy one-liners when interpreted (numba's own reductions are several times slower) ->
#: their compiled forms, for 1-d and 2-d arrays.
COMPILED_FORMS = {"lowest": ("lowest_loop", "lowest_loop"), "highest": ("highest_loop", "highest_loop"),
                  "copy_row": ("copy_row", "copy_columns"), "fill_row": ("fill_row", "fill_columns")}

WIDEST = (-2**63, 2**63 - 1)          # the int64 range: the widest a table's values can be


# ---- the rules of a valid step ------------------------------------------------------------

def first_request(rows, computed, scheduled, code, value, num_rows):
    """The request ``check_requests`` names for ``code``: the first whose row is outside
    [0, num_rows), or whose clamped scheduled / computed / seq_len (by code) is ``value``."""
    for i in range(rows.shape[0]):
        row, c, n = clamp(rows[i]), clamp(computed[i]), clamp(scheduled[i])
        if code == E_ROW_OUT_OF_RANGE:
            found = row < 0 or row >= num_rows
        elif code == E_SCHEDULED_NOT_POSITIVE:
            found = n == value
        elif code == E_COMPUTED_NEGATIVE or code == E_COMPUTED_PAST_TABLE:
            found = c == value
        else:
            found = c + n == value
        if found:
            return i
    return -1


def check_requests(token_ids, block_table, rows, computed, scheduled, block_size, columns):
    """The request-level bounds every other loop indexes by: each row inside the tables, each
    request scheduling >= 1 token from a computed length >= 0, within the token table and the
    block table's first ``columns`` (the rest is not written out). One pass of reductions; a
    failure then looks for the request to name. Returns a report (``step_codes``): ``(E_OK, -1,
    -1, num_tokens, max_query_len, max_seq_len)`` or the failed bound's."""
    num_rows, model_len = token_ids.shape
    bs = int(block_size)
    min_row, max_row, min_comp, max_comp, min_sched, max_sched = HIGH, LOW, HIGH, LOW, HIGH, LOW
    max_seq = 2 * LOW
    total = 0
    for i in range(rows.shape[0]):
        row, c, n = clamp(rows[i]), clamp(computed[i]), clamp(scheduled[i])
        min_row, max_row = min(min_row, row), max(max_row, row)
        min_comp, max_comp = min(min_comp, c), max(max_comp, c)
        min_sched, max_sched = min(min_sched, n), max(max_sched, n)
        max_seq = max(max_seq, c + n)
        total += n
    needed = -1
    if min_row < 0 or max_row >= num_rows:
        code, value = E_ROW_OUT_OF_RANGE, 0
    elif min_sched <= 0:
        code, value = E_SCHEDULED_NOT_POSITIVE, min_sched
    elif min_comp < 0:
        code, value = E_COMPUTED_NEGATIVE, min_comp
    elif max_comp >= model_len:
        code, value = E_COMPUTED_PAST_TABLE, max_comp
    elif max_seq > model_len:
        code, value = E_PAST_TOKEN_TABLE, max_seq
    elif (max_seq + bs - 1) // bs > min(columns, block_table.shape[1]):
        code, value, needed = E_TABLE_TOO_NARROW, max_seq, (max_seq + bs - 1) // bs
    else:
        return E_OK, -1, -1, total, max_sched, max_seq
    return code, first_request(rows, computed, scheduled, code, value, num_rows), needed, 0, 0, 0


def check_schedule(token_ids, block_table, rows, computed, scheduled, block_size, max_tokens, row_mark, columns):
    """``check_requests``, each row scheduled once, the step within ``max_tokens``. ``row_mark``:
    scratch, one entry per table row and a last one counting the checks (this one's stamp)."""
    report = check_requests(token_ids, block_table, rows, computed, scheduled, block_size, columns)
    code, _, _, num_tokens, _, _ = report
    if code != E_OK:
        return report
    last = row_mark.shape[0] - 1
    stamp = row_mark[last] + 1
    row_mark[last] = stamp
    for i in range(rows.shape[0]):
        row = int(rows[i])
        if row_mark[row] == stamp:
            return E_ROW_REPEATED, i, -1, 0, 0, 0
        row_mark[row] = stamp
    if num_tokens > max_tokens:
        return E_TOO_MANY_TOKENS, -1, -1, num_tokens, 0, 0
    return report


def check_state_slots(state_table, rows, slot_mark):
    """Each scheduled request's recurrent-state slot (``state_table[row]``) inside [0, S) and held
    by no other request of the step, where ``slot_mark`` has S + 1 entries: one per slot, the last
    counting the checks (this one's stamp). An empty ``state_table``: the model keeps no state.
    Returns ``(code, request)``; rows are checked already (``check_requests``)."""
    if state_table.shape[0] == 0:
        return E_OK, -1
    bound = slot_mark.shape[0] - 1
    stamp = slot_mark[bound] + 1
    slot_mark[bound] = stamp
    for i in range(rows.shape[0]):
        slot = clamp(state_table[int(rows[i])])
        if slot < 0 or slot >= bound:
            return E_STATE_SLOT_OUT_OF_RANGE, i
        if slot_mark[slot] == stamp:
            return E_STATE_SLOT_REPEATED, i
        slot_mark[slot] = stamp
    return E_OK, -1


def reads_null_block(block_table, row, used):
    """Whether a column the request's attention reads ([0, used): the blocks of its computed
    and scheduled tokens) holds a block id <= the null block."""
    return lowest(block_table, row, 0, used) <= NULL_BLOCK


def holds_block_past(block_table, row, num_blocks):
    """Whether the request's row holds a block id >= ``num_blocks`` in any column (a captured
    graph's static block table may be read anywhere)."""
    return highest(block_table, row, 0, block_table.shape[1]) >= num_blocks


def token_outside(token_ids, row, start, stop, vocab_size):
    """Whether a scheduled token id (``token_ids[row, start:stop]``) is outside [0, vocab_size)."""
    return lowest(token_ids, row, start, stop) < 0 or highest(token_ids, row, start, stop) >= vocab_size


def first_outside(table, row, start, stop, low, high):
    """The first index in [start, stop) whose value in ``table[row]`` is outside [low, high]."""
    for col in range(start, stop):
        value = table[row, col]
        if value < low or value > high:
            return col
    return -1


def check_step(token_ids, block_table, rows, computed, scheduled, block_size, max_tokens,
               vocab_size, num_blocks, row_mark, state_table, slot_mark, columns=HIGH):
    """Every bound of one step, writing nothing but ``row_mark`` / ``slot_mark``:
    ``check_schedule``, ``check_state_slots``, then per request ``reads_null_block``,
    ``token_outside``, ``holds_block_past`` (every column); reports the first null block, else
    the first token outside the vocabulary, else the first row with a block past the cache.
    Bounds > 0 (the preparer passes the int32 range when it has none)."""
    report = check_schedule(token_ids, block_table, rows, computed, scheduled, block_size,
                            max_tokens, row_mark, columns)
    code, _, _, _, _, _ = report
    if code != E_OK:
        return report
    state_code, state_request = check_state_slots(state_table, rows, slot_mark)
    if state_code != E_OK:
        return state_code, state_request, -1, 0, 0, 0
    bs = int(block_size)
    shift = block_shift(bs)
    blocks_can_pass = can_reach(block_table, num_blocks)
    token_request = -1
    block_request = -1
    for i in range(rows.shape[0]):
        row, c = int(rows[i]), int(computed[i])
        end = c + int(scheduled[i])
        used = block_of(end + bs - 1, bs, shift)
        if reads_null_block(block_table, row, used):
            at = first_outside(block_table, row, 0, used, NULL_BLOCK + 1, WIDEST[1])
            return E_NULL_BLOCK, i, at, 0, 0, 0
        if token_request < 0 and token_outside(token_ids, row, c, end, vocab_size):
            token_request = i
        if block_request < 0 and blocks_can_pass and holds_block_past(block_table, row, num_blocks):
            block_request = i
    if token_request >= 0:
        row, c = int(rows[token_request]), int(computed[token_request])
        at = first_outside(token_ids, row, c, c + int(scheduled[token_request]), 0, vocab_size - 1)
        return E_TOKEN_OUT_OF_VOCAB, token_request, at, 0, 0, 0
    if block_request >= 0:
        row = int(rows[block_request])
        at = first_outside(block_table, row, 0, block_table.shape[1], WIDEST[0], num_blocks - 1)
        return E_BLOCK_OUT_OF_CACHE, block_request, at, 0, 0, 0
    return report


# ---- writing a checked step ---------------------------------------------------------------

def write_request(token_ids, block_table, i, row, c, n, bs, shift, k, input_ids, positions,
                  slot_mapping, query_start_loc, seq_lens, num_computed, block_table_out):
    """Request ``i``'s inputs (as vLLM's ``_prepare_inputs``), its tokens from index ``k``: ids,
    positions and slots (a block at a time: consecutive within one), then its query_start_loc,
    seq_len, computed length and block-table row. Returns the index after its tokens."""
    end = c + n
    if n == 1:                                   # decode: one token, no inner loops
        col = block_of(c, bs, shift)
        positions[k] = c
        input_ids[k] = token_ids[row, c]
        slot_mapping[k] = int(block_table[row, col]) * bs + (c - col * bs)
    else:
        ids_out = input_ids[k:k + n]
        ids = token_ids[row, c:end]
        pos_out = positions[k:k + n]
        for j in range(n):
            ids_out[j] = ids[j]
        for j in range(n):
            pos_out[j] = c + j
        slots_out = slot_mapping[k:k + n]
        p = c
        while p < end:
            col = block_of(p, bs, shift)
            stop = min((col + 1) * bs, end)
            base = int(block_table[row, col]) * bs - col * bs
            for q in range(p, stop):
                slots_out[q - c] = base + q
            p = stop
    for col in range(min(block_table.shape[1], block_table_out.shape[1])):   # extra columns ignored
        block_table_out[i, col] = block_table[row, col]
    num_computed[i] = c
    seq_lens[i] = end
    query_start_loc[i + 1] = k + n
    return k + n


def write_state_slots(state_table, rows, state_slots):
    """Each request's state slot (``state_table[row]``; -1 for every request of a model without
    state: an empty table)."""
    if state_table.shape[0] == 0:
        for i in range(rows.shape[0]):
            state_slots[i] = -1
    else:
        for i in range(rows.shape[0]):
            state_slots[i] = state_table[int(rows[i])]


def write_step(token_ids, block_table, rows, computed, scheduled, block_size, input_ids,
               positions, slot_mapping, query_start_loc, seq_lens, num_computed, block_table_out):
    """``write_request`` for every request of a checked step (``write_state_slots`` apart)."""
    bs = int(block_size)
    shift = block_shift(bs)
    k = 0
    query_start_loc[0] = 0
    for i in range(rows.shape[0]):
        k = write_request(token_ids, block_table, i, int(rows[i]), int(computed[i]), int(scheduled[i]),
                          bs, shift, k, input_ids, positions, slot_mapping, query_start_loc, seq_lens,
                          num_computed, block_table_out)


def prepare_step(token_ids, block_table, rows, computed, scheduled, block_size, max_tokens,
                 vocab_size, num_blocks, row_mark, state_table, slot_mark, input_ids, positions,
                 slot_mapping, query_start_loc, seq_lens, num_computed, block_table_out, state_slots):
    """``check_step`` and ``write_step`` in one pass (to ``block_table_out``'s columns): each
    request's rules, then its ``write_request``, while its rows are in cache. A failure leaves the
    outputs partly written (the caller passes buffers no result lives in); ``check_step``'s report."""
    report = check_schedule(token_ids, block_table, rows, computed, scheduled, block_size,
                            max_tokens, row_mark, block_table_out.shape[1])
    code, _, _, _, _, _ = report
    if code != E_OK:
        return report
    state_code, state_request = check_state_slots(state_table, rows, slot_mark)
    if state_code != E_OK:
        return state_code, state_request, -1, 0, 0, 0
    bs = int(block_size)
    shift = block_shift(bs)
    blocks_can_pass = can_reach(block_table, num_blocks)
    k = 0
    query_start_loc[0] = 0
    for i in range(rows.shape[0]):
        row, c, n = int(rows[i]), int(computed[i]), int(scheduled[i])
        if (reads_null_block(block_table, row, block_of(c + n + bs - 1, bs, shift))
                or token_outside(token_ids, row, c, c + n, vocab_size)
                or (blocks_can_pass and holds_block_past(block_table, row, num_blocks))):
            return check_step(token_ids, block_table, rows, computed, scheduled, block_size,
                              max_tokens, vocab_size, num_blocks, row_mark, state_table, slot_mark,
                              block_table_out.shape[1])
        k = write_request(token_ids, block_table, i, row, c, n, bs, shift, k, input_ids, positions,
                          slot_mapping, query_start_loc, seq_lens, num_computed, block_table_out)
    write_state_slots(state_table, rows, state_slots)
    return report


def write_checked_step(token_ids, block_table, rows, computed, scheduled, block_size, num_tokens,
                       state_table, slot_mark, input_ids, positions, slot_mapping, query_start_loc,
                       seq_lens, num_computed, block_table_out, state_slots):
    """``write_step`` of a checked step of ``num_tokens`` tokens into a bucket's buffers (checked to
    hold it; the padder pads them), after ``check_requests`` and ``check_state_slots`` again:
    False, nothing written, if the step no longer passes them or has another token count (it
    changed since ``check_step``)."""
    code, _, _, total, _, _ = check_requests(token_ids, block_table, rows, computed, scheduled, block_size,
                                             block_table_out.shape[1])
    if code != E_OK or total != num_tokens:
        return False
    state_code, _ = check_state_slots(state_table, rows, slot_mark)
    if state_code != E_OK:
        return False
    write_step(token_ids, block_table, rows, computed, scheduled, block_size, input_ids,
               positions, slot_mapping, query_start_loc, seq_lens, num_computed, block_table_out)
    write_state_slots(state_table, rows, state_slots)
    return True


# ---- request arrays into the int32 form the loops take ------------------------------------

def clamp_requests(rows, computed, scheduled, out):
    """Three int64 request arrays, each value clamped, into rows 0-2 of the preparer's int32
    request buffer ``out`` (one compiled variant)."""
    for i in range(rows.shape[0]):
        out[0, i] = clamp(rows[i])
        out[1, i] = clamp(computed[i])
        out[2, i] = clamp(scheduled[i])


# ---- padding: the rows past a step's real ones, by the padder's rules (``pad_loops``) ----

def fill_padding(num_tokens, num_reqs, rules, input_ids, positions, slot_mapping,
                 query_start_loc, seq_lens, num_computed, block_table, state_slots):
    """The padding rules (``rules``: one row per field, in ``fields.ARRAY_FIELDS`` order) on a
    step written into bucket-sized arrays."""
    pad_rows(input_ids, rules[0], num_tokens, num_reqs)
    pad_rows(positions, rules[1], num_tokens, num_reqs)
    pad_rows(slot_mapping, rules[2], num_tokens, num_reqs)
    pad_rows(query_start_loc, rules[3], num_tokens, num_reqs)
    pad_rows(seq_lens, rules[4], num_tokens, num_reqs)
    pad_rows(num_computed, rules[5], num_tokens, num_reqs)
    pad_rows(block_table, rules[6], num_tokens, num_reqs)
    pad_rows(state_slots, rules[7], num_tokens, num_reqs)


def pad_step(num_tokens, num_reqs, rules, input_ids, positions, slot_mapping, query_start_loc,
             seq_lens, num_computed, block_table, state_slots, o_input_ids, o_positions, o_slot_mapping,
             o_query_start_loc, o_seq_lens, o_num_computed, o_block_table, o_state_slots):
    """Copy the real rows of prepared inputs into bucket-sized outputs, then ``fill_padding``;
    False, nothing written, when an input or an output is shorter than the real counts."""
    if not (holds(input_ids, o_input_ids, rules[0], num_tokens, num_reqs)   # (&, not ``and``: numba's
            & holds(positions, o_positions, rules[1], num_tokens, num_reqs)   # inliner warns on it)
            & holds(slot_mapping, o_slot_mapping, rules[2], num_tokens, num_reqs)
            & holds(query_start_loc, o_query_start_loc, rules[3], num_tokens, num_reqs)
            & holds(seq_lens, o_seq_lens, rules[4], num_tokens, num_reqs)
            & holds(num_computed, o_num_computed, rules[5], num_tokens, num_reqs)
            & holds(block_table, o_block_table, rules[6], num_tokens, num_reqs)
            & holds(state_slots, o_state_slots, rules[7], num_tokens, num_reqs)):
        return False
    copy_rows(input_ids, o_input_ids, rules[0], num_tokens, num_reqs)
    copy_rows(positions, o_positions, rules[1], num_tokens, num_reqs)
    copy_rows(slot_mapping, o_slot_mapping, rules[2], num_tokens, num_reqs)
    copy_rows(query_start_loc, o_query_start_loc, rules[3], num_tokens, num_reqs)
    copy_rows(seq_lens, o_seq_lens, rules[4], num_tokens, num_reqs)
    copy_rows(num_computed, o_num_computed, rules[5], num_tokens, num_reqs)
    copy_rows(block_table, o_block_table, rules[6], num_tokens, num_reqs)
    copy_rows(state_slots, o_state_slots, rules[7], num_tokens, num_reqs)
    fill_padding(num_tokens, num_reqs, rules, o_input_ids, o_positions, o_slot_mapping,
                 o_query_start_loc, o_seq_lens, o_num_computed, o_block_table, o_state_slots)
    return True
