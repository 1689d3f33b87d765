"""Padding: every model input grown to a bucket's (tokens, requests) with safe fill values.

The rules (one table, ``graphrt.core.defaults.PAD_FILL_VALUES``, overridable per attention
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

from typing import Mapping

import numpy as np

from graphrt.core import defaults, host_kernels
from graphrt.core.errors import ConfigError, InputError
from graphrt.core.fields import ARRAY_FIELDS, FIELD_DTYPES, REQUEST_FIELDS, TOKEN_FIELDS, ModelInputs

#: The order of the ``fills`` array of ``host_loops.fill_padding``.
_KERNEL_FILL_ORDER = ("input_ids", "positions", "slot_mapping", "seq_lens",
                      "num_computed_tokens", "block_table")


class Padder:
    """Pads :class:`ModelInputs` to a bucket.

    With ``max_num_tokens`` / ``max_num_reqs`` given, results are views of persistent
    buffers (no allocation per step; valid until the next call). Without, each call
    allocates. ``kernel`` picks the implementation as for :class:`~graphrt.InputPreparer`
    (``numba``: one compiled loop, ``numpy``: one slice assignment per field, ``auto``).
    """

    def __init__(self, fill_values: Mapping[str, int] | None = None, *,
                 max_num_tokens: int | None = None, max_num_reqs: int | None = None,
                 kernel: str | None = None) -> None:
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
        self.kernel = host_kernels.resolve_kernel(kernel)
        self._pad_step = host_kernels.compiled("pad_step") if self.kernel == "numba" else None
        #: The fill table as the compiled loops take it (``host_loops.fill_padding``).
        self.kernel_fills = np.array([fills[name] for name in _KERNEL_FILL_ORDER], dtype=np.int64)
        self._max_tokens = max_num_tokens
        self._max_reqs = max_num_reqs
        self._buffers: dict[str, np.ndarray] = {}
        self._out_views: dict[tuple[int, int, int], tuple[object, tuple[np.ndarray, ...]]] = {}

    def pad(self, inputs: ModelInputs, *, num_tokens: int, num_reqs: int,
            out: Mapping[str, np.ndarray] | None = None) -> ModelInputs:
        """Return ``inputs`` padded to ``num_tokens`` tokens and ``num_reqs`` requests.

        ``out`` (field -> array at least as large as the target) receives the result in
        place: a backend passes its host staging buffers so padding writes there directly.
        """
        t, r = inputs.num_tokens, inputs.num_reqs
        self.check_targets(t, r, num_tokens, num_reqs)
        dst = self.targets(out, num_tokens, num_reqs, inputs.block_table.shape[1])
        if self._pad_step is not None:
            if not self._pad_step(t, r, num_tokens, num_reqs, self.kernel_fills, inputs.input_ids,
                                  inputs.positions, inputs.slot_mapping, inputs.query_start_loc,
                                  inputs.seq_lens, inputs.num_computed_tokens, inputs.block_table,
                                  *dst):
                raise InputError("inputs", f"arrays shorter than num_tokens={t} / num_reqs={r}")
        else:
            self._pad_numpy(inputs, num_tokens, num_reqs, dst)
        return ModelInputs(*dst, r, t, inputs.max_query_len, inputs.max_seq_len,
                           inputs.uniform_decode)

    def _pad_numpy(self, inputs: ModelInputs, num_tokens: int, num_reqs: int,
                   dst: tuple[np.ndarray, ...]) -> None:
        """The numpy implementation: one slice assignment per field (fills skipped when the
        step fills its bucket)."""
        t, r = inputs.num_tokens, inputs.num_reqs
        fills = self.fill_values
        by_name = dict(zip(ARRAY_FIELDS, dst))
        for name in TOKEN_FIELDS:
            buf = by_name[name]
            buf[:t] = getattr(inputs, name)[:t]
            if num_tokens > t:
                buf[t:] = fills[name]
        qsl = by_name["query_start_loc"]
        qsl[:r + 1] = inputs.query_start_loc[:r + 1]
        for name in REQUEST_FIELDS:
            by_name[name][:r] = getattr(inputs, name)[:r]
        if num_reqs > r:
            qsl[r + 1:] = qsl[r]
            for name in REQUEST_FIELDS:
                by_name[name][r:] = fills[name]

    @staticmethod
    def check_targets(num_tokens: int, num_reqs: int, padded_tokens: int, padded_reqs: int) -> None:
        """Padding never shrinks a step."""
        if padded_tokens < num_tokens:
            raise InputError("num_tokens", f"padding target {padded_tokens} is below the real "
                                           f"{num_tokens} tokens")
        if padded_reqs < num_reqs:
            raise InputError("num_reqs", f"padding target {padded_reqs} is below the real "
                                         f"{num_reqs} requests")

    def targets(self, out: Mapping[str, np.ndarray] | None, num_tokens: int, num_reqs: int,
                width: int) -> tuple[np.ndarray, ...]:
        """Per field (in ``ARRAY_FIELDS`` order), the array of the padded length the result
        is written into. Views of a caller's ``out`` are remembered per shape."""
        if out is not None:
            memo = self._out_views.get((num_tokens, num_reqs, width))
            if memo is not None and memo[0] is out:
                return memo[1]
        lengths = {"input_ids": num_tokens, "positions": num_tokens, "slot_mapping": num_tokens,
                   "query_start_loc": num_reqs + 1, "seq_lens": num_reqs,
                   "num_computed_tokens": num_reqs, "block_table": num_reqs}
        if out is None:
            return tuple(self._buffer(name, (lengths[name], width) if name == "block_table"
                                      else (lengths[name],)) for name in ARRAY_FIELDS)
        views = tuple(_view(name, out[name], lengths[name], width) for name in ARRAY_FIELDS)
        if len(self._out_views) >= defaults.PREPARE_VIEW_MEMO_LIMIT:
            self._out_views.clear()
        self._out_views[(num_tokens, num_reqs, width)] = (out, views)
        return views

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
