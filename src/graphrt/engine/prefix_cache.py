"""Prefix cache: a radix tree over full KV blocks (SGLang's RadixCache with page = block_size).

Each node is one full block (key: its ``block_size`` token ids as bytes; value: the KV block id),
so eviction is block-granular, least-recently-used unreferenced leaf first. Shared KV stays
correct because only full computed blocks are inserted (never written again), a match leaves at
least the last token to compute, a duplicate block is swapped for the tree's (so a referenced
node's ancestors are referenced too), and references are the :class:`BlockAllocator`'s.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from graphrt.core import defaults
from graphrt.core.errors import ConfigError
from graphrt.engine.block_allocator import BlockAllocator

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Node:
    """One cached block: the tokens it holds (``key``), its block id and its children."""

    key: bytes
    block: int
    parent: Node | None
    depth: int                                  # blocks from the root (the root is 0)
    children: dict[bytes, Node] = field(default_factory=dict)
    last_access: int = 0


@dataclass
class Match:
    """The longest cached full-block prefix: its blocks, and the node of the last one."""

    blocks: list[int]
    node: Node

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


def block_keys(token_ids: Sequence[int], block_size: int, num_blocks: int) -> list[bytes]:
    """The key of each of the first ``num_blocks`` full blocks of ``token_ids``."""
    if num_blocks <= 0:
        return []
    raw = np.asarray(token_ids[:num_blocks * block_size], dtype=np.int64).tobytes()
    width = 8 * block_size
    return [raw[i * width:(i + 1) * width] for i in range(num_blocks)]


class PrefixCache:
    """Radix tree of cached KV blocks; sharing and eviction through the allocator's references."""

    def __init__(self, block_size: int, allocator: BlockAllocator) -> None:
        self.block_size = block_size
        self.allocator = allocator
        self.root = Node(b"", -1, None, 0)
        self._clock = itertools.count(1)
        self.epoch = 0                  # bumped by reset: nodes of an older epoch are gone
        self.num_nodes = 0
        self.num_evicted = 0            # blocks evicted under pressure, ever
        allocator.evictor = self.evict

    # ---- lookup ---------------------------------------------------------------------
    def max_match_blocks(self, num_tokens: int) -> int:
        """Most blocks a request of ``num_tokens`` tokens may take (its last token is computed)."""
        return max(num_tokens - 1, 0) // self.block_size

    def match_prefix(self, token_ids: Sequence[int], *, touch: bool = True) -> Match:
        """The longest cached full-block prefix of ``token_ids``, capped by
        :meth:`max_match_blocks`; ``touch`` marks the path as used now (for LRU eviction)."""
        limit = self.max_match_blocks(len(token_ids))
        return self.match_keys(block_keys(token_ids, self.block_size, limit), touch=touch)

    def match_keys(self, keys: Sequence[bytes], *, touch: bool = True) -> Match:
        """``match_prefix`` for a caller that holds the block keys (``block_keys``) and has
        already capped them with ``max_match_blocks``."""
        node, blocks = self.root, []
        now = next(self._clock) if touch else 0
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            node = child
            blocks.append(node.block)
            if touch:
                node.last_access = now
        return Match(blocks, node)

    # ---- insertion ------------------------------------------------------------------
    def insert(self, node: Node, keys: Sequence[bytes], blocks: Sequence[int]) -> tuple[Node, list[int]]:
        """Extend the tree below ``node`` with full computed ``blocks`` keyed by ``keys``.

        Where the tree already holds a key, its block stays. Returns the last node and the tree's
        block per key: the caller swaps its duplicates for those."""
        now = next(self._clock)
        path: list[int] = []
        new: list[int] = []
        for key, block in zip(keys, blocks):
            child = node.children.get(key)
            if child is None:
                child = Node(key, block, node, node.depth + 1)
                node.children[key] = child
                new.append(block)
            child.last_access = now
            path.append(child.block)
            node = child
        if new:
            self.allocator.mark_cached(new)
            self.num_nodes += len(new)
        return node, path

    # ---- eviction -------------------------------------------------------------------
    def _evictable(self, node: Node) -> bool:
        return node is not self.root and not node.children and self.allocator.refcount(node.block) == 0

    def evict(self, num_blocks: int) -> int:
        """Evict at least ``num_blocks`` unreferenced leaves, least recently used first (a parent
        left childless and unreferenced becomes a candidate). Returns how many were evicted."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self._evictable(n)]
        heapq.heapify(heap)
        evicted: list[int] = []
        while heap and len(evicted) < num_blocks:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            evicted.append(node.block)
            if self._evictable(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.allocator.uncache(evicted)
        self.num_nodes -= len(evicted)
        self.num_evicted += len(evicted)
        return len(evicted)

    def reset(self) -> None:
        """Forget every cached block; blocks requests still reference stay theirs."""
        blocks = [n.block for n in self._nodes()]
        self.root = Node(b"", -1, None, 0)
        self.epoch += 1
        self.num_nodes = 0
        if blocks:
            self.allocator.uncache(blocks)

    def _nodes(self) -> list[Node]:
        """Every node below the root."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out



#: Why graphrt's engine refuses prefix caching for a model with recurrent state.
HYBRID_PREFIX_REASON = (
    "the model keeps recurrent state (Mamba2 / gated delta-net layers: docs/hybrid.md), one state per "
    "request for its latest position only; a cached KV prefix holds no recurrent state at its end, so a "
    "prefix hit could not resume those layers (it would start them from zeros: wrong outputs). "
    "Checkpointing the states at block boundaries (vLLM's 'align' mode) is not implemented")


def prefix_caching(requested: bool | None, has_state: bool) -> bool:
    """Whether the engine caches prefixes: ``requested`` (None: the default, on) unless the model
    keeps recurrent state -- then off, said once at INFO, and asking for it is a ConfigError
    naming ``enable_prefix_caching`` and the reason (:data:`HYBRID_PREFIX_REASON`)."""
    if not has_state:
        return defaults.DEFAULT_ENABLE_PREFIX_CACHING if requested is None else requested
    if requested:
        raise ConfigError(f"enable_prefix_caching: not available for this model: {HYBRID_PREFIX_REASON}")
    if requested is None:
        logger.info("graphrt: prefix caching is off: %s", HYBRID_PREFIX_REASON)
    return False

__all__ = ["HYBRID_PREFIX_REASON", "Match", "Node", "PrefixCache", "block_keys", "prefix_caching"]
