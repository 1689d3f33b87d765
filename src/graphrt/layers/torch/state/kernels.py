"""The recurrent kernels a hybrid model's layers run, chosen once (docs/hybrid.md).

:class:`RecurrentKernels` is a set of the kernels with the reference ones' signatures
(``causal_conv1d``, ``ssd_scan``, ``gated_delta_rule``, ``selective_scan``, ``rg_lru_scan``,
``lightning_attention``); graphrt's two sets are registered here, the reference
(``mamba_kernels``, ``gated_delta``, ``selective_scan``, ``rg_lru``, ``lightning``) and Triton
(``triton_recurrent``).
:func:`select_recurrent_kernels` picks one when the runner is built (``GRAPHRT_RECURRENT``, read
and checked by :func:`requested_recurrent_kernels` alone: ``auto``, Triton on CUDA where it runs,
else the reference; ``reference``; ``triton``; or a set registered with
:func:`register_recurrent_kernels`); the state backend puts it in each step's metadata, which the
layers call. Adding a set touches its module and its registration.
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple

import torch

from graphrt.core.errors import ConfigError
from graphrt.layers.torch.state.gated_delta import gated_delta_rule
from graphrt.layers.torch.state.lightning import lightning_attention
from graphrt.layers.torch.state.mamba_kernels import causal_conv1d, ssd_scan
from graphrt.layers.torch.state.rg_lru import rg_lru_scan
from graphrt.layers.torch.state.selective_scan import selective_scan


class RecurrentKernels(NamedTuple):
    """One set of the recurrent kernels, each with the reference kernel's signature
    (``selective_scan``, Mamba1's, ``rg_lru_scan``, RecurrentGemma's, and ``lightning_attention``,
    MiniMax's, default to the reference: a set made before they existed)."""

    name: str
    causal_conv1d: Callable
    ssd_scan: Callable
    gated_delta_rule: Callable
    selective_scan: Callable = selective_scan
    rg_lru_scan: Callable = rg_lru_scan
    lightning_attention: Callable = lightning_attention


#: Environment variable choosing the recurrent kernels (:func:`requested_recurrent_kernels`).
RECURRENT_ENV = "GRAPHRT_RECURRENT"
#: Its default: Triton on CUDA where it runs, else the reference (:func:`recurrent_backend`).
AUTO = "auto"


#: graphrt's reference kernels: what metadata built without a backend runs.
REFERENCE_KERNELS = RecurrentKernels("reference", causal_conv1d, ssd_scan, gated_delta_rule, selective_scan,
                                     rg_lru_scan, lightning_attention)


def _triton(device: torch.device) -> RecurrentKernels:
    from graphrt.layers.torch.state.triton_recurrent import (triton_causal_conv1d, triton_gated_delta_rule,
                                                               triton_lightning_attention, triton_rg_lru_scan,
                                                               triton_selective_scan, triton_ssd_scan)

    return RecurrentKernels("triton", triton_causal_conv1d, triton_ssd_scan, triton_gated_delta_rule,
                            triton_selective_scan, triton_rg_lru_scan, triton_lightning_attention)


_KERNELS: dict[str, Callable[[torch.device], RecurrentKernels]] = {"reference": lambda device: REFERENCE_KERNELS,
                                                                   "triton": _triton}


def register_recurrent_kernels(name: str, make: Callable[[torch.device], RecurrentKernels]) -> None:
    """Register a set ``name`` (a ``GRAPHRT_RECURRENT`` value): ``make(device)`` returns it."""
    _KERNELS[name] = make


def unregister_recurrent_kernels(name: str) -> None:
    """Remove a set :func:`register_recurrent_kernels` added (a test's toy set)."""
    if name not in ("reference", "triton"):
        _KERNELS.pop(name, None)


def requested_recurrent_kernels() -> str:
    """``GRAPHRT_RECURRENT``'s value (``auto`` when unset), the one place it is read: ``auto`` or
    a registered set's name, else a ConfigError naming the variable and the allowed values."""
    choice = os.environ.get(RECURRENT_ENV, AUTO)
    allowed = (AUTO, *_KERNELS)
    if choice not in allowed:
        raise ConfigError(f"{RECURRENT_ENV}={choice!r} is not one of {allowed} (unset: {AUTO!r})")
    return choice


def recurrent_backend(device: torch.device, choice: str) -> str:
    """graphrt's own set for ``choice`` (``auto``, ``reference`` or ``triton``) on ``device``:
    ``triton`` where asked or, under ``auto``, on CUDA where it runs; a ConfigError saying why
    where ``triton`` is asked for and cannot run."""
    if choice == "reference":
        return "reference"
    from graphrt.layers.torch.state.triton_recurrent import triton_problem

    problem = triton_problem(device)
    if choice == "triton" and problem is not None:
        raise ConfigError(f"{RECURRENT_ENV}=triton: {problem}")
    return "triton" if problem is None and (choice == "triton" or device.type == "cuda") else "reference"


def select_recurrent_kernels(device: torch.device | str) -> RecurrentKernels:
    """The set the layers run on ``device``, chosen once: a registered set ``GRAPHRT_RECURRENT``
    names, else graphrt's choice between Triton and the reference (:func:`recurrent_backend`)."""
    device = torch.device(device)
    choice = requested_recurrent_kernels()
    if choice not in (AUTO, "reference", "triton"):
        return _KERNELS[choice](device)
    return _KERNELS[recurrent_backend(device, choice)](device)


__all__ = ["RECURRENT_ENV", "REFERENCE_KERNELS", "RecurrentKernels", "recurrent_backend", "register_recurrent_kernels",
           "requested_recurrent_kernels", "select_recurrent_kernels", "unregister_recurrent_kernels"]
