"""A CPU "recording graph" with the semantics of a captured device graph.

Capture runs the forward under a ``TorchDispatchMode`` and records each aten op with its
arguments and outputs, Python values baked in as captured; replay re-executes the ops in order
on the same tensors (under ``inference_mode``). What would break a device graph (host syncs,
value-dependent shapes, process-group collectives, nested capture) raises
:class:`GraphCaptureError` at the op. Tensors made during capture live with the graph
(:attr:`RecordingGraph.captured_bytes`, an upper bound of a device's: CPU graphs share no
memory). Limits: aten ops only (not host reads inside opaque custom kernels, ``.cpu()`` copies
or Python side effects); a few CPU kernels check values on the host where CUDA's do not
(``F.one_hot``). Which ops are refused: :mod:`graphrt.backends.torch.recording_ops`; how
each recorded op replays is decided once, at capture (:func:`plan_step`, below): a replay
re-runs only the planned steps, all of them in this module."""

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
    capture_violation,
    host_sync_message,
    packet_set,
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

# ---- replay planning: what replaying each recorded op means, decided once at capture ----------

_EMPTY_OPS = packet_set("empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                        "new_empty_strided", "_resize_output_")
_FACTORY_KWARGS = frozenset({"dtype", "layout", "device", "pin_memory"})


def storage_key(t: torch.Tensor) -> int:
    """The storage behind ``t``, shared by its views: its data pointer, else ``id(t)``."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(t)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two tensors hold the same bits (NaNs and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    if as_int is not None and a.dtype != torch.bool and (a.is_floating_point() or a.is_complex()):
        return torch.equal(a.view(as_int), b.view(as_int))
    return torch.equal(a, b)


_OUT_CACHE: dict[Any, tuple[Any, tuple[str, ...], frozenset[str]] | None] = {}


def _out_overload(func: Any) -> tuple[Any, tuple[str, ...], frozenset[str]] | None:
    """Find the ``.out`` overload taking the same arguments as ``func`` plus its outputs.

    Returns (overload, names of the out arguments in return order, factory kwargs the
    out overload drops because ``out`` fixes them), or None. Cached per overload.
    """
    if func in _OUT_CACHE:
        return _OUT_CACHE[func]
    found = None
    base = [(a.name, str(a.type), a.kwarg_only) for a in func._schema.arguments]
    packet = func.overloadpacket
    for overload_name in packet.overloads():
        candidate = getattr(packet, overload_name)
        arguments = candidate._schema.arguments
        outs = tuple(a.name for a in arguments if a.is_out)
        if not outs or len(outs) != len(func._schema.returns):
            continue
        rest = [(a.name, str(a.type), a.kwarg_only) for a in arguments if not a.is_out]
        rest_names = {r[0] for r in rest}
        dropped = frozenset(b[0] for b in base
                            if b[2] and b[0] in _FACTORY_KWARGS and b[0] not in rest_names)
        if [b for b in base if b[0] not in dropped] == rest:
            found = (candidate, outs, dropped)
            break
    _OUT_CACHE[func] = found
    return found


def _fast(op: Any) -> Callable[..., Any]:
    """The C++ callable behind an OpOverload: skips one Python frame per replayed op."""
    return getattr(op, "_op", op)


#: One replay step: a callable and the arguments it is called with.
ReplayStep = tuple[Callable[..., Any], tuple, dict]


def _copy_step(func: Any, args: tuple, kwargs: dict,
               fresh: list[tuple[int, torch.Tensor]]) -> ReplayStep:
    """A replay step that recomputes ``func`` and copies its new outputs into the captured ones."""
    op = _fast(func)
    single = len(func._schema.returns) == 1 and str(func._schema.returns[0].type) == "Tensor"

    def check(src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.shape != dst.shape:
            raise GraphCaptureError(
                f"{func} returned shape {tuple(src.shape)} on replay but {tuple(dst.shape)} "
                "at capture: its output shape depends on tensor values, which a graph "
                "cannot follow")

    if single:
        dst = fresh[0][1]

        def run_single() -> None:
            src = op(*args, **kwargs)
            check(src, dst)
            dst.copy_(src)
        return run_single, (), {}

    def run_many() -> None:
        leaves = tree_leaves(op(*args, **kwargs))
        for index, captured in fresh:
            check(leaves[index], captured)
            captured.copy_(leaves[index])
    return run_many, (), {}


def _collective_step(func: Any, args: tuple, kwargs: dict, leaves: list[Any],
                     fresh: list[tuple[int, torch.Tensor]]) -> ReplayStep:
    """A functional collective (``torch.distributed._functional_collectives``): re-issue it,
    wait for its result (the recorded ``wait_tensor`` waited on the capture's, which replay
    does not re-run), then copy the new outputs into the captured ones."""
    op, wait = _fast(func), _fast(torch.ops._c10d_functional.wait_tensor.default)
    tensors = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]

    def run() -> None:
        result = tree_leaves(op(*args, **kwargs))
        for i in tensors:
            wait(result[i])
        for index, captured in fresh:
            captured.copy_(result[index])
    return run, (), {}


def _out_step(func: Any, args: tuple, kwargs: dict, out: Any,
              leaves: list[Any]) -> ReplayStep | None:
    """A replay step writing through ``func``'s ``.out`` overload, if it reproduces ``func``.

    The overload is tried once on scratch tensors laid out like the captured outputs;
    it is used only if it neither raises, reallocates nor differs by a single bit.
    """
    found = _out_overload(func)
    if found is None:
        return None
    overload, out_names, dropped = found
    values = list(out) if len(out_names) > 1 else [out]
    base_kwargs = {k: v for k, v in kwargs.items() if k not in dropped}
    scratch_values = []
    for value in values:
        tensors = value if isinstance(value, (list, tuple)) else [value]
        scratch = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                   for t in tensors]
        scratch_values.append(scratch if isinstance(value, (list, tuple)) else scratch[0])
    scratch_leaves = tree_leaves(scratch_values)
    layout = [(t.data_ptr(), t.shape, t.stride()) for t in scratch_leaves]
    try:
        overload(*args, **base_kwargs, **dict(zip(out_names, scratch_values)))
    except Exception:
        return None
    if layout != [(t.data_ptr(), t.shape, t.stride()) for t in scratch_leaves]:
        return None
    if not all(_bits_equal(s, t) for s, t in zip(scratch_leaves, leaves)):
        return None
    return _fast(overload), args, {**base_kwargs, **dict(zip(out_names, values))}


def plan_step(func: Any, args: tuple, kwargs: dict, out: Any, leaves: list[Any],
              fresh: list[tuple[int, torch.Tensor]]) -> ReplayStep | None:
    """Decide once, at capture, what replaying this op means; None when nothing.

    ``leaves`` are the op's flattened outputs and ``fresh`` the (index, tensor) pairs of
    those that do not share storage with any input (newly allocated by the op). An op
    without fresh outputs (a view, ``func.is_view`` or not) is not re-run; a "maybe
    view" op such as ``reshape`` that had to copy at capture is re-run like any other.
    """
    if func.overloadpacket in _EMPTY_OPS or torch.Tag.inplace_view in func.tags:
        return None
    if func.namespace == "_c10d_functional" and func.overloadpacket.__name__ != "wait_tensor":
        return _collective_step(func, args, kwargs, leaves, fresh)
    mutates = any(a.alias_info is not None and a.alias_info.is_write
                  for a in func._schema.arguments)
    if mutates:
        return _copy_step(func, args, kwargs, fresh) if fresh else (_fast(func), args, kwargs)
    if not func._schema.returns:
        return _fast(func), args, kwargs
    if not fresh:
        return None
    if torch.Tag.nondeterministic_seeded in func.tags:
        return _copy_step(func, args, kwargs, fresh)
    all_fresh = len(fresh) == len(leaves)
    distinct = len({storage_key(t) for _, t in fresh}) == len(fresh)
    step = _out_step(func, args, kwargs, out, leaves) if all_fresh and distinct else None
    return step if step is not None else _copy_step(func, args, kwargs, fresh)
