"""Graph modes: what a user asks for (:class:`GraphMode`), what an attention backend can run
inside a FULL graph (:class:`AttentionGraphSupport`), the best mode both allow
(:func:`resolve_mode`), and how one step actually runs (:class:`RuntimeMode`)."""

from __future__ import annotations

import enum


class GraphMode(str, enum.Enum):
    """vLLM's graph modes: one for decode batches, one for mixed (prefill / chunked) batches."""

    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"

    def decode_mode(self) -> "RuntimeMode":
        """Runtime mode of uniform-decode batches."""
        return {GraphMode.NONE: RuntimeMode.NONE, GraphMode.PIECEWISE: RuntimeMode.PIECEWISE}.get(
            self, RuntimeMode.FULL)

    def mixed_mode(self) -> "RuntimeMode":
        """Runtime mode of mixed / prefill batches."""
        return {GraphMode.NONE: RuntimeMode.NONE, GraphMode.PIECEWISE: RuntimeMode.PIECEWISE,
                GraphMode.FULL: RuntimeMode.FULL, GraphMode.FULL_DECODE_ONLY: RuntimeMode.NONE,
                GraphMode.FULL_AND_PIECEWISE: RuntimeMode.PIECEWISE}[self]

    def separate_decode_graphs(self) -> bool:
        """Whether decode batches get their own FULL graphs keyed ``uniform_decode=True``."""
        return self in (GraphMode.FULL_DECODE_ONLY, GraphMode.FULL_AND_PIECEWISE)


class AttentionGraphSupport(enum.IntEnum):
    """What an attention backend can run inside a FULL graph (vLLM's four levels)."""

    NEVER = 0                        # attention must stay outside graphs
    UNIFORM_SINGLE_TOKEN_DECODE = 1  # full graphs of single-token decode batches only
    UNIFORM_BATCH = 2                # full graphs of uniform batches (decode, spec-decode)
    ALWAYS = 3                       # full graphs of any batch, mixed included


def resolve_mode(requested: GraphMode, *, attention: AttentionGraphSupport,
                 piecewise: bool) -> tuple[GraphMode, str | None]:
    """The best mode the backend supports at or below ``requested``; the reason if degraded."""
    mode = GraphMode(requested)
    if mode is GraphMode.NONE:
        return mode, None
    full_mixed = attention >= AttentionGraphSupport.ALWAYS
    full_decode = attention >= AttentionGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
    wanted = mode
    if mode is GraphMode.FULL and not full_mixed:
        mode = GraphMode.FULL_AND_PIECEWISE if full_decode else GraphMode.PIECEWISE
    if mode in (GraphMode.FULL_AND_PIECEWISE, GraphMode.FULL_DECODE_ONLY) and not full_decode:
        mode = GraphMode.PIECEWISE if mode is GraphMode.FULL_AND_PIECEWISE else GraphMode.NONE
    if not piecewise:
        if mode is GraphMode.FULL_AND_PIECEWISE:
            mode = GraphMode.FULL if full_mixed else GraphMode.FULL_DECODE_ONLY
        elif mode is GraphMode.PIECEWISE:
            mode = GraphMode.NONE
    if mode is wanted:
        return mode, None
    return mode, (f"graph mode {wanted.value} degraded to {mode.value}: attention supports full graphs "
                  f"{attention.name.lower()}, piecewise capture {'available' if piecewise else 'unavailable'}")


class RuntimeMode(str, enum.Enum):
    """How one step actually runs."""

    NONE = "NONE"            # eagerly
    PIECEWISE = "PIECEWISE"  # graphs between attention calls, attention eager
    FULL = "FULL"            # one graph for the whole forward
