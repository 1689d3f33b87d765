"""The step's fields: which arrays a model input has, their dtypes, and :class:`ModelInputs`.

One table for input preparation, padding, and every backend's staging buffers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping")
REQUEST_FIELDS = ("seq_lens", "num_computed_tokens", "block_table")
ARRAY_FIELDS = TOKEN_FIELDS + ("query_start_loc",) + REQUEST_FIELDS
#: The dtype of every array field, for whoever allocates buffers for them.
FIELD_DTYPES: dict[str, type] = {
    "input_ids": np.int32, "positions": np.int32, "slot_mapping": np.int64,
    "query_start_loc": np.int32, "seq_lens": np.int32, "num_computed_tokens": np.int32,
    "block_table": np.int32}


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


__all__ = ["ARRAY_FIELDS", "FIELD_DTYPES", "REQUEST_FIELDS", "TOKEN_FIELDS", "ModelInputs"]
