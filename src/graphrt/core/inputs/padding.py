"""Padding: every model input grown to a bucket's (tokens, requests) with safe fill values.

One rule table (:func:`pad_rules`: level from ``graphrt.core.inputs.fields``, fill from
``defaults.PAD_FILL_VALUES``, overridable per attention backend): a padded token writes no real
KV slot, a padded request attends to nothing and owns the trash state slot, ``query_start_loc``
repeats its last value (docs/padding.md). ``num_tokens`` / ``num_reqs`` stay the real counts."""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import numpy as np

from graphrt.core import defaults

from graphrt.core.inputs import host_kernels
from graphrt.core.errors import ConfigError, InputError
from graphrt.core.inputs.fields import ARRAY_FIELDS, FIELD_DTYPES, FIELDS, ModelInputs, buffer_shapes, field_rows


class PadRule(NamedTuple):
    """How one field is padded: the rows past the real ones of its ``level`` (see
    ``fields.field_rows``) get ``fill``, or with ``repeat_last`` a copy of the last real row."""

    level: tuple[int, int, int]
    fill: int
    repeat_last: bool


def pad_rules(fill_values: Mapping[str, int]) -> dict[str, PadRule]:
    """The padding rule of every field, in ``ARRAY_FIELDS`` order, for a table of fill values
    (``query_start_loc`` takes ``defaults.QUERY_START_LOC_FILL``). Both implementations, the
    numpy one here and the compiled ``host_loops.fill_padding``, apply exactly this table."""
    fills = {**fill_values, "query_start_loc": defaults.QUERY_START_LOC_FILL}
    return {name: PadRule(FIELDS[name].level, 0, True) if fills[name] == defaults.PAD_REPEAT_LAST
            else PadRule(FIELDS[name].level, int(fills[name]), False) for name in ARRAY_FIELDS}


def fill_padding(rules: Sequence[Sequence[int]], num_tokens: int, num_reqs: int,
                 arrays: Sequence[np.ndarray]) -> None:
    """The padding rules in numpy (the compiled ones are ``host_loops.fill_padding``): on a
    step written into bucket-sized ``arrays`` (``ARRAY_FIELDS`` order), each field's rows past
    the real ones get its fill or its last real row. ``rules``: ``Padder.kernel_rules`` as
    rows of ``(per_token, per_request, extra, fill, repeat_last)``."""
    for arr, (per_token, per_request, extra, fill, repeat_last) in zip(arrays, rules):
        real = field_rows((per_token, per_request, extra), num_tokens, num_reqs)
        if arr.shape[0] > real:
            arr[real:] = arr[real - 1] if repeat_last else fill


def empty_step(table_width: int) -> ModelInputs:
    """A step of no request and no token: padded, it is pure padding (every fill of the
    rules), the input of a capture's warm-up and of a data-parallel rank with no work."""
    def empty(name: str, *shape: int) -> np.ndarray:
        return np.zeros(shape, FIELD_DTYPES[name])
    return ModelInputs(empty("input_ids", 0), empty("positions", 0), empty("slot_mapping", 0),
                       empty("query_start_loc", 1), empty("seq_lens", 0), empty("num_computed_tokens", 0),
                       empty("block_table", 0, table_width), empty("state_slots", 0), 0, 0, 0, 0, True)


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
        if fills["state_slots"] >= 0:
            raise ConfigError("the state_slots fill must be negative: a padded request must never "
                              "read or write a live request's recurrent state (negative: the trash slot)")
        self.fill_values: dict[str, int] = fills
        #: Every field's padding rule (:func:`pad_rules`), in ``ARRAY_FIELDS`` order.
        self.rules: dict[str, PadRule] = pad_rules(fills)
        #: The same table as the compiled loops take it: one row per field, (level, fill, repeat_last).
        self.kernel_rules = np.array([(*rule.level, rule.fill, rule.repeat_last)
                                      for rule in self.rules.values()], dtype=np.int64)
        self._rule_rows = self.kernel_rules.tolist()
        self.kernel = host_kernels.resolve_kernel(kernel)
        self._pad_step = host_kernels.compiled("pad_step") if self.kernel == "numba" else None
        self._fill_padding = host_kernels.compiled("fill_padding") if self.kernel == "numba" else None
        self._max_tokens = max_num_tokens
        self._max_reqs = max_num_reqs
        self._buffers: dict[str, np.ndarray] = {}
        self._views: dict[tuple[int, int, int], tuple[object, tuple[np.ndarray, ...]]] = {}
        self._empty: dict[int, ModelInputs] = {}

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
            if not self._pad_step(t, r, self.kernel_rules, inputs.input_ids, inputs.positions,
                                  inputs.slot_mapping, inputs.query_start_loc, inputs.seq_lens,
                                  inputs.num_computed_tokens, inputs.block_table, inputs.state_slots, *dst):
                raise InputError("inputs", f"arrays shorter than num_tokens={t} / num_reqs={r}")
        else:
            self._pad_numpy(inputs, dst)
        return ModelInputs(*dst, r, t, inputs.max_query_len, inputs.max_seq_len,
                           inputs.uniform_decode)

    def fill(self, num_tokens: int, num_reqs: int, arrays: Sequence[np.ndarray]) -> None:
        """Pad a step of ``num_tokens`` tokens and ``num_reqs`` requests already written into
        the first rows of bucket-sized ``arrays`` (``ARRAY_FIELDS`` order): what
        ``InputPreparer.write`` leaves to the padder."""
        if self._fill_padding is not None:
            self._fill_padding(num_tokens, num_reqs, self.kernel_rules, *arrays)
        else:
            fill_padding(self._rule_rows, num_tokens, num_reqs, arrays)

    def pad_empty(self, num_tokens: int, num_reqs: int, out: Mapping[str, np.ndarray]) -> ModelInputs:
        """A step of pure padding, ``num_tokens`` tokens and ``num_reqs`` requests, written into
        ``out`` (no KV slot written, every request attends to nothing)."""
        width = out["block_table"].shape[1]
        empty = self._empty.get(width)
        if empty is None:
            empty = self._empty[width] = empty_step(width)
        return self.pad(empty, num_tokens=num_tokens, num_reqs=num_reqs, out=out)

    def _pad_numpy(self, inputs: ModelInputs, dst: tuple[np.ndarray, ...]) -> None:
        """The numpy implementation of :attr:`rules`: per field, one slice assignment of the
        real rows, then :func:`fill_padding`."""
        t, r = inputs.num_tokens, inputs.num_reqs
        sources = (inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.query_start_loc,
                   inputs.seq_lens, inputs.num_computed_tokens, inputs.block_table, inputs.state_slots)
        for src, buf, rule in zip(sources, dst, self.rules.values()):
            real = field_rows(rule.level, t, r)
            buf[:real] = src[:real]
        fill_padding(self._rule_rows, t, r, dst)

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
        is written into: views of a caller's ``out`` or of the persistent buffers,
        remembered per shape, or fresh arrays when the padder is unbounded."""
        key = (num_tokens, num_reqs, width)
        memo = self._views.get(key)
        if memo is not None and memo[0] is out:
            return memo[1]
        shapes = buffer_shapes(num_tokens, num_reqs, width)
        if out is not None:
            views = tuple(_view(name, out[name], shapes[name]) for name in ARRAY_FIELDS)
        elif self._max_tokens is None or self._max_reqs is None:
            return tuple(np.empty(shapes[name], dtype=FIELD_DTYPES[name]) for name in ARRAY_FIELDS)
        else:
            views = tuple(self._buffer(name, shapes[name]) for name in ARRAY_FIELDS)
        if len(self._views) >= defaults.PREPARE_VIEW_MEMO_LIMIT:
            self._views.clear()
        self._views[key] = (out, views)
        return views

    def _buffer(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A view of the persistent buffer for ``name``, grown past the padder's limits when
        a target needs it (remembered views of the old buffer are dropped then)."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape[1:] != shape[1:] or buf.shape[0] < shape[0]:
            limit = buffer_shapes(self._max_tokens, self._max_reqs, 0)[name][0]
            buf = np.empty((max(limit, shape[0]),) + shape[1:], dtype=FIELD_DTYPES[name])
            self._buffers[name] = buf
            self._views.clear()
        return buf[:shape[0]]


def _view(name: str, buf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The first ``shape[0]`` rows of a caller's buffer, checked to hold ``shape``."""
    if buf.shape[0] < shape[0] or buf.shape[1:] != shape[1:]:
        raise InputError(name, f"output buffer of shape {buf.shape} cannot hold {shape}")
    return buf[:shape[0]]
