"""``graphrt.LLM``: the embedded default engine -- scheduler, block allocator, ModelRunner.

It makes the library usable end to end and is how the parity tests drive real models::

    llm = graphrt.LLM(model_dir, backend="cpu", max_num_seqs=8)
    outs = llm.generate([[1, 2, 3]], graphrt.SamplingParams(max_tokens=8))
    outs[0].token_ids

Warm-up (capture / precompile) happens in the constructor. The prefix cache
(``enable_prefix_caching``, on by default) lets a request start from the KV of its longest
cached full-block prefix; ``schedule_policy`` orders the waiting queue (docs/api.md).

Faults: a step that raises finishes the requests it ran with ``finish_reason="error"`` (and
frees their blocks); ``generate`` then aborts the rest of its own requests and raises
:class:`~graphrt.core.errors.GenerationError` carrying every one of its outputs. A lost XLA KV
cache is re-created and the requests that held KV are recomputed. Threads: one lock
serializes ``add_request`` / ``step`` / ``abort_request`` and each step of ``generate``, so
concurrent ``generate`` calls batch together; each call gets exactly its own outputs.
``close()`` takes it too: it waits for the running step, and every call after it raises
GraphrtError saying the engine is closed.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any, Sequence

import numpy as np

from graphrt.core import defaults
from graphrt.config import GraphConfig
from graphrt.engine.block_allocator import BlockAllocator
from graphrt.engine.engine_args import check_engine_args
from graphrt.engine.metrics import EngineMetrics, engine_stats
from graphrt.engine.outputs import RequestOutput
from graphrt.engine.overlap import Launched, OverlapLoop, overlap_enabled
from graphrt.engine.prefix_cache import PrefixCache
from graphrt.engine.recovery import StepRecovery
from graphrt.engine.scheduler import Request, ScheduledStep, Scheduler, Status
from graphrt.engine.tables import write_step_tables
from graphrt.engine.validation import params_per_prompt, validate_request
from graphrt.engine.watchdog import engine_watchdog
from graphrt.core.errors import GenerationError, GraphrtError
from graphrt.runner import ModelRunner, sampling_batch
from graphrt.engine.sampling_params import SamplingParams, without_seed
from graphrt.models.hf_config import model_eos_token_ids

logger = logging.getLogger(__name__)


class LLM(OverlapLoop, StepRecovery):
    """Continuous batching over a :class:`ModelRunner`, with a prefix cache and schedule policies.

    ``enable_prefix_caching`` (default on): finished and running requests' full computed KV
    blocks stay cached in a radix tree and are shared, by reference, with later requests of
    the same prefix. ``schedule_policy``: "fcfs" (default), "lof", "random", "lpm" or
    "dfs-weight". ``schedule_conservativeness`` (default 1, as in SGLang): admission reserves
    KV for estimated outputs, scaled by it (0: admit without the estimate; see
    :class:`~graphrt.engine.scheduler.Scheduler`). SGLang's prefill and decode log lines (every
    ``decode_log_interval`` decode steps) go to the ``graphrt.engine`` logger; ``metrics`` keeps
    their numbers. ``watchdog_timeout`` (s; None / 0: off) fails a hung forward (docs/api.md).
    Overlap scheduling (SGLang's, on unless ``disable_overlap_schedule``) prepares each step
    while the device runs the previous one, on backends that dispatch asynchronously (xla);
    the others run the plain loop (engine/overlap.py).
    """

    def __init__(self, model: Any, backend: Any = "auto", *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 block_size: int = defaults.DEFAULT_BLOCK_SIZE, num_kv_blocks: int | None = None,
                 strict: bool = False, dtype: Any = None, progress: bool = False,
                 enable_prefix_caching: bool = defaults.DEFAULT_ENABLE_PREFIX_CACHING,
                 schedule_policy: str = defaults.DEFAULT_SCHEDULE_POLICY,
                 schedule_conservativeness: float = defaults.DEFAULT_SCHEDULE_CONSERVATIVENESS,
                 decode_log_interval: int = defaults.DEFAULT_DECODE_LOG_INTERVAL,
                 watchdog_timeout: float | None = defaults.DEFAULT_WATCHDOG_TIMEOUT,
                 watchdog_action: str = defaults.DEFAULT_WATCHDOG_ACTION,
                 disable_overlap_schedule: bool = defaults.DEFAULT_DISABLE_OVERLAP_SCHEDULE,
                 config: GraphConfig | None = None, **graph_fields: Any) -> None:
        from graphrt.registry import select_backend
        config = check_engine_args(         # before anything is loaded (engine/engine_args.py)
            model, config, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, block_size=block_size, strict=strict, schedule_policy=schedule_policy,
            schedule_conservativeness=schedule_conservativeness, decode_log_interval=decode_log_interval,
            watchdog_timeout=watchdog_timeout, watchdog_action=watchdog_action,
            disable_overlap_schedule=disable_overlap_schedule, graph_fields=graph_fields)
        backend_obj = select_backend(backend) if isinstance(backend, str) else backend
        if isinstance(model, str) or hasattr(model, "__fspath__"):   # tp > 1: each rank loads its shard
            model = str(model) if config.tensor_parallel_size > 1 else backend_obj.load_model(str(model), dtype)
        self.config = config
        self.runner = ModelRunner(model, config, backend=backend_obj, num_kv_blocks=num_kv_blocks,
                                  dtype=dtype, progress=progress)
        cfg = self.config
        self.eos_token_ids = frozenset(model_eos_token_ids(self.runner.model))
        self.allocator = BlockAllocator(self.runner.num_kv_blocks)
        self.prefix_cache = PrefixCache(cfg.block_size, self.allocator) if enable_prefix_caching else None
        self.scheduler = Scheduler(max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   block_size=cfg.block_size, allocator=self.allocator,
                                   prefix_cache=self.prefix_cache, schedule_policy=schedule_policy,
                                   schedule_conservativeness=schedule_conservativeness)
        self.metrics = EngineMetrics(backend=self.runner.backend.name, block_size=cfg.block_size,
                                     capacity_blocks=self.allocator.capacity, decode_log_interval=decode_log_interval)
        self.token_table = np.zeros((cfg.max_num_seqs, cfg.max_model_len), dtype=np.int32)
        self.block_table = np.zeros((cfg.max_num_seqs, cfg.max_blocks_per_req), dtype=np.int32)
        self._ids = itertools.count()
        self._lock = threading.RLock()      # serializes every caller (see the module docstring)
        self._requests: dict[int, Request] = {}              # unfinished requests by id
        self._owners: dict[int, int | None] = {}             # request id -> generate call (None: step API)
        self._outbox: dict[int | None, dict[int, RequestOutput]] = {None: {}}  # finished, undelivered
        self._call_faults: dict[int, BaseException] = {}    # generate call -> first fault of its requests
        self._calls = itertools.count()
        self._faults: dict[int, BaseException] = {}         # failed request id -> its fault, undelivered
        self._kv_resets_seen = self.runner.kv_cache_resets
        self.num_step_faults = 0            # faults contained by finishing requests with "error"
        self.watchdog = engine_watchdog(self.runner, watchdog_timeout, watchdog_action, owner=self, lock=self._lock)
        self.overlap = overlap_enabled(self.runner, disable_overlap_schedule)
        self._inflight: list[Launched] = []         # launched, unresolved steps (overlap)
        self._closed = False                        # close() was called: every call refused

    # ---- requests ------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue one request; bad input raises InputError and changes nothing."""
        params = params or SamplingParams()
        self._validate(prompt_token_ids, params, "prompt_token_ids")
        with self._lock:
            self._check_open()
            return self._enqueue(prompt_token_ids, params, None)

    def abort_request(self, request_id: int) -> RequestOutput | None:
        """Abort an unfinished request and free its blocks; returns its output (finish_reason
        "abort"), or None if no such request is unfinished. A ``generate`` call that owns it
        returns that output in its place; ``step()`` does not return it again."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                return None
            owner = self._owners.pop(request_id, None)
            out = self._finish(req, "abort", "aborted by abort_request()")
            if owner is not None and owner in self._outbox:
                self._outbox[owner][request_id] = out
            return out

    def _enqueue(self, prompt_token_ids: Sequence[int], params: SamplingParams, owner: int | None) -> int:
        """Queue an already validated request for ``owner`` (a generate call; None: the step API)."""
        req = Request(next(self._ids), [int(t) for t in prompt_token_ids], params)
        self.scheduler.add(req)
        self._requests[req.request_id] = req
        self._owners[req.request_id] = owner
        return req.request_id

    def _validate(self, prompt: Sequence[int], params: SamplingParams, where: str) -> None:
        """Refuse a request before it is queued (``validation.validate_request``)."""
        validate_request(prompt, params, where, config=self.config, vocab_size=self.runner.vocab_size,
                         kv_capacity=self.allocator.capacity)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order.

        Every prompt is validated before any is queued, so a bad one raises InputError
        (naming its index) and leaves the engine serving as before.
        """
        prompts = list(prompt_token_ids)
        params = params_per_prompt(prompts, sampling_params)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            self._validate(p, sp, f"prompt_token_ids[{i}]")
        with self._lock:
            self._check_open()
            call = next(self._calls)
            ids = [self._enqueue(p, sp, call) for p, sp in zip(prompts, params)]
            mine = self._outbox[call] = {}
        try:
            while True:
                with self._lock:    # one step at a time; other callers' steps run ours too
                    if len(mine) == len(ids) or call in self._call_faults:
                        break
                    self._deliver(self._step())
        except BaseException as exc:
            outs, _ = self._close_call(call, ids, prompts, f"aborted: generate() failed: {exc!r}")
            if not isinstance(exc, Exception):
                raise
            raise GenerationError(f"generate() failed and aborted its unfinished requests: {exc!r}",
                                  outs) from exc
        outs, fault = self._close_call(call, ids, prompts, "aborted: another request of its generate() "
                                                           "call failed")
        if fault is not None:
            failed = sum(o.finish_reason == "error" for o in outs)
            raise GenerationError(f"generate(): {failed} of {len(ids)} requests failed in a step "
                                  f"({type(fault).__name__}: {fault}); the unfinished rest were aborted",
                                  outs) from fault
        return outs

    def _close_call(self, call: int, ids: list[int], prompts: list[Sequence[int]], why: str
                    ) -> tuple[list[RequestOutput], BaseException | None]:
        """A generate call's outputs in prompt order and its first fault; its requests that are
        still unfinished are aborted (blocks freed), with ``why`` as their error."""
        with self._lock:
            mine = self._outbox.pop(call, {})
            fault = self._call_faults.pop(call, None)
            outs = []
            for rid, prompt in zip(ids, prompts):
                out = mine.get(rid)
                if out is None:
                    self._owners.pop(rid, None)
                    req = self._requests.get(rid)
                    out = (self._finish(req, "abort", why) if req is not None else
                           RequestOutput(rid, [int(t) for t in prompt], [], "abort", why))
                outs.append(out)
            return outs, fault

    # ---- the loop ------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        """Whether any request is queued or running, or a step-API output awaits ``step()``."""
        with self._lock:
            return self.scheduler.has_unfinished() or bool(self._outbox[None]) or self._inflight_live()

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the ``add_request`` requests that finished since
        the last call (in this step, or in one a concurrent ``generate`` ran), failed ones with
        finish_reason "error". Requests of ``generate`` calls are kept for those calls.

        Raises only if scheduling itself failed: then nothing ran and every request is still
        queued, consistent, for the next step.
        """
        with self._lock:
            self._deliver(self._step())
            box = self._outbox[None]
            outs = list(box.values())
            box.clear()
            return outs

    def _deliver(self, outs: list[RequestOutput]) -> None:
        """File finished outputs under their owners (a generate call, or None: the step API)."""
        for out in outs:
            owner = self._owners.pop(out.request_id, _NO_OWNER)
            fault = self._faults.pop(out.request_id, None)
            box = self._outbox.get(owner)
            if box is None:
                continue    # aborted or its call is gone: nobody waits for it
            box[out.request_id] = out
            if fault is not None and owner is not None:
                self._call_faults.setdefault(owner, fault)

    def _step(self) -> list[RequestOutput]:
        """One step (the lock held): every request that finished in it, whoever owns it."""
        self._check_open()
        self.watchdog.check()               # refused after a watchdog timeout until reset()
        if self.runner.kv_cache_resets != self._kv_resets_seen:
            self._recover_kv(None, [])    # re-created outside a step: cached KV is gone too
        if self.overlap:
            return self._step_overlapped()
        step = self.scheduler.schedule()
        if not step.requests:
            if self.scheduler.has_unfinished():
                raise GraphrtError("scheduler made no progress: a request cannot fit in the KV cache")
            return []
        self.metrics.observe(step)
        try:
            tokens, samples = self._run(step)
        except Exception as exc:  # noqa: BLE001 - any fault finishes the step's requests, never wedges
            return self._fail(step.requests, exc)
        except BaseException:
            # KeyboardInterrupt and kin: the step's requests stay queued; their progress was
            # not advanced, so the next step recomputes the same tokens (the KV too if lost).
            self._recover_kv(None, [])
            raise
        finished = self._apply(step, tokens, samples)
        self.metrics.record(self.scheduler, self.runner)
        return finished

    def _run(self, step: ScheduledStep) -> tuple[np.ndarray, list[bool]]:
        """Write the tables and run the step: (one token per request, which requests sampled)."""
        inputs, samples = self._step_inputs(step)
        self.watchdog.arm(step)
        try:
            tokens = self.runner.execute(**inputs)
        finally:
            self.watchdog.disarm()          # raises WatchdogTimeout if it fired for this forward
        if tokens is None or len(tokens) != len(step):
            raise GraphrtError(f"the runner returned {None if tokens is None else len(tokens)} tokens "
                               f"for a step of {len(step)} requests")
        return tokens, samples

    def _step_inputs(self, step: ScheduledStep) -> tuple[dict[str, Any], list[bool]]:
        """Write the step's tables; (the runner's arguments for it, which requests sample). A
        request that does not sample keeps its seed's stream (``without_seed``)."""
        self._write_tables(step)
        reqs = step.requests
        computed = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int32, count=len(reqs))
        scheduled = np.asarray(step.num_scheduled, dtype=np.int32)
        samples = [r.num_computed_tokens + n == r.num_tokens for r, n in zip(reqs, step.num_scheduled)]
        params = [r.params if s else without_seed(r.params) for r, s in zip(reqs, samples)]
        return {"token_ids": self.token_table, "block_table": self.block_table,
                "req_rows": np.fromiter((r.row for r in reqs), dtype=np.int32, count=len(reqs)),
                "num_computed_tokens": computed, "num_scheduled_tokens": scheduled,
                "sampling": sampling_batch(params, [r.request_id for r in reqs], self.runner.vocab_size)}, samples

    def _apply(self, step: ScheduledStep, tokens: np.ndarray, samples: list[bool]) -> list[RequestOutput]:
        """Advance each request by its step; a request whose update fails finishes with "error"."""
        finished = []
        for req, n, sampled, tok in zip(step.requests, step.num_scheduled, samples, tokens):
            if req.status is Status.FINISHED:
                continue    # aborted during the step (from within it: the lock is re-entrant)
            try:
                req.num_computed_tokens += n
                reason = None
                if sampled:
                    token = int(tok)
                    req.output_token_ids.append(token)
                    reason = self._stop_reason(req, token)
                    if reason is not None:
                        finished.append(self._finish(req, reason))
                if reason is None:
                    self.scheduler.cache_computed(req)   # its new full blocks, for others to share
            except Exception as exc:  # noqa: BLE001 - contained to this request
                finished.extend(self._fail([req], exc))
        return finished

    def _finish(self, req: Request, reason: str, error: str | None = None) -> RequestOutput:
        """Finish ``req`` (running or waiting): free its row, blocks and runner state."""
        self.scheduler.finish(req, reason)
        try:
            self.runner.free_request(req.request_id)
        except Exception:  # noqa: BLE001 - the request is finished either way
            logger.warning("graphrt: freeing the runner state of request %d failed", req.request_id,
                           exc_info=True)
        self._requests.pop(req.request_id, None)
        known = len(req.output_token_ids) - req.num_unresolved     # placeholders are not output
        return RequestOutput(req.request_id, req.prompt_token_ids, req.output_token_ids[:known],
                             reason, error, req.num_cached_tokens)

    def _write_tables(self, step: ScheduledStep) -> None:
        """Write the step's new token ids and blocks into the persistent tables."""
        write_step_tables(self.token_table, self.block_table, step)

    def _stop_reason(self, req: Request, token: int, generated: int | None = None) -> str | None:
        """Why ``req`` stops at ``token``, its ``generated``-th output (default: its last), or None."""
        if not req.params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        generated = len(req.output_token_ids) if generated is None else generated
        if generated >= req.params.max_tokens or len(req.prompt_token_ids) + generated >= self.config.max_model_len:
            return "length"
        return None

    @property
    def stats(self) -> dict[str, Any]:
        """Runner cache statistics plus scheduler counters (:func:`~graphrt.engine.metrics.engine_stats`)."""
        with self._lock:
            return engine_stats(self)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's name); blocks running requests hold stay theirs."""
        with self._lock:
            self.scheduler.reset_prefix_cache()

    def close(self) -> None:
        """Stop the engine, from any thread: wait for the step running now (its lock; at most
        ``LLM_CLOSE_WAIT_S``, not at all once the watchdog fired), then stop the watchdog thread
        and the runner's tensor-parallel workers. A ``generate`` in flight then raises
        GenerationError saying the engine is closed (with its outputs so far); every later call
        raises GraphrtError saying so. Idempotent; the workers also stop when it is collected."""
        fired = self.watchdog.error is not None         # that forward hangs: do not wait for it
        locked = self._lock.acquire(timeout=0 if fired else defaults.LLM_CLOSE_WAIT_S)
        if not locked:
            logger.error("graphrt: close(): a step still runs on another thread; closing under it")
        try:
            self._closed = True
            self.watchdog.close()
            self.runner.close()
        finally:
            if locked:
                self._lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise GraphrtError("this graphrt.LLM is closed (close() was called); build a new engine")

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_NO_OWNER = object()   # a request id with no owner left (aborted): its output is dropped


__all__ = ["LLM", "RequestOutput", "Status"]
