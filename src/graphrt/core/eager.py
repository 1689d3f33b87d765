"""Why a step ran without a graph: the causes, in one place, and the per-cause counters.

Every eager step counts under exactly one :class:`EagerCause` with its real tokens
(``CacheStats.eager_by_cause``; the free-text reason in ``eager_reasons``); ``CacheStats``
refuses an eager step without a cause. The list is documented in docs/api.md ("Eager steps by
cause"). Strict mode is not a cause: there a miss raises ``CacheMissError`` instead."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EagerCause(str, enum.Enum):
    """The reasons a step runs without a graph / executable."""

    #: More tokens (or decode requests) than the largest bucket: planned by the bucket policy.
    ABOVE_LARGEST_BUCKET = "above_largest_bucket"
    #: A request longer than the largest context bucket of FULL graphs (and no PIECEWISE key).
    ABOVE_LARGEST_CONTEXT = "above_largest_context"
    #: The key's capture failed; it runs eagerly (``stats.failed_builds``, the error in
    #: ``eager_reasons`` and the key's ``failed`` in the warm-up report).
    CAPTURE_FAILED = "capture_failed"
    #: The graph mode does not cover the step: ``NONE`` / ``enforce_eager``, an eager-only
    #: backend, or a mixed step under ``FULL_DECODE_ONLY``.
    MODE = "mode"
    #: The configured mode would cover the step, but the attention backend (its FULL-graph
    #: support level) or the model (no PIECEWISE split) cannot: the mode was degraded.
    UNSUPPORTED = "unsupported_by_attention"
    #: The key is not built yet: background warm-up (or a traffic re-fit) is still building
    #: keys, and no built key covers the step.
    WARMING_UP = "miss_during_warmup"
    #: The key was left unbuilt: its graph would not fit in the graph memory the KV budget
    #: admitted (background warm-up stops there).
    GRAPH_MEMORY = "graph_memory"
    #: The key has no entry and no warm-up will build it (``warmup=False`` and never built);
    #: strict mode raises instead.
    MISS = "miss"


@dataclass
class EagerCount:
    """Eager steps of one cause and the real tokens they ran."""

    steps: int = 0
    tokens: int = 0


def new_eager_counts() -> dict[EagerCause, EagerCount]:
    """One zeroed counter per cause, made once per cache (the hot path only adds to them)."""
    return {cause: EagerCount() for cause in EagerCause}


def describe_causes() -> dict[str, str]:
    """Every cause's value and its one-line meaning (the first line of its comment), for docs,
    ``graphrt`` output and the Prometheus export's HELP text."""
    return dict(_MEANINGS)


_MEANINGS: dict[str, str] = {
    EagerCause.ABOVE_LARGEST_BUCKET.value: "more tokens or decode requests than the largest bucket",
    EagerCause.ABOVE_LARGEST_CONTEXT.value: "a request longer than the largest context bucket of FULL graphs",
    EagerCause.CAPTURE_FAILED.value: "the key's capture / compile failed (its error in eager_reasons)",
    EagerCause.MODE.value: "the graph mode runs this kind of step eagerly (NONE, enforce_eager, eager backend)",
    EagerCause.UNSUPPORTED.value: "the attention backend or the model cannot hold this step kind in a graph",
    EagerCause.WARMING_UP.value: "the key is not built yet (background warm-up or a re-fit is building it)",
    EagerCause.GRAPH_MEMORY.value: "the key was left unbuilt: it would exceed the graph memory the KV budget admitted",
    EagerCause.MISS.value: "the key was never built and no warm-up will build it",
}
