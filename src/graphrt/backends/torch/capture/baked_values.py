"""Complete keys: is every host value a captured forward bakes in a function of its key?

A graph replays its kernels with the host values they were captured with; a value that depends
on a step's contents (the longest sequence, a host-side plan) is stale for the next step under
the key (transformers #45323 lost half its GSM8K accuracy so). :meth:`BakedValueChecks.check_key`
records a FULL key's forward twice on the CPU recording graph, under pure padding and a busy
step, ``before_replay`` run first; differing numbers or ops mean the key is incomplete.
:meth:`~BakedValueChecks.check_refresh` does the same for the metadata build alone at every FULL
capture of a backend with ``before_replay``: a refreshed value handed to ``build`` as a Python
number is refused, naming the backend and the ops."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

from graphrt.backends.torch import recording_graph as rg
from graphrt.core import graph_tasks
from graphrt.core.attention_decl import backend_name
from graphrt.core.dispatch import BatchDescriptor
from graphrt.core.errors import GraphCaptureError
from graphrt.core.inputs.fields import ModelInputs
from graphrt.layers.torch.attention.backend import CaptureHostValues, HostValues

logger = logging.getLogger(__name__)

#: Differences listed in a report (the count is always complete).
MAX_LISTED = 8
#: How deep :func:`host_leaves` looks into metadata (nested dataclasses / containers).
MAX_DEPTH = 4


@dataclass
class BakedReport:
    """What one key's forward bakes in: how many host numbers, and those that varied."""

    num_values: int
    varying: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.varying


class TaskMarks:
    """The device graph API as a recorded check sees it: each graph task's ops (``graph_task``)
    are marked, so that on a device with task updates -- which re-issues them with fresh host
    values before every replay -- their numbers count as refreshed, not baked. A task that needs
    an update on a device without them fails as its capture would."""

    def __init__(self, api: Any, graph: rg.RecordingGraph) -> None:
        self.name = getattr(api, "name", "")
        self.task_updates = bool(getattr(api, "task_updates", False))
        self.graph = graph
        self.ranges: list[tuple[int, int]] = []

    @contextlib.contextmanager
    def task_group(self, hook: Any, tasks: list) -> Iterator[None]:
        start = self.graph.num_ops
        yield
        self.ranges.append((start, self.graph.num_ops))

    def baked_values(self) -> list[tuple[str, tuple[Any, ...]]]:
        """The graph's baked values, with those of re-issued tasks' ops left empty."""
        values = self.graph.baked_values()
        if self.task_updates:
            for start, end in self.ranges:
                values[start:end] = [(op, ()) for op, _ in values[start:end]]
        return values


def host_leaves(value: Any, depth: int = 0) -> list[Any]:
    """The host numbers metadata carries: its ints, floats, bools and strings, and its tensors'
    shapes, through dataclasses, named tuples, dicts, lists and tuples (other objects skipped)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return [value]
    if isinstance(value, torch.Tensor):
        return [tuple(value.shape)]
    if depth >= MAX_DEPTH:
        return []
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items: Any = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        return []
    return [leaf for item in items for leaf in host_leaves(item, depth + 1)]


class BakedValueChecks:
    """The checks of one executor's FULL captures, handed what they read: its step buffers
    (``StepBuffers``: host arrays, padding, the device copy, tensor views), its attention and the
    host values the attention keys, the device-graph API (task marks), its forward, metadata
    build, padding host values (``dummy_host``) and ``step_host_values``; whether the attention
    has a refresh (``before_replay``), whether varying values refuse a capture (``refuse``), and
    ``max_model_len`` / ``vocab_size`` for the busy step."""

    def __init__(self, buffers: Any, attention: Any, keyed_host_values: Any, graph_api: Any, *,
                 forward: Any, refresh: bool, refuse: bool, max_model_len: int, vocab_size: int) -> None:
        """``forward``: the executor's :class:`~graphrt.backends.torch.forward.TorchForward` (the
        run, the metadata build and the host values the checks replay)."""
        self.buffers, self.attention, self.keyed_host_values, self.graph_api = (buffers, attention,
                                                                               keyed_host_values, graph_api)
        self.fwd = forward
        self.refresh, self.refuse = refresh, refuse
        self.max_model_len, self.vocab_size = max_model_len, vocab_size

    def _dummy(self, t: int, r: int, busy: bool, context: int | None) -> ModelInputs:
        """Host inputs of a step of ``t`` tokens and ``r`` requests that writes no KV slot: pure
        padding, or (``busy``) every request with tokens and the longest sequences the key allows
        (its context bucket, else max_model_len), reading the null block."""
        h = self.buffers.host_arrays
        padding = self.buffers.load_dummy(t, r)
        if not busy:
            return padding
        max_len = context or self.max_model_len
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
        h["input_ids"][:n] = np.arange(n) % max(self.vocab_size, 1)
        self.buffers.to_device(t, r)
        return ModelInputs(h["input_ids"][:t], h["positions"][:t], h["slot_mapping"][:t],
                           h["query_start_loc"][:r + 1], h["seq_lens"][:r], h["num_computed_tokens"][:r],
                           h["block_table"][:r], h["state_slots"][:r], r, n, int(counts.max()), max_len, False)

    def refresh_for_capture(self, padded: ModelInputs, key: BatchDescriptor) -> None:
        """At a FULL capture of ``key``: the backend's ``before_replay`` on ``padded`` (its padding
        step) with only its declared (keyed or refreshed) host values readable -- reading another
        raises GraphCaptureError naming it and ``before_replay``."""
        t, r = key.num_tokens, key.num_reqs
        attention = self.attention
        host = self.fwd.step_host_values(HostValues(0, 0, 0, 0, 0, 0, False), padded, key)
        guarded = CaptureHostValues(host, self.keyed_host_values, backend_name(attention), key, reader="before_replay",
                                    refreshed=tuple(getattr(attention, "refreshed_host_values", ())))
        attention.before_replay(self.buffers.tensors(t, r), guarded)

    def _refresh(self, key: BatchDescriptor, busy: bool) -> None:
        """Load a padding or busy step of ``key`` and run the backend's refresh on it, as before a run."""
        t, r = key.num_tokens, key.num_reqs
        inputs = self._dummy(t, r, busy, key.max_seq_len)
        if self.refresh:
            host = self.fwd.step_host_values(HostValues(0, 0, 0, 0, 0, 0, False), inputs, key)
            self.attention.before_replay(self.buffers.tensors(t, r), host)

    def _record(self, key: BatchDescriptor, busy: bool) -> list[tuple[str, tuple[Any, ...]]]:
        t, r = key.num_tokens, key.num_reqs
        self._refresh(key, busy)
        graph = rg.RecordingGraph()
        marks = TaskMarks(self.graph_api, graph)
        with torch.no_grad(), graph_tasks.capturing(marks, []), rg.recording_graph(graph):
            self.fwd.run(t, r, self.fwd.dummy_host(t, r, key))
        values = marks.baked_values()
        graph.reset()
        return values

    def check_key(self, key: BatchDescriptor) -> BakedReport:
        """Record ``key``'s forward under two steps it holds and list the host values that differ."""
        quiet, busy = self._record(key, False), self._record(key, True)
        self.buffers.load_dummy(key.num_tokens, key.num_reqs)
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

    def check_refresh(self, key: BatchDescriptor) -> None:
        """Before a FULL capture of ``key`` by a backend with a ``before_replay``: record the metadata
        build after a refresh with a busy step and after one with padding; host numbers that differ
        -- in the build's ops or in the metadata -- came from the refresh through the backend's own
        state, and a graph would bake them in: GraphCaptureError naming the backend and the first
        differences (the key then runs eagerly; strict mode raises)."""
        t, r = key.num_tokens, key.num_reqs
        with torch.no_grad(), graph_tasks.capturing(TaskMarks(self.graph_api, rg.RecordingGraph()), []):
            self.fwd.metadata(t, r, self.fwd.dummy_host(t, r, key))     # a warm-up, as a capture's
        runs = []
        for busy in (True, False):          # padding last: what the capture then runs on
            self._refresh(key, busy)
            graph = rg.RecordingGraph()
            marks = TaskMarks(self.graph_api, graph)
            with torch.no_grad(), graph_tasks.capturing(marks, []), rg.recording_graph(graph):
                meta = self.fwd.metadata(t, r, self.fwd.dummy_host(t, r, key))
            runs.append((marks.baked_values(), host_leaves(meta)))
            graph.reset()
        (busy_ops, busy_meta), (quiet_ops, quiet_meta) = runs
        diffs = [f"op {i} {op}: {list(b)} after a busy step's refresh, {list(a)} after padding's"
                 for i, ((op, a), (_, b)) in enumerate(zip(quiet_ops, busy_ops)) if a != b]
        if [op for op, _ in quiet_ops] != [op for op, _ in busy_ops]:
            diffs.insert(0, f"the build runs {len(busy_ops)} ops after a busy step's refresh, {len(quiet_ops)} after "
                            "padding's")
        if busy_meta != quiet_meta:
            diffs.append(f"the metadata's host numbers and shapes: {busy_meta} after a busy step's refresh, "
                         f"{quiet_meta} after padding's")
        if diffs:
            raise GraphCaptureError(
                f"attention backend {backend_name(self.attention)!r}: the metadata of {key} depends on what "
                f"before_replay left on the backend -- {'; '.join(diffs[:MAX_LISTED])}. A graph would bake this step's "
                f"value in; build must read host values only through its host argument (keyed ones), and before_replay "
                f"must write what a graph reads into device buffers (docs/attention.md, 'The refresh path')")

    def check_baked(self, key: BatchDescriptor) -> BakedReport:
        """``check_baked_values`` / strict mode at a FULL capture (and at every FULL capture of a
        model's own backend with a ``before_replay``): the host values ``key``'s forward bakes in
        (:meth:`check_key`); values that differ between two steps the key holds fail the capture in
        strict mode and for such a backend (``refuse``), and are logged otherwise."""
        report = self.check_key(key)
        if not report.complete:
            message = (f"{key}: the captured forward bakes in host values that differ between steps "
                       f"under this key -- {'; '.join(report.varying)}. Make them part of the key or "
                       f"refresh them in the attention backend's before_replay (docs/attention.md)")
            if self.refuse:
                raise GraphCaptureError(message)
            logger.warning("graphrt: %s", message)
        return report


__all__ = ["BakedReport", "BakedValueChecks", "MAX_DEPTH", "MAX_LISTED", "host_leaves", "TaskMarks"]
