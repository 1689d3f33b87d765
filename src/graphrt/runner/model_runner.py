"""``ModelRunner``: the one front end every backend sits behind.

Built as a recipe: open (backend, model, executor), keys (:mod:`graphrt.runner.keys`), size the
caches, allocate, prepare (host side, step features), warm up. Per step: check, plan, write
(padded into staging buffers), run (replay / call / eagerly), sample; the optional features
(:mod:`graphrt.runner.features`) join at those points. See docs/architecture.md, 'One engine
step, file by file'.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import threading
import time
from typing import Any, Mapping, Sequence

import numpy as np

from graphrt.backends.base import Backend, SamplingBatch
from graphrt.config import GraphConfig, check_flags, check_unknown_fields
from graphrt.core.cache import CacheStats, FailedBuild, GraphCache
from graphrt.core.dispatch import Dispatcher, DispatchShape, sampler_key
from graphrt.core.dp_agreement import DataParallelStep, StepAgreement
from graphrt.core.eager import EagerCause
from graphrt.core.errors import ConfigError, InputError
from graphrt.core.inputs.extra_inputs import ExtraInputs
from graphrt.core.inputs.fields import ModelInputs
from graphrt.core.future_tokens import PendingTokens
from graphrt.core.graph_memory import size_kv_cache
from graphrt.core.graph_modes import RuntimeMode
from graphrt.core.inputs.preparer import InputPreparer
from graphrt.core.lora import LoraOff, RunnerLora
from graphrt.core.sampling.batch import sampling_batch
from graphrt.runner.background import BackgroundWarmup
from graphrt.runner.capture_plan import open_plan_store, read_plan
from graphrt.runner.features import Step, StepFeature, StepFeatures
from graphrt.runner.keys import ServingKeys
from graphrt.runner.outputs import StepOutput, StepOutputs
from graphrt.runner.plans import (LastStep, OnDemandBuilds, SamplerChoice, StepArgs, StepInfo, StepPlan, plan_sampler,
                                  sampler_entry)
from graphrt.runner.setup import open_executor
from graphrt.runner.traffic import TrafficFit
from graphrt.runner.warmup import warmup_mode
from graphrt.runner.warmup_plan import WarmupPlan
from graphrt.runner.weights import RunnerWeights

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs a model's steps on one backend with graphs / executables per bucket.

    ``model`` is a Hugging Face directory or a model object following ``docs/models.md``. The KV
    cache has ``num_kv_blocks`` blocks, or as many as ``kv_cache_memory`` bytes (or the device's
    free memory) hold; block 0 is the null block.

    ``step_agreement``: data-parallel ranks agree on each step's bucket; a rank with no work calls
    :meth:`execute_dummy` (docs/distributed.md).

    ``warmup``: ``True`` / ``"upfront"`` builds every key in the constructor; ``"background"``
    serves at once and builds keys between steps, most demanded first; ``False`` defers it to
    :meth:`warmup`.

    Feature objects (None when off): ``lora`` (``LoraOff``, whose methods say how to turn it on,
    with ``max_loras=0``), ``data_parallel``, ``background``, ``traffic``; ``features`` picks each
    step's (:class:`~graphrt.runner.features.StepFeatures`). Always there: ``keys`` (the serving
    keys: dispatcher, graph caches, plan memo; ``dispatcher``, ``cache`` and ``sampler_cache``
    read them), ``outputs`` (last step's readouts and logprobs), ``warmup_plan`` (keys built,
    background warm-up, the capture plan store) and ``weights`` (in-place refit, sleep / wake,
    the live-buffer check).

    Threads: :meth:`execute` serializes its callers, but ``outputs`` and :attr:`last_step`
    describe whichever step ran last, so read them from the thread that drives the runner.
    """

    def __init__(self, model: Any, config: GraphConfig | None = None, *,
                 backend: str | Backend = "auto", num_kv_blocks: int | None = None,
                 kv_cache_memory: int | None = None, dtype: Any = None, warmup: bool | str = True,
                 progress: bool = True, step_agreement: StepAgreement | None = None,
                 **config_fields: Any) -> None:
        check_unknown_fields(config_fields, inspect.signature(ModelRunner.__init__).parameters, "ModelRunner")
        fields = {**(config.model_dump(exclude_unset=True) if config is not None else {}), **config_fields}
        self.config = cfg = config if config is not None and not config_fields else GraphConfig.create(**fields)
        check_flags(progress=progress)
        warmup = warmup_mode(warmup)
        self.progress = progress
        self._lock = threading.Lock()
        # 1. open: the backend, the model loaded and checked, the executor, its graph mode
        opened = open_executor(model, cfg, backend, dtype, num_kv_blocks=num_kv_blocks,
                               kv_cache_memory=kv_cache_memory)
        self.backend, self.executor, self.model = opened.backend, opened.executor, opened.model
        self.vocab_size = self.executor.vocab_size
        #: The graph mode served, and the step kinds the configured mode had graphs for and this
        #: one has not (their eager steps count as ``unsupported_by_attention``).
        self.mode, self.degraded = opened.mode, opened.degraded
        # 2. keys: the dispatcher (a saved capture plan's buckets where there is one), the caches
        self._builds = OnDemandBuilds(self.executor)
        can = self.executor.capabilities
        self._async, self._eager_fallback = can.async_execution, can.eager_fallback
        #: The serving keys: dispatcher, forward and sampler caches, plan memo (keys.py).
        self.keys = ServingKeys(opened.dispatcher, strict=cfg.strict, degraded=opened.degraded,
                                build_missing=None if self._eager_fallback else self._builds,
                                logprobs=cfg.max_logprobs > 0, penalties=cfg.enable_penalties)
        # the capture plan, kept beside the compilation cache (none configured: nothing to read)
        store = (open_plan_store(cfg, backend=self.backend.name, executor=self.executor, model=self.model)
                 if cfg.compilation_cache_dir else None)
        saved = read_plan(store, self.keys) if store is not None else None
        # 3. size the caches (KV blocks beside the graphs' memory) and allocate them
        self.num_kv_blocks, self.graph_memory = size_kv_cache(self.executor, cfg, self.keys.jobs(),
                                                              num_kv_blocks, kv_cache_memory)
        self.executor.allocate_kv_cache(self.num_kv_blocks, cfg.block_size)
        # 4. prepare: the host side of every step (checks, padding) and the step features
        self.preparer = InputPreparer(max_num_reqs=cfg.max_num_seqs,
                                      max_num_tokens=cfg.max_num_batched_tokens,
                                      block_size=cfg.block_size, vocab_size=self.vocab_size,
                                      num_blocks=self.num_kv_blocks,
                                      table_width=cfg.max_blocks_per_req, kernel=cfg.host_kernel,
                                      strict=cfg.strict, decode_query_len=cfg.decode_query_len,
                                      num_state_slots=self.executor.num_state_slots)
        self._host_buffers = self.executor.host_buffers
        self._open_features(cfg, step_agreement)
        # 5. warm up: upfront, in the background, or deferred (the warm-up plan made when first
        # used where nothing warms up now, no plan is kept and no re-fit runs)
        self._store, self._warmup_plan = store, None
        self.background: BackgroundWarmup | None = None
        if warmup is not None or store is not None or cfg.refit_interval:
            self.background = self.warmup_plan.open_background(
                warmup, lambda: not self._launched, data_parallel=step_agreement is not None)
        self.traffic = (TrafficFit.attach(self.keys, self.warmup_plan, cfg, step_agreement)
                        if cfg.refit_interval else None)
        self.features = StepFeatures(lora=self.lora, extra=self.extra, on_device=self._async, outputs=self.outputs,
                                     executor=self.executor, data_parallel=self.data_parallel, traffic=self.traffic)
        if self._warmup_plan is not None:
            self._warmup_plan.begin(warmup, saved)

    def _open_features(self, cfg: GraphConfig, step_agreement: StepAgreement | None) -> None:
        """The runner's feature objects: LoRA, data parallelism, extra inputs, weights, outputs,
        future tokens (:class:`StepFeatures` picks each step's from them)."""
        slots = self.executor.lora
        if cfg.max_loras and slots is None:
            raise ConfigError(f"max_loras={cfg.max_loras}: backend {self.backend.name} has no LoRA support")
        self.lora = RunnerLora(slots, cfg.max_loras, cfg.max_num_seqs, self._lock) if slots is not None else LoraOff()
        self.data_parallel = DataParallelStep(step_agreement, self.lora) if step_agreement is not None else None
        #: The model's declared per-step inputs, checked and written each step (None: it has none).
        self.extra = (ExtraInputs(self.executor.extra_inputs, self.executor.extra_buffers)
                      if self.executor.extra_inputs else None)
        #: In-place refit, sleep / wake and the live-buffer check (weights.py).
        self.weights = RunnerWeights(self.executor, self.keys.cache, self.keys.sampler_cache, self._lock,
                                     lambda: self.background is not None and self.background.active)
        #: The live-buffer check's watch, read before each step (None: nothing can move under the entries).
        self._buffer_watch = self.weights.watch
        if isinstance(self.lora, RunnerLora):       # a LoRA load is checked first: no slot under stale graphs
            self.lora.before_load = self.weights.verify
        self._launched = False          # a step launched by execute_async may still run
        self._choice: SamplerChoice | None = None     # the last batch's sampler
        #: Logprobs, and the last step's readouts (``outputs.logits()``, ``hidden_states()``, ...).
        self.outputs = StepOutputs(self.executor, self.keys.sampler_cache, cfg.max_logprobs, self._builds)
        self._sampled: tuple[Any, int] | None = None   # the last sampled step: (sampler output, requests)

    @property
    def warmup_plan(self) -> WarmupPlan:
        """Warm-up: the keys built and served, the capture plan, background warm-up
        (warmup_plan.py); made by the constructor where it warms up, keeps a plan or re-fits,
        else on first use (:meth:`warmup`)."""
        if self._warmup_plan is None:
            self._warmup_plan = WarmupPlan(self.keys, self.executor, self.config, self._lock, store=self._store,
                                           graph_memory=self.graph_memory, preparer=self.preparer,
                                           label=self.backend.name, progress=self.progress)
        return self._warmup_plan

    @property
    def dispatcher(self) -> Dispatcher:
        """The dispatcher served now (``keys.dispatcher``; only :meth:`ServingKeys.serve` replaces it)."""
        return self.keys.dispatcher

    @property
    def cache(self) -> GraphCache:
        """The forward graph cache (``keys.cache``)."""
        return self.keys.cache

    @property
    def sampler_cache(self) -> GraphCache:
        """The sampler graph cache (``keys.sampler_cache``)."""
        return self.keys.sampler_cache

    @property
    def warmup_report(self) -> list[dict[str, Any]]:
        """The last warm-up's rows: key, seconds, bytes, hits, failed (``warmup_plan.report``)."""
        return self.warmup_plan.report

    # ---- setup ---------------------------------------------------------------------
    def warmup(self) -> list[dict[str, Any]]:
        """Capture / compile every key, largest first, then seal; a failed capture runs eagerly
        with a warning, or raises GraphCaptureError in strict mode / without an eager path."""
        return self.warmup_plan.warm_up()

    # ---- one step ------------------------------------------------------------------
    def execute(self, *, token_ids: np.ndarray, block_table: np.ndarray, req_rows: np.ndarray,
                num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray,
                sampling: SamplingBatch | None = None, lora_ids: Any = None,
                future_rows: Any = None, extra_inputs: Mapping[str, Any] | None = None,
                prompt_logprobs: Any = None, state_slots: Any = None) -> np.ndarray | StepOutput | None:
        """Run one scheduled step; returns one sampled token per request (or None without sampling).

        ``lora_ids``: per-request LoRA slot (-1 or None: none). ``future_rows``: see
        :meth:`execute_async`. ``extra_inputs``: an array per ``model.extra_inputs`` entry.
        With logprobs asked (``logprobs`` / ``prompt_logprobs``) it returns a :class:`StepOutput`.
        ``state_slots``: each table row's recurrent-state slot (default: the row itself).

        Bad input raises :class:`InputError` before any static buffer or the KV cache is touched.
        Calls from several threads run one at a time.
        """
        with self._lock:
            return self._execute(StepArgs(token_ids, block_table, req_rows, num_computed_tokens,
                                          num_scheduled_tokens, sampling, lora_ids, future_rows, extra_inputs,
                                          prompt_logprobs, state_slots))

    def execute_async(self, *, token_ids: np.ndarray, block_table: np.ndarray, req_rows: np.ndarray,
                      num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray,
                      sampling: SamplingBatch, lora_ids: Any = None, future_rows: Any = None,
                      extra_inputs: Mapping[str, Any] | None = None, prompt_logprobs: Any = None,
                      state_slots: Any = None) -> PendingTokens:
        """:meth:`execute` without waiting: returns a :class:`PendingTokens` (``result()`` waits).

        ``future_rows`` (one int per request, -1: none): request ``i``'s last scheduled token is
        replaced by the previous sampled step's token at row ``future_rows[i]``, before the host
        has it. Asynchronous backends resolve it on the device; the others run the step to the end.
        """
        if sampling is None:
            raise InputError("sampling", "execute_async returns sampled tokens: pass a SamplingBatch")
        with self._lock:
            out = self._execute(StepArgs(token_ids, block_table, req_rows, num_computed_tokens,
                                         num_scheduled_tokens, sampling, lora_ids, future_rows, extra_inputs,
                                         prompt_logprobs, state_slots), wait=False)
            num_reqs = self.outputs.last.num_reqs
        if type(out) is PendingTokens:
            return out
        if not self._async:
            return PendingTokens(tokens=out)
        return PendingTokens(functools.partial(self.executor.fetch_tokens, out, num_reqs))

    def _execute(self, a: StepArgs, wait: bool = True) -> Any:
        """Check, plan, write, run and sample one step (lock held): host tokens, the sampler's
        device output with ``wait=False``, or None without ``sampling``."""
        t0 = time.perf_counter()
        step, features = self._check(a, wait)
        self._plan(step, features)
        self._write(step, features)
        logits = self._run(step.plan, step.padded, step.num_tokens, step.num_reqs, step.future, step.choice)
        out = self._sample(step, logits)
        self.outputs.last = LastStep(step.plan, step.num_tokens, step.num_reqs, time.perf_counter() - t0)
        self._launched = not wait
        for feature in features:
            feature.finish(step)         # the traffic re-fit decides here, every refit_interval-th step
        if wait and self.background is not None and self.background.active:
            self.background.turn.set()       # between steps: the builder's turn
        return out

    def _check(self, a: StepArgs, wait: bool) -> tuple[Step, Sequence[StepFeature]]:
        """Check: refused while the weights are (asleep, dropped, stale) or a background build
        failed; every bound of the step, its sampling rows and each feature's argument checked
        before anything is written. Returns the step and the features it runs."""
        if self.weights.blocked:            # asleep, weights dropped, or a buffer moved under the graphs
            raise self.weights.refusal()
        watch = self._buffer_watch
        if watch is not None and watch.due:  # re-bound / reallocated since the last check: check now
            self.weights.verify()
        if self.background is not None and self.background.error is not None:
            error, self.background.error = self.background.error, None
            raise error                      # a background build failed in strict mode / without an eager path
        checked = self.preparer.check(token_ids=a.token_ids, block_table=a.block_table, req_rows=a.req_rows,
                                      num_computed_tokens=a.num_computed_tokens,
                                      num_scheduled_tokens=a.num_scheduled_tokens, state_slots=a.state_slots)
        t, r = checked.num_tokens, checked.num_reqs
        if a.sampling is not None and a.sampling.num_reqs != r:
            raise InputError("sampling", f"{a.sampling.num_reqs} rows for {r} requests")
        step = Step(a, wait, t, r, self._sampled)
        features = self.features.for_step(a)
        for feature in features:
            feature.check(step)
        step.shape = DispatchShape(t, r, checked.uniform_decode, step.num_loras,
                                   self.keys.context(checked.max_seq_len))
        return step, features

    def _plan(self, step: Step, features: Sequence[StepFeature]) -> None:
        """Plan: the shape's remembered :class:`StepPlan` (its key, entries, padded sizes) after
        the features saw the shape (agreed across data-parallel ranks, counted for a re-fit), and
        the batch's sampler, remembered while the same batch samples."""
        for feature in features:
            feature.dispatched(step)
        step.plan = plan = self.keys.plan(step.shape, self.background)
        sampling = step.args.sampling
        if sampling is not None:
            choice = self._choice
            if choice is None or choice.batch is not sampling or choice.padded_reqs != plan.padded_reqs:
                skey = sampler_key(sampling, plan.padded_reqs, self.vocab_size)
                choice = self._choice = SamplerChoice(sampling, plan.padded_reqs, skey, skey.kind)
            step.choice = choice

    def _write(self, step: Step, features: Sequence[StepFeature]) -> None:
        """Write: the step padded to its key into the executor's staging buffers, then each
        feature's rows (adapters, extra inputs, future tokens, penalty counts)."""
        plan = step.plan
        step.padded = self.preparer.write(num_tokens=plan.key.num_tokens, num_reqs=plan.padded_reqs,
                                          out=self._host_buffers)
        for feature in features:
            feature.write(step)
        self._sampled = None        # until this step's tokens are: a failed step has none

    def _sample(self, step: Step, logits: Any) -> Any:
        """Sample: the step's tokens (with logprobs through ``outputs`` where asked); None
        without a sampling batch."""
        plan, choice, sampling, r = step.plan, step.choice, step.args.sampling, step.num_reqs
        if step.logprobs:
            out, self._sampled = self.outputs.finish(plan, step.padded, logits, sampling, step.wait,
                                                     step.prompt_logprobs, step.args)
            return out
        if choice is None:
            return None
        entry = (plan.sampler.get(choice.kind) or plan_sampler(plan, choice.key, self.keys.sampler_cache)).entry
        if step.wait or not self._async:
            out = self.executor.sample(logits, r, sampling, padded_reqs=plan.padded_reqs, entry=entry,
                                       key=choice.key)
        else:
            out = self.executor.sample(logits, r, sampling, padded_reqs=plan.padded_reqs, entry=entry,
                                       key=choice.key, wait=False)
        self._sampled = (out, r)
        return out

    def _run(self, plan: StepPlan, padded: ModelInputs, real_tokens: int, real_reqs: int,
             future: Any = None, choice: SamplerChoice | None = None) -> Any:
        """Count the step, then run ``plan`` on the written ``padded`` step (real or dummy).
        Counted before the forward, which evicts the host's caches on a CPU device: a step of
        the plan's shape adds one to the plan's tallies, decided with the plan; one of other real
        sizes (a dummy step, a data-parallel step run at the group's shape) records its own."""
        keys = self.keys
        tally = plan.tally
        if real_tokens == tally.real_tokens and real_reqs == tally.real_reqs:
            tally.steps += 1
        else:
            keys.cache.record_as(tally, real_tokens=real_tokens, real_reqs=real_reqs)
        if plan.wanted is not None:          # its own key is not built yet: demand for it (and its sampler)
            demand, (mode, key) = self.background.demand, plan.wanted
            demand[plan.wanted] += 1
            if choice is not None and mode is RuntimeMode.FULL:
                demand[(mode, dataclasses.replace(choice.key, num_reqs=key.num_reqs))] += 1
        if choice is not None and plan.mode is RuntimeMode.FULL:
            got = plan.sampler.get(choice.kind) or plan_sampler(plan, choice.key, keys.sampler_cache,
                                                                self.background)
            if got.entry is None and not self._eager_fallback:     # no eager sampler: build it now
                entry = self._builds(keys.sampler_cache, got.key, RuntimeMode.FULL, got.key)
                got = plan.sampler[choice.kind] = sampler_entry(keys.sampler_cache, got.key, entry, None, None,
                                                                tally.real_reqs)
            elif got.eager_cause is EagerCause.WARMING_UP:
                self.background.demand[(RuntimeMode.FULL, got.key)] += 1
            if real_reqs == got.tally.real_reqs:
                got.tally.steps += 1
            else:
                keys.sampler_cache.record_as(got.tally, real_tokens=0, real_reqs=real_reqs)
        if future is not None:
            return self.executor.run(plan.mode, plan.key, plan.entry, padded, future=future)
        return self.executor.run(plan.mode, plan.key, plan.entry, padded)

    def execute_dummy(self) -> None:
        """Join a data-parallel step with nothing scheduled here: run the agreed bucket on padding
        only (no KV written, nothing sampled). Nothing runs when no rank has work."""
        if self.data_parallel is None:
            raise ConfigError("execute_dummy needs a ModelRunner built with step_agreement= "
                              "(data-parallel ranks that step together)")
        with self._lock:
            if self.weights.blocked:
                raise self.weights.refusal()
            self.weights.verify_if_changed()
            shape = self.data_parallel.agree_idle()
            if shape is None:
                return
            plan = self.keys.plan(shape, self.background)
            padded = self.preparer.padder.pad_empty(plan.key.num_tokens, plan.padded_reqs, self._host_buffers)
            for feature in self.features.always:
                feature.pad(plan)
            self._run(plan, padded, 0, 0)
            self.outputs.last = LastStep(plan, 0, 0, 0.0)

    @property
    def last_step(self) -> StepInfo | None:
        """What the last step ran as (:meth:`~graphrt.runner.outputs.StepOutputs.last_step`)."""
        return self.outputs.last_step()

    # ---- weights and memory (weights.py) ---------------------------------------
    def update_weights(self, weights: Any) -> dict[str, Any]:
        """Copy new weights into the parameters in place, so every graph / executable built uses
        them with nothing rebuilt: ``weights`` is a checkpoint directory or ``.safetensors`` file,
        a mapping or an iterable of ``(name, tensor)`` in the checkpoint's names, all or some of
        them (fused and tensor-parallel parameters take their part as the loader does). Every
        tensor is checked first: an unknown name, a wrong shape or a dtype that does not cast is
        an InputError naming it, and nothing is written. Returns the tensors, bytes and seconds."""
        return self.weights.update(weights)

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Give the device memory back: ``level=1`` keeps the weights in host memory, ``level=2``
        drops them (refit after :meth:`wake`); both drop the KV and state caches (every request's
        KV is gone). Steps are refused until :meth:`wake`. Returns the bytes released and measured."""
        return self.weights.sleep(level)

    def wake(self) -> dict[str, Any]:
        """Take the memory back at the buffers the graphs read; keys whose buffers came back at
        another address are recaptured (``recaptured``, also in ``stats``), never replayed stale."""
        return self.weights.wake()

    def recapture(self) -> int:
        """Capture again every key whose buffers were re-bound or moved (after a StaleBufferError
        named them), over the buffers bound now; steps run again. Returns how many keys."""
        return self.weights.recapture()

    # ---- introspection ---------------------------------------------------------------
    @property
    def stats(self) -> CacheStats:
        """Forward cache statistics, with ``compiles``: every build the executor counted
        (sampler's and those no cache lookup saw included)."""
        stats = self.keys.cache.stats
        stats.compiles = self.executor.build_count
        return stats

    @property
    def sampler_stats(self) -> CacheStats:
        """Sampler graph statistics: hits, and eager steps after a failed capture."""
        return self.keys.sampler_cache.stats

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
        """Stop background warm-up, save the capture plan, stop what the executor started
        (tensor-parallel workers; docs/distributed.md). Idempotent."""
        if self._warmup_plan is not None:
            self._warmup_plan.close()
        self.executor.close()

    def __enter__(self) -> "ModelRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ModelRunner", "StepInfo", "FailedBuild", "sampling_batch"]
