"""Graph memory measured before the KV cache exists, on every torch graph device.

:func:`measure_graph_memory` captures sample keys as warm-up will (same builds, largest first,
one fresh pool, every graph kept until the last is measured, so no fresh segment is paid that
warm-up never pays) against a throwaway two-block KV cache, records the bytes each added, then
drops all it made and releases the memory, so warm-up measures the same bytes again."""

from __future__ import annotations

import gc
import logging
from typing import Any, Callable, Sequence

from graphrt.backends.torch.device_graphs import describe_capture_failure
from graphrt.backends.torch.capture.graph_builder import GraphBuilder
from graphrt.core import defaults
from graphrt.core.cache import describe_key
from graphrt.core.graph_modes import RuntimeMode

logger = logging.getLogger(__name__)

#: Blocks of the throwaway KV cache the samples are captured against (null block + one).
SAMPLE_KV_BLOCKS = defaults.SAMPLE_KV_BLOCKS


def measure_graph_memory(builder: GraphBuilder | None, kv_allocated: bool, allocate_kv: Callable[[int], None],
                         release_kv: Callable[[], None], jobs: Sequence[tuple[RuntimeMode, Any]]
                         ) -> tuple[dict[Any, int], str | None]:
    """Bytes each of ``jobs`` adds when ``builder`` captures it in order into one fresh pool (a
    capture that fails counts 0: warm-up will run that key eagerly), against a KV cache of
    ``SAMPLE_KV_BLOCKS`` blocks made by ``allocate_kv(num_blocks)`` and dropped by
    ``release_kv()``; ``({}, reason)`` on the eager backend (no builder) or once the KV cache
    exists (``kv_allocated``)."""
    if builder is None:
        return {}, "the eager backend captures no graphs"
    if kv_allocated:
        return {}, "the KV cache is already allocated; graphs are measured only before it"
    report_len = len(builder.report)
    allocate_kv(SAMPLE_KV_BLOCKS)
    builder.new_pool()
    measured: dict[Any, int] = {}
    entries: list[Any] = []     # kept until every sample is measured, as warm-up keeps its graphs
    try:
        for mode, key in jobs:
            try:
                entry, nbytes = builder.build(mode, key, check_baked=False)   # warm-up checks these keys
            except Exception as exc:  # noqa: BLE001 - warm-up reports it; here it holds nothing
                logger.info("graphrt: graph memory sample %s failed to capture (%s); counted as 0 bytes",
                            describe_key(key), describe_capture_failure(exc))
                entry, nbytes = None, 0
            measured[key] = int(nbytes)
            entries.append(entry)
    finally:
        entries.clear()
        # Forget everything the samples made, so that warm-up builds (and measures) it again.
        builder.forget(report_len)
        release_kv()
        gc.collect()
        builder.graph_api.release_memory()
    return measured, None
