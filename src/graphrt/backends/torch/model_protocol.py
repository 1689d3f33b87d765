"""What the torch executor reads of a model: its attention layers' declarations.

The attention seam (docs/attention.md): each attention layer may declare what it can run in
a FULL graph (``graph_support``: vLLM's four levels) and which of the step's host values a
graph of it fixes when it is built (``keyed_host_values(device, dtype)``: ``max_seq_len`` for
graphrt's reference kernels, which the keys then hold as context buckets). A layer that
declares nothing runs in any graph and fixes nothing.
"""

from __future__ import annotations

import torch

from graphrt.core.dispatch import AttentionGraphSupport


def keyed_host_values(model: torch.nn.Module, device: torch.device) -> tuple[str, ...]:
    """What the model's attention layers fix when a graph is built (their ``keyed_host_values``;
    a layer that declares nothing fixes nothing)."""
    dtype = next(model.parameters()).dtype
    found: set[str] = set()
    for layer in model.attention_layers() if hasattr(model, "attention_layers") else []:
        declare = getattr(layer, "keyed_host_values", None)
        if declare is not None:
            found.update(declare(device, dtype))
    return tuple(sorted(found))


def attention_support(model: torch.nn.Module) -> AttentionGraphSupport:
    """The least FULL-graph support declared by the model's attention layers."""
    layers = model.attention_layers() if hasattr(model, "attention_layers") else []
    levels = [AttentionGraphSupport(getattr(layer, "graph_support", AttentionGraphSupport.ALWAYS))
              for layer in layers]
    return min(levels, default=AttentionGraphSupport.ALWAYS)


__all__ = ["attention_support", "keyed_host_values"]
