"""The one attention function graphrt registers with transformers' ``AttentionInterface``.

``transformers.AttentionInterface.register(ATTENTION_NAME, graphrt_attention)`` and
``config._attn_implementation = ATTENTION_NAME`` route every attention call of a
``PreTrainedModel`` that declares ``_supports_attention_backend`` here, with the calling module
(``module.layer_idx`` set), ``query [1, Hq, T, D]``, ``key [1, Hkv, T, D]``, ``value [1, Hkv, T,
Dv]``, the model's mask (None: transformers builds no mask for an implementation it has no mask
function for) and the layer's keyword arguments (``scaling``, ``sliding_window``, ``softcap``,
``s_aux`` ...). It must return ``(out [1, T, Hq, Dv], weights or None)``.

What handles the call is the calling thread's innermost :func:`handling` handler: the layer probe while a model
is inspected (``facts.py``), graphrt's paged layers while it runs (``model.py``). Outside both
the call is an error: the model is a graphrt model now, run it through graphrt.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch

#: The name graphrt's attention is registered under (``config._attn_implementation``).
ATTENTION_NAME = "graphrt"

Handler = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, Any, dict], tuple]


#: This thread's stack of handlers (``stack``): each engine's forward (its main thread's, its
#: background builder's) routes the attention calls it makes to its own paged layers, never to
#: those of another engine's forward running on another thread at the same time. A plain
#: ``threading.local`` (torch 2.11's Dynamo does not see a subclass's per-thread attributes).
_HANDLERS = threading.local()


def _stack() -> list[Handler]:
    """This thread's handler stack, made on first use."""
    stack = getattr(_HANDLERS, "stack", None)
    if stack is None:
        stack = _HANDLERS.stack = []
    return stack


def graphrt_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature, dispatched to the innermost handler."""
    handlers = getattr(_HANDLERS, "stack", None)
    if not handlers:
        raise RuntimeError(f"attention implementation {ATTENTION_NAME!r} called outside graphrt: this model's "
                           "attention runs over graphrt's paged KV cache; run it through graphrt (ModelRunner, "
                           "graphrt.LLM) or set model.set_attn_implementation('sdpa') to use it on its own")
    return handlers[-1](module, query, key, value, attention_mask, kwargs)


@contextlib.contextmanager
def handling(handler: Handler) -> Iterator[None]:
    """Route the registered attention function to ``handler`` inside the block, on this thread."""
    handlers = _stack()
    handlers.append(handler)
    try:
        yield
    finally:
        handlers.pop()


def register_attention() -> None:
    """Register :func:`graphrt_attention` with transformers (idempotent; imports transformers)."""
    from transformers import AttentionInterface

    if AttentionInterface._global_mapping.get(ATTENTION_NAME) is not graphrt_attention:
        AttentionInterface.register(ATTENTION_NAME, graphrt_attention)


__all__ = ["ATTENTION_NAME", "graphrt_attention", "handling", "register_attention"]
