"""The XLA executor's compile bookkeeping: a :class:`~graphrt.core.cache.GraphCache` of the keys
compiled for the current KV cache shape, so planning, sealing, strict mode and the counters are
every backend's one mechanism, including compiles no lookup sees. :class:`CompileLedger` adds
the nearest compiled key of a miss (:meth:`explain_miss`), the KV shape executables are compiled
against, and the on-disk executable store (:mod:`graphrt.backends.xla.executables`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Hashable

from graphrt.backends.xla.batch import batch_spec, describe_change
from graphrt.backends.xla.compile import thread_cache_hits, thread_compiles, thread_last_compiled
from graphrt.backends.xla.entries import XlaEntry
from graphrt.backends.xla.executables import ExecutableCache
from graphrt.core.cache import GraphCache, describe_key
from graphrt.core.dispatch import BatchDescriptor, SamplerKey

logger = logging.getLogger(__name__)


class CompileLedger(GraphCache[bool]):
    """The executor's compiled keys as a :class:`GraphCache` (each entry ``True``: the runner's
    caches hold the executables, so a retired one is freed), with the on-disk store.

    ``vocab_size`` and ``table_width`` describe the inputs of a key that was never compiled
    (for :meth:`explain_miss`); ``store`` is the on-disk executable store, or None.
    """

    def __init__(self, *, strict: bool, vocab_size: int, table_width: int,
                 store: ExecutableCache | None = None) -> None:
        super().__init__(strict=strict)
        self.store = store
        self._vocab_size = vocab_size
        self._width = table_width
        self._kv_shape: tuple[int, ...] | None = None
        self._lock = threading.Lock()

    def set_kv_shape(self, shape: tuple[int, ...]) -> None:
        """The forwards are compiled for the KV cache's shape: a new shape forgets every compiled
        key (warm-up starts over; the runner's entries for the old shape are stale), and the
        store keys executables by it."""
        if self._kv_shape is not None and self._kv_shape != shape:
            self.clear()
        self._kv_shape = shape

    # ---- making entries ------------------------------------------------------------------
    def before_build(self, key: Hashable) -> None:
        """A key is about to be loaded or compiled: after warm-up that is unplanned."""
        self.check_build(key, lambda: self.explain_miss(key))

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
            self.put(key, True, seconds=entry.build_seconds, nbytes=entry.nbytes)
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
            self.stats.compiles += thread_compiles() - compiles
            self.put(key, True, seconds=entry.build_seconds, nbytes=entry.nbytes)
        logger.debug("graphrt: xla compiled %s in %.3f s (lowering %.3f s)%s", describe_key(key), seconds,
                     lower_seconds, " from the persistent cache" if entry.persistent_cache_hit else "")
        return entry

    # ---- unplanned compiles --------------------------------------------------------------
    def explain_miss(self, key: Hashable) -> str:
        """Which compiled key is nearest to ``key`` and which input field differs from it."""
        if isinstance(key, SamplerKey):
            same = [k for k in self.keys() if isinstance(k, SamplerKey) and k.greedy == key.greedy
                    and k.logprobs == key.logprobs]
            if not same:
                kind = "logprobs" if key.logprobs else "greedy" if key.greedy else "random"
                return f"no {kind} sampler was compiled during warm-up"
            near = min(same, key=lambda k: abs(k.num_reqs - key.num_reqs))
            return (f"shape: field 'logits' is ({key.num_reqs}, {self._vocab_size}); the nearest compiled "
                    f"sampler expects ({near.num_reqs}, {self._vocab_size})")
        forward_keys = [k for k in self.keys() if isinstance(k, BatchDescriptor)]
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
            self.stats.compiles += n
            self.unplanned(key, f"{n} XLA compile(s) (last: {thread_last_compiled()}) while running the "
                                 f"precompiled {what} for {describe_key(key)}: something on the hot path was "
                                 "not precompiled (an eager jax op, or an argument whose pytree structure, "
                                 "dtype or shape differs from warm-up)")


__all__ = ["CompileLedger"]
