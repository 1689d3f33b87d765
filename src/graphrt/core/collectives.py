"""A collective sequence as data, framework-neutral: its hash (a signature every rank can
all-gather in one int64 word), its text, and the error that names where ranks' sequences part.

The torch backends log each functional collective a capture issues
(:mod:`graphrt.backends.torch.parallel.collective_log`); the XLA backend reads them from the
compiled program's HLO (:mod:`graphrt.backends.xla.collective_check`). docs/distributed.md,
"Collective signatures"."""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

from graphrt.core.errors import CollectiveMismatchError

#: One collective: op name, its scalar arguments (reduce op, group size, group name; XLA: its
#: replica groups), the shapes and dtypes of its tensors.
Collective = tuple[str, tuple[str, ...], tuple[tuple[int, ...], ...], tuple[str, ...]]


def signature(entries: Sequence[Collective]) -> int:
    """A stable 62-bit hash of a collective list (equal lists, equal hashes, on any process)."""
    digest = hashlib.blake2b(repr(list(entries)).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def describe(entry: Collective) -> str:
    """One collective as text: ``all_reduce(sum, 0) [4x64 float32]``."""
    name, scalars, shapes, dtypes = entry
    tensors = ", ".join(f"{'x'.join(map(str, s)) or 'scalar'} {d}" for s, d in zip(shapes, dtypes))
    return f"{name}({', '.join(scalars)})" + (f" [{tensors}]" if tensors else "")


def first_differences(lists: Sequence[Sequence[Collective]]) -> tuple[int, dict[int, str]]:
    """The index of the first collective where the ranks' lists differ, and per rank its
    collective there (``"none (N in all)"`` where its list is shorter)."""
    longest = max(len(entries) for entries in lists)
    index = next((i for i in range(longest)
                  if len({entries[i] if i < len(entries) else None for entries in lists}) > 1), longest)
    first = {rank: describe(entries[index]) if index < len(entries) else f"none ({len(entries)} in all)"
             for rank, entries in enumerate(lists)}
    return index, first


def mismatch_error(key: Any, lists: Sequence[Sequence[Collective]]) -> CollectiveMismatchError:
    """The error every rank raises when the ranks' collective lists for ``key`` differ."""
    index, first = first_differences(lists)
    ranks = "; ".join(f"rank {rank}: {text}" for rank, text in first.items())
    counts = ", ".join(str(len(entries)) for entries in lists)
    return CollectiveMismatchError(
        f"the tensor-parallel ranks captured different collectives for {key} (collectives per rank: {counts}); "
        f"first difference at collective #{index}: {ranks}. The key is not replayed and the engine stops: "
        "every rank must run the same model code and configuration", key=key, first=first)


__all__ = ["Collective", "describe", "first_differences", "mismatch_error", "signature"]
