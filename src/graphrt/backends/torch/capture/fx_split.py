"""PIECEWISE graphs: the model split at its attention calls.

:class:`SplitModel` traces the model with ``torch.fx`` (attention modules are leaves) and cuts
it at every attention call (a module with ``graphrt_attention = True``, or the op
``torch.ops.graphrt.paged_attention``). Pieces see token shapes only, so one set per token
bucket serves any request count; attention runs eagerly between them on the real metadata.
With ``eager_collectives`` it also cuts at every functional collective (``_c10d_functional``
ops, with the ops that wrap their result): they run eagerly between the pieces and are waited
there (``GraphConfig.collectives="eager"``, for fabrics whose collectives cannot be captured).
:class:`PiecewiseBuffers` gives every value crossing a cut a persistent buffer (token-major ones
shared across buckets), which the captured pieces read and write inside the graph."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from graphrt.core.errors import GraphrtError

PIECE = "piece"
ATTENTION = "attention"
COLLECTIVE = "collective"
_COLLECTIVE_NAMESPACE = "_c10d_functional"


class SplitError(GraphrtError):
    """The model cannot be split at its attention calls (the message says why)."""


def is_attention_module(module: torch.nn.Module) -> bool:
    """Whether calls of ``module`` are split points (its class sets ``graphrt_attention``)."""
    return bool(getattr(module, "graphrt_attention", False))


def _attention_ops() -> tuple[Any, ...]:
    """The registered graphrt attention op (both its packet and its default overload)."""
    from graphrt.layers.torch.attention.paged import PAGED_ATTENTION_OP
    return (PAGED_ATTENTION_OP, PAGED_ATTENTION_OP.overloadpacket)


def _has_hooks(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


class _AttentionLeafTracer(torch.fx.Tracer):
    """fx tracer that keeps attention modules as single ``call_module`` nodes.

    Modules with forward hooks stay whole too: tracing into them would drop the hooks,
    while a ``call_module`` node calls the module, hooks included. So do modules whose class
    sets ``graphrt_fx_leaf`` (a LoRA linear: its forward reads the key's adapter count when
    each bucket's pieces are captured, instead of once at trace time).
    """

    def is_leaf_module(self, module: torch.nn.Module, qualname: str) -> bool:
        return (is_attention_module(module) or _has_hooks(module) or getattr(module, "graphrt_fx_leaf", False)
                or super().is_leaf_module(module, qualname))


@dataclass
class SplitCall:
    """One call of the split model: a piece (captured per bucket) or an attention call (eager)."""

    kind: str
    module: torch.nn.Module
    args: tuple[str, ...]
    outs: tuple[tuple[int | None, str], ...]  # (tuple index or None for a single output, value name)
    index: int                                  # position among the calls of its kind

    def bind(self, env: dict[str, Any], result: Any) -> None:
        """Store the call's result(s) in ``env`` under their value names."""
        for idx, name in self.outs:
            env[name] = result if idx is None else result[idx]


class SplitModel:
    """``model`` as a sequence of pieces and attention calls over named values."""

    def __init__(self, model: torch.nn.Module, eager_collectives: bool = False) -> None:
        try:
            graph = _AttentionLeafTracer().trace(model)
        except Exception as exc:  # noqa: BLE001 - any tracing failure means "cannot split"
            raise SplitError(f"torch.fx cannot trace {type(model).__name__}.forward "
                             f"({type(exc).__name__}: {exc}); piecewise graphs need a traceable "
                             "forward without Python control flow on tensor values") from exc
        traced = torch.fx.GraphModule(model, graph)
        roots = dict(traced.named_modules())
        attention_ops = _attention_ops()

        def split_kind(node: torch.fx.Node) -> str | None:
            if node.op == "call_module":
                return ATTENTION if is_attention_module(roots[node.target]) else None
            if node.op != "call_function":
                return None
            if node.target in attention_ops:
                return ATTENTION
            if eager_collectives and getattr(node.target, "namespace", None) == _COLLECTIVE_NAMESPACE:
                return COLLECTIVE
            return None

        # Partitions in graph order: pieces between the eager calls; a collective's result
        # wrappers (they take it as their argument) stay in its partition.
        kinds: dict[int, str] = {0: PIECE}
        partition_of: dict[torch.fx.Node, int] = {}
        current = 0
        for node in traced.graph.nodes:
            kind = split_kind(node) or PIECE
            chained = kind == COLLECTIVE and kinds[current] == COLLECTIVE and any(
                partition_of.get(a) == current for a in node.args if isinstance(a, torch.fx.Node))
            if (kind != PIECE or kinds[current] != PIECE) and not chained:
                current = len(kinds)
                kinds[current] = kind
            partition_of[node] = current
        count = sum(kind == ATTENTION for kind in kinds.values())
        if count == 0:
            raise SplitError(f"{type(model).__name__} has no attention call to split at: mark the "
                             "attention module class with graphrt_attention = True or call "
                             "torch.ops.graphrt.paged_attention")
        self._kinds = kinds

        split = split_module(traced, model, partition_of.__getitem__)
        self.graph_module = split
        self.num_attention = count
        #: The functional collectives run eagerly between pieces (``eager_collectives``; else 0).
        self.num_collectives = sum(kind == COLLECTIVE for kind in kinds.values())
        self.inputs: tuple[str, ...] = ()
        self.constants: dict[str, str] = {}  # value name -> attribute path (parameters, buffers)
        self.calls: list[SplitCall] = []
        self.output = self._parse(split)

    def _parse(self, split: torch.fx.GraphModule) -> str:
        """Read the top-level split graph into calls; returns the output value's name."""
        inputs, counts = [], {PIECE: 0, ATTENTION: 0, COLLECTIVE: 0}
        output: str | None = None
        for node in split.graph.nodes:
            if node.op == "placeholder":
                inputs.append(node.name)
            elif node.op == "call_module":
                kind = self._kinds[int(node.target.rsplit("_", 1)[1])]
                getitems = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]
                if getitems and len(getitems) != len(node.users):
                    raise SplitError(f"{node.target}: output used both whole and by index")
                outs = (tuple(sorted((u.args[1], u.name) for u in getitems)) if getitems
                        else ((None, node.name),) if node.users else ())
                for arg in node.args:
                    if not isinstance(arg, torch.fx.Node):
                        raise SplitError(f"{node.target} takes a non-value argument {arg!r}")
                module = getattr(split, node.target)
                self.calls.append(SplitCall(kind, _Waited(module) if kind == COLLECTIVE else module,
                                       tuple(a.name for a in node.args), outs, counts[kind]))
                counts[kind] += 1
            elif node.op == "get_attr":
                self.constants[node.name] = node.target
            elif node.op == "call_function" and node.target is operator.getitem:
                continue
            elif node.op == "output":
                value = node.args[0]
                if not isinstance(value, torch.fx.Node):
                    raise SplitError("piecewise graphs need a forward that returns one tensor")
                output = value.name
            else:
                raise SplitError(f"unexpected node {node.op} {node.target} between pieces")
        self.inputs = tuple(inputs)
        assert output is not None
        return output

    @property
    def pieces(self) -> list[SplitCall]:
        """The calls that are captured (everything between attention calls)."""
        return [s for s in self.calls if s.kind == PIECE]

    def run(self, inputs: Sequence[Any], pieces: Sequence[Callable[..., Any]] | None = None) -> dict[str, Any]:
        """Run every step eagerly; ``pieces`` replaces the piece modules (compiled versions).

        Returns every value by name; ``env[self.output]`` is the model's output.
        """
        env: dict[str, Any] = dict(zip(self.inputs, inputs))
        env.update((name, _attr(self.graph_module, path)) for name, path in self.constants.items())
        for step in self.calls:
            fn = step.module if pieces is None or step.kind != PIECE else pieces[step.index]
            step.bind(env, fn(*[env[a] for a in step.args]))
        return env

    def forward(self, *inputs: Any, pieces: Sequence[Callable[..., Any]] | None = None) -> Any:
        """The model's output, computed through the split (for parity checks and FULL + compile)."""
        return self.run(inputs, pieces)[self.output]


@dataclass
class PiecewiseEntry:
    """The captured pieces of one token bucket and the calls that replay them, attention between."""

    num_tokens: int
    calls: list[Callable[[], None]]
    graphs: list[Any]
    output: torch.Tensor
    input_ptrs: dict[str, int]
    compiled: bool
    tasks: list[Any] = field(default_factory=list)
    #: The buffers its pieces read beyond their inputs, as captured (backends/torch/live_buffers.py).
    buffers: Any = None
    #: Functional collectives each replay runs eagerly between its pieces (``collectives="eager"``).
    eager_collectives: int = 0


class _Waited:
    """A collective partition run eagerly: its outputs waited before anything reads them (a
    functional collective's result is ready only after ``wait_tensor``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any) -> Any:
        out = self.module(*args)
        wait = torch.ops._c10d_functional.wait_tensor
        if isinstance(out, torch.Tensor):
            return wait(out)
        return type(out)(wait(o) if isinstance(o, torch.Tensor) else o for o in out)


def _attr(module: torch.nn.Module, path: str) -> Any:
    """``module``'s attribute at a dotted ``path``."""
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _run_into(fn: Callable[..., Any], args: list[Any], outs: list[tuple[int | None, Any]]) -> None:
    """Call ``fn`` on ``args`` and copy each tensor output into its persistent buffer view."""
    result = fn(*args)
    for idx, dst in outs:
        if isinstance(dst, torch.Tensor):
            dst.copy_(result if idx is None else result[idx])


class PiecewiseBuffers:
    """Persistent buffers for the values that cross cuts, shared by every token bucket."""

    def __init__(self, split: SplitModel, capacity: int) -> None:
        self.split = split
        self.capacity = int(capacity)
        self._shared: dict[str, torch.Tensor] = {}
        self._own: dict[tuple[str, int], torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held by every buffer."""
        return sum(t.untyped_storage().nbytes() for t in self._tensors())

    def _tensors(self) -> Iterator[torch.Tensor]:
        yield from self._shared.values()
        yield from self._own.values()

    def bind(self, env: dict[str, Any], num_tokens: int) -> dict[str, Any]:
        """A buffer view for each tensor value of a warm-up ``env``; other values as they are.

        The split model's inputs keep their own (static) tensors, parameters stay themselves.
        """
        views: dict[str, Any] = {}
        fixed = set(self.split.inputs) | set(self.split.constants)
        for name, value in env.items():
            if name in fixed or not isinstance(value, torch.Tensor):
                views[name] = value
            else:
                views[name] = self._view(name, value, num_tokens)
        return views

    def _view(self, name: str, value: torch.Tensor, num_tokens: int) -> torch.Tensor:
        shape = tuple(value.shape)
        token_major = len(shape) >= 1 and shape[0] == num_tokens <= self.capacity
        if token_major:
            buf = self._shared.get(name)
            if buf is None:
                buf = torch.zeros((self.capacity,) + shape[1:], dtype=value.dtype, device=value.device)
                self._shared[name] = buf
            if buf.shape[1:] == shape[1:] and buf.dtype == value.dtype and buf.device == value.device:
                return buf[:num_tokens]
        own = self._own.get((name, num_tokens))
        if own is None:
            own = torch.zeros(shape, dtype=value.dtype, device=value.device)
            self._own[(name, num_tokens)] = own
        return own

    def bind_calls(self, views: dict[str, Any], pieces: Sequence[Callable[..., Any]]) -> list[Callable[[], None]]:
        """One bound call per split call over the views, in order.

        A piece call reads its inputs from the views and copies its outputs into them (the
        copies are part of the captured graph); an attention call does the same eagerly.
        """
        calls: list[Callable[[], None]] = []
        for step in self.split.calls:
            fn = step.module if step.kind != PIECE else pieces[step.index]
            args = [views[a] for a in step.args]
            outs = [(idx, views[name]) for idx, name in step.outs]
            calls.append(_bound(fn, args, outs))
        return calls


def _bound(fn: Callable[..., Any], args: list[Any], outs: list[tuple[int | None, Any]]) -> Callable[[], None]:
    def call() -> None:
        _run_into(fn, args, outs)
    return call


def compile_piece(module: torch.fx.GraphModule, args: Sequence[Any], backend: str) -> Callable[..., Any]:
    """``module`` compiled by the ``torch.compile`` backend for exactly these arguments.

    Static shapes: the compiled code is only valid for tensors laid out like ``args``
    (one compile per bucket). Non-tensor arguments are baked in as constants. The graph
    goes to the backend directly, as Dynamo would hand it over, so no Dynamo frame or
    guard runs at call time (or inside a capture).
    """
    graph = torch.fx.Graph()
    remap: dict[torch.fx.Node, Any] = {}
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    for node, arg in zip(placeholders, args):
        remap[node] = graph.placeholder(node.name) if isinstance(arg, torch.Tensor) else arg
    result = graph.graph_copy(module.graph, remap)
    single = not isinstance(result, (tuple, list))
    graph.output((result,) if single else tuple(result))
    gm = torch.fx.GraphModule(module, graph)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    compiled = torch._dynamo.lookup_backend(backend)(gm, tensors)

    def call(*call_args: Any) -> Any:
        out = compiled(*[a for a in call_args if isinstance(a, torch.Tensor)])
        return out[0] if single else out
    return call


def split_or_reason(model: torch.nn.Module, eager_collectives: bool = False) -> tuple[SplitModel | None, str | None]:
    """The split model (also at its collectives with ``eager_collectives``), or None and why it
    cannot be split."""
    try:
        return SplitModel(model, eager_collectives), None
    except SplitError as exc:
        return None, str(exc)
