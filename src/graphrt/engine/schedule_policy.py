"""Schedule policies: the order in which waiting requests are offered to admission (SGLang's policies).

Cache-agnostic ``fcfs``, ``lof`` (largest ``max_tokens`` first) and ``random`` (seeded); cache-aware
``lpm`` (longest prefix match first; a request sharing an uncached prefix with one ahead of it is
held back a step, so the prefix is computed once -- SGLang sorts such requests last, graphrt leaves
them out of this step; ``fcfs`` above ``LPM_MAX_WAITING`` waiting requests) and ``dfs-weight``
(depth first over the tree, heaviest subtree first, deeper matches before their ancestors'), which
serve ``fcfs`` without the prefix cache. Every order is a stable permutation of the queue (``lpm``
without the requests it holds back). docs/api.md, "Prefix cache and schedule policies".
"""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

from graphrt.core import defaults
from graphrt.core.errors import InputError
from graphrt.engine.prefix_cache import Match, Node, PrefixCache

#: "lpm" sorts by prefix match only while at most this many requests wait (SGLang: the
#: matching costs a tree walk per request per step), and serves first-come-first-served above.
LPM_MAX_WAITING = 128
#: "lpm" in-batch prefix sharing (SGLang's thresholds, in tokens): a waiting request that
#: matches at most CHECK tokens of the cache but at least DEPRIORITIZE tokens of a request
#: ahead of it in the queue waits, so that it finds the prefix cached one step later.
IN_BATCH_PREFIX_CHECK_THRESHOLD = 32
IN_BATCH_PREFIX_DEPRIORITIZE_THRESHOLD = 32

POLICIES = ("fcfs", "lof", "random", "lpm", "dfs-weight")
CACHE_AWARE = frozenset({"lpm", "dfs-weight"})

#: ``match(request) -> Match``: a request's cache match, without touching the LRU order.
Matcher = Callable[[Any], Match]
#: ``keys(request, num_blocks) -> list[bytes]``: the keys of a request's first full blocks.
Keys = Callable[[Any, int], list[bytes]]


def check_policy(name: str) -> None:
    """Refuse a name that is not one of :data:`POLICIES` (InputError naming ``schedule_policy``)."""
    if name not in POLICIES:
        raise InputError("schedule_policy", f"unknown policy {name!r}; expected one of {list(POLICIES)}")


class SchedulePolicy:
    """Orders a waiting queue by one of :data:`POLICIES`."""

    def __init__(self, name: str, prefix_cache: PrefixCache | None, *,
                 seed: int | None = defaults.SCHEDULE_RANDOM_SEED) -> None:
        check_policy(name)
        self.name = name
        #: What runs: a cache-aware policy without a prefix cache serves fcfs.
        self.active = "fcfs" if name in CACHE_AWARE and prefix_cache is None else name
        self.prefix_cache = prefix_cache
        self._rng = random.Random(seed)

    def order(self, waiting: Sequence[Any], match: Matcher, keys: Keys) -> list[Any]:
        """The requests of ``waiting`` admission should try this step, in order."""
        policy = self.active
        if policy == "lpm" and len(waiting) > LPM_MAX_WAITING:
            policy = "fcfs"
        if policy == "fcfs":
            return list(waiting)
        if policy == "lof":
            return sorted(waiting, key=lambda r: -r.params.max_tokens)
        if policy == "random":
            out = list(waiting)
            self._rng.shuffle(out)
            return out
        matches = [match(r) for r in waiting]
        if policy == "lpm":
            return self._longest_prefix(waiting, matches, keys)
        return self._dfs_weight(waiting, matches)

    def _longest_prefix(self, waiting: Sequence[Any], matches: list[Match], keys: Keys) -> list[Any]:
        bs = self.prefix_cache.block_size
        check = IN_BATCH_PREFIX_CHECK_THRESHOLD
        demote = IN_BATCH_PREFIX_DEPRIORITIZE_THRESHOLD
        trie: dict[bytes, dict] = {}          # the prefixes of the requests seen so far
        later: set[int] = set()
        for i, (req, m) in enumerate(zip(waiting, matches)):
            if m.num_blocks * bs > check:
                continue
            ks = keys(req, self.prefix_cache.max_match_blocks(req.num_tokens))
            level, depth = trie, 0
            while depth < len(ks) and ks[depth] in level:
                level = level[ks[depth]]
                depth += 1
            if depth * bs >= demote and depth > 0:
                later.add(i)
                continue
            for key in ks[depth:]:
                level = level.setdefault(key, {})
        ranked = sorted((i for i in range(len(waiting)) if i not in later), key=lambda i: -matches[i].num_blocks)
        return [waiting[i] for i in ranked]

    def _dfs_weight(self, waiting: Sequence[Any], matches: list[Match]) -> list[Any]:
        at: dict[Node, list[Any]] = {}
        weight: dict[Node, int] = {}
        first: dict[Node, int] = {}
        for i, (req, m) in enumerate(zip(waiting, matches)):
            at.setdefault(m.node, []).append(req)
            node: Node | None = m.node
            while node is not None:
                weight[node] = weight.get(node, 0) + 1
                first.setdefault(node, i)
                node = node.parent
        root = self.prefix_cache.root
        out: list[Any] = []
        stack: list[tuple[Node, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                out.extend(at.get(node, ()))
                continue
            stack.append((node, True))
            kids = [c for c in node.children.values() if c in weight]
            # Pushed lightest first: the heaviest subtree (then the earliest arrival) pops first.
            kids.sort(key=lambda c: (weight[c], -first[c]))
            stack.extend((c, False) for c in kids)
        return out


__all__ = ["CACHE_AWARE", "POLICIES", "SchedulePolicy", "check_policy"]
