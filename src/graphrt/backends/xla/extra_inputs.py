"""Per-step extra inputs on the XLA backend (:mod:`graphrt.core.inputs.extra_inputs`).

The executor keeps one numpy staging buffer per declared input, sized for the grid's largest
key; each forward key takes its first ``rows(tokens, requests)`` rows as one more pytree
argument (shapes fixed by the key: nothing compiles per step), passed to the forward as
``extra=``. A model that declares none keeps its executables' signature."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from graphrt.core.errors import ConfigError
from graphrt.core.inputs.extra_inputs import ExtraInput, check_extra_specs


def model_extra_specs(model: Any) -> dict[str, ExtraInput]:
    """The extra inputs ``model`` declares (its ``extra_inputs``, checked), or ``{}``; graphrt's
    own decoder reads none, so declaring them for it is a ConfigError."""
    declared = getattr(model, "extra_inputs", None)
    if not declared:                        # most models: nothing to check
        return {}
    specs = check_extra_specs(declared, "model")
    if specs and getattr(model, "own_code", False):
        raise ConfigError(f"model.extra_inputs {sorted(specs)}: graphrt's JAX decoder reads no extra inputs; "
                          "pass XlaModel(config, params, forward=..., compute_logits=..., extra_inputs=...) "
                          "with a forward that takes extra= (docs/xla.md)")
    return specs


def staging_buffers(specs: Mapping[str, ExtraInput], max_tokens: int, max_reqs: int) -> dict[str, np.ndarray]:
    """One host buffer per input, rows for the grid's largest key, every row its fill."""
    return {name: np.full((spec.rows(max_tokens, max_reqs), *spec.shape), spec.fill, np.dtype(spec.dtype))
            for name, spec in specs.items()}


def abstract_args(specs: Mapping[str, ExtraInput], num_tokens: int, num_reqs: int) -> tuple[dict[str, Any], ...]:
    """The forward's trailing arguments for a key padded to ``num_tokens`` / ``num_reqs``: one
    dict of ShapeDtypeStructs, or none when nothing is declared (the signature stays as it was)."""
    if not specs:
        return ()
    return ({name: jax.ShapeDtypeStruct((spec.rows(num_tokens, num_reqs), *spec.shape), np.dtype(spec.dtype))
             for name, spec in specs.items()},)


def padded_args(specs: Mapping[str, ExtraInput], buffers: Mapping[str, np.ndarray], num_tokens: int,
                num_reqs: int) -> tuple[dict[str, np.ndarray], ...]:
    """The forward's trailing arguments of a step: one dict of copies of each staging buffer's
    padded rows, or none when nothing is declared. Copies, because JAX on CPU may read numpy
    arguments asynchronously while the runner rewrites the buffers for the next step."""
    if not specs:
        return ()
    return ({name: buffers[name][:spec.rows(num_tokens, num_reqs)].copy() for name, spec in specs.items()},)


def fingerprint(specs: Mapping[str, ExtraInput]) -> tuple[tuple[Any, ...], ...]:
    """The declaration as the executable store's fingerprint sees it: name, level, shape, dtype, fill."""
    return tuple((name, spec.level, tuple(spec.shape), np.dtype(spec.dtype).name, float(spec.fill))
                 for name, spec in sorted(specs.items()))


__all__ = ["abstract_args", "fingerprint", "model_extra_specs", "padded_args", "staging_buffers"]
