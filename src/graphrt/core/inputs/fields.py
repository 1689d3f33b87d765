"""The step's fields: which arrays a model input has, their dtypes and lengths, and :class:`ModelInputs`.

One table for input preparation, padding, and every backend's staging buffers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

#: A field's level: its rows as ``(per token, per request, extra)``, so a step of T tokens
#: and R requests has ``per_token * T + per_request * R + extra`` rows of it.
TOKEN = (1, 0, 0)          # T rows: one per scheduled token
REQUEST = (0, 1, 0)        # R rows: one per request
BOUNDARY = (0, 1, 1)       # R + 1 rows: each request's first token, then the total


class Field(NamedTuple):
    """What every consumer of a field needs: its dtype, its level, and whether each row is a
    block-table row (one column per block) rather than one value."""

    dtype: type
    level: tuple[int, int, int]
    per_block: bool = False


#: Every array of a step, in the order of :class:`ModelInputs` (and of the compiled loops'
#: arguments).
FIELDS: dict[str, Field] = {
    "input_ids": Field(np.int32, TOKEN),
    "positions": Field(np.int32, TOKEN),
    "slot_mapping": Field(np.int64, TOKEN),
    "query_start_loc": Field(np.int32, BOUNDARY),
    "seq_lens": Field(np.int32, REQUEST),
    "num_computed_tokens": Field(np.int32, REQUEST),
    "block_table": Field(np.int32, REQUEST, per_block=True),
    "state_slots": Field(np.int32, REQUEST),
}
ARRAY_FIELDS = tuple(FIELDS)
TOKEN_FIELDS = tuple(name for name, f in FIELDS.items() if f.level == TOKEN)
REQUEST_FIELDS = tuple(name for name, f in FIELDS.items() if f.level == REQUEST)
#: The dtype of every array field, for whoever allocates buffers for them.
FIELD_DTYPES: dict[str, type] = {name: f.dtype for name, f in FIELDS.items()}
#: The largest position, token id, block id or count a step's int32 fields hold. The host
#: checks bound every input by it first (each request value clamped to
#: [-INDEX_MAX - 1, INDEX_MAX] before any sum or product), so no check can overflow.
INDEX_MAX = int(np.iinfo(np.int32).max)


def field_rows(level: tuple[int, int, int], num_tokens: int, num_reqs: int) -> int:
    """Rows of a field of ``level`` in a step of ``num_tokens`` tokens and ``num_reqs`` requests."""
    per_token, per_request, extra = level
    return per_token * num_tokens + per_request * num_reqs + extra


def buffer_shapes(max_tokens: int, max_reqs: int, table_width: int) -> dict[str, tuple[int, ...]]:
    """The shape of each field's buffer for steps of up to ``max_tokens`` tokens and
    ``max_reqs`` requests, block-table rows ``table_width`` wide (a padder's persistent
    buffers, a backend's staging buffers)."""
    return {name: (field_rows(f.level, max_tokens, max_reqs),) + ((table_width,) if f.per_block else ())
            for name, f in FIELDS.items()}


@dataclass(slots=True)
class ModelInputs:
    """One step's model inputs. Arrays may be longer than the real counts after padding.

    ``num_tokens`` / ``num_reqs`` are always the real counts; the padded sizes are the
    array lengths (``padded_num_tokens`` / ``padded_num_reqs``).
    """

    input_ids: np.ndarray            # int32 [T]
    positions: np.ndarray            # int32 [T]
    slot_mapping: np.ndarray         # int64 [T], -1 for padding
    query_start_loc: np.ndarray      # int32 [R + 1]
    seq_lens: np.ndarray             # int32 [R]
    num_computed_tokens: np.ndarray  # int32 [R]
    block_table: np.ndarray          # int32 [R, max_blocks_per_req]
    state_slots: np.ndarray          # int32 [R]: each request's recurrent-state slot; -1: padding / none
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    uniform_decode: bool

    @property
    def padded_num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def padded_num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def logits_indices(self) -> np.ndarray:
        """Index of each real request's last scheduled token (where a token is sampled)."""
        return self.query_start_loc[1:self.num_reqs + 1] - 1

    def copy(self) -> "ModelInputs":
        """A deep copy that survives the next ``prepare`` / ``pad`` call."""
        return dataclasses.replace(self, **{f: getattr(self, f).copy() for f in ARRAY_FIELDS})


__all__ = ["ARRAY_FIELDS", "BOUNDARY", "FIELDS", "FIELD_DTYPES", "INDEX_MAX", "REQUEST", "REQUEST_FIELDS", "TOKEN",
           "TOKEN_FIELDS", "Field", "ModelInputs", "buffer_shapes", "field_rows"]
