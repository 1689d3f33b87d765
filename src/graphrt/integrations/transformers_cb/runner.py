"""transformers' continuous-batching ``ModelRunner`` on graphrt's graphs.

:class:`GraphrtCBRunner` subclasses transformers' ``ModelRunner`` and takes the place of the one
transformers made for a batch processor (:mod:`.activation` swaps it in). transformers' manager,
scheduler, paged cache and input preparation run as they are; three things are graphrt's:

* **Shapes.** :meth:`maybe_pad_inputs` (transformers asks it the padded sizes of each step)
  answers with a graphrt :class:`~graphrt.Dispatcher`'s key: the step's query tokens padded to
  graphrt's token :class:`~graphrt.BucketPolicy` and the cache tokens it reads to a context
  bucket, in place of transformers' coarse intervals (64 tokens, 16384 cache tokens). A step
  above the largest token bucket runs eagerly at its own size (graphrt's rule).
* **Padding.** The padded rows of the step's model kwargs get graphrt's fills
  (:mod:`.padding`): a padded token writes only the allocator's write-trash slot.
* **Graphs.** Each key's graph is captured through the backend's ``graphs(fn, cache)`` (the
  recording graph on ``cpu``, CUDA or ACL graphs where present) and replayed; every step is
  counted in a :class:`~graphrt.GraphCache` (captures, replays, eager steps by cause).

The forward it captures is transformers' own ``_forward_process_and_sample`` (model, logits
processors, sampler), over the batch processor's static buffers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.continuous_batching.model_runner import ModelRunner
from transformers.generation.continuous_batching.utils import stream_context

from graphrt.backends.torch.device_graphs import describe_capture_failure
from graphrt.config import GraphConfig
from graphrt.core import defaults
from graphrt.core.buckets import BucketPolicy
from graphrt.core.cache import GraphCache, describe_key
from graphrt.core.dispatch import BatchDescriptor, Dispatch, Dispatcher
from graphrt.core.errors import ConfigError
from graphrt.core.graph_modes import GraphMode, RuntimeMode
from graphrt.integrations.transformers_cb.padding import KwargPadder, RealSizes, empty_sizes
from graphrt.registry import select_backend

logger = logging.getLogger(__name__)


def key_policies(cb_config: Any, cache: Any, capture_sizes: Any = None,
                 context_buckets: Any = None) -> tuple[BucketPolicy, BucketPolicy]:
    """graphrt's token and context bucket policies for a batch processor.

    Tokens: graphrt's capture sizes (:meth:`~graphrt.GraphConfig.capture_policy`) for its
    ``max_requests_per_batch`` and ``max_batch_tokens``. Context (the cache tokens a step reads,
    up to ``cache.max_tokens_read``, always the last bucket): every
    ``DEFAULT_MIN_CONTEXT_BUCKET`` tokens ``LINEAR_CONTEXT_BUCKETS`` times, then graphrt's
    doubling context buckets (:meth:`~graphrt.GraphConfig.context_policy`). ``capture_sizes`` /
    ``context_buckets`` replace the defaults (capped at those limits)."""
    tokens, top = int(cache.max_batch_tokens), int(cache.max_tokens_read)
    config = GraphConfig.create(
        max_num_seqs=min(int(cb_config.max_requests_per_batch), tokens), max_num_batched_tokens=tokens,
        max_model_len=top, block_size=int(cb_config.page_size),
        context_buckets=None if context_buckets is None else [int(c) for c in context_buckets])
    if capture_sizes is None:
        token_policy = config.capture_policy()
    else:
        sizes = [int(s) for s in capture_sizes if int(s) <= tokens]
        if not sizes:
            raise ConfigError(f"capture_sizes: none of {list(capture_sizes)} is within the processor's "
                              f"max_batch_tokens={tokens}")
        token_policy = BucketPolicy(sizes)
    contexts = config.context_policy()
    if context_buckets is None:
        step = defaults.DEFAULT_MIN_CONTEXT_BUCKET
        linear_top = min(top, step * defaults.LINEAR_CONTEXT_BUCKETS)
        sizes = list(range(step, linear_top + 1, step)) + [c for c in contexts if c > linear_top]
        contexts = BucketPolicy(sizes + [top])
    return token_policy, contexts


@dataclass
class ReadStats:
    """Cache tokens the steps read (``max_kv_read``, summed): the real ones and, padding to the
    keys' context buckets included, those the attention ran over. The token padding is in the
    :class:`~graphrt.CacheStats`; this is the other dimension of a key."""

    real: int = 0
    padded: int = 0

    @property
    def padding_waste(self) -> float:
        """Fraction of the cache tokens read that were padding."""
        return 0.0 if self.padded == 0 else 1.0 - self.real / self.padded


class GraphrtCBRunner(ModelRunner):
    """transformers' ``ModelRunner`` whose steps run under graphrt's keys, padding and graphs.

    ``base``: the runner transformers made (its logits processors, config, IOs, cache and
    sampling flags are taken over); ``model``: the manager's model; ``settings``: what
    ``enable`` was given. ``graph_cache`` (a :class:`~graphrt.GraphCache`) holds the graphs and
    the statistics; ``reads`` the cache tokens read, real and padded.
    """

    def __init__(self, base: ModelRunner, model: torch.nn.Module, settings: Any) -> None:
        super().__init__(logit_processor=base.logit_processor, cb_config=base.cb_config,
                         inputs_and_outputs=base.inputs_and_outputs, cache=base.cache,
                         do_sample=base.do_sample, return_logprobs=base.return_logprobs)
        #: Every step is padded (to its key, or to its own size when it runs eagerly).
        self.pad_inputs = True
        self.model = model
        self.settings = settings
        io = self.inputs_and_outputs
        token_policy, context_policy = key_policies(self.cb_config, self.cache, settings.capture_sizes,
                                                    settings.context_buckets)
        self.dispatcher = Dispatcher(GraphMode.FULL, token_buckets=token_policy,
                                     max_num_seqs=io.max_requests_per_batch, context_buckets=context_policy,
                                     max_context=int(self.cache.max_tokens_read))
        self.backend = select_backend(settings.backend)
        self.graph_cache: GraphCache = GraphCache(strict=settings.strict)
        self.graphs = self.backend.graphs(self._forward, self.graph_cache)
        allocators = list(self.cache.cache_allocators.values())
        self.padder = KwargPadder([a.write_trash_index for a in allocators], [a.read_trash_index for a in allocators])
        self.layer_types = list(io.cumulative_seqlens_k)
        self.warmed_up = False
        self.warmup_seconds = 0.0
        self.reads = ReadStats()
        self._step: Dispatch | None = None
        self._batch: dict | None = None
        #: The dispatcher's answers by (query tokens, context bucket): a pure function of the shape.
        self._dispatches: dict[tuple[int, int], Dispatch] = {}

    # ------------------------------------------------------------------ shapes
    def maybe_pad_inputs(self, num_q_tokens: int, max_kv_read: int, use_decode_fast_path: bool) -> tuple[int, int]:
        """The padded (query tokens, cache tokens read) of the next step: its graphrt key's, or
        its own when it runs eagerly. The first step captures the key set first when
        ``ahead`` and no warm-up did (its inputs are not written yet)."""
        if use_decode_fast_path:
            raise ConfigError("graphrt.integrations.transformers_cb: transformers scheduled a decode-fast-path "
                              "step, which activation turns off (max_blocks_per_request=0)")
        if self.settings.ahead and not self.warmed_up:
            self.warmup(self.model)
        context = self.dispatcher.context_bucket(max_kv_read)
        d = self._dispatches.get((num_q_tokens, context))
        if d is None:
            reqs = min(num_q_tokens, self.inputs_and_outputs.max_requests_per_batch)
            d = self._dispatches[num_q_tokens, context] = self.dispatcher.dispatch(num_q_tokens, reqs, False,
                                                                                   context=context)
        self._step = d
        padded = max_kv_read if d.mode is RuntimeMode.NONE else int(d.key.max_seq_len)
        self.reads.real += max_kv_read
        self.reads.padded += padded
        return (num_q_tokens if d.mode is RuntimeMode.NONE else d.key.num_tokens), padded

    # ------------------------------------------------------------------ steps
    def compute_batch(self, model: torch.nn.Module, batch_data: dict) -> None:
        """Pad the step's kwargs by graphrt's rules, then replay its key's graph (captured on
        first use unless captured ahead), or run it eagerly where the dispatcher said so."""
        io = self.inputs_and_outputs
        d = self._step
        if d is None:
            raise ConfigError("graphrt.integrations.transformers_cb: a step reached the runner without "
                              "maybe_pad_inputs (transformers' processor did not pad it)")
        self._step = None
        real = RealSizes(io.total_seqlen_q, io.num_request_in_batch, len(io.req_id_to_new_token_position),
                         io.true_read_sizes, io.total_seqlen_k)
        self._prepare(batch_data, real, io.num_q_tokens, io.max_kv_read)
        with stream_context(io.compute_stream):
            if d.mode is RuntimeMode.NONE:
                self.graph_cache.record_step(real_tokens=real.tokens, padded_tokens=io.num_q_tokens,
                                             real_reqs=real.reqs, padded_reqs=len(batch_data["logits_indices"]),
                                             eager_reason=d.reason, eager_cause=d.cause)
                self._forward(d.key)
                return
            if d.key not in self.graph_cache:
                self._capture(d.key)
            self.graphs(d.key, num_tokens=real.tokens, num_reqs=real.reqs)

    def _prepare(self, batch_data: dict, real: RealSizes, q: int, kv: int) -> None:
        """The kwargs the forward reads: padded by graphrt's rules, host values fixed by the key."""
        self.padder.fill(batch_data, real, self.inputs_and_outputs.logits_processors_defaults)
        # max_length_k is a host value a graph bakes in: the key's bound on any request's keys.
        batch_data["max_length_k"] = dict.fromkeys(self.layer_types, q + kv)
        if self.supports_logits_to_keep(self.model):
            batch_data["logits_to_keep"] = batch_data["logits_indices"]
        self._batch = batch_data

    def _forward(self, key: Any) -> None:
        """transformers' forward, logits processing and sampling of the current kwargs."""
        carry_over_ids, prev_output_ids, output_ids = self.inputs_and_outputs.get_cb_kwargs()
        self._forward_process_and_sample(self.model, self._batch, carry_over_ids, prev_output_ids, output_ids)

    def _capture(self, key: BatchDescriptor) -> None:
        """Capture ``key``'s graph over the current kwargs; a failure is recorded (the key runs
        eagerly, counted under ``capture_failed``) and logged with graphrt's reason."""
        self.graph_cache.check_build(key, lambda: f"{describe_key(key)} was not captured at warm-up")
        t0 = time.perf_counter()
        try:
            self.graphs.build(key)
        except Exception as error:        # noqa: BLE001 - any capture failure: the key runs eagerly
            reason = describe_capture_failure(error)
            self.graph_cache.put_failed(key, reason, seconds=time.perf_counter() - t0)
            logger.warning("graphrt: capturing %s failed, it runs eagerly: %s", describe_key(key), reason)

    # ------------------------------------------------------------------ warm-up
    @torch.no_grad()
    def warmup(self, model: torch.nn.Module) -> None:
        """transformers' warm-up hook: with ``ahead``, capture every key of the dispatcher
        (largest first) on steps of pure padding, then seal the cache (strict mode refuses a
        later capture); without, keys are captured on first use."""
        if self.warmed_up or not self.settings.ahead:
            return
        t0 = time.perf_counter()
        io = self.inputs_and_outputs
        empty = empty_sizes(len(self.cache.cache_allocators), self.layer_types)
        for _, key in self.dispatcher.keys():
            if key in self.graph_cache:
                continue
            io.num_q_tokens, io.max_kv_read, io.use_block_table = key.num_tokens, int(key.max_seq_len), False
            io.num_request_in_batch, io.total_seqlen_q = 0, 0
            io.requests_in_batch, io.req_id_to_new_token_position = [], {}
            batch = io.get_model_kwargs(use_padding=True)
            batch["cu_seq_lens_q"][0] = 0
            for bounds in batch["cu_seq_lens_k"].values():
                bounds[0] = 0
            self._prepare(batch, empty, key.num_tokens, int(key.max_seq_len))
            with stream_context(io.compute_stream):
                self._capture(key)
        io.num_q_tokens = io.max_kv_read = 0
        self.graph_cache.seal()
        self.warmed_up = True
        self.warmup_seconds = time.perf_counter() - t0
        logger.info("graphrt: captured %d keys in %.2f s", len(self.graph_cache), self.warmup_seconds)
