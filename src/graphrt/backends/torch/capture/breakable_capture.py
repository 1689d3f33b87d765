"""Breakable capture: PIECEWISE graphs without a compiler or a traceable model.

Needing only ``model.attention_layers()`` (vLLM's ``VLLM_USE_BREAKABLE_CUDAGRAPH``, SGLang's
prefill graphs), it runs the forward once while capturing and at each attention call ends the
graph, runs attention eagerly (remembering its arguments and output) and begins the next. A
replay replays each segment and re-runs each attention on the same tensors between them,
copying into the captured output. Segments share the pool; tensors crossing a break live with
the entry, so their addresses stay the captured ones."""

from __future__ import annotations

import contextlib
import gc
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves

from graphrt.backends.torch.device_graphs import GraphPool, GraphTask
from graphrt.core.graph_tasks import capturing
from graphrt.core.collector import collector_paused


@dataclass
class AttentionBreak:
    """One attention call cut out of a capture: re-run eagerly at replay into ``output``."""

    forward: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any

    def __call__(self) -> None:
        result = self.forward(*self.args, **self.kwargs)
        for dst, src in zip(tree_leaves(self.output), tree_leaves(result)):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)


class _Segments:
    """The graphs of one breakable capture, opened and closed around each break."""

    def __init__(self, pool: GraphPool) -> None:
        self.pool, self.api = pool, pool.api
        self.calls: list[Callable[[], None]] = []
        self.graphs: list[Any] = []
        self.tasks: list[GraphTask] = []
        self._open: tuple[Any, contextlib.ExitStack] | None = None

    def begin(self) -> None:
        self.api.synchronize()
        graph, stack = self.api.new_graph(), contextlib.ExitStack()
        stack.enter_context(capturing(self.api, self.tasks))
        stack.enter_context(self.api.capture(graph, self.pool.handle))
        self._open = (graph, stack)

    def end(self, exc: tuple[Any, Any, Any] = (None, None, None)) -> None:
        graph, stack = self._open
        self._open = None
        stack.__exit__(*exc)
        if exc[0] is None:
            self.api.synchronize()
            self.graphs.append(graph)
            self.calls.append(graph.replay)

    def cut(self, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """End the open graph, run ``forward`` eagerly, remember the call, open the next graph."""
        self.end()
        output = forward(*args, **kwargs)
        self.calls.append(AttentionBreak(forward, args, kwargs, output))
        self.begin()
        return output


@contextlib.contextmanager
def _breaking_at(layers: list[torch.nn.Module], segments: _Segments) -> Any:
    """Route every call of ``layers`` through ``segments.cut`` (an instance ``forward``)."""
    own = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        layer.forward = (lambda f: lambda *a, **k: segments.cut(f, a, k))(layer.forward)
    try:
        yield
    finally:
        for layer, forward in zip(layers, own):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward


def capture_breakable(pool: GraphPool, fn: Callable[[], Any], layers: list[torch.nn.Module]
                      ) -> tuple[list[Callable[[], None]], list[Any], Any, int, list[GraphTask]]:
    """Capture ``fn`` (the model's forward on static buffers, already warmed up) into graphs
    of ``pool``, broken at each call of ``layers``: (replay calls in order -- segment replays
    and :class:`AttentionBreak` calls --, the graphs, ``fn``'s output, bytes the graphs added,
    refreshable tasks). A failed capture raises and gives the pool a fresh handle."""
    api = pool.api
    segments = _Segments(pool)
    before = api.memory_in_use()
    if api.collect_before_capture:
        gc.collect()
    try:
        with collector_paused(), torch.no_grad(), _breaking_at(layers, segments):
            segments.begin()
            try:
                output = fn()
            except BaseException:
                if segments._open is not None:
                    segments.end(sys.exc_info())
                raise
            segments.end()
    except BaseException:
        pool.handle = api.new_pool()
        raise
    return segments.calls, segments.graphs, output, max(api.memory_in_use() - before, 0), segments.tasks


__all__ = ["AttentionBreak", "capture_breakable"]
