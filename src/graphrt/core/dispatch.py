"""The dispatcher: the single source of truth for "which key does this step run under".

Given the graph mode and the bucket policies, it maps a step's
:class:`BatchDescriptor` to a runtime mode (FULL graph, PIECEWISE graphs, or NONE =
eager) and the padded key. Warm-up asks the same object for every key it can return,
so capture / precompile and serving can never disagree.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, NamedTuple

from graphrt.core import defaults
from graphrt.core.buckets import BucketPolicy
from graphrt.core.eager import EagerCause
from graphrt.core.errors import ConfigError, InputError
from graphrt.core.graph_modes import GraphMode, RuntimeMode
from graphrt.core.lora import lora_buckets


@dataclass(frozen=True, order=True)
class BatchDescriptor:
    """A step's shape; once padded, the key of a graph or executable.

    ``num_reqs`` is None for PIECEWISE keys (pieces see token shapes only). ``num_loras``: the
    step's distinct LoRA adapters, bucketed (0: none). ``max_seq_len``: the key's context bucket
    where the attention reads the context length as a host value (every request of the step
    has at most that many tokens); None where the key holds any context.
    """

    num_tokens: int
    num_reqs: int | None
    uniform_decode: bool
    num_loras: int = 0
    max_seq_len: int | None = None

    def __str__(self) -> str:
        kind = "decode" if self.uniform_decode else "mixed"
        reqs = "any" if self.num_reqs is None else self.num_reqs
        loras = f", loras={self.num_loras}" if self.num_loras else ""
        context = f", context<={self.max_seq_len}" if self.max_seq_len is not None else ""
        return f"({kind}, tokens={self.num_tokens}, reqs={reqs}{loras}{context})"


@dataclass(frozen=True)
class SamplerKey:
    """The key of a sampler graph / executable: ``num_reqs`` padded request rows, and
    whether every row is greedy (an argmax-only sampler) or not.

    ``logprobs=True`` keys the logprobs graph of ``num_reqs`` rows instead (always with
    ``greedy=False``): run after either sampler, it reads the same logits rows and the tokens
    just sampled (:func:`logprobs_key`). Two random samplers are not built at warm-up by default:
    ``wide_top_k`` (a row's top_k past ``defaults.SAMPLER_TOP_K_CANDIDATES``: exact by counting)
    and ``penalties`` (repetition / presence / frequency penalties, greedy rows included)."""

    num_reqs: int
    greedy: bool
    logprobs: bool = False
    wide_top_k: bool = False
    penalties: bool = False

    @property
    def kind(self) -> str:
        """``greedy``, ``random``, ``logprobs``, or the random sampler's variant
        (``random+wide-top-k``, ``random+penalties``, ``random+penalties+wide-top-k``)."""
        if self.logprobs:
            return "logprobs"
        if self.greedy:
            return "greedy"
        return "random" + "+penalties" * self.penalties + "+wide-top-k" * self.wide_top_k

    def __str__(self) -> str:
        return f"(sample, reqs={self.num_reqs}, {self.kind})"


def sampler_key(sampling: Any, num_reqs: int, vocab_size: int, candidates: int | None = None) -> SamplerKey:
    """The sampler a step's batch needs (a :class:`~graphrt.core.sampling.batch.SamplingBatch`) at
    ``num_reqs`` padded rows: the penalised one when a row has penalties, the greedy one when
    every row is greedy, else the random one; wide where a random row's top_k lies between the
    ``candidates`` (``defaults.SAMPLER_TOP_K_CANDIDATES``) and ``vocab_size``."""
    ceiling = sampling.top_k_ceiling
    wide = (defaults.SAMPLER_TOP_K_CANDIDATES if candidates is None else candidates) < ceiling < vocab_size
    if sampling.penalties is not None:
        return SamplerKey(num_reqs, False, wide_top_k=wide, penalties=True)
    if sampling.all_greedy:
        return SamplerKey(num_reqs, True)
    return SamplerKey(num_reqs, False, wide_top_k=wide)


def logprobs_key(num_reqs: int) -> SamplerKey:
    """The key of the logprobs graph of ``num_reqs`` rows."""
    return SamplerKey(num_reqs, False, True)


@dataclass(frozen=True)
class Dispatch:
    """The dispatcher's answer for one step."""

    mode: RuntimeMode
    key: BatchDescriptor  # the padded shape to run under (the real shape when eager)
    reason: str           # why this mode: shown in logs, statistics and CacheMissError
    cause: EagerCause | None = None   # when eager: the counted cause (mode, above the largest bucket)


class DispatchShape(NamedTuple):
    """The shape a step is dispatched as: its own, or the one its data-parallel group agreed on
    (:class:`~graphrt.core.dp_agreement.StepAgreement`), looked up by :meth:`Dispatcher.dispatch`.
    ``context`` is ``Dispatcher.context_bucket`` of its longest request (0 without buckets)."""

    num_tokens: int
    num_reqs: int
    uniform_decode: bool
    num_loras: int
    context: int = 0


class Dispatcher:
    """Maps steps to (runtime mode, padded key) by looking them up in its key set.

    The key set is built once from the mode and the bucket policies: :meth:`keys` lists it
    (warm-up builds exactly those) and :meth:`dispatch` returns the first candidate key the set
    holds, so every key a step can run under is one warm-up built.

    * ``token_buckets`` -- token counts of mixed keys; ``decode_buckets`` -- batch sizes of
      uniform-decode keys (default: ``token_buckets / q`` capped at ``max_num_seqs``, with the
      largest decode batch the token buckets hold).
    * ``mixed_num_reqs`` -- requests of FULL mixed keys: None is ``min(tokens, max_num_seqs)``;
      an int fixes it (XLA).
    * ``eager_fallback`` -- a step above the largest bucket runs eagerly; without it (XLA) it
      is an :class:`InputError`.
    * ``separate_decode`` -- uniform-decode steps get keys ``(b * q, b, uniform_decode=True)``.
    * ``decode_query_len`` -- ``q`` = 1 + num_speculative_tokens, tokens per decode request.
    * ``max_loras`` -- every key exists per adapter-count bucket (0, 1, 2, 4, ..., max_loras);
      steps with and without adapters never share a graph.
    * ``context_buckets`` -- every FULL key exists per context bucket (``max_seq_len``, at most
      ``max_context``); a longer step runs PIECEWISE where the mode has it, else eagerly.

    A decode step above the largest decode bucket is handled as a mixed step. docs/api.md.
    """

    def __init__(self, mode: GraphMode, *, token_buckets: BucketPolicy | None,
                 max_num_seqs: int, decode_buckets: BucketPolicy | None = None,
                 mixed_num_reqs: int | None = None, eager_fallback: bool = True,
                 separate_decode: bool | None = None, decode_query_len: int = 1, max_loras: int = 0,
                 context_buckets: BucketPolicy | None = None, max_context: int | None = None) -> None:
        self.mode = GraphMode(mode)
        self.context_buckets = context_buckets
        self.max_context = max_context
        #: The context buckets as a sorted tuple (empty: FULL keys hold any context).
        self.context_sizes: tuple[int, ...] = tuple(context_buckets) if context_buckets is not None else ()
        if max_loras < 0:
            raise ConfigError(f"max_loras must be >= 0, got {max_loras}")
        self.max_loras = int(max_loras)
        #: The adapter-count buckets (None: LoRA off, and core/lora.py is not asked).
        self.lora_buckets = lora_buckets(self.max_loras) if self.max_loras else None
        if decode_query_len < 1:
            raise ConfigError(f"decode_query_len must be >= 1, got {decode_query_len}")
        self.decode_query_len = q = int(decode_query_len)
        self.separate_decode = (self.mode.separate_decode_graphs() if separate_decode is None
                                else separate_decode and self.mode is not GraphMode.NONE)
        self.max_num_seqs = int(max_num_seqs)
        self.eager_fallback = eager_fallback
        self.mixed_num_reqs = mixed_num_reqs
        if self.mode is not GraphMode.NONE and token_buckets is None:
            raise ConfigError(f"graph mode {self.mode.value} needs token buckets")
        self.token_buckets = token_buckets
        if decode_buckets is None and token_buckets is not None:
            # Capped at the largest decode batch *including* it (max_num_seqs when the token
            # buckets reach it): a full decode batch must never fall back to eager because its
            # size is missing from the capture list or off the grid of multiples of q.
            top = min(self.max_num_seqs, token_buckets.max_size // q)
            sizes = [b for b in (s // q for s in token_buckets) if b >= 1]
            decode_buckets = BucketPolicy(sizes + [top]).capped(top) if top >= 1 else None
        self.decode_buckets = decode_buckets
        if mixed_num_reqs is not None and token_buckets is not None:
            if mixed_num_reqs < self.max_num_seqs:
                raise ConfigError(f"a fixed mixed batch size ({mixed_num_reqs}) must cover "
                                  f"max_num_seqs={self.max_num_seqs}")
        #: The runtime mode of mixed steps, and of uniform steps without keys of their own.
        self._mixed = self.mode.mixed_mode()
        self._uniform = self._mixed if self.separate_decode else self.mode.decode_mode()
        #: The key set: every key dispatch can return, with the mode it runs in.
        self._keys: dict[BatchDescriptor, RuntimeMode] = self._key_set()

    def _key_set(self) -> dict[BatchDescriptor, RuntimeMode]:
        """Every (key, mode) the policies give: the decode keys, the mixed (and uniform-as-mixed)
        keys of each token bucket, each once per adapter-count bucket."""
        keys: dict[BatchDescriptor, RuntimeMode] = {}
        adapters = [0] + (list(self.lora_buckets) if self.lora_buckets is not None else [])
        contexts = tuple(self._context_key(c) for c in self.context_sizes) or (None,)
        if self.separate_decode and self.decode_buckets is not None:
            q = self.decode_query_len
            keys.update((BatchDescriptor(b * q, b, True, n, c), RuntimeMode.FULL)
                        for b in self.decode_buckets for n in adapters for c in contexts)
        for runtime in {self._mixed, self._uniform} - {RuntimeMode.NONE}:
            for b in self.token_buckets or ():
                keys.update((self._token_key(runtime, b, n, c), runtime) for n in adapters for c in contexts)
        return keys

    def _token_key(self, runtime: RuntimeMode, tokens: int, num_loras: int, context: int | None) -> BatchDescriptor:
        """The key of a token bucket: PIECEWISE keys see tokens only (and any context: their
        attention runs outside the graphs); FULL ones a request count and the context bucket."""
        if runtime is RuntimeMode.PIECEWISE:
            return BatchDescriptor(tokens, None, False, num_loras)
        reqs = self.mixed_num_reqs if self.mixed_num_reqs is not None else min(tokens, self.max_num_seqs)
        return BatchDescriptor(tokens, reqs, False, num_loras, context)

    @staticmethod
    def _context_key(context: int) -> int | None:
        """A FULL key's ``max_seq_len`` for a context bucket (None: the dispatcher has none)."""
        return context if context > 0 else None

    def context_bucket(self, max_seq_len: int) -> int:
        """What :meth:`dispatch` takes for a step whose longest request has ``max_seq_len``
        tokens: its context bucket, 0 without context buckets, -1 above the largest."""
        sizes = self.context_sizes
        if not sizes:
            return 0
        i = bisect.bisect_left(sizes, max_seq_len)
        return sizes[i] if i < len(sizes) else -1

    def dispatch(self, num_tokens: int, num_reqs: int, uniform_decode: bool, num_loras: int = 0,
                 context: int = 0) -> Dispatch:
        """Runtime mode and padded key for a step of this real shape with ``num_loras`` distinct
        adapters and ``context`` (:meth:`context_bucket` of its longest request; 0: not given,
        any context up to ``max_context``): the first of its candidate keys (its decode bucket, then its token
        bucket) the key set holds, else eager with the reason (a pure function of the shape:
        callers on a hot path remember it, as ``ModelRunner`` does)."""
        n = self.lora_bucket(num_loras) if num_loras else 0
        keys = self._keys
        sizes = self.context_sizes
        if context == 0 and sizes:           # not given: any context, the whole table's key if there is one
            context = sizes[-1] if sizes[-1] == self.max_context else -1
        c = self._context_key(context)
        full_ok = not sizes or context > 0   # a FULL key holds this context
        if uniform_decode and self.separate_decode and self.decode_buckets is not None and full_ok:
            b = self.decode_buckets.bucket_for(num_reqs)
            if b is not None:
                key = BatchDescriptor(b * self.decode_query_len, b, True, n, c)
                if key in keys:
                    return Dispatch(RuntimeMode.FULL, key, "decode bucket")
        runtime = self._uniform if uniform_decode else self._mixed
        real = BatchDescriptor(num_tokens, num_reqs, uniform_decode, num_loras)
        if runtime is RuntimeMode.NONE:
            # A decode step no decode bucket held is above the largest bucket, whatever the
            # mixed mode then says; otherwise the mode itself runs it eagerly.
            above = uniform_decode and self.separate_decode
            return Dispatch(RuntimeMode.NONE, real, f"graph mode {self.mode.value} runs "
                                                    f"{'decode' if uniform_decode else 'mixed'} steps eagerly",
                            EagerCause.ABOVE_LARGEST_BUCKET if above else EagerCause.MODE)
        if runtime is RuntimeMode.FULL and not full_ok:
            return self._above_context(real)
        b = self.token_buckets.bucket_for(num_tokens)
        key = self._token_key(runtime, b, n, c) if b is not None else None
        if key is None or keys.get(key) is not runtime:
            return self._above(real, "token", self.token_buckets)
        reason = "token bucket (piecewise)" if runtime is RuntimeMode.PIECEWISE else "token bucket"
        return Dispatch(runtime, key, reason)

    def lora_bucket(self, num_loras: int) -> int:
        """The adapter count of the key a step with ``num_loras`` distinct adapters runs under."""
        if num_loras == 0:
            return 0
        if self.lora_buckets is None or not 0 < num_loras <= self.max_loras:
            raise InputError("lora_ids", f"{num_loras} distinct adapters in one step; at most max_loras="
                                         f"{self.max_loras} can run together")
        return self.lora_buckets.bucket_for(num_loras)

    def _above(self, real: BatchDescriptor, which: str, policy: BucketPolicy | None) -> Dispatch:
        largest = policy.max_size if policy is not None else 0
        reason = f"{real.num_tokens} tokens above the largest {which} bucket ({largest})"
        if not self.eager_fallback:
            raise InputError("num_scheduled_tokens",
                             f"{reason}: this backend has no eager fallback; keep steps within "
                             "max_num_batched_tokens / max_num_seqs")
        return Dispatch(RuntimeMode.NONE, real, reason + "; runs eagerly", EagerCause.ABOVE_LARGEST_BUCKET)

    def _above_context(self, real: BatchDescriptor) -> Dispatch:
        reason = (f"a request of the step is longer than the largest context bucket of FULL graphs "
                  f"({self.context_sizes[-1]} tokens)")
        if not self.eager_fallback:
            raise InputError("num_computed_tokens", f"{reason}: this backend has no eager fallback; keep "
                                                    "requests within max_model_len")
        return Dispatch(RuntimeMode.NONE, real, reason + "; runs eagerly", EagerCause.ABOVE_LARGEST_CONTEXT)

    def with_buckets(self, *, token_buckets: BucketPolicy | None = None,
                     decode_buckets: BucketPolicy | None = None) -> "Dispatcher":
        """The same dispatcher (mode, limits, LoRA and context buckets) over other bucket sizes:
        ``token_buckets`` / ``decode_buckets`` where given, else this one's (a traffic re-fit, a
        saved capture plan). The largest sizes must stay what they were, so the new key set
        covers every step the old one did."""
        tokens = token_buckets if token_buckets is not None else self.token_buckets
        decode = decode_buckets if decode_buckets is not None else self.decode_buckets
        for name, old, new in (("token", self.token_buckets, tokens), ("decode", self.decode_buckets, decode)):
            if old is not None and new is not None and new.max_size != old.max_size:
                raise ConfigError(f"re-fitted {name} buckets must keep the largest size {old.max_size} "
                                  f"(got {new.max_size}): the new key set must cover every step the old one did")
        return Dispatcher(self.mode, token_buckets=tokens, max_num_seqs=self.max_num_seqs, decode_buckets=decode,
                          mixed_num_reqs=self.mixed_num_reqs, eager_fallback=self.eager_fallback,
                          separate_decode=self.separate_decode, decode_query_len=self.decode_query_len,
                          max_loras=self.max_loras, context_buckets=self.context_buckets,
                          max_context=self.max_context)

    def covering(self, num_tokens: int, num_reqs: int, uniform_decode: bool, num_loras: int = 0,
                 context: int = 0) -> list[tuple[RuntimeMode, BatchDescriptor]]:
        """Every key of the set that can run a step of this shape (``dispatch``'s arguments, the
        adapter count already bucketed), smallest first: enough tokens and requests (a
        PIECEWISE key holds any request count), a decode key only for a decode step, the same
        adapter bucket, and a context bucket at least the step's (a key without one holds any
        context). Background warm-up runs a step under the first one built while its own
        key is not (padding is invisible, so the tokens are the same)."""
        if context == 0 and self.context_sizes:
            context = self.context_sizes[-1] if self.context_sizes[-1] == self.max_context else -1
        found = [(mode, k) for k, mode in self._keys.items()
                 if k.num_tokens >= num_tokens and (k.num_reqs is None or k.num_reqs >= num_reqs)
                 and (uniform_decode or not k.uniform_decode) and k.num_loras == num_loras
                 and (k.max_seq_len is None or 0 < context <= k.max_seq_len)]
        return sorted(found, key=lambda mk: (mk[1].num_tokens, mk[1].num_reqs or 0, mk[1].max_seq_len or 0,
                                             mk[0].value))

    def keys(self) -> list[tuple[RuntimeMode, BatchDescriptor]]:
        """The key set: every (mode, key) ``dispatch`` can return with a graph, largest first
        (capture order)."""
        return sorted(((mode, key) for key, mode in self._keys.items()),
                      key=lambda mk: (mk[1].num_tokens, mk[1].num_reqs or 0, mk[1].max_seq_len or 0,
                                      mk[1].num_loras, mk[0].value),
                      reverse=True)
