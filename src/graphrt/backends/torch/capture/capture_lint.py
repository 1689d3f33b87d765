"""``graphrt lint``: what in a model would stop or corrupt a graph capture, named per module.

Where the recording graph stops at the first bad op, the lint's modes note every one and let it
run, so one forward names all of them under their modules and at the file and line that issued
them, with the fix: host syncs, data-dependent shapes, process-group collectives, and (two
steps of one shape, a step of another shape between them) baked host values -- a value a layer
carries from one forward to the next included. aten ops only. docs/testing.md, "Before
capturing: graphrt lint"."""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from graphrt.backends.torch.recording_ops import (DYNAMIC_SHAPE_OPS, HOST_SYNC_OPS, TENSOR_HOST_READS,
                                                  capture_violation)

#: The kinds of finding, each with its fix.
FIXES: dict[str, str] = {
    "host sync": "keep the value on the device (tensor ops, torch.where, masks), or compute it before the "
                 "forward and pass it in a buffer the graph reads",
    "data-dependent shape": "use a fixed-size alternative (torch.where / masked_fill instead of x[mask], "
                            "nonzero_static, scatter_add_ into a fixed length, output_size=)",
    "collective": "use torch.distributed._functional_collectives, which graphs record and replay",
    "baked host value": "make the value part of the graph key (a bucket) or write it into a device buffer "
                        "the graph reads and refresh that buffer before each replay; a value kept from the "
                        "previous forward (self.n = ...) is stale in a graph: take it from the step's inputs",
    "data-dependent control flow": "replace the Python branch on a tensor value by device ops (torch.where), "
                                   "so every step of a shape runs the same ops",
}
OUTSIDE = "(outside the model's modules)"
#: Code a hazard is never blamed on: torch, the standard library, this module.
_NOT_USER_CODE = tuple(os.path.dirname(p) + os.sep for p in (torch.__file__, contextlib.__file__)) + (
    sysconfig.get_paths()["stdlib"] + os.sep, __file__)


def _where() -> str:
    """``file:line: source`` of the innermost frame outside torch, the standard library and this
    module: the line of the model's code that issued the op being noted."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_USER_CODE):
        frame = frame.f_back
    if frame is None:
        return ""
    path, line = frame.f_code.co_filename, frame.f_lineno
    shown = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
    return f"{shown}:{line}: {linecache.getline(path, line).strip()}"


@dataclass
class Finding:
    """One thing that would stop or corrupt a capture, where it happened and how to fix it."""

    module: str
    kind: str
    what: str
    detail: str = ""
    count: int = 1
    where: str = ""           # "file:line: source" of the model's code that issued the op

    @property
    def fix(self) -> str:
        return FIXES[self.kind]

    def __str__(self) -> str:
        times = f" (x{self.count})" if self.count > 1 else ""
        detail = f": {self.detail}" if self.detail else ""
        where = f"\n    at {self.where}" if self.where else ""
        return f"{self.module}: {self.kind}: {self.what}{times}{detail}{where}\n    fix: {self.fix}"


@dataclass
class LintReport:
    """Every finding of a lint, in the order first seen, and the ops the forward ran."""

    findings: list[Finding] = field(default_factory=list)
    num_ops: int = 0

    @property
    def clean(self) -> bool:
        return not self.findings

    def modules(self) -> list[str]:
        return list(dict.fromkeys(f.module for f in self.findings))

    def __str__(self) -> str:
        if self.clean:
            return f"no capture hazards in {self.num_ops} ops"
        lines = [str(f) for f in self.findings]
        lines.append(f"{len(self.findings)} finding(s) in {len(self.modules())} module(s) over {self.num_ops} ops")
        return "\n".join(lines)


class _Tracker:
    """The module path each op runs under, from global forward (pre-)hooks."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.names = {id(m): name or type(root).__name__ for name, m in root.named_modules()}
        self.stack: list[str] = []
        self._handles: list[Any] = []

    def __enter__(self) -> "_Tracker":
        def pre(module: torch.nn.Module, args: Any) -> None:
            self.stack.append(self.names.get(id(module), self.stack[-1] if self.stack else OUTSIDE))

        def post(module: torch.nn.Module, args: Any, out: Any) -> None:
            if self.stack:
                self.stack.pop()

        self._handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                         torch.nn.modules.module.register_module_forward_hook(post, always_call=True)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    @property
    def here(self) -> str:
        return self.stack[-1] if self.stack else OUTSIDE


class _Notes:
    """What one forward did: findings (deduplicated per module, kind and op) and each op's numbers."""

    def __init__(self, tracker: _Tracker) -> None:
        self.tracker = tracker
        self.findings: dict[tuple[str, str, str], Finding] = {}
        self.ops: list[tuple[str, str, tuple[Any, ...], str]] = []    # module, op, its numbers, where
        self.host_read_depth = 0

    def note(self, kind: str, what: str, detail: str = "") -> None:
        key = (self.tracker.here, kind, what)
        if key in self.findings:
            self.findings[key].count += 1
        else:
            self.findings[key] = Finding(self.tracker.here, kind, what, detail, where=_where())


def _kind(func: Any) -> str:
    if func.namespace == "c10d":
        return "collective"
    return "host sync" if func.overloadpacket in HOST_SYNC_OPS else "data-dependent shape"


def _what(func: Any) -> str:
    packet = func.overloadpacket
    if packet in HOST_SYNC_OPS:
        return f"{HOST_SYNC_OPS[packet]} ({func})"
    if packet in DYNAMIC_SHAPE_OPS:
        return f"{DYNAMIC_SHAPE_OPS[packet][0]} ({func})"
    return str(func)


class _DispatchNotes(TorchDispatchMode):
    def __init__(self, notes: _Notes) -> None:
        super().__init__()
        self.notes = notes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        notes = self.notes
        violation = capture_violation(func, args, kwargs)
        if violation is not None and not (notes.host_read_depth and func.overloadpacket in HOST_SYNC_OPS):
            notes.note(_kind(func), _what(func))
        numbers = tuple(v for v in tree_leaves((args, kwargs)) if isinstance(v, (bool, int, float)))
        notes.ops.append((notes.tracker.here, str(func), numbers, _where()))
        return func(*args, **kwargs)


class _FunctionNotes(TorchFunctionMode):
    def __init__(self, notes: _Notes) -> None:
        super().__init__()
        self.notes = notes

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in TENSOR_HOST_READS:
            return func(*args, **kwargs)
        self.notes.note("host sync", TENSOR_HOST_READS[func])
        self.notes.host_read_depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.notes.host_read_depth -= 1


@contextlib.contextmanager
def noting(model: torch.nn.Module) -> Iterator[_Notes]:
    """Within the block, every op the model runs is noted (not refused) under its module."""
    with _Tracker(model) as tracker:
        notes = _Notes(tracker)
        with _FunctionNotes(notes), _DispatchNotes(notes), torch.no_grad():
            yield notes


def lint_forward(model: torch.nn.Module, run: Callable[[int], Any],
                 between: Callable[[], Any] | None = None) -> LintReport:
    """Lint ``model`` over ``run(0)`` and ``run(1)``: two forwards of the same shape on different
    contents (``run`` calls the model; whatever else it runs is outside the model's modules and
    not compared), after one unnoted ``run(0)`` for one-time work, with ``between()`` -- a step of
    another shape -- run unnoted between them, so a value the model carries from one forward to
    the next differs between the two."""
    with torch.no_grad():
        run(0)                           # one-time work (lazy initialisation) out of the comparison
    notes = []
    for i in range(2):
        if i and between is not None:
            with torch.no_grad():
                between()
        with noting(model) as n:
            run(i)
        notes.append(n)
    first, second = notes
    found = dict(first.findings)
    for key, f in second.findings.items():
        found.setdefault(key, f)
    first.ops = [op for op in first.ops if op[0] != OUTSIDE]
    second.ops = [op for op in second.ops if op[0] != OUTSIDE]
    for a, b in zip(first.ops, second.ops):
        if a[:2] != b[:2]:
            key = (b[0], "data-dependent control flow", a[1])
            found.setdefault(key, Finding(b[0], "data-dependent control flow", f"ran {a[1]} on one step and {b[1]} "
                                                                               "on another of the same shape",
                                          where=b[3]))
            break
        if a[2] != b[2]:
            differing = [(x, y) for x, y in zip(a[2], b[2]) if x != y][:3]
            key = (a[0], "baked host value", a[1])
            if key not in found:
                found[key] = Finding(a[0], "baked host value", a[1],
                                     "; ".join(f"{x!r} on one step, {y!r} on another" for x, y in differing),
                                     where=a[3])
            else:
                found[key].count += 1
    if len(first.ops) != len(second.ops) and not any(f.kind == "data-dependent control flow" for f in found.values()):
        last = first.ops[-1] if first.ops else (OUTSIDE, "", (), "")
        found[(last[0], "data-dependent control flow", "")] = Finding(
            last[0], "data-dependent control flow", f"{len(first.ops)} ops on one step, {len(second.ops)} on another",
            where=last[3])
    findings = [f for f in found.values() if f.module != OUTSIDE]
    return LintReport(findings, len(first.ops))


__all__ = ["FIXES", "Finding", "LintReport", "lint_forward", "noting"]
