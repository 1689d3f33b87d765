"""Why a step ran eagerly: the causes, in one place, and the per-cause counters.

Every eager step is counted under exactly one :class:`EagerCause`, with the real tokens it
ran (``CacheStats.eager_by_cause``); the free-text reason stays in ``eager_reasons``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from graphrt.core.dispatch import Dispatch, Dispatcher, GraphMode, RuntimeMode


class EagerCause(str, enum.Enum):
    """The four reasons a step runs without a graph / executable."""

    #: More tokens (or decode requests) than the largest bucket: planned by the bucket policy.
    ABOVE_LARGEST_BUCKET = "above_largest_bucket"
    #: The key's capture failed during warm-up; it runs eagerly (``stats.failed_builds``).
    CAPTURE_FAILED = "capture_failed"
    #: The graph mode does not cover the step: ``NONE`` / ``enforce_eager``, an eager-only
    #: backend, or a mixed step under ``FULL_DECODE_ONLY``.
    MODE = "mode"
    #: The key has no entry (not built during warm-up); strict mode raises instead.
    MISS = "miss"


@dataclass
class EagerCount:
    """Eager steps of one cause and the real tokens they ran."""

    steps: int = 0
    tokens: int = 0


def new_eager_counts() -> dict[EagerCause, EagerCount]:
    """One zeroed counter per cause, made once per cache (the hot path only adds to them)."""
    return {cause: EagerCount() for cause in EagerCause}


def dispatch_cause(dispatcher: Dispatcher, d: Dispatch, uniform_decode: bool) -> EagerCause:
    """Why the dispatcher sent a step eager (``d.mode`` is NONE): its graph mode does not cover
    the step, or the step is above the largest bucket that would have covered it. Mirrors
    :meth:`Dispatcher.dispatch`: decode steps above the largest decode bucket count as above.
    A stand-in dispatcher without a graph ``mode`` counts as the mode's choice."""
    if d.mode is not RuntimeMode.NONE:
        raise ValueError(f"dispatch_cause: the step runs {d.mode.value}, not eagerly")
    mode = getattr(dispatcher, "mode", GraphMode.NONE)
    if mode is GraphMode.NONE:
        return EagerCause.MODE
    if uniform_decode and getattr(dispatcher, "separate_decode", False):
        return EagerCause.ABOVE_LARGEST_BUCKET   # no decode bucket held it (else it had a graph)
    runtime = mode.decode_mode() if uniform_decode else mode.mixed_mode()
    return EagerCause.MODE if runtime is RuntimeMode.NONE else EagerCause.ABOVE_LARGEST_BUCKET
