"""Multi-controller XLA: one engine over the devices of several ``jax.distributed`` processes.

Every process builds the same ``graphrt.LLM`` / ``ModelRunner`` over a mesh of all processes'
devices and is given the same requests (SPMD, as any multi-controller JAX program): each runs
the same scheduler on the same inputs, so each dispatches the same step, and the compiled
programs meet in their collectives. Each process holds and measures only its addressable
devices; replicated outputs (logits, sampled tokens) are read from its own shard. Two checks
turn a divergence into a named error on every process instead of a hang:

* after each compile, the program's collectives agree across the processes
  (:func:`~graphrt.backends.xla.collective_check.check_processes_agree`);
* before each step, :class:`StepAgreement` all-gathers the step's key and a checksum of its
  padded inputs: processes about to run different steps raise
  :class:`~graphrt.core.errors.StepMismatchError`.

docs/distributed.md, "Multi-controller XLA"."""

from __future__ import annotations

import zlib
from typing import Any, Iterable

import numpy as np

from graphrt.core.errors import StepMismatchError
from graphrt.core.inputs.fields import ARRAY_FIELDS

#: The step row's words: the key (tokens, requests, uniform decode, LoRAs, context bucket),
#: the real counts, then one checksum per padded array field.
_KEY_WORDS = 7


def process_count() -> int:
    """``jax.process_count()`` (1 where jax.distributed is not initialised)."""
    import jax

    return int(jax.process_count())


def check_built(entries: Iterable[Any]) -> None:
    """Every process compiled the same collectives for each entry (in the same order on all)."""
    from graphrt.backends.xla.collective_check import check_processes_agree

    for entry in entries:
        check_processes_agree(entry.executable, entry.key)


class StepAgreement:
    """Each step's key and input checksums, all-gathered before it runs (one small collective)."""

    def __init__(self) -> None:
        self._row = np.zeros(_KEY_WORDS + len(ARRAY_FIELDS), dtype=np.int32)

    def check(self, key: Any, padded: Any) -> None:
        """Raise :class:`StepMismatchError` on every process unless all are about to run this step."""
        from jax.experimental import multihost_utils

        row = self._row
        row[:_KEY_WORDS] = (key.num_tokens, -1 if key.num_reqs is None else key.num_reqs, key.uniform_decode,
                            key.num_loras, -1 if key.max_seq_len is None else key.max_seq_len,
                            padded.num_tokens, padded.num_reqs)
        for i, name in enumerate(ARRAY_FIELDS):
            array = np.ascontiguousarray(getattr(padded, name))
            row[_KEY_WORDS + i] = zlib.crc32(array.view(np.uint8).reshape(-1)) & 0x7FFFFFFF
        rows = np.asarray(multihost_utils.process_allgather(row)).reshape(-1, row.size)
        if (rows == rows[0]).all():
            return
        steps = [{"process": p, "key": r[:5].tolist(), "tokens": int(r[5]), "requests": int(r[6]),
                  "checksums": dict(zip(ARRAY_FIELDS, r[_KEY_WORDS:].tolist()))} for p, r in enumerate(rows)]
        differ = [name for i, name in enumerate(ARRAY_FIELDS) if len(set(rows[:, _KEY_WORDS + i])) > 1]
        keys = "; ".join(f"process {s['process']}: {s['tokens']} tokens, {s['requests']} requests, key {s['key']}"
                         for s in steps)
        raise StepMismatchError(
            f"the jax.distributed processes of this engine were about to run different steps ({keys}; inputs that "
            f"differ: {differ or 'none, the keys do'}): give every process the same requests in the same order, "
            "the same configuration and seeds", steps)


__all__ = ["StepAgreement", "check_built", "process_count"]
