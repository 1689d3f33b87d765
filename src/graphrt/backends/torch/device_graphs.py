"""Torch device graphs, the small API each device supplies, and capture / replay of any callable
per key. A device supplies a :class:`DeviceGraphAPI` (graphs, a shared pool, a capture
context); :func:`record` captures with the rules that make graphs correct (device synchronised,
GC paused, refreshable tasks collected)."""

from __future__ import annotations

import abc
import contextlib
import gc
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch

from graphrt.core.errors import GraphCaptureError, GraphrtError
from graphrt.core import graph_tasks
from graphrt.core.collector import collector_paused

#: A graph task's hook: run before each replay of its graph with the padded inputs (host numpy arrays).
PreReplayHook = Callable[[], None]


@dataclass
class GraphTask:
    """An op captured so that a hook can refresh it before each replay of its graph.

    ``handle`` and ``event`` are the device's task-group handle and the external event
    the graph waits on (Ascend); both are None where the device has no task update.
    """

    hook: PreReplayHook
    handle: Any = None
    event: Any = None


class DeviceGraphAPI(abc.ABC):
    """The few device calls the shared graph code needs (CUDA, NPU, CPU recording)."""

    name: str = ""
    device: torch.device = torch.device("cpu")
    #: Host staging buffers are page-locked (async host-to-device copies).
    pin_memory: bool = False
    #: ``torch.compile`` backend used by ``compile_model`` (None: compiling is unsupported).
    compile_backend: str | None = "inductor"
    #: Run the garbage collector once before the first capture (frees device memory that
    #: dead tensors hold, so the graph pool starts from the real high-water mark).
    collect_before_capture: bool = True
    #: Whether graphs of one pool reuse each other's freed memory (a device caching allocator:
    #: CUDA, NPU), so a graph captured after a larger one adds only what it keeps (and the
    #: allocator's segment rounding); False where every graph keeps its own intermediates (the
    #: CPU recording graph). The graph-memory estimate extrapolates differently for each.
    graphs_share_memory: bool = False
    #: Whether device work runs behind the host (CUDA, Ascend: a launch returns before the device
    #: finishes, so overlapping steps hides the host's share); False where it is done on return.
    asynchronous: bool = False
    #: Whether a captured task can be re-issued before a replay (Ascend's task update), so an
    #: op marked ``graph_task(needs_task_update=True)`` may be captured.
    task_updates: bool = False

    def new_event(self) -> Any:
        """An event with ``record()`` (on the current stream) and ``synchronize()`` (wait for what
        was queued before the record). Default: the CPU's, complete once recorded."""
        return CompletedEvent()

    @abc.abstractmethod
    def new_graph(self) -> Any:
        """An empty graph object with ``replay()``."""

    @abc.abstractmethod
    def capture(self, graph: Any, pool: Any) -> ContextManager[Any]:
        """Context manager in which the device records ``graph`` into ``pool``."""

    @abc.abstractmethod
    def new_pool(self) -> Any:
        """A memory-pool handle shared by every graph of one executor."""

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU)."""

    @abc.abstractmethod
    def memory_in_use(self) -> int:
        """Bytes held by the device allocator (or by captured graphs, on CPU)."""

    def memory_info(self) -> tuple[int, int] | None:
        """(free, total) device bytes, where known."""
        return None

    def release_memory(self) -> None:
        """Hand memory of dropped graphs back to the device (the caching allocator's
        ``empty_cache``), so that what they held counts as free again. No-op by default."""

    @contextlib.contextmanager
    def task_group(self, hook: PreReplayHook, tasks: list[GraphTask]) -> Iterator[None]:
        """Capture the enclosed ops as one refreshable task; ``hook`` runs before each replay."""
        tasks.append(GraphTask(hook))
        yield

    def pre_replay(self, tasks: Sequence[GraphTask]) -> None:
        """Run each captured task's hook before a replay (after the attention's ``before_replay``,
        whose refreshed values the hooks read: they take no step)."""
        for task in tasks:
            task.hook()


class CompletedEvent:
    """A device event where work is done when it returns (the CPU): recording and waiting are no-ops."""

    __slots__ = ()

    def record(self) -> None:
        """Nothing to mark: what came before is done."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True


@dataclass
class CapturedGraph:
    """One captured forward or sampler, with the input addresses it was captured on."""

    graph: Any
    input_ptrs: dict[str, int]
    tasks: list[GraphTask] = field(default_factory=list)
    compiled: bool = False
    #: The buffers it reads beyond its inputs, as captured (backends/torch/live_buffers.py).
    buffers: Any = None


def record(api: DeviceGraphAPI, pool: Any, fn: Callable[[], Any], *,
           collect: bool = False) -> tuple[Any, int, list[GraphTask]]:
    """Capture ``fn`` into a new graph of ``api`` in ``pool``: (graph, bytes it added, the
    refreshable tasks it captured). ``collect`` runs the garbage collector first (once per
    pool is enough), which then stays off during the capture: it may free captured tensors.
    A capture that fails raises; the caller should give later graphs a fresh pool."""
    api.synchronize()
    graph = api.new_graph()
    tasks: list[GraphTask] = []
    before = api.memory_in_use()
    if collect and api.collect_before_capture:
        gc.collect()
    with collector_paused(), graph_tasks.capturing(api, tasks), api.capture(graph, pool):
        fn()
    api.synchronize()
    return graph, max(api.memory_in_use() - before, 0), tasks


class GraphPool:
    """One memory pool that every graph captured through it shares, and capture into it.

    The garbage collector runs once, before the first capture. A capture that fails can
    leave the pool marked as recording (torch 2.11's ``capture_end`` raises before it
    releases the pool), so later graphs go to a fresh pool."""

    def __init__(self, api: DeviceGraphAPI) -> None:
        self.api = api
        self.handle = api.new_pool()
        self._collected = False

    def capture(self, fn: Callable[[], Any], warmups: int) -> tuple[Any, int, list[GraphTask]]:
        """Run ``fn`` ``warmups`` times eagerly (lazy initialisation, allocator warm-up), then
        :meth:`record` it, all without autograd."""
        with torch.no_grad():
            for _ in range(warmups):
                fn()
            return self.record(fn)

    def record(self, fn: Callable[[], Any]) -> tuple[Any, int, list[GraphTask]]:
        """:func:`record` ``fn`` into this pool: (graph, bytes it added, refreshable tasks)."""
        try:
            return record(self.api, self.handle, fn, collect=not self._collected)
        except BaseException:
            self.handle = self.api.new_pool()
            raise
        finally:
            self._collected = True


_HOST_SYNC_MARKERS = ("operation not permitted when stream is capturing",
                      "cudaerrorstreamcaptureunsupported", "cudaerrorstreamcaptureinvalidated",
                      "capture_status", "stream is capturing", "cudaerrorstreamcaptureimplicit")


def check_addresses(entry: Any, now: dict[str, int]) -> None:
    """Debug mode (``debug_check_addresses``): every input ``entry`` (a captured graph or a
    piecewise entry, with its ``input_ptrs``) reads is still at its captured address; ``now``
    is the executor's current ``input_ptrs()``."""
    moved = [k for k, p in entry.input_ptrs.items() if now.get(k) != p]
    if moved:
        raise GraphrtError(f"static buffers {moved} moved since capture: a replay would read "
                           "stale memory; never reassign executor buffers, copy into them")


def _root_causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during, outermost first."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def describe_capture_failure(exc: BaseException) -> str:
    """Why a capture failed and what to change, for the eager-fallback warning."""
    chain = _root_causes(exc)
    texts = [(e, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) for e in chain]
    for e, text in texts:
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in text.lower():
            return (f"out of memory while capturing ({text}); lower max_cudagraph_capture_size, "
                    "capture fewer sizes, or reserve less memory for the KV cache")
    for e, text in texts:
        if isinstance(e, GraphCaptureError):
            return f"{text}; make the model capturable or use graph mode PIECEWISE / NONE"
    for e, text in texts:
        if any(marker in text.lower() for marker in _HOST_SYNC_MARKERS):
            return (f"an op the device cannot capture ran in the forward ({text}): a host sync "
                    "(.item(), .cpu(), .tolist(), printing), a data-dependent shape or a "
                    "device-to-host copy; remove it from the forward, or use graph mode "
                    "PIECEWISE (if it is in attention) or NONE")
    e, text = texts[-1]
    return f"{type(e).__name__}: {text}"
