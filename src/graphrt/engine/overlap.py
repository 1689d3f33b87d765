"""Overlap scheduling (seed 002's ``event_loop_overlap``) for :class:`graphrt.LLM`.

One overlapped step: schedule step n + 1 and launch it (``runner.execute_async``) while the
device still runs step n, then wait for step n's tokens and process them. The host's
scheduling, table writes and input preparation thus run while the device computes.

What makes this exact:

* **Optimistic progress.** Launching a step advances each request's computed tokens at once,
  and a request that samples gets a placeholder token (id 0, counted in ``num_unresolved``),
  so the scheduler plans the next step as if the token were known.
* **Future tokens.** A request that decodes its unresolved token in step n + 1 names the
  row of step n that sampled it (``future_rows``); the backend substitutes the sampled id
  on the device before the forward reads it (:mod:`graphrt.core.future_tokens`).
* **Known finishes.** A request whose launched tokens reach ``max_tokens`` or
  ``max_model_len`` is ``retiring``: the scheduler skips it, so batches are the plain loop's.
  A request that samples EOS is known only when its step resolves; it has then been
  scheduled once more, and that step's token for it is dropped.
* **The prefix cache only sees resolved tokens.** Unresolved tokens are always a request's
  last ones and lie beyond its computed tokens whenever blocks are cached, so no block
  key covers a placeholder; cached blocks whose KV an in-flight step still writes are only
  read by later steps, which the device runs after it.
* **Faults.** A failed launch fails its requests; a failed resolve fails the step's requests,
  and if the KV cache was lost the in-flight step is dropped and every running request is
  recomputed without its placeholders.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphrt.core.errors import ConfigError, GraphrtError
from graphrt.core.future_tokens import PendingTokens
from graphrt.engine.scheduler import Request, ScheduledStep, Status

logger = logging.getLogger(__name__)

#: The id written for a token that is not known yet (any id in the vocabulary would do).
PLACEHOLDER_TOKEN = 0


@dataclass
class Launched:
    """A step launched but not yet resolved: its requests and whether each samples."""

    step: ScheduledStep
    pending: PendingTokens
    samples: list[bool]


def check_overlap_flag(disable_overlap_schedule: bool) -> None:
    """Refuse a ``disable_overlap_schedule`` that is not True or False (ConfigError naming it)."""
    if not isinstance(disable_overlap_schedule, bool):
        raise ConfigError(f"disable_overlap_schedule must be True or False, got {disable_overlap_schedule!r}")


def overlap_enabled(runner: Any, disable_overlap_schedule: bool) -> bool:
    """Whether the engine overlaps its steps: asked for, and the backend dispatches
    asynchronously (on the others it would wait for every step anyway; said once, at INFO)."""
    check_overlap_flag(disable_overlap_schedule)
    if disable_overlap_schedule:
        return False
    if not runner.executor.async_execution:
        logger.info("graphrt: overlap scheduling needs a backend that dispatches asynchronously; "
                    "%s runs each step to the end, so the engine runs the plain loop", runner.backend.name)
        return False
    return True


def drop_unresolved(req: Request) -> None:
    """Forget ``req``'s placeholder tokens (its KV is recomputed; they are recomputed too)."""
    if req.num_unresolved:
        del req.output_token_ids[-req.num_unresolved:]
    req.num_unresolved, req.future_row, req.retiring = 0, -1, False


class OverlapLoop:
    """The overlapped step of :class:`graphrt.LLM` (a mixin over its scheduler, runner,
    tables, metrics, watchdog and request bookkeeping)."""

    _inflight: list[Launched]

    def _step_overlapped(self) -> list[Any]:
        """Schedule and launch the next step, then resolve the previous one; returns the
        requests that finished (the lock held; ``_step`` checked the watchdog and the KV cache)."""
        finished: list[Any] = []
        while len(self._inflight) > 1:      # an interrupted resolve left two: the plan needs one
            finished.extend(self._resolve_oldest())
        step = self.scheduler.schedule()
        previous = self._inflight[0] if self._inflight else None
        if step.requests:
            self.metrics.observe(step)
            try:
                self._inflight.append(self._launch(step))
            except Exception as exc:  # noqa: BLE001 - contained to the step's requests
                finished.extend(self._fail(step.requests, exc))
            except BaseException:
                self._recover_kv(None, [])  # KeyboardInterrupt and kin: as in the plain loop
                raise
        elif not self._inflight:
            if self.scheduler.has_unfinished():
                raise GraphrtError("scheduler made no progress: a request cannot fit in the KV cache")
            return []
        if previous is not None and self._inflight and self._inflight[0] is previous:
            finished.extend(self._resolve_oldest())
        self.metrics.record(self.scheduler, self.runner)
        return finished

    def _inflight_live(self) -> bool:
        """Whether a launched step still holds an unfinished request."""
        return any(r.status is not Status.FINISHED for s in self._inflight for r in s.step.requests)

    def _resolve_oldest(self) -> list[Any]:
        """Resolve the oldest launched step; it stays launched if waiting is interrupted."""
        oldest = self._inflight[0]
        finished = self._resolve(oldest)
        if self._inflight and self._inflight[0] is oldest:     # a lost KV cache drops them all
            self._inflight.pop(0)
        return finished

    def _launch(self, step: ScheduledStep) -> Launched:
        """Write the tables, launch the step, and advance its requests optimistically."""
        inputs, samples = self._step_inputs(step)
        reqs = step.requests
        future = [r.future_row if r.num_unresolved and s else -1 for r, s in zip(reqs, samples)]
        self.watchdog.arm(step)
        try:
            pending = self.runner.execute_async(
                **inputs, future_rows=np.asarray(future, dtype=np.int32) if max(future) >= 0 else None)
        finally:
            self.watchdog.disarm()
        limit = self.config.max_model_len
        for i, (req, n, sampled) in enumerate(zip(reqs, step.num_scheduled, samples)):
            req.num_computed_tokens += n
            if sampled:
                req.output_token_ids.append(PLACEHOLDER_TOKEN)
                req.num_unresolved += 1
                req.future_row = i
                req.retiring = len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= limit
        return Launched(step, pending, samples)

    def _resolve(self, launched: Launched) -> list[Any]:
        """Wait for a launched step's tokens and apply them; returns the requests it finished."""
        step = launched.step
        self.watchdog.arm(step)
        try:
            tokens = launched.pending.result()
        except Exception as exc:  # noqa: BLE001 - the step's requests fail, like a failed run
            return self._fail([r for r in step.requests if r.status is not Status.FINISHED], exc)
        finally:
            self.watchdog.disarm()
        if len(tokens) != len(step):
            return self._fail(step.requests, GraphrtError(f"the runner returned {len(tokens)} tokens "
                                                          f"for a step of {len(step)} requests"))
        finished = []
        for req, sampled, tok in zip(step.requests, launched.samples, tokens):
            if req.status is Status.FINISHED:
                continue    # finished (EOS one step earlier, aborted, failed): its token is dropped
            try:
                if sampled:
                    finished.extend(self._resolve_token(req, int(tok)))
                elif req.status is Status.RUNNING:
                    self.scheduler.cache_computed(req)
            except Exception as exc:  # noqa: BLE001 - contained to this request
                finished.extend(self._fail([req], exc))
        return finished

    def _resolve_token(self, req: Request, token: int) -> list[Any]:
        """Put ``req``'s oldest unresolved token in place; finish it if it stops there."""
        index = len(req.output_token_ids) - req.num_unresolved
        req.output_token_ids[index] = token
        req.num_unresolved -= 1
        position = len(req.prompt_token_ids) + index
        if req.row >= 0 and position < req.tokens_in_row:
            self.token_table[req.row, position] = token
        reason = self._stop_reason(req, token, index + 1)
        if reason is not None:
            return [self._finish(req, reason)]
        if req.status is Status.RUNNING:
            self.scheduler.cache_computed(req)
        return []


__all__ = ["OverlapLoop", "Launched", "PLACEHOLDER_TOKEN", "check_overlap_flag", "drop_unresolved", "overlap_enabled"]
