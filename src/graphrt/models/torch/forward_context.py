"""A small global forward context (as in nano-vllm).

The torch executor sets it around each model forward so attention layers can read their
metadata (slot mapping, block table, sequence lengths...) without every module's
signature changing. During graph capture it holds views of the static buffers, so
the captured attention reads exactly the buffers that replay refreshes. It is the torch
models' side of the step (only they and the torch executor use it); importing it needs
neither torch nor jax.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

_CONTEXT: Any = None
_STATE: Any = None          # the recurrent layers' metadata (docs/hybrid.md), beside the attention's


def get_forward_context() -> Any:
    """Return the current context; raises if no forward is running."""
    if _CONTEXT is None:
        raise RuntimeError("no forward context is set: call the model through graphrt's runner "
                           "or wrap the call in graphrt.models.torch.forward_context.forward_context(...)")
    return _CONTEXT


@contextlib.contextmanager
def forward_context(ctx: Any) -> Iterator[Any]:
    """``with forward_context(meta): model(...)``: set, run, always reset."""
    global _CONTEXT
    previous = _CONTEXT
    _CONTEXT = ctx
    try:
        yield ctx
    finally:
        _CONTEXT = previous


def get_state_context() -> Any:
    """The recurrent-state metadata of the running forward (slots, starts, checkpoints: set by
    the executor of a model with a ``state_spec``); raises if none is set."""
    if _STATE is None:
        raise RuntimeError("no recurrent-state context is set: call the model through graphrt's runner "
                           "or wrap the call in graphrt.models.torch.forward_context.state_context(...)")
    return _STATE


@contextlib.contextmanager
def state_context(ctx: Any) -> Iterator[Any]:
    """``with state_context(meta): model(...)``: the recurrent layers' metadata, set and reset."""
    global _STATE
    previous = _STATE
    _STATE = ctx
    try:
        yield ctx
    finally:
        _STATE = previous
