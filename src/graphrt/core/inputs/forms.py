"""The forms :class:`~graphrt.core.inputs.preparer.InputPreparer` refuses or converts, and their words.

Off the hot path: :func:`compiled_table` runs only when a table is not already in a form the
host loops have a compiled variant for, :func:`shape_error` only when a step's batch size or
table shapes fail the preparer's one combined check.
"""

from __future__ import annotations

import logging

import numpy as np

from graphrt.core.inputs import host_kernels
from graphrt.core.errors import InputError
from graphrt.core.inputs.fields import INDEX_MAX
from graphrt.core.inputs.host_kernels import as_int_array

logger = logging.getLogger("graphrt.core.inputs.preparer")


def compiled_table(name: str, value: object, strict: bool, warned: set[tuple[str, str]]) -> np.ndarray:
    """A table the loops have a compiled variant for: ``value`` itself, or (not ``strict``)
    a converted copy with a one-time warning (``warned`` remembers which); strict mode raises instead."""
    arr = as_int_array(name, value, 2)
    why = host_kernels.table_variant(arr)
    if why is None:
        return arr
    if strict:
        raise InputError(name, f"{why}; strict mode runs only the host-kernel variants compiled "
                               f"at warm-up: pass a C-contiguous, writeable int32 or int64 array, "
                               f"e.g. np.array({name}, dtype=np.int32, order='C') (better: keep "
                               f"the engine's table in that form)")
    if (name, why) not in warned:
        warned.add((name, why))
        logger.warning("graphrt: %s %s: copied to a C-contiguous int32 / int64 array on every "
                       "step (strict mode refuses it); pass one in that form instead", name, why)
    return host_kernels.canonical_table(arr)


def shape_error(token_ids: np.ndarray, block_table: np.ndarray, rows: np.ndarray, computed: np.ndarray,
                scheduled: np.ndarray, max_num_reqs: int, table_width: int | None) -> InputError:
    """The error of a failed batch-size or table-shape check (``max_num_reqs`` requests at
    most, ``table_width`` block-table columns at least)."""
    num_reqs = rows.shape[0]
    if num_reqs == 0:
        return InputError("req_rows", "empty batch: schedule at least one request")
    if num_reqs > max_num_reqs:
        return InputError("req_rows", f"{num_reqs} requests exceed max_num_reqs={max_num_reqs}")
    if computed.shape[0] != num_reqs:
        return InputError("num_computed_tokens", f"length {computed.shape[0]} does not match "
                                                 f"req_rows length {num_reqs}")
    if scheduled.shape[0] != num_reqs:
        return InputError("num_scheduled_tokens", f"length {scheduled.shape[0]} does not match "
                                                  f"req_rows length {num_reqs}")
    if token_ids.shape[0] != block_table.shape[0]:
        return InputError("block_table", f"{block_table.shape[0]} rows but token_ids has "
                                         f"{token_ids.shape[0]}: both tables are indexed by req_rows")
    if table_width is not None and block_table.shape[1] < table_width:
        return InputError("block_table", f"{block_table.shape[1]} columns; this preparer was "
                                         f"configured for {table_width} "
                                         f"(max_model_len / block_size): pass at least that many")
    if max(token_ids.shape) >= INDEX_MAX:
        return InputError("token_ids", f"shape {token_ids.shape}: rows and max_model_len must be "
                                       f"below {INDEX_MAX} (positions and rows are int32)")
    raise AssertionError("no shape error to report")
