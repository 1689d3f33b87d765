"""``graphrt.LLM``: the embedded default engine -- scheduler, block allocator, ModelRunner::

    llm = graphrt.LLM(model_dir, backend="cpu", max_num_seqs=8)
    outs = llm.generate([[1, 2, 3]], graphrt.SamplingParams(max_tokens=8))

A step that raises finishes its requests with ``finish_reason="error"``; ``generate`` then aborts
the rest of its own and raises :class:`~graphrt.core.errors.GenerationError` with every output.
One lock serializes ``add_request`` / ``step`` / ``abort_request`` / ``close`` and each step of
``generate`` (concurrent calls batch together). See docs/api.md, "Generate end to end".
"""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
from typing import Any, Sequence


from graphrt.core import defaults
from graphrt.backends.preflight import check_before_loading
from graphrt.config import GraphConfig, check_flags
from graphrt.engine.block_allocator import BlockAllocator
from graphrt.engine.metrics import EngineMetrics, engine_stats, prometheus_text
from graphrt.engine.outputs import RequestOutput
from graphrt.engine.loop import StepLoop, overlap_enabled
from graphrt.engine.prefix_cache import PrefixCache, prefix_caching
from graphrt.engine.request import Request
from graphrt.engine.scheduler import Scheduler
from graphrt.engine.engine_args import check_engine_args
from graphrt.engine.validation import params_per_prompt, validate_request
from graphrt.engine.watchdog import engine_watchdog
from graphrt.core.errors import GenerationError, GraphrtError, RequestsInFlightError
from graphrt.runner import ModelRunner
from graphrt.runner.warmup import warmup_mode
from graphrt.engine.sampling_params import SamplingParams
from graphrt.models.hf_config import model_eos_token_ids

#: ``LLM.close()`` waits this long for a step on another thread (the watchdog's and the TP
#: timeout: a step still running then is hung); past it, or once the watchdog fired, it closes
#: under the step, which then fails.
LLM_CLOSE_WAIT_S = 300.0

logger = logging.getLogger(__name__)


class LLM:
    """Continuous batching over a :class:`ModelRunner`, with a prefix cache and schedule policies.

    ``enable_prefix_caching`` (default on; refused by models with recurrent state): full computed
    KV blocks stay in a radix tree, shared by reference with later requests of the same prefix.
    ``schedule_policy``: "fcfs" (default), "lof", "random", "lpm" or "dfs-weight".
    ``num_kv_blocks`` / ``kv_cache_memory``: the KV cache's blocks, or the bytes it shares with the
    graphs / executables (:class:`ModelRunner`'s; neither: the device's free memory).
    ``schedule_conservativeness`` (default 1, as in SGLang): scales the KV admission reserves for
    estimated outputs (0: no estimate). Prefill / decode log lines (every ``decode_log_interval``
    decode steps) go to the ``graphrt.engine`` logger; ``metrics`` keeps their numbers.
    ``watchdog_timeout`` (s; None / 0: off) fails a hung forward. ``disable_overlap_schedule``
    turns off overlap scheduling (depth 1: the next step is prepared while the device runs the
    previous one, on xla, cuda, npu; engine/loop.py says why it is exact); depth 0: plain loop.
    ``num_kv_blocks`` / ``kv_cache_memory`` size the KV cache as :class:`ModelRunner`'s do (a
    hybrid model's recurrent states come out of ``kv_cache_memory`` first: docs/hybrid.md).
    ``graph_fields`` are :class:`~graphrt.config.GraphConfig`'s, among them ``model_impl`` and
    ``trust_remote_code`` (default False: a checkpoint whose ``auto_map`` needs its own code is a
    ConfigError saying how to opt in; nothing is ever asked on stdin).
    """

    def __init__(self, model: Any, backend: Any = "auto", *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 block_size: int = defaults.DEFAULT_BLOCK_SIZE, num_kv_blocks: int | None = None,
                 kv_cache_memory: int | None = None, strict: bool = False, dtype: Any = None, progress: bool = False,
                 enable_prefix_caching: bool | None = None,
                 schedule_policy: str = defaults.DEFAULT_SCHEDULE_POLICY,
                 schedule_conservativeness: float = defaults.DEFAULT_SCHEDULE_CONSERVATIVENESS,
                 decode_log_interval: int = defaults.DEFAULT_DECODE_LOG_INTERVAL,
                 watchdog_timeout: float | None = defaults.DEFAULT_WATCHDOG_TIMEOUT,
                 watchdog_action: str = defaults.DEFAULT_WATCHDOG_ACTION,
                 disable_overlap_schedule: bool = defaults.DEFAULT_DISABLE_OVERLAP_SCHEDULE,
                 warmup: str = defaults.DEFAULT_LLM_WARMUP,
                 config: GraphConfig | None = None, **graph_fields: Any) -> None:
        from graphrt.registry import select_backend
        self.config = config = check_engine_args(     # every setting, before anything is loaded
            model, config, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, block_size=block_size, strict=strict, schedule_policy=schedule_policy,
            schedule_conservativeness=schedule_conservativeness, decode_log_interval=decode_log_interval,
            watchdog_timeout=watchdog_timeout, watchdog_action=watchdog_action,
            disable_overlap_schedule=disable_overlap_schedule, enable_prefix_caching=enable_prefix_caching,
            progress=progress, graph_fields=graph_fields, num_kv_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory,
            keywords=inspect.signature(LLM.__init__).parameters)
        warmup_mode(warmup if warmup is not True else "upfront")    # a bad value: ConfigError before loading
        backend_obj = select_backend(backend, model=model) if isinstance(backend, str) else backend
        backend_obj = backend_obj.for_tensor_parallel(config.tensor_parallel_size)
        dtype = check_before_loading(backend_obj, model, config, dtype)
        if isinstance(model, str) or hasattr(model, "__fspath__"):   # tp > 1: each rank loads its shard
            model = str(model) if config.tensor_parallel_size > 1 else backend_obj.load_model(
                str(model), dtype, model_impl=config.model_impl, trust_remote_code=config.trust_remote_code)
        self.runner = ModelRunner(model, config, backend=backend_obj, num_kv_blocks=num_kv_blocks,
                                  kv_cache_memory=kv_cache_memory, dtype=dtype, progress=progress, warmup=warmup)
        cfg = self.config
        slots = self.runner.executor.num_state_slots
        enable_prefix_caching = prefix_caching(enable_prefix_caching, slots is not None)
        self.allocator = BlockAllocator(self.runner.num_kv_blocks)
        self.prefix_cache = PrefixCache(cfg.block_size, self.allocator) if enable_prefix_caching else None
        self.scheduler = Scheduler(max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   block_size=cfg.block_size, allocator=self.allocator,
                                   prefix_cache=self.prefix_cache, schedule_policy=schedule_policy,
                                   schedule_conservativeness=schedule_conservativeness, num_state_slots=slots)
        self.metrics = EngineMetrics(backend=self.runner.backend.name, block_size=cfg.block_size,
                                     capacity_blocks=self.allocator.capacity, decode_log_interval=decode_log_interval)
        self._ids = itertools.count()
        self._lock = threading.RLock()      # serializes every caller (see the module docstring)
        self._owners: dict[int, int | None] = {}             # request id -> generate call (None: step API)
        self._outbox: dict[int | None, dict[int, RequestOutput]] = {None: {}}  # finished, undelivered
        self._call_faults: dict[int, BaseException] = {}    # generate call -> first fault of its requests
        self._calls = itertools.count()
        self.watchdog = engine_watchdog(self.runner, watchdog_timeout, watchdog_action, owner=self, lock=self._lock)
        #: Every step: schedule, launch, resolve (depth 1: overlapped, depth 0: plain).
        self.loop = StepLoop(runner=self.runner, scheduler=self.scheduler, config=cfg,
                             eos_token_ids=frozenset(model_eos_token_ids(self.runner.model)), metrics=self.metrics,
                             watchdog=self.watchdog, depth=1 if overlap_enabled(self.runner, disable_overlap_schedule)
                             else 0)
        self._closed = False                        # close() was called: every call refused
        #: While background warm-up builds between steps the loop runs plain (nothing in flight
        #: at the builder's turn); the overlap depth comes back once it is done.
        self._background = self.runner.background
        self._overlap_after_warmup: int | None = None
        if self._background is not None:
            self._follow_warmup()

    # ---- requests ------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue one request; bad input raises InputError and changes nothing."""
        params = params or SamplingParams()
        self._validate(prompt_token_ids, params, "prompt_token_ids")
        with self._lock:
            self._check_open()
            self._check_awake()
            return self._enqueue(prompt_token_ids, params, None)

    def abort_request(self, request_id: int) -> RequestOutput | None:
        """Abort an unfinished request and free its blocks; returns its output (finish_reason
        "abort"), or None. An owning ``generate`` returns it; ``step()`` does not."""
        with self._lock:
            req = self.loop.requests.get(request_id)
            if req is None:
                return None
            owner = self._owners.pop(request_id, None)
            out = self.loop.finish(req, "abort", "aborted by abort_request()")
            if owner is not None and owner in self._outbox:
                self._outbox[owner][request_id] = out
            return out

    def _enqueue(self, prompt_token_ids: Sequence[int], params: SamplingParams, owner: int | None) -> int:
        """Queue an already validated request for ``owner`` (a generate call; None: the step API)."""
        req = Request(next(self._ids), [int(t) for t in prompt_token_ids], params)
        self.loop.add(req)
        self._owners[req.request_id] = owner
        return req.request_id

    def _validate(self, prompt: Sequence[int], params: SamplingParams, where: str) -> None:
        """Refuse a request before it is queued (``validation.validate_request``)."""
        validate_request(prompt, params, where, config=self.config, vocab_size=self.runner.vocab_size,
                         kv_capacity=self.allocator.capacity)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order. Every prompt is validated first,
        so a bad one raises InputError (naming its index) and changes nothing."""
        prompts = list(prompt_token_ids)
        params = params_per_prompt(prompts, sampling_params)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            self._validate(p, sp, f"prompt_token_ids[{i}]")
        with self._lock:
            self._check_open()
            self._check_awake()
            call = next(self._calls)
            ids = [self._enqueue(p, sp, call) for p, sp in zip(prompts, params)]
            mine = self._outbox[call] = {}
        try:
            while True:
                with self._lock:    # one step at a time; other callers' steps run ours too
                    if len(mine) == len(ids) or call in self._call_faults:
                        break
                    self._check_open()
                    self._deliver(self.loop.step())
                    if self._background is not None:
                        self._follow_warmup()
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
                    req = self.loop.requests.get(rid)
                    out = (self.loop.finish(req, "abort", why) if req is not None else
                           RequestOutput(rid, [int(t) for t in prompt], [], "abort", why))
                outs.append(out)
            return outs, fault

    # ---- the loop ------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        """Whether any request is queued or running, or a step-API output awaits ``step()``."""
        with self._lock:
            return self.loop.busy() or bool(self._outbox[None])

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the ``add_request`` requests finished since the
        last call (failed ones with finish_reason "error"); ``generate``'s are kept for it.

        Raises only if scheduling failed: then nothing ran and every request is still queued.
        """
        with self._lock:
            if self._closed:
                self._check_open()
            self._deliver(self.loop.step())
            if self._background is not None:
                self._follow_warmup()
            box = self._outbox[None]
            outs = list(box.values())
            box.clear()
            return outs

    def _follow_warmup(self) -> None:
        """Between steps: the plain loop while background warm-up has keys to build."""
        if self._background.active:
            if self._overlap_after_warmup is None:
                self._overlap_after_warmup, self.loop.depth = self.loop.depth, 0
        elif self._overlap_after_warmup is not None:
            self.loop.depth, self._overlap_after_warmup = self._overlap_after_warmup, None

    def _deliver(self, outs: list[RequestOutput]) -> None:
        """File finished outputs under their owners (a generate call, or None: the step API)."""
        for out in outs:
            owner = self._owners.pop(out.request_id, _NO_OWNER)
            fault = self.loop.faults.pop(out.request_id, None)
            box = self._outbox.get(owner)
            if box is None:
                continue    # aborted or its call is gone: nobody waits for it
            box[out.request_id] = out
            if fault is not None and owner is not None:
                self._call_faults.setdefault(owner, fault)

    @property
    def overlap(self) -> bool:
        """Whether steps overlap (the loop's depth is 1); settable, between steps, to compare."""
        return self.loop.depth > 0

    @overlap.setter
    def overlap(self, value: bool) -> None:
        check_flags(overlap=value)
        if self._overlap_after_warmup is not None:      # warming up: from when it is done
            self._overlap_after_warmup = 1 if value else 0
        else:
            self.loop.depth = 1 if value else 0

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The token ids that stop a request (unless its params ignore EOS)."""
        return self.loop.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.loop.eos_token_ids = frozenset(ids)

    def metrics_text(self) -> str:
        """The graph coverage counters in Prometheus' text format (docs/api.md, "Coverage telemetry")."""
        with self._lock:
            return prometheus_text(self.runner)

    @property
    def stats(self) -> dict[str, Any]:
        """Runner cache statistics plus scheduler counters (:func:`~graphrt.engine.metrics.engine_stats`)."""
        with self._lock:
            return engine_stats(self)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's name); blocks running requests hold stay theirs."""
        with self._lock:
            self.scheduler.reset_prefix_cache()

    # ---- weights and memory (runner_weights.py; docs/api.md, "Reinforcement-learning rollouts") --
    def update_weights(self, weights: Any, *, recompute: bool = True) -> dict[str, Any]:
        """Copy new weights into the model in place (:meth:`ModelRunner.update_weights`: a checkpoint
        directory or ``.safetensors`` file, a mapping or an iterable of ``(name, tensor)``, all or
        some; checked first, nothing written on an InputError); no graph or executable is rebuilt.

        Launched steps are resolved first and the prefix cache is forgotten (its KV came from the
        old weights). ``recompute`` (default): running requests are requeued and recompute their
        KV, so every token sampled from now on is the new weights' for its context; False: they
        go on over the KV the old weights wrote. Returns the runner's report, ``recomputed`` (the
        requests requeued) and ``requests``: every unfinished request's id -> the tokens it had
        generated with the old weights (an RL rollout's policy boundary)."""
        with self._lock:
            self._check_open()
            self._deliver(self.loop.settle())
            before = {rid: len(req.output_token_ids) for rid, req in self.loop.requests.items()}
            result = self.runner.update_weights(weights)
            result["requests"] = before
            if recompute:
                result["recomputed"] = self.loop.recompute_all("the weights were refit")
            else:
                self.scheduler.reset_prefix_cache()
                result["recomputed"] = []
            return result

    def sleep(self, level: int = 1, *, drain: bool = False) -> dict[str, Any]:
        """Give the device memory back (:meth:`ModelRunner.sleep`: level 1 offloads the weights to
        host memory, level 2 drops them; the KV and state caches are dropped, the prefix cache
        forgotten). Requests queued or running are refused with :class:`RequestsInFlightError`
        (nothing released), or with ``drain=True`` run to the end first. Every request and step is
        refused (:class:`EngineAsleepError`) until :meth:`wake`. Returns the bytes released."""
        with self._lock:
            self._check_open()
            self._deliver(self.loop.settle())
            if self.loop.busy():
                if not drain:
                    ids = tuple(sorted(self.loop.requests))
                    raise RequestsInFlightError(f"sleep: {len(ids)} request(s) queued or running ({list(ids[:8])}"
                                                f"{', ...' if len(ids) > 8 else ''}); abort them, or pass "
                                                "drain=True to finish them first", ids)
                while self.loop.busy():
                    self._deliver(self.loop.step())
            result = self.runner.sleep(level)
            self.scheduler.reset_prefix_cache()      # the KV is gone
            return result

    def wake(self) -> dict[str, Any]:
        """Take the memory back (:meth:`ModelRunner.wake`); after a level-2 sleep call
        :meth:`update_weights` before generating. Returns what was restored and recaptured."""
        with self._lock:
            self._check_open()
            return self.runner.wake()

    def close(self) -> None:
        """Stop the engine, from any thread: wait for the running step (at most
        ``LLM_CLOSE_WAIT_S``; not once the watchdog fired), then stop the watchdog and TP workers.
        A ``generate`` in flight raises GenerationError (with its outputs so far); later calls
        raise GraphrtError. Idempotent; the workers also stop when it is collected."""
        fired = self.watchdog.error is not None         # that forward hangs: do not wait for it
        locked = self._lock.acquire(timeout=0 if fired else LLM_CLOSE_WAIT_S)
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

    def _check_awake(self) -> None:
        """New requests wait for a runner that can run them: refused while it sleeps, lacks
        weights or has graphs over moved buffers (EngineAsleepError, StaleBufferError)."""
        self.runner.weights.ready()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_NO_OWNER = object()   # a request id with no owner left (aborted): its output is dropped


__all__ = ["LLM", "RequestOutput"]
