"""The engine loop of :class:`graphrt.LLM`: one loop for every step, plain or overlapped.

A step: schedule, launch (write tables, run on the runner, advance requests optimistically), then
resolve launched steps until at most ``depth`` stay in flight (0: plain; 1: overlap, as SGLang's
``event_loop_overlap``). Overlap is exact because a launched sampling request gets a placeholder
token that the next step reads on the device (``future_rows``), a request reaching its limit is
``retiring`` and not scheduled again, and no prefix-cache key covers a placeholder. See
docs/api.md, "Overlap scheduling".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from threading import get_ident
from time import monotonic
from typing import Any

import numpy as np

from graphrt.config import GraphConfig, check_flags
from graphrt.core.errors import GraphrtError, KVCacheLostError
from graphrt.core.future_tokens import PendingTokens
from graphrt.engine.metrics import EngineMetrics
from graphrt.core.sampling.logprobs import StepOutput
from graphrt.engine.outputs import RequestOutput, collect_logprobs
from graphrt.engine.sampling_params import without_seed
from graphrt.engine.request import Request, Status
from graphrt.engine.scheduler import ScheduledStep, Scheduler
from graphrt.engine.watchdog import NoWatchdog, Watchdog
from graphrt.runner import ModelRunner, SamplingBatch, sampling_batch

logger = logging.getLogger("graphrt.engine.llm")

#: The id written for a token that is not known yet (any id in the vocabulary would do).
PLACEHOLDER_TOKEN = 0


@dataclass(eq=False)
class Launched:
    """A step launched but not yet resolved: its requests, which sample, and its tokens (or the
    handle that waits for them)."""

    step: ScheduledStep
    samples: list[bool]
    tokens: np.ndarray | StepOutput | None
    pending: PendingTokens | None
    prompt_starts: list[int] | None = None      # computed tokens at launch, if prompt logprobs were asked


def overlap_enabled(runner: ModelRunner, disable_overlap_schedule: bool) -> bool:
    """Whether overlap is on by default: asked for, and the device runs ahead of the host (xla,
    cuda, npu); elsewhere it would hide nothing. ``llm.overlap = True`` still forces it."""
    check_flags(disable_overlap_schedule=disable_overlap_schedule)
    if disable_overlap_schedule:
        return False
    if not runner.executor.capabilities.device_runs_ahead:
        logger.info("graphrt: overlap scheduling needs a backend that dispatches asynchronously; "
                    "%s runs each step to the end, so the engine runs the plain loop", runner.backend.name)
        return False
    return True


def drop_unresolved(req: Request) -> None:
    """Forget ``req``'s placeholder tokens (its KV is recomputed; they are recomputed too)."""
    if req.num_unresolved:
        del req.output_token_ids[-req.num_unresolved:]
        req.num_tokens -= req.num_unresolved
    req.num_unresolved, req.future_row, req.retiring = 0, -1, False


class StepLoop:
    """Schedules, launches and resolves :class:`graphrt.LLM`'s steps and finishes its requests.

    Owns the unfinished requests, the persistent token and block tables, the steps in flight and
    undelivered faults. ``lock`` is the engine's, held by every caller of :meth:`step`."""

    def __init__(self, *, runner: ModelRunner, scheduler: Scheduler, config: GraphConfig,
                 eos_token_ids: frozenset[int], metrics: EngineMetrics, watchdog: Watchdog | NoWatchdog,
                 depth: int) -> None:
        self.runner, self.scheduler, self.config = runner, scheduler, config
        self.eos_token_ids, self.metrics, self.watchdog = eos_token_ids, metrics, watchdog
        self.depth = depth                          # launched steps left unresolved after a step
        self.token_table = np.zeros((config.max_num_seqs, config.max_model_len), dtype=np.int32)
        self.block_table = np.zeros((config.max_num_seqs, config.max_blocks_per_req), dtype=np.int32)
        # Each row's recurrent-state slot (hybrid models; None otherwise): the scheduler's, per step.
        self.state_table = (np.full(config.max_num_seqs, -1, dtype=np.int32)
                            if runner.executor.num_state_slots else None)
        self.requests: dict[int, Request] = {}              # unfinished requests by id
        self.faults: dict[int, BaseException] = {}          # failed request id -> its fault, undelivered
        self.num_step_faults = 0            # faults contained by finishing requests with "error"
        self.inflight: list[Launched] = []                  # launched, unresolved steps, oldest first
        self._kv_resets_seen = runner.executor.kv_cache_resets
        # The runner's per-request arrays, persistent; the last sampling batch and whom it was for.
        self._req_arrays = np.zeros((3, config.max_num_seqs), dtype=np.int32)   # rows, computed, scheduled
        self._batch: SamplingBatch | None = None
        self._batch_for: list[int] = []         # request id per row, ~id where it does not sample
        self._prompt_logprobs: set[int] = set()     # requests whose prompt logprobs are not all computed

    def add(self, req: Request) -> None:
        """Queue a validated request."""
        self.scheduler.add(req)
        self.requests[req.request_id] = req
        if req.params.logprobs is not None:
            req.sample_logprobs = []
        if req.params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(req.prompt_token_ids)
            if len(req.prompt_token_ids) > 1:
                self._prompt_logprobs.add(req.request_id)

    def busy(self) -> bool:
        """Whether any request is queued or running, or a launched step holds one."""
        return self.scheduler.has_unfinished() or any(
            r.status is not Status.FINISHED for s in self.inflight for r in s.step.requests)

    def step(self) -> list[RequestOutput]:
        """One step (lock held): launch the next step, then resolve until ``depth`` stay in flight
        (none when nothing new launched); returns every request that finished.

        A failed launch finishes its requests with an error; KeyboardInterrupt and kin leave them
        queued, unadvanced, and an interrupted resolve is completed by the next step."""
        if self.watchdog.error is not None:
            self.watchdog.check()           # refused after a watchdog timeout until reset()
        if self.runner.executor.kv_cache_resets != self._kv_resets_seen:
            self._recover_kv(None, [])      # re-created outside a step: cached KV is gone too
        finished: list[RequestOutput] = []
        inflight = self.inflight            # cleared in place, never replaced
        while len(inflight) > self.depth:   # an interrupted resolve left one more
            finished.extend(self._resolve(inflight[0]))
        step = self.scheduler.schedule()
        keep = self.depth
        if step.requests:
            try:
                inflight.append(self._launch(step))
            except Exception as exc:  # noqa: BLE001 - any fault finishes the step's requests, never wedges
                finished.extend(self._fail(step.requests, exc))
            except BaseException:
                self._recover_kv(None, [])
                raise
        elif not inflight:
            if self.scheduler.has_unfinished():
                raise GraphrtError("scheduler made no progress: a request cannot fit in the KV cache")
            return finished
        else:
            keep = 0                        # nothing new to overlap with: drain
        while len(inflight) > keep:
            finished.extend(self._resolve(inflight[0]))
        if step.num_prefill_reqs or self.scheduler.num_decode_steps >= self.metrics.next_decode_line:
            self.metrics.record(step, self.scheduler, self.runner)     # a log line is due
        return finished

    def settle(self) -> list[RequestOutput]:
        """Resolve every launched step (lock held): nothing stays in flight; returns the requests
        that finished (before the weights or the memory change under the requests)."""
        finished: list[RequestOutput] = []
        while self.inflight:
            finished.extend(self._resolve(self.inflight[0]))
        return finished

    def recompute_all(self, why: str) -> list[int]:
        """Requeue every running request for recompute (its KV is dropped, as after a preemption)
        and forget the cached prefixes; call :meth:`settle` first. Returns the requeued ids."""
        lost = list(self.scheduler.running)
        self.scheduler.requeue(lost)
        for req in lost:
            drop_unresolved(req)
        self.scheduler.reset_prefix_cache()
        if lost:
            logger.info("graphrt: %s; requests %s are recomputed", why, [r.request_id for r in lost])
        return [r.request_id for r in lost]

    def _launch(self, step: ScheduledStep) -> Launched:
        """Write the step's inputs, run (depth 0) or launch (depth 1) it, and advance its requests
        optimistically (a placeholder token per sampling request until :meth:`_resolve`)."""
        inputs, samples = self._step_inputs(step)
        reqs = step.requests
        tokens = pending = starts = None
        if self._prompt_logprobs:
            starts = self._prompt_inputs(step, inputs)
        dog = self.watchdog                 # its heartbeat written inline (engine/watchdog.py, Watchdog)
        dog.context, dog.thread, dog.started = step, get_ident(), monotonic()
        dog.count += 1
        dog.armed = True
        try:
            if self.depth:
                future = np.full(len(reqs), -1, dtype=np.int32)
                for i, (req, sampled) in enumerate(zip(reqs, samples)):
                    if req.num_unresolved and sampled:
                        future[i] = req.future_row
                pending = self.runner.execute_async(**inputs, future_rows=future if future.max() >= 0 else None)
            else:
                tokens = self.runner.execute(**inputs)
        finally:
            dog.armed = False
            if dog.deciding or dog.fired == dog.count:
                dog.disarm()                # raises WatchdogTimeout if it fired for this forward
        limit = self.config.max_model_len
        for i, (req, n, sampled) in enumerate(zip(reqs, step.num_scheduled, samples)):
            req.num_computed_tokens += n
            if sampled:
                req.output_token_ids.append(PLACEHOLDER_TOKEN)
                req.num_tokens += 1
                req.num_unresolved += 1
                req.future_row = i
                req.retiring = len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= limit
        return Launched(step, samples, tokens, pending, starts)

    def _step_inputs(self, step: ScheduledStep) -> tuple[dict[str, Any], list[bool]]:
        """Write what the persistent tables lack for ``step`` and fill the request arrays; returns
        the runner's arguments and which requests sample. The sampling batch is reused while the
        same requests sample (a non-sampling request keeps its seed's stream: ``without_seed``)."""
        reqs = step.requests
        n = len(reqs)
        arrays = self._req_arrays[:, :n]
        rows, computed, scheduled = arrays
        token_table, block_table, state_table = self.token_table, self.block_table, self.state_table
        samples: list[bool] = []
        batch_for: list[int] = []
        for i, (req, num) in enumerate(zip(reqs, step.num_scheduled)):
            row, end = req.row, req.num_computed_tokens + num
            rows[i], computed[i], scheduled[i] = row, req.num_computed_tokens, num
            start = req.tokens_in_row
            if start < end:
                n = len(req.prompt_token_ids)      # a decode's tokens are generated ones: sliced here
                token_table[row, start:end] = (req.output_token_ids[start - n:end - n] if start >= n
                                               else req.tokens(start, end))
                req.tokens_in_row = end
            if req.blocks_in_row < len(req.blocks):
                if req.blocks_in_row == 0:
                    block_table[row] = 0
                block_table[row, req.blocks_in_row:len(req.blocks)] = req.blocks[req.blocks_in_row:]
                req.blocks_in_row = len(req.blocks)
            if state_table is not None:
                state_table[row] = req.state_slot
            sampled = end == req.num_tokens
            samples.append(sampled)
            batch_for.append(req.request_id if sampled else ~req.request_id)
        if batch_for != self._batch_for:
            params = [r.params if s else without_seed(r.params) for r, s in zip(reqs, samples)]
            self._batch = sampling_batch(params, [r.request_id for r in reqs], self.runner.vocab_size,
                                         prompt_lens=[len(r.prompt_token_ids) for r in reqs])
            self._batch_for = batch_for
        inputs = {"token_ids": token_table, "block_table": block_table, "req_rows": rows,
                  "num_computed_tokens": computed, "num_scheduled_tokens": scheduled, "sampling": self._batch}
        if state_table is not None:
            inputs["state_slots"] = state_table
        return inputs, samples

    def _prompt_inputs(self, step: ScheduledStep, inputs: dict[str, Any]) -> list[int] | None:
        """Ask for incomplete prompt logprobs and write each request's next prompt token (the
        logprob at a chunk's last position is that token's); returns computed tokens at launch."""
        counts, starts, table = [], [], self.token_table
        for req, n in zip(step.requests, step.num_scheduled):
            start, prompt = req.num_computed_tokens, req.prompt_token_ids
            wanted = req.request_id in self._prompt_logprobs and start < len(prompt) - 1
            counts.append(req.params.prompt_logprobs if wanted else None)
            starts.append(start)
            if wanted and start + n < len(prompt):
                table[req.row, start + n] = prompt[start + n]
        if any(c is not None for c in counts):
            inputs["prompt_logprobs"] = counts
            return starts
        return None

    def _resolve(self, launched: Launched) -> list[RequestOutput]:
        """Wait for the oldest launched step's tokens and replace its placeholders; returns the
        requests it finished. Stays in flight if interrupted; a fault fails its requests."""
        step = launched.step
        tokens = launched.tokens
        if tokens is None and launched.pending is not None:
            dog = self.watchdog             # the heartbeat, as in _launch
            dog.context, dog.thread, dog.started = step, get_ident(), monotonic()
            dog.count += 1
            dog.armed = True
            try:
                tokens = launched.pending.result()
            except Exception as exc:  # noqa: BLE001 - the step's requests fail, like a failed run
                self.inflight.remove(launched)
                return self._fail([r for r in step.requests if r.status is not Status.FINISHED], exc)
            finally:
                dog.armed = False
                if dog.deciding or dog.fired == dog.count:
                    dog.disarm()
        self.inflight.remove(launched)      # resolved: out of flight
        if type(tokens) is StepOutput:      # logprobs asked: filed before any request finishes
            collect_logprobs(step.requests, launched.samples, launched.prompt_starts, tokens, Status.FINISHED)
            self._prompt_logprobs.difference_update(
                r.request_id for r in step.requests if r.prompt_logprobs is not None and None not in r.prompt_logprobs[1:])
            tokens = tokens.token_ids
        if tokens is None or len(tokens) != len(step.requests):
            return self._fail(step.requests, GraphrtError(
                f"the runner returned {None if tokens is None else len(tokens)} tokens for a step of "
                f"{len(step.requests)} requests"))
        finished: list[RequestOutput] = []
        for req, sampled, tok in zip(step.requests, launched.samples, tokens):
            if req.status is Status.FINISHED:
                continue    # finished (EOS one step earlier, aborted, failed): its token is dropped
            try:
                if sampled:
                    index = len(req.output_token_ids) - req.num_unresolved
                    token = int(tok)
                    req.output_token_ids[index] = token
                    req.num_unresolved -= 1
                    position = len(req.prompt_token_ids) + index
                    if req.row >= 0 and position < req.tokens_in_row:
                        self.token_table[req.row, position] = token
                    reason = self._stop_reason(req, token, index + 1)
                    if reason is not None:
                        finished.append(self.finish(req, reason))
                        continue
                if req.status is Status.RUNNING:
                    self.scheduler.cache_computed(req)   # its new full blocks, for others to share
            except Exception as exc:  # noqa: BLE001 - contained to this request
                finished.extend(self._fail([req], exc))
        return finished

    def _stop_reason(self, req: Request, token: int, generated: int | None = None) -> str | None:
        """Why ``req`` stops at ``token``, its ``generated``-th output (default: its last), or None."""
        if not req.params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        generated = len(req.output_token_ids) if generated is None else generated
        if generated >= req.params.max_tokens or len(req.prompt_token_ids) + generated >= self.config.max_model_len:
            return "length"
        return None

    def finish(self, req: Request, reason: str, error: str | None = None) -> RequestOutput:
        """Finish ``req`` (running or waiting): free its row, blocks and runner state."""
        self.scheduler.finish(req, reason)
        try:
            self.runner.free_request(req.request_id)
        except Exception:  # noqa: BLE001 - the request is finished either way
            logger.warning("graphrt: freeing the runner state of request %d failed", req.request_id,
                           exc_info=True)
        self.requests.pop(req.request_id, None)
        self._prompt_logprobs.discard(req.request_id)
        known = len(req.output_token_ids) - req.num_unresolved     # placeholders are not output
        return RequestOutput(req.request_id, req.prompt_token_ids, req.output_token_ids[:known],
                             reason, error, req.num_cached_tokens, req.sample_logprobs, req.prompt_logprobs)

    def _fail(self, requests: list[Request], exc: Exception) -> list[RequestOutput]:
        """Finish a failed step's requests with "error" (their blocks freed), then recover a
        KV cache the fault lost: the requests that held KV in it are recomputed."""
        self.num_step_faults += 1
        why = f"{type(exc).__name__}: {exc}"
        logger.warning("graphrt: a step of request(s) %s failed; they finish with an error: %s",
                       [r.request_id for r in requests], why, exc_info=exc)
        outs = [self.finish(r, "error", why) for r in requests if r.request_id in self.requests]
        self.faults.update((o.request_id, exc) for o in outs)
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
        self.inflight.clear()                   # their KV went with the cache: recomputed too
        for req in lost + list(self.scheduler.waiting):
            drop_unresolved(req)
        self.scheduler.reset_prefix_cache()     # the cached KV went with the cache
        if isinstance(exc, KVCacheLostError):
            exc.request_ids = tuple(failed) + tuple(r.request_id for r in lost)
        logger.warning("graphrt: the KV cache was lost; requests %s are recomputed",
                       [r.request_id for r in lost])


__all__ = ["Launched", "PLACEHOLDER_TOKEN", "StepLoop", "drop_unresolved", "overlap_enabled"]
