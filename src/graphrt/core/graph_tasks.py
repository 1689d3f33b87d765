"""Graph tasks: ops whose host-side arguments a captured graph would bake in, refreshed per replay.

A model-level kernel (an attention op taking host lists, as Ascend's fused attention does)
wraps its op in :func:`graph_task`. While a device graph is captured -- the torch backends
open :func:`capturing` around each capture -- the op becomes a task of that graph, and its
hook runs before every replay: on Ascend between ``graph_task_update_begin`` and
``graph_task_update_end``, re-issuing the op with the step's values. Outside a capture
nothing happens and the op runs with the current values.

Framework-free, so that kernels of the model layer can mark their ops without importing
the backends that capture them.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

from graphrt.core.errors import GraphCaptureError

_ACTIVE = threading.local()


def capture_active() -> bool:
    """Whether a device graph is being captured on this thread (ops now become its tasks)."""
    return getattr(_ACTIVE, "capture", None) is not None


@contextlib.contextmanager
def capturing(api: Any, tasks: list) -> Iterator[None]:
    """While a graph of ``api`` (a ``DeviceGraphAPI``) is captured: collect its tasks into ``tasks``."""
    previous = getattr(_ACTIVE, "capture", None)
    _ACTIVE.capture = (api, tasks)
    try:
        yield
    finally:
        _ACTIVE.capture = previous


@contextlib.contextmanager
def graph_task(hook: Callable[[Any], None], *, needs_task_update: bool = False) -> Iterator[None]:
    """Mark the enclosed op as one whose host-side arguments a graph would bake in.

    While a graph is being captured, the op becomes a task of that graph and ``hook`` runs
    before every replay of it, with the padded step inputs: on Ascend between
    ``graph_task_update_begin`` and ``graph_task_update_end`` of the op's task group, so
    the hook re-issues the op with fresh host values (ordered by an external event);
    elsewhere as a plain pre-replay hook, which must then write device buffers the op
    reads. ``needs_task_update``: the hook re-issues the op, which only a device with task
    updates (``task_updates`` on its graph API) can splice into the graph; elsewhere the
    capture fails with :class:`GraphCaptureError` (the key then runs eagerly). Outside a
    capture it does nothing: the op runs with the current values.
    """
    active = getattr(_ACTIVE, "capture", None)
    if active is None:
        yield
        return
    api, tasks = active
    if needs_task_update and not getattr(api, "task_updates", False):
        raise GraphCaptureError(
            f"an op re-issued before each replay (graph_task(needs_task_update=True)) was captured "
            f"into a {getattr(api, 'name', '') or type(api).__name__} graph, which cannot update a "
            f"captured task: its host arguments would be baked in. Only the npu backend (ACL graph "
            f"task updates) replays it; elsewhere the key runs eagerly")
    with api.task_group(hook, tasks):
        yield


__all__ = ["capture_active", "capturing", "graph_task"]
