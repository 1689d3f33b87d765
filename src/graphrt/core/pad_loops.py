"""The padding loops, written once: plain Python over numpy arrays, in the subset numba
compiles (no numba import here), compiled by :mod:`graphrt.core.host_kernels` for
:class:`graphrt.Padder` (its numpy path is ``padding.fill_padding``). They apply the padder's
rule table (``Padder.kernel_rules``: one row per field, its level, fill and whether it repeats
its last row): no field's fill or length is written here.
"""

from __future__ import annotations

from graphrt.core.fields import field_rows

# How host_kernels compiles this file (numba's disk cache is keyed on this file alone, so
# whatever changes the compiled code is here; see host_loops).
JIT_OPTIONS = dict(nogil=True, boundscheck=False, error_model="numpy", _nrt=False)
INLINED = ()                # calls are cheap without reference counting; LLVM inlines these
#: Interpreted forms -> compiled forms for 1-d and 2-d arrays (numba's own row assignment is
#: several times slower than a loop).
COMPILED_FORMS = {"copy_row": ("copy_row", "copy_columns"), "fill_row": ("fill_row", "fill_columns")}


def copy_row(dst, i, src, j):
    """``dst[i] = src[j]``: a value, or a block-table row (its compiled form for 1-d fields too)."""
    dst[i] = src[j]


def fill_row(dst, i, value):
    """``dst[i] = value``: a value, or every column of a block-table row."""
    dst[i] = value


def copy_columns(dst, i, src, j):
    """:func:`copy_row` of a block-table row, compiled."""
    for col in range(dst.shape[1]):
        dst[i, col] = src[j, col]


def fill_columns(dst, i, value):
    """:func:`fill_row` of a block-table row, compiled."""
    for col in range(dst.shape[1]):
        dst[i, col] = value


def pad_rows(arr, rule, num_tokens, num_reqs):
    """One field's padding rule on its bucket-sized ``arr``: the rows past the real ones get the
    fill or a copy of the last real row. ``rule``: the field's row of ``Padder.kernel_rules``
    (per token, per request, extra, fill, repeat_last)."""
    real = field_rows((rule[0], rule[1], rule[2]), num_tokens, num_reqs)
    fill, repeat_last = rule[3], rule[4]
    if repeat_last:
        for i in range(real, arr.shape[0]):
            copy_row(arr, i, arr, real - 1)
    else:
        for i in range(real, arr.shape[0]):
            fill_row(arr, i, fill)


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


def holds(src, dst, rule, num_tokens, num_reqs):
    """Whether ``src`` has a field's real rows and ``dst`` room for them, rows equally wide."""
    real = field_rows((rule[0], rule[1], rule[2]), num_tokens, num_reqs)
    return (src.shape[0] >= real) & (dst.shape[0] >= real) & (src.shape[1:] == dst.shape[1:])


def copy_rows(src, dst, rule, num_tokens, num_reqs):
    """A field's real rows from ``src`` into ``dst``."""
    for i in range(field_rows((rule[0], rule[1], rule[2]), num_tokens, num_reqs)):
        copy_row(dst, i, src, i)


def pad_step(num_tokens, num_reqs, rules, input_ids, positions, slot_mapping, query_start_loc,
             seq_lens, num_computed, block_table, o_input_ids, o_positions, o_slot_mapping,
             o_query_start_loc, o_seq_lens, o_num_computed, o_block_table):
    """Copy the real rows of prepared inputs into bucket-sized outputs, then ``fill_padding``;
    False, nothing written, when an input or an output is shorter than the real counts."""
    if not (holds(input_ids, o_input_ids, rules[0], num_tokens, num_reqs)   # (&, not ``and``: numba's
            & holds(positions, o_positions, rules[1], num_tokens, num_reqs)   # inliner warns on it)
            & holds(slot_mapping, o_slot_mapping, rules[2], num_tokens, num_reqs)
            & holds(query_start_loc, o_query_start_loc, rules[3], num_tokens, num_reqs)
            & holds(seq_lens, o_seq_lens, rules[4], num_tokens, num_reqs)
            & holds(num_computed, o_num_computed, rules[5], num_tokens, num_reqs)
            & holds(block_table, o_block_table, rules[6], num_tokens, num_reqs)):
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
