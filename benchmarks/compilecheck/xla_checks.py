"""The memory assertions on a compiled XLA program, from what ``compiled.memory_analysis()`` and
the optimised HLO say (plain Python: records in, problems out).

* **Donation**: the forward donates its cache (the KV cache, and a hybrid model's state arrays);
  the executable must alias those bytes (``alias_size_in_bytes >= cache bytes``, per
  device; TPU layouts pad small arrays, so at least them) and its optimised HLO must hold no
  ``copy`` of a whole cache array.
* **Temp bounded by the step, not the cache**: the same program compiled at two cache sizes
  (``num_blocks`` and 4x that) must differ in temp bytes by less than
  :data:`TEMP_GROWTH_FRACTION` of the smaller cache (issue 41's check), and stay within
  :func:`temp_bound`: for the Pallas kernel a fixed :data:`PALLAS_TEMP_BOUND`; for the reference
  kernel, which gathers each token's context in float32, :data:`REFERENCE_FACTOR` x that gather
  (``tokens x context x 2 x kv_heads x head_dim x 4`` bytes, per device) plus the recurrent state
  working set and :data:`TEMP_SLACK`.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

MiB = 1 << 20
#: Temp bytes may grow by less than this fraction of the smaller cache when the cache grows 4x.
TEMP_GROWTH_FRACTION = 0.10
#: The Pallas path's temp bytes at any cache size and bucket: it streams the cache from HBM.
PALLAS_TEMP_BOUND = 32 * MiB
#: The reference kernel's temp bytes: at most this factor of its float32 context gather, plus slack.
REFERENCE_FACTOR = 1.1
TEMP_SLACK = 32 * MiB
#: The cache sizes each forward is compiled at: ``num_blocks`` and this many times it.
CACHE_GROWTH = 4

_COPY = re.compile(r"=\s*[a-z0-9]+\[([0-9,]*)\]\S*\s+copy(?:-start)?\(")


def cache_copies(hlo_text: str, shapes: Iterable[Sequence[int]]) -> list[str]:
    """The instructions of ``hlo_text`` (optimised HLO) that copy a whole array of one of
    ``shapes`` (the per-device cache shapes): a cache copied instead of updated in place."""
    wanted = {tuple(int(d) for d in s) for s in shapes}
    found = []
    for line in hlo_text.splitlines():
        m = _COPY.search(line)
        if m and tuple(int(d) for d in m.group(1).split(",") if d) in wanted:
            found.append(line.strip()[:200])
    return found


def context_gather_bytes(num_tokens: int, context: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of every token's context K and V in float32: what the reference kernel gathers."""
    return num_tokens * context * 2 * kv_heads * head_dim * 4


def temp_bound(record: dict[str, Any]) -> int:
    """The temp bytes ``record``'s program may use (module docstring)."""
    if record["kernel"] == "pallas":
        return PALLAS_TEMP_BOUND
    gather = context_gather_bytes(record["num_tokens"], record["context"], record["kv_heads"], record["head_dim"])
    return int(REFERENCE_FACTOR * gather) + 2 * int(record.get("state_bytes", 0)) + TEMP_SLACK


def check_program(record: dict[str, Any]) -> list[str]:
    """What ``record`` (one compiled forward) breaks: its compile error, donation, copies, temp bound."""
    if record.get("error"):
        return [record["error"]]
    if record.get("role") != "forward":
        return []
    problems = []
    if record["alias_bytes"] < record["cache_bytes"]:
        problems.append(f"donation: {record['alias_bytes']} B aliased, the cache is {record['cache_bytes']} B "
                        f"per device (a cache not donated is copied every step)")
    if record["copies"]:
        problems.append(f"{len(record['copies'])} whole-cache copies in the optimised HLO: {record['copies'][0]}")
    bound = temp_bound(record)
    if record["temp_bytes"] > bound:
        problems.append(f"temp {record['temp_bytes'] / MiB:.1f} MiB > bound {bound / MiB:.1f} MiB")
    return problems


def check_growth(small: dict[str, Any], large: dict[str, Any]) -> list[str]:
    """Temp bytes of one program at two cache sizes: the growth within
    :data:`TEMP_GROWTH_FRACTION` of the smaller cache."""
    if small.get("error") or large.get("error"):
        return []
    growth = large["temp_bytes"] - small["temp_bytes"]
    allowed = TEMP_GROWTH_FRACTION * small["cache_bytes"]
    if growth >= allowed:
        return [f"temp grows with the cache: {small['temp_bytes'] / MiB:.1f} MiB at {small['num_blocks']} blocks, "
                f"{large['temp_bytes'] / MiB:.1f} MiB at {large['num_blocks']} (+{growth / MiB:.1f} MiB >= "
                f"{TEMP_GROWTH_FRACTION:.0%} of the {small['cache_bytes'] / MiB:.1f} MiB cache)"]
    return []


def judge(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` with ``problems`` and ``ok``: each program's own checks, and each forward's
    growth between its smallest and largest cache size (reported on the larger)."""
    out = [dict(r, problems=check_program(r)) for r in records]
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in out:
        if r.get("role") == "forward" and "num_blocks" in r:
            groups.setdefault((r["chip"], r["config"], r["kernel"], r["program"]), []).append(r)
    for group in groups.values():
        group.sort(key=lambda r: r["num_blocks"])
        if len(group) > 1:
            group[-1]["problems"] = group[-1]["problems"] + check_growth(group[0], group[-1])
    for r in out:
        r["ok"] = not r["problems"]
    return out


__all__ = ["CACHE_GROWTH", "PALLAS_TEMP_BOUND", "REFERENCE_FACTOR", "TEMP_GROWTH_FRACTION", "TEMP_SLACK",
           "cache_copies", "check_growth", "check_program", "context_gather_bytes", "judge", "temp_bound"]
