"""Graph memory measured before the KV cache exists, on every torch graph device.

:func:`measure_graph_memory` is :meth:`TorchExecutor.measure_graph_memory`: it captures
sample keys exactly as warm-up will (same builds, largest first, one fresh pool, every graph
kept until the last is measured -- a CUDA pool whose graphs are all gone is released, and the
next capture would pay a fresh segment that warm-up never pays) against a
throwaway two-block KV cache, records the bytes each capture added -- what the device
counts: ``torch.cuda`` / ``torch.npu`` reserved memory, the CPU recording graph's captured
bytes -- and then drops every graph, the pool, the piecewise buffers and compiled pieces it
made and the KV cache, and hands the memory back (``DeviceGraphAPI.release_memory``), so
warm-up starts from the same state and measures the same bytes again.
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Sequence

from graphrt.backends.torch.device_graphs import GraphPool, describe_capture_failure
from graphrt.core.cache import describe_key
from graphrt.core.dispatch import RuntimeMode

logger = logging.getLogger(__name__)

#: Blocks of the throwaway KV cache the samples are captured against (null block + one).
SAMPLE_KV_BLOCKS = 2


def measure_graph_memory(executor: Any, jobs: Sequence[tuple[RuntimeMode, Any]]
                         ) -> tuple[dict[Any, int], str | None]:
    """``executor`` (a ``TorchExecutor``, not imported: it imports this module): bytes each of ``jobs`` adds when captured in order into one fresh pool (a capture that
    fails counts 0: warm-up will run that key eagerly); ``({}, reason)`` on the eager backend."""
    api = executor.graph_api
    if api is None:
        return {}, "the eager backend captures no graphs"
    if executor.kv_caches:
        return {}, "the KV cache is already allocated; graphs are measured only before it"
    report_len = len(executor.capture_report)
    executor.allocate_kv_cache(SAMPLE_KV_BLOCKS, executor.block_size)
    executor.pool = GraphPool(api)
    measured: dict[Any, int] = {}
    entries: list[Any] = []     # kept until every sample is measured, as warm-up keeps its graphs
    check_baked, executor.check_baked = executor.check_baked, False   # warm-up checks these keys
    try:
        for mode, key in jobs:
            try:
                entry, nbytes = executor.build(mode, key)
            except Exception as exc:  # noqa: BLE001 - warm-up reports it; here it holds nothing
                logger.info("graphrt: graph memory sample %s failed to capture (%s); counted as 0 bytes",
                            describe_key(key), describe_capture_failure(exc))
                entry, nbytes = None, 0
            measured[key] = int(nbytes)
            entries.append(entry)
    finally:
        executor.check_baked = check_baked
        entries.clear()
        _drop_samples(executor, report_len)
    return measured, None


def _drop_samples(executor: Any, report_len: int) -> None:
    """Forget everything the samples made, so that warm-up builds (and measures) it again."""
    del executor.capture_report[report_len:]
    executor.pool = GraphPool(executor.graph_api)
    executor.pieces.reset()
    executor.kv.release()
    executor.kv_caches, executor.kv_cache = [], None
    gc.collect()
    executor.graph_api.release_memory()
