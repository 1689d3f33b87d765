"""A rank's collective signature for one captured key, and the check that every rank's agrees.

While a tensor-parallel rank builds a key, :class:`CollectiveLog` (a ``TorchDispatchMode`` under
the capture) writes down each functional collective the forward issues (op, scalar arguments
such as the reduce op and group, input shapes and dtypes). Every rank then all-gathers a 62-bit
hash of its list with the build's status (:class:`~graphrt.backends.torch.parallel.tp_protocol.Agreement`);
when the hashes differ, every rank gathers the lists themselves and raises the same
:class:`~graphrt.core.errors.CollectiveMismatchError`, naming each rank's first differing
collective. The key is never replayed.

``dry=True`` (the CPU recording graph, whose capture and warm-up runs execute the ops): a
collective is not sent during the build; it returns a local stand-in of the right shape (its
input where shapes match, zeros otherwise) and the recorded replay step re-issues the real
one. So ranks whose collectives differ cannot meet mismatched peers -- and hang -- before the
check has run. A device graph (CUDA, ACL) must capture the real collective kernels, so there
the log only records (``dry=False``); docs/distributed.md says what is proven where."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from graphrt.core.collectives import Collective, describe, first_differences, mismatch_error, signature
from graphrt.core.errors import CollectiveMismatchError

_NAMESPACE = "_c10d_functional"
_WAIT = "wait_tensor"


class CollectiveLog(TorchDispatchMode):
    """Log every functional collective dispatched while active; with ``dry`` answer each with a
    local stand-in instead of sending it (see the module doc)."""

    def __init__(self, dry: bool = False) -> None:
        super().__init__()
        self.dry = dry
        self.entries: list[Collective] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace != _NAMESPACE:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name == _WAIT:
            return args[0] if self.dry else func(*args, **kwargs)
        leaves = tree_leaves((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        scalars = tuple(str(v) for v in leaves if isinstance(v, (str, int, float, bool)))
        self.entries.append((name, scalars, tuple(tuple(t.shape) for t in tensors),
                             tuple(str(t.dtype).removeprefix("torch.") for t in tensors)))
        if not self.dry:
            return func(*args, **kwargs)
        return _stand_in(func, args, kwargs)

    def signature(self) -> int:
        """The 62-bit hash of the list (fits an int64 agreement word on every rank)."""
        return signature(self.entries)


def _stand_in(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func``'s outputs computed locally: shapes from its meta kernel, values the input's
    where a shape matches (an all-reduce as if this rank were alone), else zeros."""
    meta = tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, (args, kwargs))
    shapes = func(*meta[0], **meta[1])
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    device = inputs[0].device if inputs else torch.device("cpu")

    def local(m: Any) -> Any:
        if not isinstance(m, torch.Tensor):
            return m
        same = next((t for t in inputs if t.shape == m.shape and t.dtype == m.dtype), None)
        return same.clone() if same is not None else torch.zeros(m.shape, dtype=m.dtype, device=device)
    return tree_map(local, shapes)


def agreed(rows: Sequence[Sequence[int]]) -> bool:
    """Whether every rank's agreement row (status, signature, count) has the same collectives;
    rows of ranks whose build failed are not compared (that key runs nowhere as a graph)."""
    if any(row[0] for row in rows):
        return True
    return len({(row[1], row[2]) for row in rows}) == 1


def gather_mismatch(group: Any, size: int, key: Any, entries: list[Collective]) -> CollectiveMismatchError:
    """Every rank's list, gathered on ``group`` (every rank calls this once the signatures
    disagreed), as the error each rank raises."""
    import torch.distributed as dist

    lists: list[Any] = [None] * size
    dist.all_gather_object(lists, entries, group=group)
    return mismatch_error(key, lists)


__all__ = ["Collective", "CollectiveLog", "agreed", "gather_mismatch", "describe", "first_differences", "mismatch_error", "signature"]
