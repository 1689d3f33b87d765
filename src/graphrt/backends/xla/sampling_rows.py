"""The random sampler's host inputs: one step's sampling rows as the executable takes them.

Host-side numpy only (nothing here is traced): the staging rows of temperature, top-k, top-p and
min-p, the host generator that keys unseeded rows, and each seeded request's step counter, so
its draws depend on nothing but its seed and how many tokens it has sampled
(:mod:`graphrt.backends.xla.sampler` folds the two).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from graphrt.backends.xla.batch import SamplingMetadata
from graphrt.core.sampling.batch import SamplingBatch, write_sampling_rows

#: Seed of the XLA sampler's host generator that keys requests without their own seed
#: (None: fresh entropy per executor, like the torch device RNG).
XLA_SAMPLER_HOST_SEED: int | None = None

_U32_MASK = 0xFFFFFFFF


class SamplingRows:
    """Staging rows for ``max_reqs`` requests over a vocabulary of ``vocab_size``; ``seed`` keys
    the host generator (multi-controller XLA: the same on every process, so their rows agree)."""

    def __init__(self, max_reqs: int, vocab_size: int, seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self._host = {"temperature": np.zeros(max_reqs, np.float32), "top_k": np.zeros(max_reqs, np.int32),
                      "top_p": np.ones(max_reqs, np.float32), "min_p": np.zeros(max_reqs, np.float32)}
        self._rng = np.random.default_rng(XLA_SAMPLER_HOST_SEED if seed is None else seed)
        self._seed_steps: dict[int, int] = {}
        #: The (frozen) batch and row counts whose parameters the host rows hold: a step of the
        #: same batch writes only its keys.
        self._written: tuple[Any, int, int] | None = None
        #: The written batch's parameter rows (temperature, top-k, top-p, min-p), copied out of the
        #: host rows once per batch: every step of the batch hands the executable these arrays.
        self._params: tuple[np.ndarray, ...] = ()
        #: uint32 zeros ``[rows]`` by row count: the step counters of a step without seeded rows.
        self._no_steps: dict[int, np.ndarray] = {}

    def metadata(self, num_reqs: int, rows: int, sampling: SamplingBatch) -> SamplingMetadata:
        """The sampling metadata of one step, as host arrays the executable transfers: padded
        rows greedy, unseeded rows keyed from the host generator, seeded rows by their seed and
        their own step counter (which this advances).

        Every array handed over is one no later step writes: the executable's transfer of a
        step's arguments may still read them while the next step is prepared (asynchronous
        dispatch; on a CPU device an array may be used in place, not copied). So the parameter
        rows are copied once per batch (a new batch gets new copies; these are never written
        again), the keys and (with seeded rows) the step counters are fresh arrays each step,
        and a step without seeded rows shares one zeros array of counters that nothing writes.

        A seed's threefry key is its low and high 32-bit halves: the batch holds seeds in
        [0, 2**64) and top_k at most 2**31 - 1 (:mod:`graphrt.core.sampling.batch`), so no value is
        truncated into these uint32 / int32 buffers."""
        h, n = self._host, num_reqs
        written = self._written
        if written is None or written[0] is not sampling or written[1] != n or written[2] != rows:
            write_sampling_rows(sampling, n, rows, self.vocab_size, h)
            self._written = (sampling, n, rows)
            self._params = tuple(h[f][:rows].copy() for f in ("temperature", "top_k", "top_p", "min_p"))
        temperature, top_k, top_p, min_p = self._params
        seeds = np.zeros((rows, 2), np.uint32)
        seeds[:n] = self._rng.integers(0, 2**32, size=(n, 2), dtype=np.uint32)
        seeded = sampling.seeded
        if seeded:
            steps = np.zeros(rows, np.uint32)
            for i, seed, rid in seeded:            # the seeded rows only (found once per batch)
                step = self._seed_steps.get(rid, 0)
                self._seed_steps[rid] = step + 1
                seeds[i, 0], seeds[i, 1], steps[i] = seed & _U32_MASK, seed >> 32, step
        else:
            steps = self._no_steps.get(rows)
            if steps is None:
                steps = self._no_steps[rows] = np.zeros(rows, np.uint32)
        return SamplingMetadata(temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds, steps=steps,
                                min_p=min_p)

    def free(self, request_id: int) -> None:
        """Forget a finished request's step counter."""
        self._seed_steps.pop(request_id, None)


__all__ = ["SamplingRows"]
