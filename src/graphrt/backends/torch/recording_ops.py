"""What the recording graph knows about aten ops: which a capture refuses, and how each recorded
op is replayed.

:func:`capture_violation` names the ops and argument patterns that would break a device graph
(host syncs, dynamic shapes, process-group collectives) with what to use instead;
:func:`plan_step` decides once per op whether a replay skips it (views), re-runs it in place,
through its ``.out`` overload, recomputes and copies it (RNG ops, so each replay draws afresh),
or re-issues a functional collective."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.utils._pytree import tree_leaves

from graphrt.core.errors import GraphCaptureError

__all__ = [
    "DYNAMIC_SHAPE_OPS",
    "HOST_SYNC_OPS",
    "ReplayStep",
    "TENSOR_HOST_READS",
    "capture_violation",
    "host_sync_message",
    "plan_step",
    "storage_key",
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


def host_sync_message(what: str) -> str:
    """The capture error for ``what``, an operation that reads a device value on the host."""
    return (f"{what} reads a device value on the host during capture; a captured graph "
            "would bake in the value seen at capture time (and a device graph cannot "
            "contain a host sync at all). Keep the value on the device (tensor ops, "
            "torch.where, masks) or read it before capture begins.")


def _dynamic_shape_message(what: str, fix: str) -> str:
    return (f"{what} produces an output whose shape depends on tensor values; a captured "
            f"graph fixes every shape at capture time. Use a fixed-size alternative "
            f"({fix}) or move it out of the captured region.")


def capture_violation(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Return why ``func`` called with these arguments cannot be captured, or None."""
    packet = func.overloadpacket
    if packet in HOST_SYNC_OPS:
        return host_sync_message(f"{HOST_SYNC_OPS[packet]} ({func})")
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


TENSOR_HOST_READS: dict[Any, str] = {
    torch.Tensor.tolist: "`.tolist()` (aten._local_scalar_dense per element)",
    torch.Tensor.numpy: "`.numpy()`",
    torch.Tensor.__array__: "`numpy.asarray(t)` (Tensor.__array__)",
    torch.Tensor.__dlpack__: "`numpy.from_dlpack(t)` / another framework's from_dlpack (Tensor.__dlpack__)",
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
(``tolist``, ``numpy``, ``__dlpack__`` and printing hand over or copy memory directly), caught
at the Python level. (``torch.utils.dlpack.to_dlpack(t)`` is a C function no mode sees; what
reads its capsule on the host is the caller's.)"""


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
