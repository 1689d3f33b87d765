"""A CPU "recording graph" with the semantics of a captured device graph.

``torch.cuda.CUDAGraph`` records the kernels a forward launches and replays them on
the same memory; Python never runs again. :class:`RecordingGraph` reproduces that on
a machine without an accelerator, so every graph-correctness test can run in CI:

* Capture runs the forward for real under a ``TorchDispatchMode`` and records each
  aten op with its arguments and outputs. Python values (ints, shapes, a tensor's
  value read before capture) are baked in exactly as captured.
* Replay re-executes the recorded ops, in order, on the same tensors. Values copied
  into the input tensors before a replay give new results in the same output tensors.
  Ops that return new tensors write into the captured outputs (through their ``.out``
  overload when one exists and reproduces the op bit for bit, else compute and
  ``copy_``); views and metadata-only ops are not re-run, since the captured view
  already aliases its base; in-place ops re-run on their captured arguments; RNG ops
  draw fresh numbers on every replay, as CUDA's philox offset does. Functional collectives
  (``torch.distributed._functional_collectives``, over gloo on a CPU) are re-issued and waited
  for on every replay, so a captured all-reduce reads each replay's new values; collectives
  through the process-group API (``dist.all_reduce``) are refused at capture.
* What would break a device graph raises :class:`GraphCaptureError` at the op that
  does it, and the capture is abandoned: host syncs (``.item()``, ``.tolist()``,
  ``int(t)``, ``bool(t)``, ``x[t]`` with a 0-dim ``t``, printing, ``.numpy()``,
  ``torch.equal``; see :data:`HOST_SYNC_OPS`), ops whose output shape depends on tensor
  values (:data:`DYNAMIC_SHAPE_OPS`, plus boolean-mask indexing, ``repeat_interleave``
  without ``output_size`` and ``one_hot`` without ``num_classes``), and nested capture.
  With the context manager the modes are popped at once; with bare ``capture_begin()``
  they stay installed, passing ops through, until ``capture_end()`` (which then raises
  again) or ``reset()``: a mode cannot remove itself from inside its own handler.

Tensors created during capture stay alive as long as the graph (graph-private memory,
reported by :attr:`RecordingGraph.captured_bytes`). A :class:`RecordingPool` groups
graphs the way a CUDA mempool handle does, but CPU graphs never share memory: every
graph keeps its own intermediates, so ``captured_bytes`` is an upper bound on what the
same graph would hold on a device, where the caching allocator reuses freed blocks.

Replay runs under ``torch.inference_mode`` (no autograd bookkeeping), whichever of
``no_grad``, ``inference_mode`` or plain grad mode the capture used; under
``inference_mode`` composite ops are decomposed so the recording is the same as under
``no_grad``.

Limits: the recorder sees aten ops only. A host read done inside an opaque custom op
kernel, a device-to-host ``.cpu()`` copy (every tensor here is already on the CPU) and
Python side effects during capture cannot be detected. A few CPU kernels validate their
input on the host where the CUDA kernel does not (``F.one_hot(x, n)`` under ``no_grad``
checks its range with ``.item()``), so they are rejected here although a CUDA graph
could hold them.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_leaves

from graphrt.core.errors import GraphCaptureError

__all__ = [
    "DYNAMIC_SHAPE_OPS",
    "HOST_SYNC_OPS",
    "RecordingGraph",
    "RecordingPool",
    "graph_pool_handle",
    "is_current_stream_capturing",
    "recording_graph",
]

_aten = torch.ops.aten


def _packets(entries: Iterable[tuple[str, Any]]) -> dict[Any, Any]:
    """Key ``entries`` by the aten op packets of those names that exist in this torch build."""
    found: dict[Any, Any] = {}
    for name, value in entries:
        try:
            found[getattr(_aten, name)] = value
        except (AttributeError, RuntimeError):
            continue
    return found


HOST_SYNC_OPS: dict[Any, str] = _packets([
    ("_local_scalar_dense",
     "`.item()` / `int(t)` / `float(t)` / `bool(t)` / indexing with a 0-dim tensor"),
    ("is_nonzero", "`bool(t)` / `if t:`"),
    ("equal", "`torch.equal`"),
    ("allclose", "`torch.allclose`"),
    ("_linalg_check_errors", "linalg error checking (use the `torch.linalg.*_ex` variant)"),
])
"""Ops that read a device value on the host; always an error during capture."""

_SORT_INSTEAD = "a sort plus a fixed-size, padded result"
DYNAMIC_SHAPE_OPS: dict[Any, tuple[str, str]] = _packets([
    ("nonzero", ("`torch.nonzero` / `torch.where(cond)` / `torch.argwhere`",
                 "torch.nonzero_static(x, size=N), or keep the mask and use torch.where")),
    ("masked_select", ("`torch.masked_select`", "torch.where(mask, x, fill) or masked_fill")),
    ("_unique", ("`torch.unique`", _SORT_INSTEAD)),
    ("_unique2", ("`torch.unique`", _SORT_INSTEAD)),
    ("unique_dim", ("`torch.unique(dim=...)`", _SORT_INSTEAD)),
    ("unique_consecutive", ("`torch.unique_consecutive`", _SORT_INSTEAD)),
    ("unique_dim_consecutive", ("`torch.unique_consecutive(dim=...)`", _SORT_INSTEAD)),
    ("bincount", ("`torch.bincount`", "torch.zeros(N).scatter_add_(...) with a fixed length N")),
])
"""Ops whose output shape always depends on tensor values: (what, fixed-size alternative)."""



def _packet_set(*names: str) -> frozenset[Any]:
    """The aten op packets of these names that exist in this torch build."""
    return frozenset(_packets((name, None) for name in names))


_BOOL_INDEX_OPS = _packet_set("index", "_unsafe_index")
_BOOL_INDEX_PUT_OPS = _packet_set("index_put", "index_put_", "_index_put_impl_",
                                  "_unsafe_index_put")
_EMPTY_OPS = _packet_set("empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                         "new_empty_strided", "_resize_output_")
_FACTORY_KWARGS = frozenset({"dtype", "layout", "device", "pin_memory"})


def _host_sync_message(what: str) -> str:
    return (f"{what} reads a device value on the host during capture; a captured graph "
            "would bake in the value seen at capture time (and a device graph cannot "
            "contain a host sync at all). Keep the value on the device (tensor ops, "
            "torch.where, masks) or read it before capture begins.")


def _dynamic_shape_message(what: str, fix: str) -> str:
    return (f"{what} produces an output whose shape depends on tensor values; a captured "
            f"graph fixes every shape at capture time. Use a fixed-size alternative "
            f"({fix}) or move it out of the captured region.")


def _capture_violation(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Return why ``func`` called with these arguments cannot be captured, or None."""
    packet = func.overloadpacket
    if packet in HOST_SYNC_OPS:
        return _host_sync_message(f"{HOST_SYNC_OPS[packet]} ({func})")
    if packet in DYNAMIC_SHAPE_OPS:
        what, fix = DYNAMIC_SHAPE_OPS[packet]
        return _dynamic_shape_message(f"{what} ({func})", fix)
    if packet in _BOOL_INDEX_OPS or packet in _BOOL_INDEX_PUT_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in indices or ()):
            if packet in _BOOL_INDEX_OPS:
                return _dynamic_shape_message(f"boolean-mask indexing `x[mask]` ({func})",
                                              "torch.where(mask, x, y), masked_fill or "
                                              "torch.nonzero_static")
            return _dynamic_shape_message(f"boolean-mask assignment `x[mask] = v` ({func})",
                                          "masked_fill_, masked_scatter_ or torch.where")
    if packet is _aten.repeat_interleave and func is not _aten.repeat_interleave.self_int:
        if kwargs.get("output_size") is None:
            return _dynamic_shape_message(
                f"`torch.repeat_interleave` with tensor repeats and no output_size ({func})",
                "pass output_size=N")
    if func.namespace == "c10d":
        return (f"a torch.distributed collective through the process-group API ({func}) inside a "
                "capture: its Work handle is waited on outside the graph, so a replay would use a "
                "result it never waited for. Use torch.distributed._functional_collectives "
                "(all_reduce(x, 'sum', group) etc.), which graphs record and replay")
    if packet is _aten.one_hot:
        num_classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        if num_classes < 0:
            return _dynamic_shape_message(f"`F.one_hot` without num_classes ({func})",
                                          "pass num_classes")
    return None


_TENSOR_HOST_READS: dict[Any, str] = {
    torch.Tensor.tolist: "`.tolist()` (aten._local_scalar_dense per element)",
    torch.Tensor.numpy: "`.numpy()`",
    torch.Tensor.__array__: "`numpy.asarray(t)` (Tensor.__array__)",
    torch.Tensor.__repr__: "printing a tensor (Tensor.__repr__)",
    torch.Tensor.__format__: "formatting a tensor (Tensor.__format__)",
    torch.Tensor.item: "`.item()` (aten._local_scalar_dense)",
    torch.Tensor.__bool__: "`bool(t)` / `if t:` (aten._local_scalar_dense)",
    torch.Tensor.__int__: "`int(t)` (aten._local_scalar_dense)",
    torch.Tensor.__float__: "`float(t)` (aten._local_scalar_dense)",
    torch.Tensor.__index__: "using a tensor as an index (aten._local_scalar_dense)",
    torch.Tensor.__complex__: "`complex(t)` (aten._local_scalar_dense)",
}
"""Tensor methods that read values on the host without always reaching an aten op
(``tolist``, ``numpy`` and printing copy memory directly), caught at the Python level."""


def _storage_key(t: torch.Tensor) -> int:
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


_Step = tuple[Callable[..., Any], tuple, dict]


def _copy_step(func: Any, args: tuple, kwargs: dict,
               fresh: list[tuple[int, torch.Tensor]]) -> _Step:
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
                     fresh: list[tuple[int, torch.Tensor]]) -> _Step:
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
              leaves: list[Any]) -> _Step | None:
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


def _plan(func: Any, args: tuple, kwargs: dict, out: Any, leaves: list[Any],
          fresh: list[tuple[int, torch.Tensor]]) -> _Step | None:
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
    distinct = len({_storage_key(t) for _, t in fresh}) == len(fresh)
    step = _out_step(func, args, kwargs, out, leaves) if all_fresh and distinct else None
    return step if step is not None else _copy_step(func, args, kwargs, fresh)


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


def is_current_stream_capturing() -> bool:
    """Whether a :class:`RecordingGraph` capture is running on this thread."""
    return getattr(_THREAD, "graph", None) is not None


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
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return self.graph._record(func, args, kwargs)


class _HostReadGuard(TorchFunctionMode):
    """Rejects the Tensor methods of ``_TENSOR_HOST_READS``; passes everything else through."""

    def __init__(self, graph: RecordingGraph) -> None:
        super().__init__()
        self.graph: RecordingGraph | None = graph

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.graph is not None and func in _TENSOR_HOST_READS:
            self.graph._fail(_host_sync_message(_TENSOR_HOST_READS[func]))
        return func(*args, **kwargs)


class RecordingGraph:
    """A captured sequence of aten ops replayed on the same tensors (CPU CUDAGraph stand-in).

    Capture with :class:`recording_graph` or ``capture_begin()`` / ``capture_end()``, then
    call :meth:`replay`. The public surface mirrors ``torch.cuda.CUDAGraph``.
    """

    def __init__(self) -> None:
        self._records: list[tuple[Any, tuple, dict, Any]] = []
        self._steps: list[_Step] = []
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

    def capture_begin(self, pool: RecordingPool | None = None) -> None:
        """Start recording every aten op run on this thread until :meth:`capture_end`."""
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
            inputs = {_storage_key(t) for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            leaves = tree_leaves(out)
            fresh = [(i, t) for i, t in enumerate(leaves)
                     if isinstance(t, torch.Tensor) and t.numel() > 0
                     and _storage_key(t) not in inputs]
            step = _plan(func, args, kwargs, out, leaves, fresh)
        except BaseException as error:
            self._abandon(f"{func} raised {type(error).__name__}: {error}")
            raise
        self._records.append((func, args, kwargs, out))
        self._owned.update((_storage_key(t), t) for _, t in fresh)
        if step is not None:
            self._steps.append(step)
        return out

    def _check(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Abandon the capture and raise if a device graph could not hold this op."""
        violation = _capture_violation(func, args, kwargs)
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

    def __init__(self, graph: RecordingGraph, pool: RecordingPool | None = None) -> None:
        self.graph = graph
        self.pool = pool

    def __enter__(self) -> RecordingGraph:
        self.graph.capture_begin(pool=self.pool)
        return self.graph

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.graph.capture_end()
        else:
            self.graph._cancel(f"{exc_type.__name__} raised inside the capture block")
