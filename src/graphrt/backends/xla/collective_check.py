"""The collectives of a compiled XLA program, and the check that every ``jax.distributed``
process compiled the same ones for a key.

A jitted forward sharded over a mesh gets its all-reduces from XLA's SPMD partitioner, so they
appear in the compiled program's HLO (``compiled.as_text()``: ``all-reduce``, ``all-gather``,
...), not in the lowered StableHLO, which holds only explicit ones (``shard_map``'s
``stablehlo.all_reduce``); :func:`program_collectives` reads both. Across processes
(multi-controller JAX) each process compiles its own copy of the program: one whose collectives
differ from another's (a process running other code, other flags, another jax) would hang or
mix unrelated buffers. :func:`check_processes_agree` all-gathers each process's signature
(``process_allgather``: every process calls it, so it cannot hang on a difference) and, when
they differ, the lists, and raises the same :class:`~graphrt.core.errors.CollectiveMismatchError`
on every process. The XLA executor is single-controller today (docs/distributed.md): this is
the check a multi-controller build runs after each compile."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from graphrt.core.collectives import Collective, mismatch_error, signature

#: HLO collective op names (async ones as ``...-start``; their ``-done`` halves are not counted).
HLO_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                   "collective-broadcast", "ragged-all-to-all")
_HLO = re.compile(r"=\s*(?P<shape>\S.*?)\s+(?P<op>" + "|".join(HLO_COLLECTIVES) + r")(?:-start)?\(")
_GROUPS = re.compile(r"replica_groups=(.*?)(?:, [a-z_]+=|$)")
_STABLEHLO = re.compile(r'"?stablehlo\.(?P<op>all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute'
                        r'|collective_broadcast)"?.*?:\s*\((?P<shape>[^)]*)\)')


def program_collectives(text: str) -> list[Collective]:
    """The collectives of an HLO or StableHLO program's text, in program order: op, result
    shape text (StableHLO: operand types), replica groups (source locations and channel ids left out: they differ between
    processes that run the same collectives)."""
    found: list[Collective] = []
    for line in text.splitlines():
        match = _HLO.search(line)
        if match is not None:
            groups = _GROUPS.search(line)
            found.append((match.group("op"), (match.group("shape"), groups.group(1) if groups else ""), (), ()))
            continue
        match = _STABLEHLO.search(line)
        if match is not None:
            found.append((match.group("op").replace("_", "-"), (match.group("shape").strip(), ""), (), ()))
    return found


def check_processes_agree(program: Any, key: Any) -> list[Collective]:
    """Every ``jax.distributed`` process's collectives for ``key`` (``program``: a compiled or
    lowered jax program, or its text) must be the same; the list, or
    :class:`~graphrt.core.errors.CollectiveMismatchError` on every process. One process: no check."""
    import jax
    from jax.experimental import multihost_utils

    text = program if isinstance(program, str) else program.as_text()
    entries = program_collectives(text)
    if jax.process_count() == 1:
        return entries
    sig = signature(entries)
    mine = np.asarray([sig >> 31, sig & 0x7FFFFFFF, len(entries)], dtype=np.int32)
    rows = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), 3)
    if (rows == rows[0]).all():
        return entries
    encoded = np.frombuffer(repr(entries).encode("utf-8"), dtype=np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([encoded.size], dtype=np.int32))).reshape(-1)
    padded = np.zeros(int(sizes.max()), dtype=np.uint8)
    padded[:encoded.size] = encoded
    texts = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    lists = [_parse(bytes(row[:size]).decode("utf-8")) for row, size in zip(texts, sizes)]
    raise mismatch_error(key, lists)


def _parse(text: str) -> list[Collective]:
    """A list :func:`repr` wrote (literals only)."""
    import ast

    return [tuple(item) for item in ast.literal_eval(text)]   # type: ignore[misc]


__all__ = ["HLO_COLLECTIVES", "check_processes_agree", "program_collectives"]
