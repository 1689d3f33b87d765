"""Stand-ins for the ``torch.cuda`` and ``torch.npu`` graph namespaces over the CPU recording graph.

graphrt's CUDA and Ascend adapters take the namespace they call as an argument; these
fakes let the adapters' own code (streams, pools, memory accounting, Ascend task groups,
task updates and external events) run through the shared executor on a CPU. Every call
is appended to ``calls`` so tests can check the protocol.

CUDA's stream-capture modes are kept as far as they reach other threads: while a
:class:`FakeCudaGraph` captures in "global" mode (torch's default), a synchronize from any other
thread fails as it does on a GPU ("operation not permitted when stream is capturing").

Ascend task updates are simulated faithfully enough to matter: ``graph_task_group_begin``
/ ``end`` remember which recorded steps of the graph being captured form the task, and
``graph_task_update_begin`` / ``end`` record the ops issued in between and splice them in
place of the task's steps, so a replay runs the op with the updated host-side arguments.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from graphrt.backends.torch import recording_graph as rg


#: Captures running in CUDA's "global" mode, process-wide as CUDA keeps them: graph -> its thread.
_GLOBAL_CAPTURES: dict[int, int] = {}


def _check_sync(what: str) -> None:
    """Fail ``what`` (a synchronizing call) while another thread captures in "global" mode."""
    others = [t for t in list(_GLOBAL_CAPTURES.values()) if t != threading.get_ident()]
    if others:
        raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing ({what} while "
                           f"thread {others[0]} captures a graph in capture_error_mode='global')")


class FakeCudaGraph(rg.RecordingGraph):
    """``torch.cuda.CUDAGraph`` over the recording graph, with the reach of its capture mode; each
    capture is logged as ``("capture_begin", current stream, mode)``."""

    def __init__(self, owner: "FakeGraphNamespace") -> None:
        super().__init__()
        self.owner = owner

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self.owner.calls.append(("capture_begin", self.owner.current_stream().name, capture_error_mode))
        super().capture_begin(pool=pool, capture_error_mode=capture_error_mode)
        if capture_error_mode == "global":
            _GLOBAL_CAPTURES[id(self)] = threading.get_ident()

    def capture_end(self) -> None:
        try:
            super().capture_end()
        finally:
            _GLOBAL_CAPTURES.pop(id(self), None)

    def _cancel(self, reason: str) -> None:
        super()._cancel(reason)
        _GLOBAL_CAPTURES.pop(id(self), None)


class FakeStream:
    """A stream that only logs what waits on it."""

    def __init__(self, owner: "FakeGraphNamespace", name: str) -> None:
        self.owner, self.name = owner, name

    def wait_stream(self, other: "FakeStream") -> None:
        self.owner.calls.append(("wait_stream", self.name, other.name))

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeExternalEvent:
    """``torch.npu.ExternalEvent``: logs wait / reset / record with the stream."""

    count = 0

    def __init__(self, owner: "FakeNpu") -> None:
        FakeExternalEvent.count += 1
        self.owner, self.id = owner, FakeExternalEvent.count

    def wait(self, stream: FakeStream) -> None:
        self.owner.calls.append(("event.wait", self.id, stream.name))

    def reset(self, stream: FakeStream) -> None:
        self.owner.calls.append(("event.reset", self.id, stream.name))

    def record(self, stream: FakeStream) -> None:
        self.owner.calls.append(("event.record", self.id, stream.name))


class FakeEvent:
    """``torch.cuda.Event`` / ``torch.npu.Event``: logs record (with the current stream) and synchronize."""

    count = 0

    def __init__(self, owner: "FakeGraphNamespace") -> None:
        FakeEvent.count += 1
        self.owner, self.id = owner, FakeEvent.count

    def record(self, stream: FakeStream | None = None) -> None:
        self.owner.calls.append(("event.record", self.id, (stream or self.owner.current_stream()).name))

    def synchronize(self) -> None:
        _check_sync("Event.synchronize")
        self.owner.calls.append(("event.synchronize", self.id))

    def query(self) -> bool:
        return True


class FakeGraphNamespace:
    """What ``torch.cuda`` and ``torch.npu`` share: graphs, pools, streams, memory."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._pools: list[rg.RecordingPool] = []
        self._default = FakeStream(self, "default")
        self._current = self._default
        self._streams = 0
        self.capturing: rg.RecordingGraph | None = None

    def is_available(self) -> bool:
        return True

    def graph_pool_handle(self) -> rg.RecordingPool:
        pool = rg.graph_pool_handle()
        self._pools.append(pool)
        self.calls.append(("graph_pool_handle",))
        return pool

    def Stream(self, device: Any = None, priority: int = 0) -> FakeStream:  # noqa: N802 - torch's name
        self._streams += 1
        return FakeStream(self, f"s{self._streams}")

    def current_stream(self, device: Any = None) -> FakeStream:
        return self._current

    def Event(self) -> FakeEvent:  # noqa: N802 - torch's name
        return FakeEvent(self)

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        previous, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = previous

    def synchronize(self, device: Any = None) -> None:
        _check_sync("synchronize")
        self.calls.append(("synchronize",))

    def memory_reserved(self, device: Any = None) -> int:
        return sum(p.captured_bytes for p in self._pools)

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return 8 << 30, 16 << 30

    @contextlib.contextmanager
    def graph(self, graph: rg.RecordingGraph, pool: Any = None, stream: FakeStream | None = None,
              capture_error_mode: str = "global") -> Iterator[rg.RecordingGraph]:
        self.calls.append(("graph", stream.name if stream is not None else None))
        previous = self._current
        self._current = stream if stream is not None else self._current
        self.capturing = graph
        try:
            with rg.recording_graph(graph, pool=pool, capture_error_mode=capture_error_mode):
                yield graph
        finally:
            self.capturing = None
            self._current = previous


class FakeCuda(FakeGraphNamespace):
    """``torch.cuda`` as far as graphrt's CUDA adapter uses it."""

    def CUDAGraph(self) -> FakeCudaGraph:  # noqa: N802 - torch's name
        return FakeCudaGraph(self)

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache",))


class FakeNpu(FakeGraphNamespace):
    """``torch.npu`` as far as graphrt's Ascend adapter uses it, task updates included."""

    NPUGraph = rg.RecordingGraph

    def __init__(self) -> None:
        super().__init__()
        self._group_start: int | None = None
        self._update: tuple[list, rg.RecordingGraph] | None = None

    def ExternalEvent(self) -> FakeExternalEvent:  # noqa: N802 - torch_npu's name
        return FakeExternalEvent(self)

    def graph_task_group_begin(self, stream: FakeStream) -> None:
        assert self.capturing is not None, "graph_task_group_begin outside a capture"
        self._group_start = len(self.capturing._steps)
        self.calls.append(("group_begin", stream.name))

    def graph_task_group_end(self, stream: FakeStream) -> list:
        assert self.capturing is not None and self._group_start is not None
        handle = [self.capturing, self._group_start, len(self.capturing._steps)]
        self._group_start = None
        self.calls.append(("group_end", stream.name))
        return handle

    def graph_task_update_begin(self, stream: FakeStream, handle: list) -> None:
        update = rg.RecordingGraph()
        update.capture_begin()
        self._update = (handle, update)
        self.calls.append(("update_begin", stream.name, id(handle)))

    def graph_task_update_end(self, stream: FakeStream) -> None:
        assert self._update is not None, "graph_task_update_end without update_begin"
        (graph, start, end), update = self._update
        update.capture_end()
        if len(update._steps) != end - start:
            raise AssertionError(f"task update issued {len(update._steps)} ops, the task has {end - start}")
        graph._steps[start:end] = update._steps
        self._update = None
        self.calls.append(("update_end", stream.name))
