"""Bucket policies: which shapes get a captured graph or a compiled executable.

A step of ``n`` items (tokens or requests) runs under the smallest bucket ``>= n``
and is padded up to it; above the largest bucket a graph backend runs eagerly and an
XLA backend refuses (its largest bucket must cover the scheduler's limits).
"""

from __future__ import annotations

import bisect
from typing import Iterable, Mapping, Sequence

import numpy as np

from graphrt.core.errors import ConfigError

#: vLLM's default capture sizes: [1, 2, 4] then every 8 below 256, then every 16.
VLLM_SMALL_SIZES = (1, 2, 4)
VLLM_STEP_BELOW_256 = 8
VLLM_STEP_FROM_256 = 16
VLLM_STEP_SWITCH = 256
#: SGLang's default cuda-graph batch sizes: [1, 2, 4, 8, 12], every 8 up to 256, every 16
#: up to 512, every 32 beyond.
SGLANG_SMALL_SIZES = (1, 2, 4, 8, 12)
SGLANG_SCHEDULE = ((16, 256, 8), (272, 511, 16), (512, None, 32))  # (start, stop inclusive, step)
#: Largest histogram size BucketPolicy.fit solves exactly (O(n^2 * k) dynamic programme).
FIT_MAX_DISTINCT_SIZES = 4096


class BucketPolicy:
    """A sorted, deduplicated list of positive sizes."""

    __slots__ = ("_sizes",)

    def __init__(self, sizes: Iterable[int]) -> None:
        values = sorted({int(s) for s in sizes})
        if not values:
            raise ConfigError("a BucketPolicy needs at least one size")
        if values[0] <= 0:
            raise ConfigError(f"bucket sizes must be positive, got {values[0]}")
        self._sizes: tuple[int, ...] = tuple(values)

    @property
    def sizes(self) -> tuple[int, ...]:
        return self._sizes

    @property
    def max_size(self) -> int:
        return self._sizes[-1]

    @property
    def min_size(self) -> int:
        return self._sizes[0]

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self):
        return iter(self._sizes)

    def __contains__(self, n: object) -> bool:
        return n in self._sizes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BucketPolicy) and other._sizes == self._sizes

    def __hash__(self) -> int:
        return hash(self._sizes)

    def __repr__(self) -> str:
        shown = list(self._sizes) if len(self._sizes) <= 12 else (
            f"[{', '.join(map(str, self._sizes[:6]))}, ..., {', '.join(map(str, self._sizes[-3:]))}]")
        return f"BucketPolicy({shown}, n={len(self._sizes)})"

    def bucket_for(self, n: int) -> int | None:
        """Smallest size ``>= n``; ``None`` above the largest (run eagerly or refuse)."""
        i = bisect.bisect_left(self._sizes, n)
        return self._sizes[i] if i < len(self._sizes) else None

    def padded_total(self, counts: Mapping[int, float]) -> float:
        """Total padded items for a histogram ``{size: count}``; sizes above the largest run unpadded."""
        total = 0
        for n, c in counts.items():
            b = self.bucket_for(n)
            total += (n if b is None else b) * c
        return total

    def limit_to(self, n: int) -> "BucketPolicy":
        """Down-sample evenly to at most ``n`` sizes, keeping the smallest and the largest."""
        if n < 1:
            raise ConfigError(f"limit_to needs n >= 1, got {n}")
        if n >= len(self._sizes):
            return self
        if n == 1:
            return BucketPolicy([self.max_size])
        idx = np.unique(np.round(np.linspace(0, len(self._sizes) - 1, n)).astype(int))
        return BucketPolicy(self._sizes[i] for i in idx)

    def capped(self, max_size: int) -> "BucketPolicy":
        """The sizes ``<= max_size``, with ``max_size`` itself always included."""
        return BucketPolicy([s for s in self._sizes if s < max_size] + [max_size])

    @classmethod
    def vllm_default(cls, max_size: int) -> "BucketPolicy":
        """vLLM's capture sizes: [1, 2, 4], every 8 below 256, every 16 from 256; max included."""
        _check_max(max_size)
        sizes = [s for s in VLLM_SMALL_SIZES if s <= max_size]
        sizes += range(VLLM_STEP_BELOW_256, min(max_size, VLLM_STEP_SWITCH - 1) + 1,
                       VLLM_STEP_BELOW_256)
        sizes += range(VLLM_STEP_SWITCH, max_size + 1, VLLM_STEP_FROM_256)
        return cls(sizes + [max_size])

    @classmethod
    def sglang_default(cls, max_size: int) -> "BucketPolicy":
        """SGLang's cuda-graph batch sizes: [1, 2, 4, 8, 12], every 8 to 256, 16 to 512, 32 beyond."""
        _check_max(max_size)
        sizes = [s for s in SGLANG_SMALL_SIZES if s <= max_size]
        for start, stop, step in SGLANG_SCHEDULE:
            end = max_size if stop is None else min(stop, max_size)
            sizes += range(start, end + 1, step)
        return cls(sizes + [max_size])

    @classmethod
    def powers_of_two(cls, max_size: int, min_size: int = 1) -> "BucketPolicy":
        """``min_size``, doubling, until ``max_size`` (always included)."""
        _check_max(max_size)
        if min_size < 1 or min_size > max_size:
            raise ConfigError(f"powers_of_two needs 1 <= min_size <= max_size, got {min_size}, {max_size}")
        sizes, s = [], min_size
        while s < max_size:
            sizes.append(s)
            s *= 2
        return cls(sizes + [max_size])

    @classmethod
    def power_then_linear(cls, max_size: int, gap: int) -> "BucketPolicy":
        """Powers of two up to ``gap``, then every ``gap`` up to ``max_size`` (always included)."""
        _check_max(max_size)
        if gap < 1:
            raise ConfigError(f"power_then_linear needs gap >= 1, got {gap}")
        sizes, s = [], 1
        while s < min(gap, max_size):
            sizes.append(s)
            s *= 2
        sizes += range(gap, max_size + 1, gap)
        return cls(sizes + [max_size])

    @classmethod
    def fit(cls, counts: Mapping[int, int], max_buckets: int) -> "BucketPolicy":
        """The at most ``max_buckets`` sizes that minimise total padded items over ``counts``.

        ``counts`` is a histogram ``{observed size: how many steps}``. The largest observed
        size is always a bucket (so every observed step is covered) and every bucket is an
        observed size (an optimal bucket never needs to be anything else). Solved exactly by
        dynamic programming over the sorted distinct sizes: O(n^2 * k) for n sizes, k buckets.
        """
        if max_buckets < 1:
            raise ConfigError(f"fit needs max_buckets >= 1, got {max_buckets}")
        items = sorted((int(s), int(c)) for s, c in counts.items() if int(c) > 0)
        if not items:
            raise ConfigError("fit needs at least one observed size with a positive count")
        if items[0][0] <= 0:
            raise ConfigError(f"observed sizes must be positive, got {items[0][0]}")
        if len(items) > FIT_MAX_DISTINCT_SIZES:
            raise ConfigError(f"fit solves at most {FIT_MAX_DISTINCT_SIZES} distinct sizes "
                              f"exactly, got {len(items)}; bin the histogram first")
        return cls(_fit_sizes(items, max_buckets))


def _check_max(max_size: int) -> None:
    if int(max_size) < 1:
        raise ConfigError(f"max_size must be >= 1, got {max_size}")


def _fit_sizes(items: Sequence[tuple[int, int]], max_buckets: int) -> list[int]:
    """Optimal partition of sorted (size, count) items into <= k contiguous groups.

    A group i..j is served by bucket ``size[j]`` at cost ``size[j] * sum(count[i..j])``.
    ``best_m[j] = min(best_{m-1}[j], min_i best_{m-1}[i-1] + cost(i, j))``, vectorised over (i, j).
    """
    sizes = np.array([s for s, _ in items], dtype=np.int64)
    weights = np.array([c for _, c in items], dtype=np.int64)
    n = len(sizes)
    k = min(max_buckets, n)
    prefix = np.concatenate(([0], np.cumsum(weights)))
    inf = np.iinfo(np.int64).max // 4
    starts = np.arange(n)[:, None]                                    # i
    ends = np.arange(n)[None, :]                                      # j
    group_cost = sizes[None, :] * (prefix[1:][None, :] - prefix[:-1][:, None])
    valid = (starts >= 1) & (starts <= ends)
    best = sizes * prefix[1:]                                         # one group: items 0..j
    choice = np.zeros((k, n), dtype=np.int64)                         # start of the last group
    for m in range(1, k):
        prev = np.concatenate(([inf], best[:-1]))                     # best_{m-1}[i-1]
        costs = np.where(valid, prev[:, None] + group_cost, inf)
        arg = np.argmin(costs, axis=0)
        split = costs[arg, np.arange(n)]
        better = split < best
        choice[m] = np.where(better, arg, choice[m - 1])
        best = np.where(better, split, best)
    out, j, m = [], n - 1, k - 1
    while j >= 0:
        out.append(int(sizes[j]))
        j, m = int(choice[m][j]) - 1, m - 1
    return sorted(out)
