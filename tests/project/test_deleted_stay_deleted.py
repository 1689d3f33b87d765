"""What issue 44 deleted stays deleted: an executor's capabilities are declared once, in its
``Capabilities`` record (no flag beside it); no module keeps a one-line alias of a graphrt
function or class under an old name; no removed-API stub (an attribute whose only job is to
raise 'this is gone') remains. docs/api.md, 'Moved module paths', names each replacement."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from graphrt.backends.base import Capabilities, Executor

SRC = Path(__file__).resolve().parents[2] / "src" / "graphrt"
FLAGS = {f.name for f in dataclasses.fields(Capabilities)}
TREES = {str(p.relative_to(SRC)): ast.parse(p.read_text()) for p in sorted(SRC.rglob("*.py"))}


def flags_beside_the_record(tree: ast.AST) -> list[str]:
    """``Class.flag`` for each capability an executor class declares apart from its record: a
    class attribute, a property or method, or ``self.flag = ...``."""
    found = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        if not any("Executor" in ast.unparse(base) for base in cls.bases):
            continue
        for node in ast.walk(cls):
            names: list[str] = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        names.append(target.id)
                    elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                          and target.value.id == "self"):
                        names.append(target.attr)
            found += [f"{cls.name}.{name}" for name in names if name in FLAGS]
    return found


def aliases(tree: ast.Module) -> list[str]:
    """``name = other`` at module level where ``other`` is a function or class the module
    defines or imports from graphrt (constants in capitals aside): an old name kept alive."""
    ours = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("graphrt")):
            ours |= {alias.asname or alias.name for alias in node.names}
    found = []
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        value = node.value
        if isinstance(value, ast.Name):
            target, base = value.id, value.id
        elif isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name):
            target, base = value.attr, value.value.id
        else:
            continue
        if base in ours and not target.isupper():
            found.append(f"line {node.lineno}: {node.targets[0].id} = {ast.unparse(value)}")
    return found


def removed_stubs(tree: ast.AST) -> list[str]:
    """Descriptors whose ``__get__`` on an instance only raises (a removed attribute's stub)."""
    return [cls.name for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
            for fn in cls.body if isinstance(fn, ast.FunctionDef) and fn.name in ("__get__", "__getattr__")
            and isinstance(fn.body[-1], ast.Raise)]


def test_capabilities_are_declared_only_in_their_record() -> None:
    assert not FLAGS & (set(vars(Executor)) | set(Executor.__annotations__)), "flags beside Executor.capabilities"
    found = {name: bad for name, tree in TREES.items() if (bad := flags_beside_the_record(tree))}
    assert not found, found


def test_no_module_keeps_an_alias_or_a_removed_api_stub() -> None:
    found = {name: bad for name, tree in TREES.items() if (bad := aliases(tree) + removed_stubs(tree))}
    assert not found, found


def test_the_checks_can_fail() -> None:
    """Planted: a flag beside the record, an alias of a selector, a stub that only raises."""
    planted = ast.parse("from graphrt.x import select_attention\n"
                        "class E(Executor):\n    has_graphs = True\n"
                        "    def __init__(self):\n        self.async_execution = False\n"
                        "choose_attention = select_attention\nNO_LORA = defaults.NO_LORA\n"
                        "class Gone:\n    def __get__(self, obj, owner=None):\n        raise AttributeError('gone')\n")
    assert flags_beside_the_record(planted) == ["E.has_graphs", "E.async_execution"]
    assert aliases(planted) == ["line 6: choose_attention = select_attention"]
    assert removed_stubs(planted) == ["Gone"]
