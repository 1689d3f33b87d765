"""The small primitives the host loops (:mod:`graphrt.core.inputs.host_loops`) are built from: the int32
clamp, row minima / maxima (numpy when interpreted, their compiled loops under numba:
``host_loops.COMPILED_FORMS``), block arithmetic by shift. Plain Python in numba's subset,
compiled into the loops that call them (``host_kernels``)."""

from __future__ import annotations

import numpy as np

from graphrt.core.inputs.fields import INDEX_MAX

LOW, HIGH = -INDEX_MAX - 1, INDEX_MAX


def clamp(x):
    """``x`` as an integer bounded to the int32 range (see ``step_codes``)."""
    return min(max(int(x), LOW), HIGH)


def lowest(table, row, start, stop):
    """The smallest of ``table[row, start:stop]`` (not empty; one value: a decode's token)."""
    return table[row, start] if stop - start == 1 else table[row, start:stop].min()


def highest(table, row, start, stop):
    """The largest of ``table[row, start:stop]`` (not empty)."""
    return table[row, start] if stop - start == 1 else table[row, start:stop].max()


def lowest_loop(table, row, start, stop):
    """:func:`lowest`, compiled: one pass LLVM vectorises (unsigned indices: no wraparound)."""
    row = np.uint64(row)
    low = table[row, np.uint64(start)]
    for col in range(np.uint64(start), np.uint64(stop)):
        if table[row, col] < low:
            low = table[row, col]
    return low


def highest_loop(table, row, start, stop):
    """:func:`highest`, compiled."""
    row = np.uint64(row)
    high = table[row, np.uint64(start)]
    for col in range(np.uint64(start), np.uint64(stop)):
        if table[row, col] > high:
            high = table[row, col]
    return high


def block_shift(block_size):
    """log2(block_size) for a power of two, else -1: see :func:`block_of`."""
    shift = 0
    while (1 << shift) < block_size:
        shift += 1
    return shift if (1 << shift) == block_size else -1


def block_of(position, block_size, shift):
    """``position // block_size``, by a shift when ``shift`` (``block_shift``) >= 0: a 64-bit
    division per request or block costs 15-40 cycles."""
    return position >> shift if shift >= 0 else position // block_size


def can_reach(table, bound):
    """Whether a value of ``table`` (int32 or int64) can be >= ``bound`` (a check against a
    bound no value reaches is skipped: an int32 table against the int32 outputs' range)."""
    return bound <= HIGH or table.itemsize > 4
