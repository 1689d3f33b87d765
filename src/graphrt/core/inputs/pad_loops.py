"""The padding loops' per-field helpers: a field's rows past the real ones filled or repeated
by the padder's rule (``Padder.kernel_rules``), a field's real rows copied. The entry points
that apply them to every field, ``fill_padding`` and ``pad_step``, are in
:mod:`graphrt.core.inputs.host_loops`; plain Python in numba's subset (``host_kernels``)."""

from __future__ import annotations

from graphrt.core.inputs.fields import field_rows


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


def holds(src, dst, rule, num_tokens, num_reqs):
    """Whether ``src`` has a field's real rows and ``dst`` room for them, rows equally wide."""
    real = field_rows((rule[0], rule[1], rule[2]), num_tokens, num_reqs)
    return (src.shape[0] >= real) & (dst.shape[0] >= real) & (src.shape[1:] == dst.shape[1:])


def copy_rows(src, dst, rule, num_tokens, num_reqs):
    """A field's real rows from ``src`` into ``dst``."""
    for i in range(field_rows((rule[0], rule[1], rule[2]), num_tokens, num_reqs)):
        copy_row(dst, i, src, i)
