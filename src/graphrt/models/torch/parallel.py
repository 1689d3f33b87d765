"""Tensor-parallel building blocks for graphrt's torch reference models.

Each layer holds its rank's weight slice and takes ``(tp_rank, tp_size, group)``. Collectives are
functional (recorded by the CPU graph) and waited; with ``tp_size == 1`` each layer is its ``nn``
counterpart. ``weight_loader`` reads only this rank's slice; ``nn.Module.to_empty`` drops it:
call ``bind_weight_loaders()`` again. See docs/distributed.md, "Tensor-parallel layers".
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from graphrt.core.errors import ConfigError, InputError


class TPGroup(NamedTuple):
    """This rank's place in a tensor-parallel group, in the layers' argument order
    (``*tp`` fills ``tp_rank, tp_size, group``); the default is unsharded."""

    rank: int = 0
    size: int = 1
    group: Any = None


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, or a :class:`ConfigError` naming ``what`` when it does not divide."""
    if denominator <= 0 or numerator % denominator:
        raise ConfigError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def kv_head_shard(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``(first KV head, number of KV heads)`` that rank ``tp_rank`` of ``tp_size`` holds.

    At least as many KV heads as ranks: split evenly. Fewer: each rank holds one head, replicated
    on ``tp_size // num_kv_heads`` consecutive ranks (4 ranks, 2 heads -> 0, 0, 1, 1). Query heads
    are always split evenly, so a rank's query heads are those reading its KV head(s).
    """
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank {tp_rank} is not in [0, {tp_size})")
    if num_kv_heads >= tp_size:
        per_rank = divide(num_kv_heads, tp_size, "num_key_value_heads")
        return tp_rank * per_rank, per_rank
    if tp_size % num_kv_heads:
        raise ConfigError(f"tensor_parallel_size ({tp_size}) is neither a divisor nor a multiple of "
                          f"num_key_value_heads ({num_kv_heads})")
    return tp_rank // kv_head_replicas(num_kv_heads, tp_size), 1


def kv_head_replicas(num_kv_heads: int, tp_size: int) -> int:
    """How many ranks hold each KV head: 1 when split, ``tp_size // num_kv_heads`` when replicated."""
    return max(1, tp_size // num_kv_heads)


def _shape(loaded: Any) -> tuple[int, ...]:
    """Shape of a tensor or a safetensors slice."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def _take(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """``loaded[..., start:start + size, ...]`` along ``dim`` (a tensor or a safetensors slice,
    which then reads only those bytes)."""
    index = (slice(None),) * dim + (slice(start, start + size),)
    return loaded[index]


def _copy(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise InputError("loaded_weight", f"{what} has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded)


class _Parallel(nn.Module):
    """Rank, size and group shared by the parallel layers, and the waited collectives."""

    def _init_parallel(self, tp_rank: int, tp_size: int, group: Any) -> None:
        if not 0 <= tp_rank < tp_size:
            raise ConfigError(f"tp_rank {tp_rank} is not in [0, {tp_size})")
        self.tp_rank, self.tp_size, self.group = tp_rank, tp_size, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp_size == 1 else all_reduce(x, self.group)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp_size == 1 else all_gather_last(x, self.group)

    def bind_weight_loaders(self) -> None:
        """Attach ``weight_loader`` to this module's own parameters (again after ``to_empty``)."""
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: Any = None) -> None:
        """Copy this rank's slice of ``loaded_weight`` into ``param``; every layer defines it."""
        raise NotImplementedError(f"{type(self).__name__} defines no weight_loader")


def waited(t: torch.Tensor) -> torch.Tensor:
    """The result of a functional collective once it has completed."""
    import torch.distributed._functional_collectives as fc
    return t.wait() if isinstance(t, fc.AsyncCollectiveTensor) else t


def _world(group: Any) -> Any:
    import torch.distributed as dist
    return group if group is not None else dist.group.WORLD


def all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum over ``group`` (None: the default group), waited (a functional collective: recorded
    by CPU graphs)."""
    import torch.distributed._functional_collectives as fc
    return waited(fc.all_reduce(x, "sum", _world(group)))


def all_gather_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``x`` concatenated along the last dim, in rank order, waited."""
    import torch.distributed._functional_collectives as fc
    gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor    # the latter: older torch
    return waited(gather(x.contiguous(), x.dim() - 1, _world(group)))


class ColumnParallelLinear(_Parallel):
    """``y = x W^T + b`` with ``W``'s output rows (and ``b``) split evenly over the ranks:
    ``[T, in] -> [T, out / tp_size]``, or ``[T, out]`` gathered when ``gather_output``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int = 0, tp_size: int = 1,
                 group: Any = None, gather_output: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self._init_parallel(tp_rank, tp_size, group)
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = divide(out_features, tp_size, "output features")
        self.gather_output = gather_output
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(self.out_per_rank, dtype=dtype)) if bias else None
        self.bind_weight_loaders()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return self.all_gather_last(y) if self.gather_output else y

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: Any = None) -> None:
        """Copy rows ``[rank * out / tp, (rank + 1) * out / tp)`` of the full weight (or bias)."""
        if _shape(loaded_weight)[0] != self.out_features:
            raise InputError("loaded_weight", f"has {_shape(loaded_weight)[0]} rows, expected {self.out_features}")
        size = self.out_per_rank
        _copy(param, _take(loaded_weight, 0, self.tp_rank * size, size), "the rank's slice")


class _FusedColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel linear whose local rows stack several checkpoint projections' slices;
    ``shard_offsets``: shard id -> (local start, local rows, checkpoint start, checkpoint rows)."""

    shard_offsets: dict[Any, tuple[int, int, int, int]]

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: Any = None) -> None:
        """Copy this rank's slice of checkpoint projection ``shard_id`` into its local rows."""
        if shard_id not in self.shard_offsets:
            raise InputError("shard_id", f"{shard_id!r} is not one of {list(self.shard_offsets)}")
        start, size, src_start, full = self.shard_offsets[shard_id]
        if _shape(loaded_weight)[0] != full:
            raise InputError("loaded_weight", f"shard {shard_id!r} has {_shape(loaded_weight)[0]} rows, "
                                              f"expected {full}")
        _copy(param.narrow(0, start, size), _take(loaded_weight, 0, src_start, size), f"shard {shard_id!r}")


class MergedColumnParallelLinear(_FusedColumnParallelLinear):
    """Column-parallel fusion of equal-width projections (gate/up: shard ids ``0``, ``1``):
    the local output is ``[gate slice, up slice]``, so ``chunk(2, -1)`` splits it."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp_rank: int = 0,
                 tp_size: int = 1, group: Any = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(in_features, sum(output_sizes), bias, tp_rank, tp_size, group, dtype=dtype)
        self.shard_offsets = {}
        start = 0
        for shard_id, full in enumerate(output_sizes):
            size = divide(full, tp_size, f"projection {shard_id} width")
            self.shard_offsets[shard_id] = (start, size, tp_rank * size, full)
            start += size


class QKVParallelLinear(_FusedColumnParallelLinear):
    """Fused q/k/v with heads split over the ranks (shard ids ``"q"``, ``"k"``, ``"v"``; KV heads
    per :func:`kv_head_shard`). Local output: ``[q, k, v]`` with the per-rank head counts."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool, tp_rank: int = 0, tp_size: int = 1, group: Any = None,
                 dtype: torch.dtype = torch.float32) -> None:
        num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        kv_start, num_kv_heads = kv_head_shard(total_num_kv_heads, tp_rank, tp_size)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        # The base class splits ``out_features`` evenly; give it the local width times tp_size
        # (with replicated KV heads that is more than the checkpoint's q + k + v rows).
        super().__init__(hidden_size, (q_size + 2 * kv_size) * tp_size, bias, tp_rank, tp_size, group,
                         dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = q_size, kv_size
        q_full, kv_full = total_num_heads * head_dim, total_num_kv_heads * head_dim
        self.shard_offsets = {"q": (0, q_size, tp_rank * q_size, q_full),
                              "k": (q_size, kv_size, kv_start * head_dim, kv_full),
                              "v": (q_size + kv_size, kv_size, kv_start * head_dim, kv_full)}


class RowParallelLinear(_Parallel):
    """``y = all_reduce(x_r W_r^T) + b`` with ``W``'s input columns split evenly: takes the
    rank's slice ``[T, in / tp_size]`` (``input_is_parallel``, a column-parallel output) or
    the full ``[T, in]`` and returns the full ``[T, out]`` on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int = 0, tp_size: int = 1,
                 group: Any = None, input_is_parallel: bool = True, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self._init_parallel(tp_rank, tp_size, group)
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = divide(in_features, tp_size, "input features")
        self.input_is_parallel = input_is_parallel
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        self.bind_weight_loaders()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = x.narrow(-1, self.tp_rank * self.in_per_rank, self.in_per_rank)
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)          # exactly nn.Linear
        y = self.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: Any = None) -> None:
        """Copy columns ``[rank * in / tp, (rank + 1) * in / tp)`` of the weight; the bias whole."""
        if param.dim() == 1:
            _copy(param, loaded_weight[:], "the bias")
            return
        if _shape(loaded_weight)[-1] != self.in_features:
            raise InputError("loaded_weight", f"has {_shape(loaded_weight)[-1]} columns, "
                                              f"expected {self.in_features}")
        size = self.in_per_rank
        _copy(param, _take(loaded_weight, 1, self.tp_rank * size, size), "the rank's slice")


class VocabParallelEmbedding(_Parallel):
    """Embedding with vocabulary rows split: rank r owns ``[r * per_rank, (r + 1) * per_rank)``,
    ``per_rank = ceil(vocab / tp_size)``; each rank embeds its ids, zeros elsewhere
    (``torch.where``), then an all-reduce sums."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1,
                 group: Any = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self._init_parallel(tp_rank, tp_size, group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.per_rank = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, embedding_dim, dtype=dtype))
        self.bind_weight_loaders()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        owned = (local >= 0) & (local < self.per_rank)
        rows = F.embedding(torch.where(owned, local, 0), self.weight)
        return self.all_reduce(torch.where(owned.unsqueeze(-1), rows, 0))

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: Any = None) -> None:
        """Copy this rank's vocabulary rows; rows past the vocabulary are zeroed."""
        if _shape(loaded_weight)[0] != self.num_embeddings:
            raise InputError("loaded_weight", f"has {_shape(loaded_weight)[0]} rows, expected "
                                              f"{self.num_embeddings} (the vocabulary)")
        size = max(0, min(self.per_rank, self.num_embeddings - self.vocab_start))
        with torch.no_grad():
            param[size:].zero_()
        if size:
            _copy(param[:size], _take(loaded_weight, 0, self.vocab_start, size), "the rank's rows")


class ParallelLMHead(VocabParallelEmbedding):
    """LM head over :class:`VocabParallelEmbedding`'s split (tie by sharing ``weight``): rank
    logits are all-gathered and padding columns cut; every rank returns float32 ``[N, vocab]``."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = self.all_gather_last(F.linear(hidden, self.weight))
        return logits[..., :self.num_embeddings].float()


__all__ = ["ColumnParallelLinear", "MergedColumnParallelLinear", "ParallelLMHead", "QKVParallelLinear",
           "RowParallelLinear", "TPGroup", "VocabParallelEmbedding", "divide", "kv_head_replicas", "kv_head_shard", "waited"]
