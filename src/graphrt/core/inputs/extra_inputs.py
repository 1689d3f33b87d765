"""Per-step extra inputs: arrays a model reads besides graphrt's step fields.

A model declares them (``model.extra_inputs = {name: ExtraInput(...)}``: a row per token or per
request, trailing shape, dtype, padding fill); the executor keeps a staging and a static device
buffer for each, and the runner checks every array an engine passes (InputError naming it,
before any write), copies its real rows and pads with the fill. docs/attention.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from graphrt.core.errors import ConfigError, InputError

#: Levels an extra input can have: a row per scheduled token, or per request.
LEVELS = ("token", "request")


@dataclass(frozen=True)
class ExtraInput:
    """One declared extra input: ``level`` ("token" or "request"), trailing ``shape`` of a row,
    ``dtype`` (a numpy dtype name or dtype) and the ``fill`` of padded rows."""

    level: str
    shape: tuple[int, ...] = ()
    dtype: Any = "float32"
    fill: float = 0.0

    def rows(self, num_tokens: int, num_reqs: int) -> int:
        """Rows of a step of ``num_tokens`` tokens and ``num_reqs`` requests."""
        return num_tokens if self.level == "token" else num_reqs


def check_extra_specs(specs: Mapping[str, Any], owner: str) -> dict[str, ExtraInput]:
    """The declared extra inputs, checked (ConfigError naming the input and the field)."""
    if not isinstance(specs, Mapping):
        raise ConfigError(f"{owner}.extra_inputs must map names to graphrt.ExtraInput, got {type(specs).__name__}")
    out = {}
    for name, spec in specs.items():
        if not isinstance(spec, ExtraInput):
            raise ConfigError(f"{owner}.extra_inputs[{name!r}] must be a graphrt.ExtraInput, got {type(spec).__name__}")
        if spec.level not in LEVELS:
            raise ConfigError(f"{owner}.extra_inputs[{name!r}].level must be one of {LEVELS}, got {spec.level!r}")
        if not all(isinstance(d, int) and d > 0 for d in spec.shape):
            raise ConfigError(f"{owner}.extra_inputs[{name!r}].shape must be positive ints, got {spec.shape!r}")
        try:
            dtype = np.dtype(spec.dtype)
        except TypeError as exc:
            raise ConfigError(f"{owner}.extra_inputs[{name!r}].dtype: not a dtype: {spec.dtype!r}") from exc
        if dtype.kind not in "iufb":
            raise ConfigError(f"{owner}.extra_inputs[{name!r}].dtype must be a number or bool dtype, got {dtype}")
        problem = _fill_problem(spec.fill, dtype)
        if problem is not None:
            raise ConfigError(f"{owner}.extra_inputs[{name!r}].fill: {spec.fill!r} {problem}")
        out[name] = spec
    return out


def _fill_problem(fill: Any, dtype: np.dtype) -> str | None:
    """Why ``fill`` cannot be written into an array of ``dtype`` as it is, or None: padded rows
    would otherwise hold another value (or every step's padding would raise)."""
    if isinstance(fill, (bool, np.bool_)) or not isinstance(fill, (int, float, np.integer, np.floating)):
        if dtype.kind == "b" and isinstance(fill, (bool, np.bool_)):
            return None
        return f"is not a number (a {type(fill).__name__}); the fill of a {dtype} input is one"
    if dtype.kind == "b":
        return None if fill in (0, 1) else f"cannot be held by {dtype} (0 or 1)"
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if not np.isfinite(fill) or fill != int(fill) or not info.min <= int(fill) <= info.max:
            return f"cannot be held by {dtype} (an integer in [{info.min}, {info.max}])"
        return None
    with np.errstate(over="ignore"):
        held = np.asarray(fill, dtype=np.float64).astype(dtype)
    if np.isfinite(fill) and not np.isfinite(held):
        return f"cannot be held by {dtype} (it overflows: largest {np.finfo(dtype).max})"
    return None


class ExtraInputs:
    """A runner's extra inputs: checks each step's arrays and writes them, padded, into the
    executor's staging buffers (persistent; nothing is allocated per step)."""

    def __init__(self, specs: Mapping[str, ExtraInput], buffers: Mapping[str, np.ndarray]) -> None:
        self.specs = dict(specs)
        self.buffers = buffers

    def check(self, arrays: Mapping[str, Any] | None, num_tokens: int, num_reqs: int) -> dict[str, np.ndarray]:
        """Each declared input of a step, as an array of its dtype and shape (InputError naming
        ``extra_inputs[name]`` otherwise: a missing, unknown, misshapen or mistyped one)."""
        if arrays is not None and not isinstance(arrays, Mapping):
            raise InputError("extra_inputs", f"must map each declared input's name to its array (a dict), got a "
                                             f"{type(arrays).__name__}; the model declares {sorted(self.specs)}")
        given = dict(arrays or {})
        unknown = sorted(set(given) - set(self.specs))
        if unknown:
            raise InputError("extra_inputs", f"{unknown} are not declared by the model (it declares "
                                             f"{sorted(self.specs)})")
        out = {}
        for name, spec in self.specs.items():
            if name not in given:
                raise InputError(f"extra_inputs[{name!r}]", "is declared by the model and missing from the step")
            arr = given[name]
            want_dtype = np.dtype(spec.dtype)
            if not isinstance(arr, np.ndarray) or arr.dtype != want_dtype:
                raise InputError(f"extra_inputs[{name!r}]", f"must be a numpy array of {want_dtype}, got "
                                                            f"{getattr(arr, 'dtype', type(arr).__name__)}")
            want = (spec.rows(num_tokens, num_reqs), *spec.shape)
            if arr.shape != want:
                raise InputError(f"extra_inputs[{name!r}]", f"has shape {arr.shape}; a step of {num_tokens} tokens "
                                                            f"and {num_reqs} requests needs {want} ({spec.level} level)")
            out[name] = arr
        return out

    def write(self, arrays: Mapping[str, np.ndarray], num_tokens: int, num_reqs: int, padded_tokens: int,
              padded_reqs: int) -> None:
        """Copy each checked array's rows into its staging buffer, then pad to the bucket with its fill."""
        for name, spec in self.specs.items():
            buf = self.buffers[name]
            real, padded = spec.rows(num_tokens, num_reqs), spec.rows(padded_tokens, padded_reqs)
            buf[:real] = arrays[name]
            buf[real:padded] = spec.fill

    def write_padding(self, padded_tokens: int, padded_reqs: int) -> None:
        """A step of padding only (a data-parallel dummy): every row the fill."""
        for name, spec in self.specs.items():
            self.buffers[name][:spec.rows(padded_tokens, padded_reqs)] = spec.fill


__all__ = ["ExtraInput", "ExtraInputs", "LEVELS", "check_extra_specs"]
