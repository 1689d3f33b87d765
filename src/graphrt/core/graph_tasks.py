"""Graph tasks: ops whose host-side arguments a captured graph would bake in, refreshed per replay.

A model kernel (Ascend's fused attention, taking host lists) wraps its op in
:func:`graph_task`; while a torch backend captures (:func:`capturing`), the op becomes a task
of the graph whose hook re-issues it with the step's values before every replay. Framework-free,
so model kernels mark ops without importing the backends."""

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
def graph_task(hook: Callable[[], None], *, needs_task_update: bool = False) -> Iterator[None]:
    """Mark the enclosed op as one whose host-side arguments a graph would bake in.

    While a graph is captured, the op becomes its task and ``hook()`` runs before every replay,
    after the attention backend's ``before_replay`` (the one reader of the step's host values:
    the hook reads what it refreshed, never the step), on Ascend inside the task group's update,
    re-issuing the op; elsewhere as a pre-replay hook writing device buffers the op reads. ``needs_task_update``:
    only a graph API with ``task_updates`` can splice the re-issued op in; elsewhere the capture
    fails with :class:`GraphCaptureError` (the key runs eagerly). Outside a capture: nothing.
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
