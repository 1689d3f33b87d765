"""Outside a backend package, an executor is used only through its contract: the members
``graphrt.backends.base.Executor`` declares (docs/architecture.md). A module that reaches past
it (a torch executor's ``static``, XLA's ``programs``) works on one backend and breaks on the
next; this test names each such access."""

from __future__ import annotations

import ast
from pathlib import Path

from graphrt.backends.base import Executor

SRC = Path(__file__).resolve().parents[2] / "src" / "graphrt"
#: Names an executor goes by in the code outside the backends.
EXECUTOR_NAMES = {"executor", "ex"}
#: Every member the contract declares: methods, properties, annotated and class attributes.
CONTRACT = ({n for n in dir(Executor) if not n.startswith("_")}
            | {n for n in Executor.__annotations__ if not n.startswith("_")})


def _is_executor(node: ast.AST) -> bool:
    """``executor`` / ``ex``, or any ``<something>.executor``."""
    return ((isinstance(node, ast.Name) and node.id in EXECUTOR_NAMES)
            or (isinstance(node, ast.Attribute) and node.attr == "executor"))


def outside_contract(tree: ast.AST) -> list[str]:
    """``line N: name`` for every member of an executor read, written or looked up by
    ``getattr`` / ``hasattr`` / ``setattr`` that the contract does not declare."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_executor(node.value):
            name = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and _is_executor(node.args[0]) and isinstance(node.args[1], ast.Constant)):
            name = node.args[1].value
        else:
            continue
        if name not in CONTRACT:
            found.append(f"line {node.lineno}: {name}")
    return found


def _modules() -> list[Path]:
    """Every module outside the backend packages (which implement the contract)."""
    return [p for p in sorted(SRC.rglob("*.py")) if "backends" not in p.relative_to(SRC).parts]


def test_modules_outside_the_backends_use_only_the_executor_contract() -> None:
    bad = {str(p.relative_to(SRC)): found for p in _modules()
           if (found := outside_contract(ast.parse(p.read_text())))}
    assert not bad, f"executor members outside graphrt.backends.base.Executor: {bad}"


def test_the_check_finds_a_planted_access() -> None:
    """The check can fail: a torch-only buffer read, directly and through getattr."""
    planted = ast.parse("def f(runner, ex):\n    a = runner.executor.static\n"
                        "    return getattr(ex, 'programs', None), ex.capabilities, ex.run\n")
    assert outside_contract(planted) == ["line 2: static", "line 3: programs"]


def test_the_contract_declares_what_the_runner_uses() -> None:
    """The members the runner and the kit rely on are declared, with the capabilities as one record."""
    for name in ("capabilities", "build_count", "input_ptrs", "kv_views", "dtype", "device", "run", "sample",
                 "host_buffers", "kv_cache", "state_caches", "device_buffers", "update_weights", "weight_names",
                 "sleep", "wake", "stale_buffers", "buffer_watch"):
        assert name in CONTRACT, name
