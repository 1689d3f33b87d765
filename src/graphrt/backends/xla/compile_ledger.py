"""The XLA executor's compile bookkeeping: which keys were planned and compiled, and what a
compile after warm-up means. It holds no executables: the entries it makes go to the runner's
:class:`~graphrt.core.cache.GraphCache`, the one entry store, as captured graphs do.

:class:`CompileLedger` records, for one executor:

* the planned keys -- every key warm-up's ``build_many`` was asked for -- and whether warm-up
  is over (sealed: every planned key compiled, or :meth:`seal` called); without warm-up
  (``disable_precompile``) nothing is planned, so nothing is unplanned until :meth:`seal`;
* the keys compiled for the current KV cache shape (for sealing, and the nearest key of a miss);
* the counters: every compile the executor caused, and the unplanned ones after warm-up --
  including compiles no cache lookup sees (an eager op on the hot path, a direct ``build``);
* strict mode for compiles: an unplanned compile raises ``CacheMissError`` naming the nearest
  compiled key and the input field that differs, else it is logged and counted;
* the on-disk executable store (:mod:`graphrt.backends.xla.executables`), read before a key
  is lowered and written after it is compiled.

It does not own the keys (the runner's dispatcher), lowering (the executor: it knows the KV
cache and the weights), the entries or the step statistics (the runner's caches).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Hashable, Iterable

from graphrt.backends.xla.batch import batch_spec, describe_change
from graphrt.backends.xla.compile import thread_cache_hits, thread_compiles, thread_last_compiled
from graphrt.backends.xla.entries import XlaEntry
from graphrt.backends.xla.executables import ExecutableCache
from graphrt.core.cache import describe_key
from graphrt.core.dispatch import BatchDescriptor, SamplerKey
from graphrt.core.errors import CacheMissError

logger = logging.getLogger(__name__)


class CompileLedger:
    """Planned and compiled keys, the compile counters, strict mode and the on-disk store.

    ``vocab_size`` and ``table_width`` describe the inputs of a key that was never compiled
    (for :meth:`explain_miss`); ``store`` is the on-disk executable store, or None.
    """

    def __init__(self, *, strict: bool, vocab_size: int, table_width: int,
                 store: ExecutableCache | None = None) -> None:
        self.strict = strict
        self.store = store
        self._vocab_size = vocab_size
        self._width = table_width
        self._compiled: set[Hashable] = set()
        self._planned: frozenset[Hashable] = frozenset()
        self._sealed = False
        self._kv_shape: tuple[int, ...] | None = None
        self._lock = threading.Lock()
        #: Backend compiles the executor caused (builds, and any caught while running).
        self.compile_count = 0
        #: Compiles after warm-up (strict mode raises instead).
        self.unplanned_compiles = 0

    # ---- warm-up state -------------------------------------------------------------------
    def plan(self, keys: Iterable[Hashable]) -> None:
        """Warm-up will compile ``keys`` (``build_many``'s jobs: the runner's dispatcher's keys
        and their samplers; background warm-up's and a traffic re-fit's); once every planned key
        exists, any further compile is unplanned. Planning a key not yet compiled reopens
        warm-up, so a re-fit's new keys are planned compiles."""
        new = frozenset(keys)
        self._planned |= new
        if not new <= self._compiled:
            self._sealed = False

    @property
    def planned_keys(self) -> frozenset[Hashable]:
        """Every key warm-up was asked to compile (empty before warm-up)."""
        return self._planned

    @property
    def compiled_keys(self) -> frozenset[Hashable]:
        """Every key compiled (or loaded from disk) for the current KV cache shape."""
        return frozenset(self._compiled)

    @property
    def sealed(self) -> bool:
        """Whether warm-up is over: every planned key is compiled (or :meth:`seal` was called)."""
        if not self._sealed and self._planned and self._planned <= self._compiled:
            self._sealed = True
        return self._sealed

    def seal(self) -> None:
        """Declare warm-up over even if some planned keys were never compiled."""
        self._sealed = True

    def set_kv_shape(self, shape: tuple[int, ...]) -> None:
        """The forwards are compiled for the KV cache's shape: a new shape forgets every compiled
        key (warm-up starts over; the runner's entries for the old shape are stale), and the
        store keys executables by it."""
        if self._kv_shape is not None and self._kv_shape != shape:
            self._compiled.clear()
            self._sealed = False
        self._kv_shape = shape

    # ---- making entries ------------------------------------------------------------------
    def before_build(self, key: Hashable) -> None:
        """A key is about to be loaded or compiled: after warm-up that is unplanned."""
        if self.sealed:
            self._unplanned(key, self.explain_miss(key))

    def load(self, key: Hashable, spec: Any) -> XlaEntry | None:
        """The entry for ``key`` from the on-disk store, skipping lowering; None on a miss."""
        if self.store is None:
            return None
        t0 = time.perf_counter()
        compiled = self.store.load((key, self._kv_shape))
        if compiled is None:
            return None
        entry = XlaEntry.of(compiled, key, spec, 0.0, time.perf_counter() - t0, True)
        with self._lock:
            self._compiled.add(key)
        logger.debug("graphrt: xla loaded %s from the executable cache", describe_key(key))
        return entry

    def compile(self, key: Hashable, lowered: Any, spec: Any, lower_seconds: float) -> XlaEntry:
        """Compile ``lowered`` for ``key`` (on any thread), count it and write it to the store."""
        compiles, hits = thread_compiles(), thread_cache_hits()
        t0 = time.perf_counter()
        compiled = lowered.compile()
        seconds = time.perf_counter() - t0
        entry = XlaEntry.of(compiled, key, spec, lower_seconds, seconds, thread_cache_hits() > hits)
        if self.store is not None:
            self.store.store((key, self._kv_shape), compiled)
        with self._lock:
            self.compile_count += thread_compiles() - compiles
            self._compiled.add(key)
        logger.debug("graphrt: xla compiled %s in %.3f s (lowering %.3f s)%s", describe_key(key), seconds,
                     lower_seconds, " from the persistent cache" if entry.persistent_cache_hit else "")
        return entry

    # ---- unplanned compiles --------------------------------------------------------------
    def explain_miss(self, key: Hashable) -> str:
        """Which compiled key is nearest to ``key`` and which input field differs from it."""
        if isinstance(key, SamplerKey):
            same = [k for k in self._compiled if isinstance(k, SamplerKey) and k.greedy == key.greedy
                    and k.logprobs == key.logprobs]
            if not same:
                kind = "logprobs" if key.logprobs else "greedy" if key.greedy else "random"
                return f"no {kind} sampler was compiled during warm-up"
            near = min(same, key=lambda k: abs(k.num_reqs - key.num_reqs))
            return (f"shape: field 'logits' is ({key.num_reqs}, {self._vocab_size}); the nearest compiled "
                    f"sampler expects ({near.num_reqs}, {self._vocab_size})")
        forward_keys = [k for k in self._compiled if isinstance(k, BatchDescriptor)]
        planned = f"{len(forward_keys)} forward buckets were compiled during warm-up"
        if not isinstance(key, BatchDescriptor) or key.num_reqs is None or not forward_keys:
            return f"{key} was never compiled; {planned}"
        near = min(forward_keys, key=lambda k: (k.uniform_decode != key.uniform_decode,
                                                abs(k.num_tokens - key.num_tokens),
                                                abs(k.num_reqs - key.num_reqs)))
        diff = describe_change(self._spec(near), self._spec(key))
        return f"{key} was never compiled ({planned}); versus the nearest, {near}: {diff}"

    def _spec(self, key: BatchDescriptor) -> Any:
        """The abstract batch a forward key is compiled for (as the executor lowers it)."""
        return batch_spec(key.num_tokens, key.num_reqs, key.uniform_decode, self._width)

    def compiled_while_running(self, before: int, key: Hashable, what: str) -> None:
        """The calling thread compiled while running ``key``'s executable (``before``: its
        compile count then): count it, and after warm-up treat it as unplanned."""
        n = thread_compiles() - before
        with self._lock:
            self.compile_count += n
        if self.sealed:
            self._unplanned(key, f"{n} XLA compile(s) (last: {thread_last_compiled()}) while running the "
                                 f"precompiled {what} for {describe_key(key)}: something on the hot path was "
                                 "not precompiled (an eager jax op, or an argument whose pytree structure, "
                                 "dtype or shape differs from warm-up)")

    def _unplanned(self, key: Hashable, reason: str) -> None:
        """A compile after warm-up: raise in strict mode, else log and count it."""
        if self.strict:
            raise CacheMissError(key, reason)
        with self._lock:
            self.unplanned_compiles += 1
        logger.warning("graphrt: unplanned XLA compile after warm-up: %s", reason)


__all__ = ["CompileLedger"]
