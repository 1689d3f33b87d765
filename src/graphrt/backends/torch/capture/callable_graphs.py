"""Any callable captured per key on a torch device: the piece an engine with its own model runner
takes instead of :class:`graphrt.ModelRunner` (vLLM's ``CUDAGraphWrapper`` role). A key is one
graph (FULL) or graphs between given attention modules (PIECEWISE, by breakable capture); calls
are counted in the :class:`graphrt.GraphCache` as the runner counts steps, and a strict cache
refuses a key it has no entry for."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, Hashable, Sequence, TypeVar

import torch

from graphrt.backends.torch.capture.breakable_capture import capture_breakable
from graphrt.backends.torch.device_graphs import DeviceGraphAPI, GraphPool
from graphrt.core import defaults
from graphrt.core.cache import FailedBuild, GraphCache, describe_key
from graphrt.core.eager import EagerCause
from graphrt.core.errors import ConfigError
from graphrt.core.graph_modes import RuntimeMode

T = TypeVar("T")

#: The entry of a key on the eager backend: nothing captured, but the key was planned (strict
#: mode then refuses only the keys never built, as on the graph backends).
_EAGER = "eager: nothing captured"


@dataclass
class _Graph(Generic[T]):
    """A captured key: its replay calls (one graph's, or PIECEWISE segments' with the attention
    calls between them) and the output tensors they refresh."""

    calls: list[Callable[[], None]]
    graphs: list[Any]
    outputs: T
    piecewise: bool = False

    def replay(self) -> T:
        if not self.piecewise:
            self.calls[0]()
            return self.outputs
        with torch.no_grad():                      # the attention runs eagerly between segments
            for call in self.calls:
                call()
        return self.outputs


class TorchGraphs(Generic[T]):
    """``fn(key)`` captured once per key over the caller's static buffers, then replayed.

    The caller copies each step's inputs, padded to the key, into the tensors ``fn`` reads, and
    reads the tensors ``fn`` returned at capture (a replay refreshes them). Entries live in
    ``cache``; graphs share one pool. ``api=None`` (``eager``): ``fn`` runs.
    ``attention_layers``: modules a PIECEWISE capture may break at (restored afterwards).
    """

    def __init__(self, fn: Callable[[Hashable], T], api: DeviceGraphAPI | None,
                 cache: GraphCache | None = None, *, warmups: int = defaults.CAPTURE_WARMUP_RUNS,
                 attention_layers: Sequence[torch.nn.Module] = ()) -> None:
        self.fn, self.api, self.warmups = fn, api, warmups
        self.cache: GraphCache = cache if cache is not None else GraphCache()
        self.pool = GraphPool(api) if api is not None else None
        self.attention_layers = list(attention_layers)

    @property
    def supports_piecewise(self) -> bool:
        """Whether :meth:`build` can capture PIECEWISE: a graph backend and attention modules to break at."""
        return self.api is not None and bool(self.attention_layers)

    def build(self, key: Hashable, mode: RuntimeMode = RuntimeMode.FULL) -> T:
        """Run ``fn(key)`` ``warmups`` times, then capture it -- as one graph (``FULL``), or broken
        at each call of ``attention_layers`` (``PIECEWISE``, e.g. a dispatcher's mixed keys) --
        and return its output tensors. On the eager backend ``fn`` runs once and the key is
        recorded (strict mode refuses only keys never built)."""
        if mode not in (RuntimeMode.FULL, RuntimeMode.PIECEWISE):
            raise ConfigError(f"TorchGraphs.build: mode {mode.value}; FULL or PIECEWISE")
        if self.api is None:
            with torch.no_grad():
                outputs = self.fn(key)
            self.cache.put(key, _EAGER)
            return outputs
        t0 = time.perf_counter()
        if mode is RuntimeMode.PIECEWISE:
            if not self.attention_layers:
                raise ConfigError("PIECEWISE pieces break at attention modules: pass backend.graphs(fn, cache, "
                                  "attention_layers=[...]) with the modules fn calls")
            with torch.no_grad():
                for _ in range(self.warmups):
                    self.fn(key)
            calls, graphs, output, nbytes, _ = capture_breakable(self.pool, lambda: self.fn(key),
                                                                 self.attention_layers)
            entry = _Graph(calls, graphs, output, piecewise=True)
        else:
            outputs: list[T] = []
            graph, nbytes, _ = self.pool.capture(lambda: outputs.append(self.fn(key)), self.warmups)
            entry = _Graph([graph.replay], [graph], outputs[-1])
        self.cache.put(key, entry, seconds=time.perf_counter() - t0, nbytes=nbytes)
        return entry.outputs

    def __call__(self, key: Hashable, *, num_tokens: int | None = None, num_reqs: int | None = None) -> T:
        """Replay the graph(s) of ``key`` and return its outputs, counted in the cache: a hit, or a
        miss run eagerly (never built: ``EagerCause.MISS``; a ``cache.put_failed`` entry:
        ``CAPTURE_FAILED``); on the eager backend every call is eager (``MODE``). ``num_tokens`` /
        ``num_reqs``: the call's real sizes, for the padding statistics (the key's sizes are the
        padded ones: a ``BatchDescriptor`` or a token count). Strict: once the cache is sealed, a
        key without an entry raises :class:`~graphrt.CacheMissError`."""
        entry = self.cache.lookup(key, reason="not captured")
        if self.api is None or entry is None or isinstance(entry, FailedBuild):
            if self.api is None:
                hit, cause, reason = None, EagerCause.MODE, "the eager backend captures no graphs"
            elif entry is None:
                hit, cause, reason = False, EagerCause.MISS, f"{describe_key(key)} was not captured"
            else:
                hit, cause, reason = False, EagerCause.CAPTURE_FAILED, entry.reason
            self.cache.record_call(key, hit=hit, num_tokens=num_tokens, num_reqs=num_reqs,
                                   eager_cause=cause, eager_reason=reason)
            with torch.no_grad():
                return self.fn(key)
        self.cache.record_call(key, hit=True, num_tokens=num_tokens, num_reqs=num_reqs)
        return entry.replay()


__all__ = ["TorchGraphs"]
