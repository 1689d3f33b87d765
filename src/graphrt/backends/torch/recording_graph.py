"""A CPU "recording graph" with the semantics of a captured device graph.

Capture runs the forward under a ``TorchDispatchMode`` and records each aten op with its
arguments and outputs, Python values baked in as captured; replay re-executes the ops in order
on the same tensors (under ``inference_mode``). What would break a device graph (host syncs,
value-dependent shapes, process-group collectives, nested capture) raises
:class:`GraphCaptureError` at the op. Tensors made during capture live with the graph
(:attr:`RecordingGraph.captured_bytes`, an upper bound of a device's: CPU graphs share no
memory). Limits: aten ops only (not host reads inside opaque custom kernels, ``.cpu()`` copies
or Python side effects); a few CPU kernels check values on the host where CUDA's do not
(``F.one_hot``). Which ops are refused and how each replays:
:mod:`graphrt.backends.torch.recording_ops`."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_leaves

from graphrt.backends.torch.recording_ops import (
    DYNAMIC_SHAPE_OPS,
    HOST_SYNC_OPS,
    TENSOR_HOST_READS,
    ReplayStep,
    capture_violation,
    host_sync_message,
    plan_step,
    storage_key,
)
from graphrt.core.errors import GraphCaptureError

__all__ = [
    "DYNAMIC_SHAPE_OPS",
    "HOST_SYNC_OPS",
    "RecordingGraph",
    "RecordingPool",
    "graph_pool_handle",
    "inline_ops",
    "is_current_stream_capturing",
    "recording_graph",
]


class RecordingPool:
    """A memory-pool handle grouping graphs, like ``torch.cuda.graph_pool_handle()``.

    CPU graphs do not share memory: the pool only records which graphs were captured
    into it and reports their combined private memory.
    """

    def __init__(self) -> None:
        self._graphs: weakref.WeakSet[RecordingGraph] = weakref.WeakSet()

    @property
    def num_graphs(self) -> int:
        """Captured graphs of this pool that are still alive."""
        return len(self._graphs)

    @property
    def captured_bytes(self) -> int:
        """Sum of ``captured_bytes`` over the pool's live graphs."""
        return sum(g.captured_bytes for g in list(self._graphs))

    def __repr__(self) -> str:
        return f"RecordingPool(num_graphs={self.num_graphs}, captured_bytes={self.captured_bytes})"


def graph_pool_handle() -> RecordingPool:
    """A new pool to share between graphs, like ``torch.cuda.graph_pool_handle()``."""
    return RecordingPool()


_THREAD = threading.local()

#: ``torch.cuda.CUDAGraph.capture_begin``'s modes (:meth:`RecordingGraph.capture_begin` checks them).
CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")


def is_current_stream_capturing() -> bool:
    """Whether a :class:`RecordingGraph` capture is running on this thread."""
    return getattr(_THREAD, "graph", None) is not None


@contextlib.contextmanager
def inline_ops(kernels: Mapping[Any, Callable[..., Any]]) -> Iterator[None]:
    """While open, a capture on this thread records each op of ``kernels`` (an ``OpOverload``) by
    running its Python kernel with the recorder active -- the ops it runs, op by op -- instead of
    recording the op whole. An opaque op recorded whole re-runs its Python at replay (reading host
    state then); a device graph holds the kernels that Python launched at capture, with the
    arguments it chose then, and so does a recording of its inner ops (e.g. an engine's attention
    op that looks up per-step metadata in a forward context)."""
    previous = getattr(_THREAD, "inline", None)
    _THREAD.inline = {**(previous or {}), **kernels}
    try:
        yield
    finally:
        _THREAD.inline = previous


_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd


class _DispatchRecorder(TorchDispatchMode):
    """Runs and records every aten op; passes ops through once its capture is abandoned.

    Under ``torch.inference_mode`` composite ops (``linear``, ``reshape``, ``einsum``...)
    reach the mode whole; they are decomposed with the mode active so the recorded ops,
    and the checks on them, are the same as under ``torch.no_grad``.
    """

    def __init__(self, graph: RecordingGraph) -> None:
        super().__init__()
        self.graph: RecordingGraph | None = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.graph is None:
            return func(*args, **kwargs)
        self.graph._check(func, args, kwargs)
        inline = getattr(_THREAD, "inline", None)
        if inline and func in inline:
            with self:
                return inline[func](*args, **kwargs)
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return self.graph._record(func, args, kwargs)


class _HostReadGuard(TorchFunctionMode):
    """Rejects the Tensor methods of ``TENSOR_HOST_READS``; passes everything else through."""

    def __init__(self, graph: RecordingGraph) -> None:
        super().__init__()
        self.graph: RecordingGraph | None = graph

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.graph is not None and func in TENSOR_HOST_READS:
            self.graph._fail(host_sync_message(TENSOR_HOST_READS[func]))
        return func(*args, **kwargs)


class RecordingGraph:
    """A captured sequence of aten ops replayed on the same tensors (CPU CUDAGraph stand-in).

    Capture with :class:`recording_graph` or ``capture_begin()`` / ``capture_end()``, then
    call :meth:`replay`. The public surface mirrors ``torch.cuda.CUDAGraph``.
    """

    def __init__(self) -> None:
        self._records: list[tuple[Any, tuple, dict, Any]] = []
        self._steps: list[ReplayStep] = []
        self._owned: dict[int, torch.Tensor] = {}
        self._captured = False
        self._captured_bytes = 0
        self._pool: RecordingPool | None = None
        self._modes: tuple[_DispatchRecorder, _HostReadGuard] | None = None
        self._abandoned: str | None = None

    @property
    def is_captured(self) -> bool:
        """True after a successful capture and until :meth:`reset`."""
        return self._captured

    @property
    def num_ops(self) -> int:
        """Aten ops recorded during capture (views and metadata ops included)."""
        return len(self._records)

    @property
    def num_replay_steps(self) -> int:
        """Ops that :meth:`replay` executes (views, allocations and metadata ops cost nothing)."""
        return len(self._steps)

    @property
    def captured_bytes(self) -> int:
        """Bytes of the storages allocated during capture that the graph keeps alive."""
        return self._captured_bytes

    def baked_values(self) -> list[tuple[str, tuple[Any, ...]]]:
        """Per recorded op, its name and the host numbers baked into its arguments (ints,
        floats, bools: sizes, dims, scalars, slice bounds). A replay uses exactly these, so a
        number that came from one step's data and not from the graph's key is stale later."""
        return [(str(func), tuple(v for v in tree_leaves((args, kwargs))
                                  if isinstance(v, (bool, int, float))))
                for func, args, kwargs, _ in self._records]

    def pool(self) -> RecordingPool:
        """The pool this graph was captured into, to pass to another graph's capture."""
        if not self._captured or self._pool is None:
            raise GraphCaptureError("RecordingGraph.pool() called without a preceding "
                                    "successful capture")
        return self._pool

    def capture_begin(self, pool: RecordingPool | None = None, capture_error_mode: str = "global") -> None:
        """Start recording every aten op run on this thread until :meth:`capture_end`.

        ``capture_error_mode`` is ``torch.cuda.CUDAGraph``'s ("global", "thread_local" or
        "relaxed"), checked and otherwise without effect: a recording capture sees only its own
        thread's ops, whatever the mode (other threads run as usual)."""
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise GraphCaptureError(f"capture_error_mode must be one of {list(CAPTURE_ERROR_MODES)}, "
                                    f"got {capture_error_mode!r}")
        outer = getattr(_THREAD, "graph", None)
        if outer is not None:
            message = ("nested capture: capture_begin() was called while another "
                       "RecordingGraph is capturing on this thread; device graphs cannot "
                       "be captured inside one another. End the outer capture first.")
            outer._abandon(message)
            raise GraphCaptureError(message)
        if self._captured:
            raise GraphCaptureError("this RecordingGraph already holds a captured graph; "
                                    "call reset() or create a new graph to capture again")
        if self._modes is not None:
            raise GraphCaptureError("this RecordingGraph still has an abandoned capture "
                                    "open; call capture_end() or reset() first")
        if pool is not None and not isinstance(pool, RecordingPool):
            raise GraphCaptureError(f"pool must be a RecordingPool (from graph_pool_handle() "
                                    f"or RecordingGraph.pool()), got {type(pool).__name__}")
        self._pool = pool if pool is not None else RecordingPool()
        self._abandoned = None
        guard, recorder = _HostReadGuard(self), _DispatchRecorder(self)
        guard.__enter__()
        recorder.__enter__()
        self._modes = (recorder, guard)
        _THREAD.graph = self

    def capture_end(self) -> None:
        """Stop recording and make the graph replayable.

        After a capture was abandoned by an error this closes it and raises again, so
        ``finally: graph.capture_end()`` never leaves a silently empty graph behind.
        """
        if self._modes is None:
            raise GraphCaptureError("capture_end() called without capture_begin()")
        self._close_modes()
        if self._abandoned is not None:
            reason = self._abandoned
            self._cancel(reason)
            raise GraphCaptureError(f"capture was abandoned: {reason}")
        _THREAD.graph = None
        self._captured = True
        self._captured_bytes = sum(t.untyped_storage().nbytes() for t in self._owned.values())
        assert self._pool is not None
        self._pool._graphs.add(self)

    def replay(self) -> None:
        """Re-run the captured ops on the captured tensors, under ``torch.inference_mode``."""
        if not self._captured:
            raise GraphCaptureError("replay() called on a RecordingGraph that has not been "
                                    "captured; capture it with recording_graph(graph) or "
                                    "capture_begin()/capture_end() first")
        with torch.inference_mode():
            for fn, args, kwargs in self._steps:
                fn(*args, **kwargs)

    def reset(self) -> None:
        """Drop the captured ops and the memory they keep alive; the graph can capture again."""
        self._cancel("reset() during capture")

    def _record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run one aten op for real, keep it and its outputs, plan its replay."""
        try:
            out = func(*args, **kwargs)
            inputs = {storage_key(t) for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            leaves = tree_leaves(out)
            fresh = [(i, t) for i, t in enumerate(leaves)
                     if isinstance(t, torch.Tensor) and t.numel() > 0
                     and storage_key(t) not in inputs]
            step = plan_step(func, args, kwargs, out, leaves, fresh)
        except BaseException as error:
            self._abandon(f"{func} raised {type(error).__name__}: {error}")
            raise
        self._records.append((func, args, kwargs, out))
        self._owned.update((storage_key(t), t) for _, t in fresh)
        if step is not None:
            self._steps.append(step)
        return out

    def _check(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Abandon the capture and raise if a device graph could not hold this op."""
        violation = capture_violation(func, args, kwargs)
        if violation is not None:
            self._fail(violation)

    def _fail(self, message: str) -> None:
        self._abandon(message)
        raise GraphCaptureError(message)

    def _abandon(self, reason: str) -> None:
        """Give up the running capture: stop recording, free what was recorded.

        The modes stay on the stack (in pass-through) when this runs inside one of their
        handlers; ``capture_end()``, ``reset()`` or the context manager pops them.
        """
        if self._modes is not None:
            for mode in self._modes:
                mode.graph = None
        if getattr(_THREAD, "graph", None) is self:
            _THREAD.graph = None
        self._records, self._steps, self._owned = [], [], {}
        self._abandoned = reason

    def _cancel(self, reason: str) -> None:
        """Abandon any capture, pop its modes and return to the never-captured state."""
        if self._modes is not None:
            self._abandon(reason)
            self._close_modes()
        if self._pool is not None:
            self._pool._graphs.discard(self)
        self._records, self._steps, self._owned = [], [], {}
        self._captured, self._captured_bytes = False, 0
        self._pool, self._abandoned = None, None

    def _close_modes(self) -> None:
        """Pop this capture's two modes, which must be the innermost ones."""
        assert self._modes is not None
        recorder, guard = self._modes
        innermost = _get_current_dispatch_mode(), _get_current_function_mode()
        if innermost != (recorder, guard):
            self._abandon("a mode entered during capture was still active at its end")
            raise GraphCaptureError("cannot end the capture: a TorchDispatchMode or "
                                    "TorchFunctionMode entered during capture is still active; "
                                    "exit it before capture_end()")
        recorder.__exit__(None, None, None)
        guard.__exit__(None, None, None)
        self._modes = None


class recording_graph:
    """``with recording_graph(graph, pool=None):`` captures the block, like ``torch.cuda.graph``.

    If the block raises, the capture is abandoned (the graph stays un-captured) and the
    exception propagates unchanged.
    """

    def __init__(self, graph: RecordingGraph, pool: RecordingPool | None = None,
                 capture_error_mode: str = "global") -> None:
        self.graph = graph
        self.pool = pool
        self.capture_error_mode = capture_error_mode

    def __enter__(self) -> RecordingGraph:
        self.graph.capture_begin(pool=self.pool, capture_error_mode=self.capture_error_mode)
        return self.graph

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.graph.capture_end()
        else:
            self.graph._cancel(f"{exc_type.__name__} raised inside the capture block")
