"""KV block allocator: reference-counted blocks 1..N-1. Block 0, the null block, is never handed out.

A block is *used* while some request holds a reference to it, and *free* otherwise. The
prefix cache (:mod:`graphrt.engine.prefix_cache`) may mark blocks *cached*: their KV stays
indexed after the last request lets go. A cached block with no reference still counts as
free -- it is evicted (the cache's least-recently-used unreferenced leaf first) only when
``allocate`` runs short of uncached free blocks. So ``num_free`` is what a request can get,
and ``num_used`` shows leaks (0 once every request has finished), with or without a cache.
"""

from __future__ import annotations

from typing import Callable, Iterable

from graphrt.core import defaults
from graphrt.core.errors import InputError


class BlockAllocator:
    """Hands out, shares and takes back KV cache blocks; O(1) per block."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise InputError("num_blocks", f"needs at least 2 blocks (block {defaults.NULL_BLOCK} is "
                                           f"reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        # Pop from the end: low block ids go out first, which keeps tests readable.
        self._free = [b for b in range(num_blocks - 1, -1, -1) if b != defaults.NULL_BLOCK]
        self._ref = [0] * num_blocks
        self._used: set[int] = set()
        self._cached: set[int] = set()
        self._num_idle_cached = 0      # cached blocks nobody references: free, evictable
        #: Called with ``k`` when ``allocate`` needs ``k`` more uncached blocks; it must
        #: ``uncache`` at least ``k`` unreferenced cached blocks (the prefix cache's eviction).
        self.evictor: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out: never used, returned, or cached and unreferenced."""
        return len(self._free) + self._num_idle_cached

    @property
    def capacity(self) -> int:
        """Blocks a single request could ever hold (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_used(self) -> int:
        """Blocks some request references (0 once every request has finished)."""
        return len(self._used)

    @property
    def num_cached(self) -> int:
        """Blocks the prefix cache indexes, referenced or not."""
        return len(self._cached)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no request references (counted in ``num_free``)."""
        return self._num_idle_cached

    def refcount(self, block: int) -> int:
        """How many holders reference ``block`` (0: free or idle cached)."""
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks (one reference each), or ``None`` (and nothing taken) if fewer
        are free. Evicts unreferenced cached blocks when the uncached ones run short."""
        if n > self.num_free:
            return None
        short = n - len(self._free)
        if short > 0:
            if self.evictor is None:
                raise RuntimeError("cached blocks are counted free but no evictor is set")
            self.evictor(short)
            if len(self._free) < n:
                raise RuntimeError(f"the evictor freed {len(self._free)} of the {n} blocks needed")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._ref[b] = 1
        self._used.update(out)
        return out

    def share(self, blocks: Iterable[int]) -> None:
        """Take one more reference to each block; each must be used or cached (all or none)."""
        blocks = list(blocks)
        bad = [b for b in blocks if not (0 <= b < self.num_blocks) or
               (self._ref[b] == 0 and b not in self._cached)]
        if bad:
            raise ValueError(f"block {bad[0]} is neither allocated nor cached: it cannot be shared")
        for b in blocks:
            if self._ref[b] == 0:
                self._num_idle_cached -= 1
                self._used.add(b)
            self._ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Freeing a block nobody references, the null block,
        or a block twice in one call is a bug and raises, and then frees none of them (a
        half-done free would leak or double-free on the next attempt). A block whose last
        reference goes stays cached if the prefix cache holds it, else returns to the free list."""
        bad = [b for b in blocks if b not in self._used]
        if bad:
            raise ValueError(f"block {bad[0]} is not allocated")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks {blocks} free a block twice: it is not allocated the second time")
        for b in blocks:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._used.remove(b)
                if b in self._cached:
                    self._num_idle_cached += 1
                else:
                    self._free.append(b)

    def mark_cached(self, blocks: Iterable[int]) -> None:
        """The prefix cache now indexes these blocks (each must be referenced, not yet cached)."""
        blocks = list(blocks)
        bad = [b for b in blocks if b not in self._used or b in self._cached]
        if bad:
            raise ValueError(f"block {bad[0]} cannot be cached: it is unreferenced or already cached")
        self._cached.update(blocks)

    def uncache(self, blocks: Iterable[int]) -> None:
        """The prefix cache forgets these blocks; the unreferenced ones become plain free blocks."""
        blocks = list(blocks)
        bad = [b for b in blocks if b not in self._cached]
        if bad:
            raise ValueError(f"block {bad[0]} is not cached")
        for b in blocks:
            self._cached.remove(b)
            if self._ref[b] == 0:
                self._num_idle_cached -= 1
                self._free.append(b)
