"""The forward context of the running thread (as in nano-vllm, made per thread).

The torch executor sets it around each model forward so attention layers can read their
metadata (slot mapping, block table, sequence lengths...) without every module's
signature changing. During graph capture it holds views of the static buffers, so
the captured attention reads exactly the buffers that replay refreshes. It is the torch
models' side of the step (only they and the torch executor use it); importing it needs
neither torch nor jax.

It belongs to the thread that set it: two engines in one process (a draft and a target, one
engine's background warm-up thread capturing while another engine's thread runs a step) each
read their own. A ``threading.local``: the executor sets and reads it in one synchronous call
on one thread (a capture on a side stream included), every thread starts with none (a builder
thread, a tensor-parallel rank's thread or process sets its own), and graphrt's other per-capture
state (``core.graph_tasks``, the recording graph) is kept per thread the same way.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator


#: This thread's running forward's attention metadata (``forward``) and its recurrent layers'
#: metadata (``state``, docs/hybrid.md); unset (None) outside a forward. A plain
#: ``threading.local`` read with ``getattr`` defaults: torch.compile traces that on every torch
#: graphrt supports, where a ``threading.local`` subclass with class-level defaults made torch
#: 2.11's Dynamo see only the defaults ("no forward context is set") inside a compiled model.
_CONTEXTS = threading.local()


def _get(which: str, setter: str, what: str) -> Any:
    ctx = getattr(_CONTEXTS, which, None)
    if ctx is None:
        raise RuntimeError(f"no {what} is set on this thread: call the model through graphrt's runner or wrap "
                           f"the call in graphrt.layers.torch.forward_context.{setter}(...)")
    return ctx


@contextlib.contextmanager
def _scoped(which: str, ctx: Any) -> Iterator[Any]:
    previous = getattr(_CONTEXTS, which, None)
    setattr(_CONTEXTS, which, ctx)
    try:
        yield ctx
    finally:
        setattr(_CONTEXTS, which, previous)


def get_forward_context() -> Any:
    """Return this thread's current context; raises if no forward is running on it."""
    return _get("forward", "forward_context", "forward context")


def forward_context(ctx: Any) -> contextlib.AbstractContextManager[Any]:
    """``with forward_context(meta): model(...)``: set for this thread, run, always reset."""
    return _scoped("forward", ctx)


def get_state_context() -> Any:
    """The recurrent-state metadata of the forward running on this thread (slots, starts,
    checkpoints: set by the executor of a model with a ``state_spec``); raises if none is set."""
    return _get("state", "state_context", "recurrent-state context")


def state_context(ctx: Any) -> contextlib.AbstractContextManager[Any]:
    """``with state_context(meta): model(...)``: the recurrent layers' metadata, set for this
    thread and reset."""
    return _scoped("state", ctx)
