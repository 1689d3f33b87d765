"""Complete keys: is every host value a captured forward bakes in a function of its key?

A device graph replays the kernels it captured with the host values they were launched with
(sizes, slice bounds, scalars). graphrt keys a graph by its padded shape, so any host value
that depends on a step's *contents* -- the longest sequence, a host-side plan an attention
backend computed -- is stale for the next step under the same key (transformers' continuous
batching left ``max_seqlen_k`` out of its key and lost half its GSM8K accuracy, #45323).

:func:`check_key` records the forward of one FULL key twice with the CPU recording graph
(which sees every aten op and its arguments, on any device), under two different steps the
key holds -- pure padding (what capture uses) and a busy step (every request with tokens,
the longest sequences the config allows) -- with the executor's pre-replay hooks run on each
step's inputs first, as a replay would. Numbers that differ between the two recordings, or a
different op sequence, mean the key is incomplete.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from graphrt.backends.torch import recording_graph as rg
from graphrt.core.dispatch import BatchDescriptor
from graphrt.core.errors import GraphCaptureError
from graphrt.core.fields import ModelInputs

logger = logging.getLogger(__name__)

#: Differences listed in a report (the count is always complete).
MAX_LISTED = 8


@dataclass
class BakedReport:
    """What one key's forward bakes in: how many host numbers, and those that varied."""

    num_values: int
    varying: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.varying


def _dummy(executor: Any, t: int, r: int, busy: bool, context: int | None) -> ModelInputs:
    """Host inputs of a step of ``t`` tokens and ``r`` requests that writes no KV slot: pure
    padding, or (``busy``) every request with tokens and the longest sequences the key allows
    (its context bucket, else max_model_len), reading the null block."""
    h = executor.host_buffers
    padding = executor.load_dummy(t, r)
    if not busy:
        return padding
    max_len = context or executor.config.max_model_len
    counts = np.full(r, t // r, dtype=np.int64)
    counts[: t % r] += 1
    counts = np.minimum(counts, max_len)          # tokens past r * max_len stay padding
    ends = np.cumsum(counts)
    n = int(ends[-1])
    computed = max_len - counts
    h["query_start_loc"][1:r + 1] = ends
    h["seq_lens"][:r] = max_len
    h["num_computed_tokens"][:r] = computed
    h["positions"][:n] = np.repeat(computed, counts) + np.arange(n) - np.repeat(ends - counts, counts)
    h["input_ids"][:n] = np.arange(n) % max(executor.vocab_size, 1)
    executor.to_device(t, r)
    return ModelInputs(h["input_ids"][:t], h["positions"][:t], h["slot_mapping"][:t],
                       h["query_start_loc"][:r + 1], h["seq_lens"][:r], h["num_computed_tokens"][:r],
                       h["block_table"][:r], h["state_slots"][:r], r, n, int(counts.max()), max_len, False)


def _record(executor: Any, key: BatchDescriptor, busy: bool) -> list[tuple[str, tuple[Any, ...]]]:
    t, r = key.num_tokens, key.num_reqs
    inputs = _dummy(executor, t, r, busy, key.max_seq_len)
    for hook in executor.pre_replay_hooks:
        hook(inputs)
    graph = rg.RecordingGraph()
    with torch.no_grad(), rg.recording_graph(graph):
        executor.forward(t, r, executor.dummy_host(t, r, key))
    values = graph.baked_values()
    graph.reset()
    return values


def check_key(executor: Any, key: BatchDescriptor) -> BakedReport:
    """Record ``key``'s forward under two steps it holds and list the host values that differ."""
    quiet, busy = _record(executor, key, False), _record(executor, key, True)
    executor.load_dummy(key.num_tokens, key.num_reqs)
    report = BakedReport(sum(len(values) for _, values in quiet))
    if [op for op, _ in quiet] != [op for op, _ in busy]:
        first = next(i for i, (a, b) in enumerate(zip(quiet + [("", ())], busy + [("", ())])) if a[0] != b[0])
        report.varying.append(f"the ops differ from op {first} on ({len(quiet)} ops under padding, "
                              f"{len(busy)} under a busy step): the forward branches on step data")
        return report
    for i, ((op, a), (_, b)) in enumerate(zip(quiet, busy)):
        if a != b and len(report.varying) < MAX_LISTED:
            report.varying.append(f"op {i} {op}: {list(a)} under padding, {list(b)} under a busy step")
    return report


def check_baked(executor: Any, key: BatchDescriptor) -> BakedReport:
    """``check_baked_values`` / strict mode at a FULL capture: the host values ``key``'s forward
    bakes in (:func:`check_key`); values that differ between two steps the key holds fail the
    capture in strict mode and are logged otherwise."""
    report = check_key(executor, key)
    if not report.complete:
        message = (f"{key}: the captured forward bakes in host values that differ between steps "
                   f"under this key -- {'; '.join(report.varying)}. Make them part of the key or "
                   f"refresh them in a pre-replay hook (docs/backends.md, complete keys)")
        if executor.config.strict:
            raise GraphCaptureError(message)
        logger.warning("graphrt: %s", message)
    return report


__all__ = ["BakedReport", "MAX_LISTED", "check_baked", "check_key"]
