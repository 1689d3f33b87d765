"""How ``graphrt.LLM`` contains a failed step (its "Faults" in engine/llm.py).

The step's requests finish with ``finish_reason="error"`` (their blocks freed) and the fault is
kept for their ``generate`` call; a KV cache the fault consumed (XLA donation) is re-created,
and every request that held KV in it is requeued for recompute, like a preemption. The plain
and the overlapped loop (engine/overlap.py) both call it.
"""

from __future__ import annotations

import logging
from typing import Any

from graphrt.core.errors import KVCacheLostError
from graphrt.engine.overlap import drop_unresolved
from graphrt.engine.scheduler import Request

logger = logging.getLogger(__name__)


class StepRecovery:
    """A mixin of :class:`graphrt.LLM` over its runner, scheduler and request bookkeeping."""

    runner: Any
    scheduler: Any
    num_step_faults: int
    _requests: dict[int, Request]
    _faults: dict[int, BaseException]
    _kv_resets_seen: int
    _inflight: list[Any]

    def _fail(self, requests: list[Request], exc: Exception) -> list[Any]:
        """Finish a failed step's requests with "error" (their blocks freed), then recover a
        KV cache the fault lost: the requests that held KV in it are recomputed."""
        self.num_step_faults += 1
        why = f"{type(exc).__name__}: {exc}"
        logger.warning("graphrt: a step of request(s) %s failed; they finish with an error: %s",
                       [r.request_id for r in requests], why, exc_info=exc)
        outs = [self._finish(r, "error", why) for r in requests if r.request_id in self._requests]
        self._faults.update((o.request_id, exc) for o in outs)
        self._recover_kv(exc, [o.request_id for o in outs])
        return outs

    def _recover_kv(self, exc: BaseException | None, failed: list[int]) -> None:
        """If the fault consumed the KV cache (XLA donation), have it re-created and requeue
        every running request for recompute, like a preemption; ``exc`` learns who lost KV."""
        self.runner.recover_kv_cache()
        resets = self.runner.kv_cache_resets
        if resets == self._kv_resets_seen and not isinstance(exc, KVCacheLostError):
            return
        self._kv_resets_seen = resets
        lost = list(self.scheduler.running)
        self.scheduler.requeue(lost)
        self._inflight = []                     # their KV went with the cache: recomputed too
        for req in lost + list(self.scheduler.waiting):
            drop_unresolved(req)
        self.scheduler.reset_prefix_cache()     # the cached KV went with the cache
        if isinstance(exc, KVCacheLostError):
            exc.request_ids = tuple(failed) + tuple(r.request_id for r in lost)
        logger.warning("graphrt: the KV cache was lost; requests %s are recomputed",
                       [r.request_id for r in lost])


__all__ = ["StepRecovery"]
