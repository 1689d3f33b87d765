"""KV block allocator: a free list over blocks 1..N-1. Block 0, the null block, is never handed out."""

from __future__ import annotations

from graphrt.core import defaults
from graphrt.core.errors import InputError


class BlockAllocator:
    """Hands out and takes back KV cache blocks; O(1) per block."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise InputError("num_blocks", f"needs at least 2 blocks (block {defaults.NULL_BLOCK} is "
                                           f"reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        # Pop from the end: low block ids go out first, which keeps tests readable.
        self._free = [b for b in range(num_blocks - 1, -1, -1) if b != defaults.NULL_BLOCK]
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Blocks a single request could ever hold (all but the null block)."""
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks, or ``None`` (and nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    @property
    def num_used(self) -> int:
        """Blocks handed out and not yet returned (0 once every request has finished)."""
        return len(self._used)

    def free(self, blocks: list[int]) -> None:
        """Return blocks; freeing a block twice or the null block is a bug and raises, and then
        frees none of them (a half-done free would leak or double-free on the next attempt)."""
        bad = [b for b in blocks if b not in self._used]
        if bad:
            raise ValueError(f"block {bad[0]} is not allocated")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks {blocks} free a block twice: it is not allocated the second time")
        for b in blocks:
            self._used.remove(b)
            self._free.append(b)
