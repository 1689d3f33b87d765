"""The pieces of a :class:`~graphrt.backends.torch.executor.TorchExecutor`'s forward: the fx split
(traced once, lazily), per token bucket the buffers its cut values live in and, with
``compile_model``, the compiled pieces, and PIECEWISE entries captured from them or by
breakable capture, as ``GraphConfig.piecewise_capture`` says."""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import torch

from graphrt.backends.torch.capture.breakable_capture import capture_breakable
from graphrt.backends.torch.device_graphs import DeviceGraphAPI, GraphPool
from graphrt.backends.torch.capture.fx_split import (PiecewiseBuffers, PiecewiseEntry, SplitModel, compile_piece,
                                              split_or_reason)
from graphrt.config import GraphConfig
from graphrt.core import defaults
from graphrt.core.dispatch import BatchDescriptor

logger = logging.getLogger(__name__)


class PiecewiseCapture:
    """The split model, piece buffers, compiled pieces and PIECEWISE capture of one executor,
    handed what they use: the model, the config, the device-graph API (None: eager), the static
    ``input_ids`` / ``positions`` buffers, and the executor's padding step (``load_dummy``), its
    forward context (``step_context``) and a padding step's host values (``dummy_host``), and the
    addresses a replay reads (``input_ptrs``). Entries are captured into the pool ``build`` is given."""

    def __init__(self, model: torch.nn.Module, config: GraphConfig, graph_api: DeviceGraphAPI | None,
                 static: Mapping[str, torch.Tensor], *, forward: Any,
                 input_ptrs: Callable[[], dict[str, int]]) -> None:
        """``forward``: the executor's :class:`~graphrt.backends.torch.forward.TorchForward` (its
        padding steps, host values and step context)."""
        self.model, self.config, self.graph_api, self.static = model, config, graph_api, static
        self.forward = forward
        self._input_ptrs = input_ptrs
        self._split: SplitModel | None = None
        self.split_reason: str | None = None
        self._split_tried = False
        self.buffers: PiecewiseBuffers | None = None
        self.compiled: dict[int, list[Callable[..., Any]]] = {}

    @property
    def split_model(self) -> SplitModel | None:
        """The model split at its attention calls (None if it cannot be split; see the log)."""
        if not self._split_tried:
            self._split_tried = True
            self._split, self.split_reason = split_or_reason(self.model, self.config.collectives == "eager")
            if self._split is None:
                logger.info("graphrt: no fx-split pieces for this model: %s", self.split_reason)
        return self._split

    @property
    def capture(self) -> str | None:
        """How PIECEWISE graphs are captured: ``fx`` (the split model), ``breakable``, or None
        (no graph API, or neither works for this model)."""
        choice = self.config.piecewise_capture
        if self.graph_api is None:
            return None
        if self.config.collectives == "eager":     # only the fx split cuts at collectives
            return "fx" if self.split_model is not None else None
        if choice != "breakable" and self.split_model is not None:
            return "fx"
        if choice != "fx" and _break_layers(self.model):
            return "breakable"
        return None

    def compiles(self, num_tokens: int) -> bool:
        """Whether a graph of ``num_tokens`` tokens is captured from compiled pieces."""
        return self.compile_note() is None and self.config.compile_model \
            and num_tokens <= self.config.compile_max_size

    def compile_note(self) -> str | None:
        """Why ``compile_model`` has no effect here, or None when it works (or is off)."""
        cfg, api = self.config, self.graph_api
        if not cfg.compile_model:
            return None
        if api is None:
            return "the eager backend captures no graphs, so nothing is compiled"
        if api.compile_backend is None:
            return f"backend {api.name} does not support torch.compile before capture"
        if cfg.piecewise_capture == "breakable":
            return "piecewise_capture=breakable captures without torch.compile, which needs the fx split"
        if self.split_model is None:
            return f"the model cannot be split at attention: {self.split_reason}"
        return None

    def reset(self) -> None:
        """Forget the piece buffers and compiled pieces (graph-memory samples drop them)."""
        self.buffers = None
        self.compiled.clear()

    def prepare(self, num_tokens: int, compiled: bool) -> tuple[list[Callable[[], None]], torch.Tensor, int]:
        """Bind the split model's values at ``num_tokens`` to the persistent piece buffers.

        A warm-up runs the split model on pure padding (one empty request) to learn every
        value that crosses a cut; the values get buffer views; with ``compiled`` each piece
        is compiled for exactly those views; then every step runs once through the buffers.
        Returns the step calls, the output view, and the bytes of buffers newly allocated.
        """
        split = self.split_model
        if self.buffers is None:
            self.buffers = PiecewiseBuffers(split, self.config.capture_policy().max_size)
        buffers = self.buffers
        held = buffers.nbytes
        inputs = (self.static["input_ids"][:num_tokens], self.static["positions"][:num_tokens])
        with torch.no_grad():
            self.forward.load_dummy(num_tokens, 1)
            with self.forward.step_context(num_tokens, 1, self.forward.dummy_host(num_tokens, 1)):
                for _ in range(defaults.CAPTURE_WARMUP_RUNS):
                    env = split.run(inputs)
                views = buffers.bind(env, num_tokens)
                pieces: list[Callable[..., Any]] = [piece.module for piece in split.pieces]
                if compiled:
                    pieces = self.compiled.get(num_tokens) or [
                        compile_piece(piece.module, [views[a] for a in piece.args],
                                      self.graph_api.compile_backend) for piece in split.pieces]
                    self.compiled[num_tokens] = pieces
                calls = buffers.bind_calls(views, pieces)
                for call in calls:
                    call()
        return calls, views[split.output], buffers.nbytes - held

    def build(self, key: BatchDescriptor, compiled: bool, pool: GraphPool) -> tuple[PiecewiseEntry, int]:
        """The PIECEWISE entry of ``key.num_tokens`` tokens, captured the configured way into ``pool``."""
        if self.capture == "breakable":
            return self._build_breakable(key, pool)
        return self._build_fx(key, compiled, pool)

    def _build_fx(self, key: BatchDescriptor, compiled: bool, pool: GraphPool) -> tuple[PiecewiseEntry, int]:
        """Capture every fx piece over the shared piece buffers; attention stays outside the
        graphs and runs eagerly between them on replay."""
        num_tokens = key.num_tokens
        calls, output, nbytes = self.prepare(num_tokens, compiled)
        graphs, tasks, replay_calls = [], [], []
        with torch.no_grad():
            for split_call, call in zip(self.split_model.calls, calls):
                if split_call.kind == "piece":
                    graph, added, piece_tasks = pool.record(call)
                    graphs.append(graph)
                    tasks += piece_tasks
                    nbytes += added
                    replay_calls.append(graph.replay)
                else:
                    replay_calls.append(call)
        entry = PiecewiseEntry(num_tokens, replay_calls, graphs, output, self._input_ptrs(), compiled, tasks,
                               eager_collectives=self.split_model.num_collectives)
        return entry, nbytes

    def _build_breakable(self, key: BatchDescriptor, pool: GraphPool) -> tuple[PiecewiseEntry, int]:
        """Capture the forward broken at each attention call (:func:`capture_breakable`);
        replayed like the fx pieces, attention eager between."""
        t, model, static = key.num_tokens, self.model, self.static

        def forward() -> torch.Tensor:
            return model(static["input_ids"][:t], static["positions"][:t])

        self.forward.load_dummy(t, 1)
        with torch.no_grad(), self.forward.step_context(t, 1, self.forward.dummy_host(t, 1)):
            for _ in range(defaults.CAPTURE_WARMUP_RUNS):
                forward()
            calls, graphs, output, nbytes, tasks = capture_breakable(pool, forward, _break_layers(model))
        return PiecewiseEntry(t, calls, graphs, output, self._input_ptrs(), False, tasks), nbytes


def _break_layers(model: Any) -> list[Any]:
    """The modules a breakable capture breaks at: the attention layers and, in a hybrid model,
    the recurrent layers (their metadata has the step's requests: docs/hybrid.md)."""
    return list(getattr(model, "attention_layers", list)()) + list(getattr(model, "state_layers", list)())


__all__ = ["PiecewiseCapture"]
