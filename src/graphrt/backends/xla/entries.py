"""What the XLA executor builds per key: one compiled executable with what it expects and what
it cost (:class:`XlaEntry`), and the per-bucket timing report over the runner's caches.

Entries live in the runner's :class:`~graphrt.core.cache.GraphCache` (forward keys) and
sampler cache, as captured graphs do on the torch backends; the executor keeps none.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable

from graphrt.backends.xla.batch import BATCH_FIELDS, XlaBatch
from graphrt.core.cache import GraphCache, describe_key

@dataclasses.dataclass
class XlaEntry:
    """One compiled executable with what it expects and what it cost."""

    executable: Any                      # jax.stages.Compiled
    key: Hashable
    spec: Any                            # abstract inputs: XlaBatch / SamplingMetadata / None (greedy)
    shapes: tuple[tuple[int, ...], ...]  # forward keys: the shape of each BATCH_FIELDS entry
    lower_seconds: float
    compile_seconds: float
    nbytes: int                          # held while loaded: the generated code (temp is per run)
    persistent_cache_hit: bool
    #: XLA's memory analysis (``memory_analysis()``): scratch, donated-and-aliased (the KV cache
    #: of a forward) and generated-code bytes; zeros where the platform does not say.
    temp_bytes: int = 0
    alias_bytes: int = 0
    code_bytes: int = 0

    @classmethod
    def of(cls, executable: Any, key: Hashable, spec: Any, lower_seconds: float, compile_seconds: float,
           persistent_cache_hit: bool) -> "XlaEntry":
        """The entry of a compiled (or loaded) ``executable``: the batch shapes it checks before
        every call, and the device bytes it holds, read from the executable."""
        shapes = (tuple(tuple(getattr(spec, f).shape) for f in BATCH_FIELDS)
                  if isinstance(spec, XlaBatch) else ())
        temp, alias, code = executable_memory(executable)
        return cls(executable, key, spec, shapes, lower_seconds, compile_seconds, code, persistent_cache_hit,
                   temp, alias, code)

    @property
    def build_seconds(self) -> float:
        """Lowering plus compiling, on the thread that did each."""
        return self.lower_seconds + self.compile_seconds

    def memory(self) -> dict[str, int]:
        """XLA's figures for the warm-up report: ``temp_bytes`` (scratch while it runs),
        ``alias_bytes`` (arguments donated and updated in place: a forward's KV cache) and
        ``code_bytes``. ``bytes`` (what the executable holds, counted per key in the graph-memory
        budget) is its code: temp memory is allocated per run, so the budget counts the largest
        once (``XlaExecutor.scratch_bytes``)."""
        return {"temp_bytes": self.temp_bytes, "alias_bytes": self.alias_bytes, "code_bytes": self.code_bytes}

    def report(self) -> dict[str, Any]:
        """One row of the per-bucket timing report."""
        return {"key": describe_key(self.key), "lower_s": round(self.lower_seconds, 4),
                "compile_s": round(self.compile_seconds, 4), "bytes": self.nbytes, **self.memory(),
                "persistent_cache_hit": self.persistent_cache_hit}


def executable_memory(compiled: Any) -> tuple[int, int, int]:
    """(temp, alias, generated code) bytes of a compiled executable, from XLA's memory analysis;
    zeros where the platform does not implement it."""
    try:
        stats = compiled.memory_analysis()
        return (int(stats.temp_size_in_bytes), int(stats.alias_size_in_bytes),
                int(stats.generated_code_size_in_bytes))
    except Exception:  # noqa: BLE001 - some platforms do not implement memory analysis
        return 0, 0, 0


def compile_report(*caches: GraphCache) -> list[dict[str, Any]]:
    """Per XLA entry of ``caches`` (a runner's ``cache`` and ``sampler_cache``): lowering and
    compile seconds, bytes, and whether it came from a persistent cache."""
    entries = (cache.lookup(key) for cache in caches for key in cache)
    return [entry.report() for entry in entries if isinstance(entry, XlaEntry)]


__all__ = ["XlaEntry", "compile_report", "executable_memory"]
