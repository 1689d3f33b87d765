"""The weights' ``dtype`` as users write it: ``"bfloat16"``, ``"half"``, ``"auto"``, ``torch.float16``.

:func:`model_dtype` is the one place a dtype argument is read (a name of
``defaults.MODEL_DTYPE_NAMES``, a torch / numpy / JAX dtype, or ``"auto"``: the checkpoint's);
anything else is a :class:`ConfigError` naming ``dtype``, not a TypeError deep in loading."""

from __future__ import annotations

from typing import Any

from graphrt.core import defaults
from graphrt.core.errors import ConfigError
from graphrt.core.numerics import dtype_name

DEFAULT_MODEL_DTYPE = "float32"


def model_dtype(value: Any, checkpoint: str | None = None) -> str:
    """The canonical name (``"float32"``, ``"float16"``, ``"bfloat16"``, ``"float64"``) of the
    weights' dtype ``value``: None is ``DEFAULT_MODEL_DTYPE``; ``"auto"`` is the
    checkpoint's ``torch_dtype`` (``checkpoint``; ``"auto"`` stays ``"auto"`` until a backend
    loading a directory knows it). Raises :class:`ConfigError` naming ``dtype``."""
    if value is None:
        return DEFAULT_MODEL_DTYPE
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key == "auto":
            return "auto" if checkpoint is None else model_dtype(checkpoint)
        name = defaults.MODEL_DTYPE_NAMES.get(key)
    else:
        try:
            name = dtype_name(value)
        except ConfigError:
            name = None
        name = name if name in defaults.MODEL_DTYPE_NAMES.values() else None
    if name is None:
        known = sorted(defaults.MODEL_DTYPE_NAMES) + ["auto"]
        raise ConfigError(f"dtype: {value!r} is not a dtype graphrt's models run in; one of {known} "
                          "(or a torch / numpy / JAX float dtype)")
    return name


__all__ = ["model_dtype"]
