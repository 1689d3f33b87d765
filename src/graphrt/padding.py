"""Padding: every model input grown to a bucket's (tokens, requests) with safe fill values.

The rules (one table, ``graphrt.defaults.PAD_FILL_VALUES``, overridable per attention
backend):

* token level -- ``input_ids`` 0 and ``positions`` 0 (valid, finite), ``slot_mapping`` -1:
  a padded token never writes a real KV slot (attention stores skip negative slots);
* request level -- ``seq_lens`` 0 (a padded request attends to nothing),
  ``num_computed_tokens`` 0, ``block_table`` rows of the null block 0;
* ``query_start_loc`` repeats its last value, so it stays non-decreasing and padded
  requests own zero query tokens; padded tokens fall after every real request.

``num_tokens`` / ``num_reqs`` of the result stay the real counts.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from graphrt import defaults
from graphrt.errors import ConfigError, InputError
from graphrt.inputs import FIELD_DTYPES, REQUEST_FIELDS, TOKEN_FIELDS, ModelInputs


class Padder:
    """Pads :class:`ModelInputs` to a bucket.

    With ``max_num_tokens`` / ``max_num_reqs`` given, results are views of persistent
    buffers (no allocation per step; valid until the next call). Without, each call
    allocates.
    """

    def __init__(self, fill_values: Mapping[str, int] | None = None, *,
                 max_num_tokens: int | None = None, max_num_reqs: int | None = None) -> None:
        fills = dict(defaults.PAD_FILL_VALUES)
        for name, value in (fill_values or {}).items():
            if name not in fills:
                raise ConfigError(f"unknown padding field {name!r}; known: {sorted(fills)} "
                                  f"(query_start_loc always repeats its last value)")
            fills[name] = int(value)
        if fills["slot_mapping"] >= 0:
            raise ConfigError("the slot_mapping fill must be negative: a padded token must never "
                              "write a real KV slot")
        self.fill_values: dict[str, int] = fills
        self._max_tokens = max_num_tokens
        self._max_reqs = max_num_reqs
        self._buffers: dict[str, np.ndarray] = {}

    def pad(self, inputs: ModelInputs, *, num_tokens: int, num_reqs: int,
            out: Mapping[str, np.ndarray] | None = None) -> ModelInputs:
        """Return ``inputs`` padded to ``num_tokens`` tokens and ``num_reqs`` requests.

        ``out`` (field -> array at least as large as the target) receives the result in
        place: a backend passes its host staging buffers so padding writes there directly.
        """
        t, r = inputs.num_tokens, inputs.num_reqs
        if num_tokens < t:
            raise InputError("num_tokens", f"padding target {num_tokens} is below the real {t} tokens")
        if num_reqs < r:
            raise InputError("num_reqs", f"padding target {num_reqs} is below the real {r} requests")
        dst = self._targets(out, num_tokens, num_reqs, inputs.block_table.shape[1])
        fills = self.fill_values
        # The fills are skipped when there is nothing to pad (a step that fills its bucket).
        for name in TOKEN_FIELDS:
            buf = dst[name]
            buf[:t] = getattr(inputs, name)[:t]
            if num_tokens > t:
                buf[t:] = fills[name]
        qsl = dst["query_start_loc"]
        qsl[:r + 1] = inputs.query_start_loc[:r + 1]
        for name in REQUEST_FIELDS:
            buf = dst[name]
            buf[:r] = getattr(inputs, name)[:r]
        if num_reqs > r:
            qsl[r + 1:] = qsl[r]
            for name in REQUEST_FIELDS:
                dst[name][r:] = fills[name]
        return dataclasses.replace(inputs, **dst)

    def _targets(self, out: Mapping[str, np.ndarray] | None, num_tokens: int, num_reqs: int,
                 width: int) -> dict[str, np.ndarray]:
        """Per field, the array of the padded length the result is written into."""
        lengths = {"input_ids": num_tokens, "positions": num_tokens, "slot_mapping": num_tokens,
                   "query_start_loc": num_reqs + 1, "seq_lens": num_reqs,
                   "num_computed_tokens": num_reqs, "block_table": num_reqs}
        if out is None:
            return {name: self._buffer(name, (n, width) if name == "block_table" else (n,))
                    for name, n in lengths.items()}
        return {name: _view(name, out[name], n, width) for name, n in lengths.items()}

    def _buffer(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A view of the persistent buffer for ``name`` (or a fresh array when unbounded)."""
        if self._max_tokens is None or self._max_reqs is None:
            return np.empty(shape, dtype=FIELD_DTYPES[name])
        buf = self._buffers.get(name)
        if buf is None or buf.shape[1:] != shape[1:] or buf.shape[0] < shape[0]:
            lead = {"query_start_loc": self._max_reqs + 1, "seq_lens": self._max_reqs,
                    "num_computed_tokens": self._max_reqs, "block_table": self._max_reqs}
            size = max(lead.get(name, self._max_tokens), shape[0])
            buf = np.empty((size,) + shape[1:], dtype=FIELD_DTYPES[name])
            self._buffers[name] = buf
        return buf[:shape[0]]


def _view(name: str, buf: np.ndarray, n: int, width: int) -> np.ndarray:
    """The first ``n`` rows of a caller's buffer, checked (``block_table`` rows are ``width`` wide)."""
    trailing = (width,) if name == "block_table" else ()
    if buf.shape[0] < n or buf.shape[1:] != trailing:
        raise InputError(name, f"output buffer of shape {buf.shape} cannot hold {(n,) + trailing}")
    return buf[:n]
