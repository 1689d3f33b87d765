"""The aten ops a capture refuses: :func:`capture_violation` names the ops and argument patterns
that would break a device graph (host syncs, dynamic shapes, process-group collectives) with
what to use instead. The recording graph (:mod:`graphrt.backends.torch.recording_graph`, which
also plans how each recorded op replays) and ``graphrt lint`` (``capture/capture_lint.py``) ask
here."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from graphrt.core.errors import GraphCaptureError

__all__ = [
    "DYNAMIC_SHAPE_OPS",
    "HOST_SYNC_OPS",
    "TENSOR_HOST_READS",
    "capture_violation",
    "host_sync_message",
    "packet_set",
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


def packet_set(*names: str) -> frozenset[Any]:
    """The aten op packets of these names that exist in this torch build."""
    return frozenset(_packets((name, None) for name in names))


_BOOL_INDEX_OPS = packet_set("index", "_unsafe_index")
_BOOL_INDEX_PUT_OPS = packet_set("index_put", "index_put_", "_index_put_impl_",
                                  "_unsafe_index_put")


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
