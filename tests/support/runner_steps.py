"""Driving a :class:`graphrt.ModelRunner` directly: the engine's persistent tables and steps.

``Tables`` holds what an engine keeps between steps -- a token-id table and a block table,
one row per request slot -- with every row owning its own shuffled, non-null blocks, so
any step over any rows is valid. ``Step`` is one call's arguments: the kit's
:class:`graphrt.testing.step.Step` (its slot arithmetic is the kit's), runnable in one call.
``random_steps`` makes a varied, deterministic workload (prefill chunks, decodes, mixed batches, steps above a bucket) with
positions that advance like a real engine's.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from graphrt import GraphConfig
from graphrt.backends.base import SamplingBatch
from graphrt.testing.step import Step as KitStep

#: The engine the runner tests drive: small enough to capture quickly, with steps above the
#: largest bucket (32 tokens) and chunked prefills (model length 64, block size 4).
LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64, block_size=4)
CONFIG = GraphConfig.create(**LIMITS)
#: Vocabulary of tests/support/hf_models.py's tiny models.
VOCAB = 128


class Tables:
    """Token ids and blocks per request slot; row r owns ``width`` distinct blocks (never 0)."""

    def __init__(self, config, vocab_size: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        rows, width = config.max_num_seqs, config.max_blocks_per_req
        self.block_size = config.block_size
        self.token_ids = rng.integers(0, vocab_size, size=(rows, config.max_model_len), dtype=np.int32)
        blocks = rng.permutation(rows * width).astype(np.int32) + 1
        self.block_table = blocks.reshape(rows, width)

    @property
    def num_kv_blocks(self) -> int:
        """Blocks a runner needs for every row's blocks (plus the null block 0)."""
        return int(self.block_table.size) + 1

    def step(self, rows, computed, scheduled, seed: int = 0) -> "Step":
        """Requests at table ``rows`` with ``computed`` tokens in the KV cache and ``scheduled``
        new ones (``seed`` seeds the KV contents the kit's properties plant)."""
        return Step(self.token_ids, self.block_table, np.asarray(rows, dtype=np.int32),
                    np.asarray(computed, dtype=np.int32), np.asarray(scheduled, dtype=np.int32),
                    self.block_size, seed)


class Step(KitStep):
    """The kit's step over :class:`Tables`, runnable in one call."""

    def run(self, runner, sampling: SamplingBatch | None = None):
        """``runner.execute`` of this step; the sampled tokens copied (the runner's array is
        a view of a buffer the next step overwrites on CPU backends)."""
        tokens = runner.execute(**self.kwargs(), sampling=sampling)
        return None if tokens is None else tokens.copy()


def random_steps(tables: Tables, config, num_steps: int, seed: int) -> Iterator[Step]:
    """A varied workload: each step picks some rows and gives each a decode token or a chunk.

    A row's computed length grows like a request's; a row that reaches ``max_model_len``
    starts over (a new request in that slot). Token totals range from 1 to
    ``max_num_batched_tokens``.
    """
    rng = np.random.default_rng(seed)
    computed = np.zeros(config.max_num_seqs, dtype=np.int64)
    for _ in range(num_steps):
        budget = int(rng.integers(1, config.max_num_batched_tokens + 1))
        num_reqs = int(rng.integers(1, min(config.max_num_seqs, budget) + 1))
        rows = rng.permutation(config.max_num_seqs)[:num_reqs]
        room = config.max_model_len - computed[rows]
        reset = room < 1
        computed[rows[reset]] = 0
        room = config.max_model_len - computed[rows]
        decode = rng.random() < 0.4
        sched = np.ones(num_reqs, dtype=np.int64)
        if not decode:
            extra = budget - num_reqs
            for i in rng.permutation(num_reqs):
                add = int(rng.integers(0, extra + 1)) if extra else 0
                add = min(add, int(room[i]) - 1)
                sched[i] += add
                extra -= add
        step = tables.step(rows, computed[rows], sched)
        computed[rows] += sched
        yield step


def greedy(n: int) -> SamplingBatch:
    return SamplingBatch(np.zeros(n, np.float32), np.full(n, 1 << 30, np.int64),
                         np.ones(n, np.float32), [None] * n, list(range(n)))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits (NaNs compare equal to themselves)."""
    t = t.contiguous()
    if t.is_floating_point():
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))
