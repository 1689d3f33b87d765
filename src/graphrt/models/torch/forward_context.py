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

#: The running forward's attention metadata ("forward") and its recurrent layers' metadata
#: ("state", docs/hybrid.md); None outside a forward.
_CONTEXTS: dict[str, Any] = {"forward": None, "state": None}


def _get(which: str, setter: str, what: str) -> Any:
    if _CONTEXTS[which] is None:
        raise RuntimeError(f"no {what} is set: call the model through graphrt's runner or wrap the call in "
                           f"graphrt.models.torch.forward_context.{setter}(...)")
    return _CONTEXTS[which]


@contextlib.contextmanager
def _scoped(which: str, ctx: Any) -> Iterator[Any]:
    previous, _CONTEXTS[which] = _CONTEXTS[which], ctx
    try:
        yield ctx
    finally:
        _CONTEXTS[which] = previous


def get_forward_context() -> Any:
    """Return the current context; raises if no forward is running."""
    return _get("forward", "forward_context", "forward context")


def forward_context(ctx: Any) -> contextlib.AbstractContextManager[Any]:
    """``with forward_context(meta): model(...)``: set, run, always reset."""
    return _scoped("forward", ctx)


def get_state_context() -> Any:
    """The recurrent-state metadata of the running forward (slots, starts, checkpoints: set by
    the executor of a model with a ``state_spec``); raises if none is set."""
    return _get("state", "state_context", "recurrent-state context")


def state_context(ctx: Any) -> contextlib.AbstractContextManager[Any]:
    """``with state_context(meta): model(...)``: the recurrent layers' metadata, set and reset."""
    return _scoped("state", ctx)
