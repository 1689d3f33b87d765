"""``ModelRunner``: the one front end every backend sits behind.

Per step: prepare inputs (numpy, persistent buffers) -> ask the dispatcher for the key
-> pad into the executor's staging buffers -> replay the captured graph / call the
compiled executable / run eagerly -> logits at each request's last token -> the sampler,
its own graph. Host-side work is identical for every backend; only the executor differs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from graphrt.core import defaults
from graphrt.backends.base import Backend, Executor, SamplingBatch
from graphrt.core.cache import CacheStats, EagerFallback, GraphCache, describe_key
from graphrt.backends.preflight import check_before_loading, check_memory
from graphrt.config import GraphConfig, check_flags
from graphrt.core.dispatch import BatchDescriptor, Dispatch, GraphMode, RuntimeMode, SamplerKey, resolve_mode
from graphrt.core.eager import EagerCause
from graphrt.core.errors import ConfigError, GraphCaptureError, InputError
from graphrt.core.future_tokens import FutureTokens, PendingTokens
from graphrt.core.graph_memory import size_kv_cache
from graphrt.core.inputs import InputPreparer
from graphrt.core.dp_agreement import DataParallelMethods, StepAgreement
from graphrt.core.lora import LoraInputs, LoraMethods, lora_off
from graphrt.core.padding import Padder
from graphrt.core.sampling import sampling_batch
from graphrt.registry import select_backend

logger = logging.getLogger(__name__)


@dataclass
class StepInfo:
    """What the last step ran as (for tests, logs and the CLI)."""

    dispatch: Dispatch
    mode: RuntimeMode
    key: BatchDescriptor
    num_tokens: int
    num_reqs: int
    eager_reason: str | None
    seconds: float
    eager_cause: EagerCause | None = None   # why it ran eagerly, grouped (None: it did not)


@dataclass(frozen=True)
class _StepPlan:
    """How every step of one real (tokens, requests, uniform) shape runs (``ModelRunner._plan``)."""

    dispatch: Dispatch
    mode: RuntimeMode
    key: BatchDescriptor
    entry: Any
    eager_reason: str | None
    padded_reqs: int
    cache_key: tuple | None          # the forward cache's key looked up (None: eager by dispatch)
    hit: bool
    sampler: dict[bool, tuple[SamplerKey, Any, str | None]]  # all_greedy -> (key, entry or None, eager reason)
    version: int                     # cache.version + sampler_cache.version when planned
    eager_cause: EagerCause | None = None


class ModelRunner(LoraMethods, DataParallelMethods):
    """Runs a model's steps on one backend with graphs / executables per bucket.

    ``model`` is a Hugging Face directory (loaded with graphrt's reference models for the
    backend's framework) or an already-built model object that follows the protocol in
    ``docs/models.md``. The KV cache has ``num_kv_blocks`` blocks, or as many as
    ``kv_cache_memory`` bytes (or the device's free memory) hold; block 0 is the null block.

    ``step_agreement``: data-parallel ranks that step together agree on each step's bucket, and
    a rank with no work calls :meth:`execute_dummy` (docs/distributed.md).

    Threads: :meth:`execute` serializes its callers (one lock; each caller gets its own
    step's tokens), but :meth:`logits`, :meth:`hidden_states` and :attr:`last_step` describe
    whichever step ran last, so read them from the thread that drives the runner.
    """

    def __init__(self, model: Any, config: GraphConfig | None = None, *,
                 backend: str | Backend = "auto", num_kv_blocks: int | None = None,
                 kv_cache_memory: int | None = None, dtype: Any = None, warmup: bool = True,
                 progress: bool = True, step_agreement: StepAgreement | None = None,
                 **config_fields: Any) -> None:
        fields = {**(config.model_dump(exclude_unset=True) if config is not None else {}), **config_fields}
        self.config = cfg = config if config is not None and not config_fields else GraphConfig.create(**fields)
        check_flags(warmup=warmup, progress=progress)
        self.backend = select_backend(backend) if isinstance(backend, str) else backend
        tp = cfg.tensor_parallel_size
        dtype = check_before_loading(self.backend, model, cfg, dtype)   # sharding, dtype, max_model_len
        if isinstance(model, (str, os.PathLike)) and tp == 1:
            model = self.backend.load_model(os.fspath(model), dtype)
        check_memory(self.backend, model, cfg, num_kv_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory)
        # tensor_parallel_size > 1: the backend starts the worker ranks, each loads its own shard
        self.executor: Executor = (self.backend.create_executor(model, cfg) if tp == 1 else
                                   self.backend.create_executor(model, cfg, dtype=dtype))
        self.model = model = self.executor.model if tp > 1 else model
        self.vocab_size = self.executor.vocab_size
        self.mode, degraded = resolve_mode(cfg.mode, attention=self.executor.attention_support,
                                           piecewise=self.executor.supports_piecewise)
        if not self.executor.has_graphs and self.mode is not GraphMode.NONE:
            self.mode, degraded = GraphMode.NONE, f"backend {self.backend.name} runs every step eagerly"
        if degraded:
            logger.info("graphrt: %s", degraded)
        self.dispatcher = self.backend.dispatcher(cfg, self.mode, model)
        self.executor.expect_keys([key for _, key in self._build_keys()])
        self.num_kv_blocks, self.graph_memory = size_kv_cache(self.executor, cfg, self._build_keys(),
                                                              num_kv_blocks, kv_cache_memory)
        self.executor.allocate_kv_cache(self.num_kv_blocks, cfg.block_size)
        self.preparer = InputPreparer(max_num_reqs=cfg.max_num_seqs,
                                      max_num_tokens=cfg.max_num_batched_tokens,
                                      block_size=cfg.block_size, vocab_size=self.vocab_size,
                                      num_blocks=self.num_kv_blocks,
                                      table_width=cfg.max_blocks_per_req, kernel=cfg.host_kernel,
                                      strict=cfg.strict, decode_query_len=cfg.decode_query_len)
        self.padder = Padder(kernel=cfg.host_kernel)
        slots = self.executor.lora
        if cfg.max_loras and slots is None:
            raise ConfigError(f"max_loras={cfg.max_loras}: backend {self.backend.name} has no LoRA support")
        self._lora = LoraInputs(cfg.max_loras, cfg.max_num_seqs, slots.host_buffers, slots.loaded) if slots else None
        self.cache: GraphCache = GraphCache(strict=cfg.strict)
        self.sampler_cache: GraphCache = GraphCache(strict=False)
        self._plans: dict[tuple[int, int, bool, int], _StepPlan] = {}   # (tokens, reqs, uniform, adapters)
        self._last: tuple[_StepPlan, int, int, float] | None = None
        self._futures = FutureTokens(on_device=self.executor.async_execution)
        self._lock = threading.Lock()
        self.step_agreement = step_agreement     # data-parallel ranks stepping together (core/dp_agreement.py)
        self.warmup_report: list[dict[str, Any]] = []
        self.progress = progress
        if warmup:
            self.warmup()

    # ---- setup ---------------------------------------------------------------------
    def _build_keys(self) -> list[tuple[RuntimeMode, BatchDescriptor | SamplerKey]]:
        """Every key warm-up builds, largest first: the dispatcher's, then a greedy and a random
        sampler for each request count a FULL key can have."""
        keys = self.dispatcher.keys()
        sampler_reqs = sorted({k.num_reqs for m, k in keys if m is RuntimeMode.FULL}, reverse=True)
        return list(keys) + [(RuntimeMode.FULL, SamplerKey(r, greedy))
                             for r in sampler_reqs for greedy in (True, False)]

    def warmup(self) -> list[dict[str, Any]]:
        """Capture / compile every key the dispatcher can return, largest first, then seal.

        Shows a progress bar and logs, per key, the seconds and bytes it took. A failed
        capture makes that key run eagerly with a warning, counted in the cache's
        ``stats.failed_builds`` and named in the report; in strict mode, and on backends that
        cannot run a step eagerly (XLA), it raises :class:`GraphCaptureError` with the reason.
        """
        if not self.executor.eager_fallback and self.config.disable_precompile:
            logger.info("graphrt: disable_precompile set: %s compiles each bucket on first use",
                        self.backend.name)
            return []
        seconds = self.preparer.compile_kernels(self.padder, out=self.executor.host_buffers)
        if seconds:
            logger.info("graphrt: host kernels (%s) ready in %.2f s", self.preparer.kernel, seconds)
        jobs: list[tuple[GraphCache, Any, RuntimeMode, Any]] = [
            (self.sampler_cache, key, mode, key) if isinstance(key, SamplerKey)
            else (self.cache, (mode, key), mode, key) for mode, key in self._build_keys()]
        start = time.perf_counter()
        try:
            ahead = self.executor.build_many([(mode, key) for _, _, mode, key in jobs], progress=self.progress)
        except Exception as exc:  # noqa: BLE001 - said once, with the reason, like a single build
            raise GraphCaptureError(f"building ahead failed: {self.executor.describe_build_failure(exc)}") from exc
        bar = tqdm(jobs, desc=f"graphrt {self.backend.name} warm-up", unit="graph",
                   disable=not self.progress or not jobs or ahead is not None, leave=False)
        for cache, cache_key, mode, key in bar:
            bar.set_postfix_str(str(key))
            t0 = time.perf_counter()
            try:
                entry, nbytes = self.executor.build(mode, key)
            except Exception as exc:  # noqa: BLE001 - any capture failure degrades to eager
                reason = self.executor.describe_build_failure(exc)
                if self.config.strict or not self.executor.eager_fallback:
                    raise GraphCaptureError(f"building {describe_key(key)} failed: {reason}") from exc
                logger.warning("graphrt: capture of %s failed, it will run eagerly: %s", key, reason)
                cache.put_failed(cache_key, reason, seconds=time.perf_counter() - t0)
                continue
            seconds = self.executor.build_seconds(entry)
            cache.put(cache_key, entry, seconds=time.perf_counter() - t0 if seconds is None else seconds,
                      nbytes=nbytes)
        self.cache.seal()
        self.sampler_cache.seal()
        total = time.perf_counter() - start
        self.warmup_report = self.cache.report() + self.sampler_cache.report()
        failed = self.cache.stats.failed_builds + self.sampler_cache.stats.failed_builds
        logger.info("graphrt: %s warm-up built %d forward and %d sampler entries in %.2f s, %.1f MiB%s",
                    self.backend.name, len(self.cache), len(self.sampler_cache), total,
                    (self.cache.stats.build_bytes + self.sampler_cache.stats.build_bytes) / 2**20,
                    f"; {failed} failed and run eagerly" if failed else "")
        self.graph_memory.actual = self.cache.stats.build_bytes + self.sampler_cache.stats.build_bytes
        logger.info("graphrt: %s", self.graph_memory.summary())
        return self.warmup_report

    # ---- one step ------------------------------------------------------------------
    def execute(self, *, token_ids: np.ndarray, block_table: np.ndarray, req_rows: np.ndarray,
                num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray,
                sampling: SamplingBatch | None = None, lora_ids: Any = None,
                future_rows: Any = None) -> np.ndarray | None:
        """Run one scheduled step; returns one sampled token per request (or None without sampling).
        ``lora_ids``: each request's LoRA adapter slot (-1 or None: none; needs ``max_loras > 0``).
        ``future_rows``: see :meth:`execute_async`.

        Bad input raises :class:`InputError` before any static buffer or the KV cache is touched:
        the preparer checks the step, the dispatcher picks its bucket, and only then are the
        inputs written, padded, into the executor's staging buffers. Calls from several
        threads run one at a time.
        """
        with self._lock:
            pending = self._execute(token_ids, block_table, req_rows, num_computed_tokens,
                                    num_scheduled_tokens, sampling, lora_ids, future_rows)
            return None if pending is None else pending.result()

    def execute_async(self, *, token_ids: np.ndarray, block_table: np.ndarray, req_rows: np.ndarray,
                      num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray,
                      sampling: SamplingBatch, lora_ids: Any = None, future_rows: Any = None) -> PendingTokens:
        """:meth:`execute` without waiting for the device: the step's sampled tokens come as a
        :class:`~graphrt.core.future_tokens.PendingTokens` whose ``result()`` waits for them.

        ``future_rows`` (one int per request, -1: none) lets this step read the tokens of the
        previous sampled step before the host has them: request ``i``'s last scheduled token
        is replaced by that step's token at row ``future_rows[i]`` (the table may hold any valid
        id there). Backends that dispatch asynchronously (``executor.async_execution``: XLA)
        resolve it on the device and return at once; the others run the step to the end first.
        """
        if sampling is None:
            raise InputError("sampling", "execute_async returns sampled tokens: pass a SamplingBatch")
        with self._lock:
            return self._execute(token_ids, block_table, req_rows, num_computed_tokens,
                                 num_scheduled_tokens, sampling, lora_ids, future_rows)

    def _execute(self, token_ids: np.ndarray, block_table: np.ndarray, req_rows: np.ndarray,
                 num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray,
                 sampling: SamplingBatch | None, lora_ids: Any, future_rows: Any) -> PendingTokens | None:
        t0 = time.perf_counter()
        shape = self.preparer.check(token_ids=token_ids, block_table=block_table,
                                    req_rows=req_rows, num_computed_tokens=num_computed_tokens,
                                    num_scheduled_tokens=num_scheduled_tokens)
        t, r, _, _, uniform = shape
        if sampling is not None:
            sampling.check_rows(r)
        future_rows = self._futures.check(future_rows, r)
        ids, n = None, 0
        if lora_ids is not None or self._lora is not None:
            if self._lora is None:
                raise lora_off()
            ids, n = self._lora.check(lora_ids, r)
        agreed = self._agreed_shape(t, r, uniform, n, ids)   # data-parallel ranks: one key for all
        plan = self._plans.get(agreed[:4])
        if plan is None or plan.version != self.cache.version + self.sampler_cache.version:
            plan = self._plan(*agreed[:4])
        key, padded_reqs, ids = plan.key, plan.padded_reqs, agreed[4]
        padded = self.preparer.write(self.padder, num_tokens=key.num_tokens, num_reqs=padded_reqs,
                                     out=self.executor.host_buffers)
        if agreed[3]:
            self._lora.write(ids, num_scheduled_tokens, t, key.num_tokens)
        future = (None if future_rows is None else
                  self._futures.apply(future_rows, padded.input_ids, padded.query_start_loc))
        self._futures.clear()       # until this step's tokens are recorded: a failed step has none
        # Statistics are counted before the forward: it evicts the host's caches (on a CPU
        # device), and the runner's objects are still warm from checking and writing.
        self.cache.record_step(real_tokens=t, padded_tokens=key.num_tokens, real_reqs=r,
                               padded_reqs=padded_reqs, eager_reason=plan.eager_reason,
                               eager_cause=plan.eager_cause, key=plan.cache_key, hit=plan.hit)
        sampler_entry = None
        if sampling is not None and plan.mode is RuntimeMode.FULL:
            sampler_key, sampler_entry, sampler_eager = plan.sampler[sampling.all_greedy]
            self.sampler_cache.record_step(real_tokens=0, padded_tokens=0, real_reqs=r, padded_reqs=padded_reqs,
                                           eager_reason=sampler_eager, eager_cause=EagerCause.CAPTURE_FAILED,
                                           key=sampler_key,
                                           hit=sampler_entry is not None)
        ex = self.executor
        logits = ex.run(plan.mode, key, plan.entry, padded, future=future) if future else \
            ex.run(plan.mode, key, plan.entry, padded)
        pending = None
        if sampling is not None and ex.async_execution:
            out = ex.sample(logits, r, sampling, padded_reqs=padded_reqs, entry=sampler_entry, wait=False)
            pending = PendingTokens(lambda: ex.fetch_tokens(out, r))
            self._futures.record(out, r)
        elif sampling is not None:
            tokens = ex.sample(logits, r, sampling, padded_reqs=padded_reqs, entry=sampler_entry)
            pending = PendingTokens(tokens=tokens)
            self._futures.record(tokens, r)
        self._last = (plan, t, r, time.perf_counter() - t0)
        return pending

    def _plan(self, t: int, r: int, uniform: bool, n: int = 0) -> "_StepPlan":
        """What every step of this real shape (and ``n`` LoRA adapters) runs as: the dispatcher's
        key, the cache entry (or the reason to run eagerly), the padded sizes and the sampler
        entries. Remembered until either cache changes; each step still counts its hit or miss."""
        d = self.dispatcher.dispatch(t, r, uniform, n) if n else self.dispatcher.dispatch(t, r, uniform)
        mode, key, entry, eager_reason, cache_key, hit = d.mode, d.key, None, None, None, False
        eager_cause = None
        if mode is RuntimeMode.NONE:
            eager_reason = d.reason
            eager_cause = d.cause or EagerCause.MODE    # a dispatcher that says eager, not why
        else:
            cache_key = (mode, key)
            entry = self.cache.lookup(cache_key, reason=lambda: f"{d.reason}, not built during warm-up")
            if entry is None and not self.executor.eager_fallback:
                entry = self._build_missing(mode, key)
            hit = entry is not None and not isinstance(entry, EagerFallback)
            if not hit:
                eager_reason = entry.reason if entry is not None else f"{key} was not captured"
                eager_cause = EagerCause.CAPTURE_FAILED if entry is not None else EagerCause.MISS
                mode, key, entry = RuntimeMode.NONE, BatchDescriptor(t, r, uniform, n), None
        padded_reqs = key.num_reqs if key.num_reqs is not None else r
        sampler = {}
        for greedy in (True, False):
            sampler_key = SamplerKey(padded_reqs, greedy)
            sampler_entry = self.sampler_cache.lookup(sampler_key)
            if isinstance(sampler_entry, EagerFallback):
                sampler[greedy] = (sampler_key, None, f"sampler capture failed: {sampler_entry.reason}")
            else:
                sampler[greedy] = (sampler_key, sampler_entry, None)
        plan = _StepPlan(d, mode, key, entry, eager_reason, padded_reqs, cache_key, hit, sampler,
                         self.cache.version + self.sampler_cache.version, eager_cause)
        if len(self._plans) >= defaults.STEP_PLAN_MEMO_LIMIT:
            self._plans.clear()
        self._plans[(t, r, uniform, n)] = plan
        return plan

    @property
    def last_step(self) -> StepInfo | None:
        """What the last step ran as (built on demand: the step itself only keeps a tuple)."""
        if self._last is None:
            return None
        plan, t, r, seconds = self._last
        return StepInfo(plan.dispatch, plan.mode, plan.key, t, r, plan.eager_reason, seconds, plan.eager_cause)

    def _build_missing(self, mode: RuntimeMode, key: BatchDescriptor) -> Any:
        """Backends without an eager path (XLA) compile a missing key now (unplanned once sealed)."""
        if self.cache.sealed:
            logger.warning("graphrt: unplanned build of %s after warm-up", key)
        t0 = time.perf_counter()
        entry, nbytes = self.executor.build(mode, key)
        self.cache.put((mode, key), entry, seconds=time.perf_counter() - t0, nbytes=nbytes)
        return entry

    # ---- introspection ---------------------------------------------------------------
    @property
    def stats(self) -> CacheStats:
        """Forward cache statistics (hits, misses, padding, eager steps, build cost)."""
        return self.cache.stats

    @property
    def sampler_stats(self) -> CacheStats:
        """Sampler graph statistics: hits, and steps whose sampler ran eagerly (its capture
        failed: ``eager_steps`` and ``eager_reasons``)."""
        return self.sampler_cache.stats

    def hidden_states(self, num_tokens: int | None = None) -> np.ndarray:
        """The last step's hidden states of its real tokens (a copy: the next step reuses the buffer)."""
        return np.array(self.executor.hidden_states(num_tokens or self.last_step.num_tokens), copy=True)

    def logits(self) -> np.ndarray:
        """The last step's logits at each real request's last token (a copy)."""
        return np.array(self.executor.logits(self.last_step.num_reqs), copy=True)

    def position_logits(self) -> np.ndarray:
        """With ``num_speculative_tokens = k > 0``: the last step's logits at each real
        request's last ``1 + k`` scheduled positions, ``[R, 1 + k, V]`` (a copy). In a
        verification step (every request scheduled its last token and ``k`` drafts), row ``j``
        is the target's distribution for the token after position ``j``: draft ``j + 1`` is
        accepted when it is what row ``j`` samples. Rows before a request's first scheduled
        token are unspecified."""
        return np.array(self.executor.position_logits(self.last_step.num_reqs), copy=True)

    def free_request(self, request_id: int) -> None:
        """Drop per-request state (seeded sampler generators)."""
        self.executor.free_request(request_id)

    def recover_kv_cache(self) -> bool:
        """After a failed :meth:`execute`: True when the failure lost the KV cache and it was
        re-created zeroed (XLA donation), so every request's KV must be recomputed."""
        with self._lock:
            return self.executor.recover_kv_cache()

    @property
    def kv_cache_resets(self) -> int:
        """How many times a failed step's lost KV cache was re-created."""
        return self.executor.kv_cache_resets

    def close(self) -> None:
        """Stop what the executor started (tensor-parallel workers; docs/distributed.md). Idempotent."""
        getattr(self.executor, "close", lambda: None)()

    def __enter__(self) -> "ModelRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ModelRunner", "StepInfo", "EagerFallback", "sampling_batch"]
