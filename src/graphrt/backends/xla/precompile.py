"""Warm-up's compiles on XLA: a batch of keys lowered one after another on the calling thread
and compiled on a thread pool (XLA's compile releases the GIL, so on a multi-core host the
compiles overlap; each entry records its own lowering and compile seconds). Handed only what it
uses: how to get a key's jitted function and abstract arguments, and the executor's
:class:`~graphrt.backends.xla.compile_ledger.CompileLedger`, which loads stored executables and
compiles the rest."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any, Callable, Hashable, Sequence

from tqdm.auto import tqdm

from graphrt.backends.xla.compile_ledger import CompileLedger
from graphrt.backends.xla.entries import XlaEntry
from graphrt.core.cache import describe_key

logger = logging.getLogger("graphrt.backends.xla.executor")

#: ``(mode, key) -> (jitted function, spec, abstract arguments)`` of a key.
AbstractInputs = Callable[[Any, Hashable], tuple[Any, Any, tuple[Any, ...]]]


def lower(jitted: Any, args: tuple[Any, ...]) -> tuple[Any, float]:
    """(lowered computation, seconds) of ``jitted`` for ``args``."""
    t0 = time.perf_counter()
    lowered = jitted.lower(*args)
    return lowered, time.perf_counter() - t0


def precompile(jobs: Sequence[tuple[Any, Hashable]], abstract_inputs: AbstractInputs, compiles: CompileLedger,
               workers: int, progress: bool) -> dict[Hashable, XlaEntry]:
    """Every job's entry by key: loaded from the ledger's store, else lowered here and compiled
    by ``workers`` threads. ``progress`` shows a bar."""
    built: dict[Hashable, XlaEntry] = {}
    start = time.perf_counter()
    bar = tqdm(total=len(jobs), desc=f"graphrt xla precompile ({workers} threads)", unit="bucket",
               disable=not progress or not jobs, leave=False)
    with bar, concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="graphrt-xla-compile") as pool:
        futures = []
        for mode, key in jobs:
            compiles.before_build(key)
            jitted, spec, args = abstract_inputs(mode, key)
            loaded = compiles.load(key, spec)
            if loaded is not None:
                built[key] = loaded
                bar.set_postfix_str(f"loaded {describe_key(key)}")
                bar.update()
                continue
            bar.set_postfix_str(f"lowering {describe_key(key)}")
            lowered, seconds = lower(jitted, args)
            futures.append(pool.submit(compiles.compile, key, lowered, spec, seconds))
        for fut in concurrent.futures.as_completed(futures):
            entry = fut.result()
            built[entry.key] = entry
            bar.set_postfix_str(f"compiled {describe_key(entry.key)}")
            bar.update()
    if jobs:
        logger.info("graphrt: xla precompiled %d executables in %.2f s with %d thread(s): lowering "
                    "%.2f s, compiling %.2f s, %d loaded from the persistent cache", len(built),
                    time.perf_counter() - start, workers, sum(e.lower_seconds for e in built.values()),
                    sum(e.compile_seconds for e in built.values()),
                    sum(e.persistent_cache_hit for e in built.values()))
    return built


__all__ = ["AbstractInputs", "lower", "precompile"]
