"""One numeric sampling field's rule (:class:`Rule`) and the helpers every rule's message uses.

The rules themselves live in :mod:`graphrt.core.sampling.batch` (temperature, top-p, top-k, seeds,
logprobs) and :mod:`graphrt.core.sampling.columns` (min-p, penalties, prompt lengths).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NoReturn

import numpy as np

from graphrt.core.errors import InputError

_INF = float("inf")
_INT64 = np.iinfo(np.int64)


def is_integer(value: Any) -> bool:
    """A Python or numpy integer that is not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python value it holds (for messages)."""
    return value.item() if isinstance(value, np.generic) else value


def _reject(name: str, rule: str, shown: Any, ok: Any) -> NoReturn:
    """Raise for the first value of ``shown`` where ``ok`` is False (a scalar: for itself)."""
    shown = np.asarray(shown)
    if shown.ndim == 0:
        raise InputError(name, f"must be {rule}, got {_plain(shown[()])!r}")
    row = int(np.flatnonzero(~np.asarray(ok, bool))[0])
    raise InputError(f"{name}[{row}]", f"must be {rule}, got {_plain(shown[row])!r}")


@dataclass(frozen=True)
class Rule:
    """One numeric field's rule: the values it accepts, as an exact per-value test
    (``rows_ok``) and as a test on a column's (min, max) that implies every value passes
    (``bounds_ok``; the batch's fast path, which falls back on ``rows_ok`` when it fails)."""

    field: str
    noun: str                                          # "real number" or "integer"
    kinds: str                                         # numpy dtype kinds accepted
    dtype: type                                        # stored as (float32 / int64)
    text: str                                          # the range, for messages
    rows_ok: Callable[[np.ndarray], np.ndarray]
    bounds_ok: Callable[[float, float], bool]

    def array(self, value: Any, ndim: int = 0, name: str | None = None) -> np.ndarray:
        """``value`` as an ``ndim``-D array of an accepted kind, floats as float32 (values
        beyond float32 become inf), integers not yet converted; the type is checked, not
        the range. Bools, strings, objects and ragged nesting raise."""
        if type(value) is np.ndarray and value.dtype == self.dtype and value.ndim == ndim:
            return value   # the hot path: a batch column already of its dtype
        name = name or self.field
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError):
            raise InputError(name, f"must be a {self.noun}{'' if ndim == 0 else ' per request'}, "
                                   f"got {value!r}") from None
        if arr.ndim != ndim:
            raise InputError(name, f"must be a {self.noun}, got {value!r}" if ndim == 0 else
                             f"must be 1-D (one value per request), got shape {arr.shape}")
        if arr.dtype.kind == "O" and arr.size and all(is_integer(v) for v in arr.flat):
            # Python ints beyond int64: real numbers (inf in float32), or out of range.
            fits = np.reshape([_INT64.min <= v <= _INT64.max for v in arr.flat], arr.shape)
            if self.dtype is np.float32:
                arr = np.reshape([float(v) if f else _INF * v for v, f in zip(arr.flat, fits.flat)], arr.shape)
            elif fits.all():
                arr = arr.astype(np.int64)
            else:
                _reject(name, self.text, value if ndim == 0 else arr, fits)
        if arr.dtype.kind not in self.kinds:
            if ndim == 0:
                raise InputError(name, f"must be a {self.noun}, got {value!r}")
            raise InputError(name, f"must hold {self.noun}s, got an array of {arr.dtype}")
        if self.dtype is np.float32 and arr.dtype != np.float32:
            with np.errstate(over="ignore"):
                arr = arr.astype(np.float32)
        return arr

    def check(self, value: Any, ndim: int = 0, name: str | None = None) -> np.ndarray:
        """``value`` checked value by value and stored as this rule's dtype."""
        arr = self.array(value, ndim, name)
        if arr.size:
            ok = self.rows_ok(arr)
            if not ok.all():
                _reject(name or self.field, self.text, value if ndim == 0 else arr, ok)
        return arr if arr.dtype == self.dtype else arr.astype(self.dtype)


def check_rows(values: Any, name: str, n: int) -> None:
    """``values`` holds one entry per request."""
    try:
        got = len(values)
    except TypeError:
        raise InputError(name, f"must be a sequence, one entry per request, got {values!r}") from None
    if got != n:
        raise InputError(name, f"{got} rows, but temperature has {n}")


__all__ = ["Rule", "check_rows", "is_integer"]
