"""Why a step ran eagerly: the causes, in one place, and the per-cause counters.

Every eager step is counted under exactly one :class:`EagerCause`, with the real tokens it
ran (``CacheStats.eager_by_cause``); the free-text reason stays in ``eager_reasons``. The
dispatcher names the cause of the steps it sends eager (``Dispatch.cause``); the runner, of
those whose key has no graph.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass



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
