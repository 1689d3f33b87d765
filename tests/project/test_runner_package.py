"""The runner package's seams (issue 44): one owner of the serving keys, the only writer of the
dispatcher (``graphrt.runner.keys.ServingKeys``); no module takes the runner as an untyped bag
(``runner: Any``) outside ``graphrt.testing``, whose kit takes an engine's own runner; warm-up,
background warm-up, the traffic re-fit and the capture plan store take the keys, never the
runner (docs/architecture.md)."""

from __future__ import annotations

import ast

import pytest

from project.test_layers import MODULES, TREES

#: Where another engine's own runner object is handled: an untyped ``runner`` is its own.
FOREIGN_RUNNERS = ("graphrt.testing",)
#: Integrations keep their own runners and dispatchers (not a ModelRunner's).
OWN_DISPATCHERS = ("graphrt.integrations",)


def runner_parameters(tree: ast.AST) -> list[tuple[int, str, str]]:
    """``(line, function, annotation)`` of every parameter named ``runner`` (annotation "" if none)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs:
                if arg.arg == "runner":
                    found.append((node.lineno, node.name, ast.unparse(arg.annotation) if arg.annotation else ""))
    return found


def untyped_runners(name: str, tree: ast.AST) -> list[str]:
    """Parameters named ``runner`` typed ``Any`` (or not at all) in module ``name``."""
    if name.startswith(FOREIGN_RUNNERS):
        return []
    return [f"line {line}: {fn}(runner: {ann or '<none>'})" for line, fn, ann in runner_parameters(tree)
            if ann in ("", "Any", "typing.Any")]


def dispatcher_writes(tree: ast.AST) -> list[str]:
    """Assignments to a ``dispatcher`` / ``_dispatcher`` attribute (``x.dispatcher = ...``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute) and leaf.attr in ("dispatcher", "_dispatcher"):
                        found.append(f"line {node.lineno}: {ast.unparse(target)}")
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_runner_is_an_untyped_bag(name: str) -> None:
    found = untyped_runners(name, TREES[name])
    assert not found, f"{name} takes the runner untyped: {found}; type it (ModelRunner under TYPE_CHECKING) " \
                      "or pass the part it reads (the serving keys, the executor)"


def test_the_runner_package_takes_its_parts_never_the_runner() -> None:
    """Warm-up, background warm-up, the re-fit and the capture plan store take the serving keys and
    the executor: no function of ``graphrt.runner`` has a ``runner`` parameter at all."""
    found = {name: runner_parameters(TREES[name]) for name in MODULES if name.startswith("graphrt.runner")}
    assert not {name: params for name, params in found.items() if params}


def test_the_dispatcher_is_assigned_in_one_module() -> None:
    writers = {name: dispatcher_writes(TREES[name]) for name in MODULES if not name.startswith(OWN_DISPATCHERS)}
    writers = {name: lines for name, lines in writers.items() if lines}
    assert set(writers) == {"graphrt.runner.keys"}, writers
    assert all("self._dispatcher" in line for line in writers["graphrt.runner.keys"]), writers


def test_the_checks_find_planted_faults() -> None:
    """The checks can fail: an untyped runner parameter, and a second writer of the dispatcher."""
    planted = ast.parse("def warm(runner: Any, n: int) -> None:\n    runner.dispatcher = n\n")
    assert untyped_runners("graphrt.runner.warmup", planted) == ["line 1: warm(runner: Any)"]
    assert untyped_runners("graphrt.testing.kit", planted) == []
    assert dispatcher_writes(planted) == ["line 2: runner.dispatcher"]
    typed = ast.parse("def watch(runner: ModelRunner) -> None:\n    pass\n")
    assert untyped_runners("graphrt.engine.watchdog", typed) == []
