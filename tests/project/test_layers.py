"""The tree shows the layers: imports point down only, there are no cycles, and the numpy
core imports neither torch, jax nor anything above it (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
#: Layer of each package or module, lowest first; a module may import its own layer or below.
#: Layer 2 is graphrt.layers' (the attention and recurrent-state seams, between core and models).
LAYERS = {
    "graphrt.core": 0,
    "graphrt.config": 1,
    "graphrt.layers": 2,
    "graphrt.models": 3,
    "graphrt.backends": 4,
    "graphrt.registry": 5,
    "graphrt.runner": 5,
    "graphrt.engine": 6,
    "graphrt.cli": 7,
    "graphrt.testing": 7,
    "graphrt.integrations": 7,
    "graphrt": 7,
}
FRAMEWORKS = {"torch", "jax", "jaxlib", "flax", "torch_npu", "safetensors", "transformers", "triton"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted((SRC / "graphrt").rglob("*.py"))}


def imports(name: str) -> tuple[set[str], set[str]]:
    """(graphrt modules, other top-level packages) that module ``name`` imports anywhere in it
    (module level, inside functions, under TYPE_CHECKING)."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    ours, others = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base]).strip(".")
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "graphrt":
                while target not in MODULES:
                    target = target.rpartition(".")[0]
                if target != name:
                    ours.add(target)
            else:
                others.add(target.split(".")[0])
    return ours, others


def layer(name: str) -> int:
    prefix = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return LAYERS[prefix]


GRAPH = {name: imports(name)[0] for name in MODULES}


def test_every_module_has_a_layer() -> None:
    assert all(layer(name) >= 0 for name in MODULES)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name: str) -> None:
    up = sorted(t for t in GRAPH[name] if layer(t) > layer(name))
    assert not up, f"{name} (layer {layer(name)}) imports {up} from above"


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(MODULES):
        if name not in state:
            visit(name)


@pytest.mark.parametrize("name", sorted(n for n in MODULES if layer(n) == 0))
def test_core_needs_no_framework(name: str) -> None:
    assert not imports(name)[1] & FRAMEWORKS, f"{name} imports {sorted(imports(name)[1] & FRAMEWORKS)}"


def test_a_planted_cycle_and_an_upward_import_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above can fail: a core module importing the runner is both."""
    graph = {**GRAPH, "graphrt.core.cache": GRAPH["graphrt.core.cache"] | {"graphrt.runner"}}
    monkeypatch.setattr(__import__(__name__), "GRAPH", graph, raising=False)
    with pytest.raises(AssertionError, match="imports .*graphrt.runner.* from above"):
        test_imports_point_down("graphrt.core.cache")
    with pytest.raises(pytest.fail.Exception, match="import cycle"):
        test_no_import_cycles()


# ---- the top-level picture -----------------------------------------------------------------

def room(name: str) -> str:
    """The top-level entry (a module or package of ``graphrt``) a module belongs to."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


ROOMS = {room(name): set() for name in MODULES}
for _name, _targets in GRAPH.items():
    ROOMS[room(_name)].update(room(t) for t in _targets if room(t) != room(_name))


def floors(rooms: dict[str, set[str]]) -> dict[str, int]:
    """Each room's floor: 1 + the highest floor it imports (1: it imports no other room); a
    circle between rooms fails."""
    floor: dict[str, int] = {}
    path: list[str] = []

    def visit(r: str) -> int:
        if r in path:
            pytest.fail("rooms import each other in a circle: " + " -> ".join(path[path.index(r):] + [r]))
        if r not in floor:
            path.append(r)
            floor[r] = 1 + max((visit(t) for t in sorted(rooms[r])), default=0)
            path.pop()
        return floor[r]

    for r in sorted(rooms):
        visit(r)
    return floor


def test_the_top_level_picture_is_small_and_flat() -> None:
    """src/graphrt holds at most 12 rooms (modules and packages) on at most 8 floors, with no
    circle between rooms (issue 44; docs/architecture.md's table)."""
    entries = sorted(p.stem if p.is_file() else p.name for p in (SRC / "graphrt").iterdir()
                     if p.name != "__pycache__" and (p.suffix == ".py" or (p / "__init__.py").exists()))
    assert entries == sorted(ROOMS) and len(entries) <= 12, entries
    assert max(floors(ROOMS).values()) <= 8, floors(ROOMS)


def test_a_circle_between_rooms_is_caught() -> None:
    with pytest.raises(pytest.fail.Exception, match="circle: .*runner.*engine.*runner|circle: .*engine.*runner.*engine"):
        floors({**ROOMS, "runner": ROOMS["runner"] | {"engine"}})


# ---- private attributes stay in their module ----------------------------------------------

def private_names(tree: ast.AST) -> set[str]:
    """``_name``s a module defines: functions, classes, assignments (``_x = ...``,
    ``self._x = ...``, class attributes), arguments excluded."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names.add(leaf.id)
                    elif isinstance(leaf, ast.Attribute):
                        names.add(leaf.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}
DEFINED = {name: private_names(tree) for name, tree in TREES.items()}


def owner_group(name: str) -> str:
    """Modules of one backend package may share private state; elsewhere a module is alone."""
    for package in ("graphrt.backends.torch", "graphrt.backends.xla"):
        if name.startswith(package + "."):
            return package
    return name


def foreign_private_reads(name: str, tree: ast.AST) -> list[str]:
    """Reads in ``name`` of a private attribute (``x._y``, x not self / cls) or import of a
    private name that only other graphrt modules, outside its backend package, define."""
    mine = DEFINED[name]
    others = {n for other, defined in DEFINED.items() if owner_group(other) != owner_group(name) for n in defined}
    own_group = {n for other, defined in DEFINED.items() if owner_group(other) == owner_group(name) for n in defined}
    found = []
    for node in ast.walk(tree):
        attr = None
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            attr = node.attr
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("graphrt"):
            for alias in node.names:
                if (alias.name.startswith("_") and not alias.name.startswith("__")
                        and owner_group(node.module) != owner_group(name)):
                    found.append(f"line {node.lineno}: imports {alias.name} from {node.module}")
            continue
        if attr is not None and attr in others and attr not in mine and attr not in own_group:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_reads_another_modules_private_attributes(name: str) -> None:
    found = foreign_private_reads(name, TREES[name])
    assert not found, f"{name} reads private attributes of other modules: {found}"


def test_a_planted_private_read_is_caught() -> None:
    """The check can fail: the runner reaching into the executor's private staging dict."""
    planted = ast.parse("def f(runner):\n    return runner.executor._host\n")
    assert foreign_private_reads("graphrt.runner", planted) == ["line 2: runner.executor._host"]
    same_package = ast.parse("def f(ex):\n    return ex._host\n")
    assert foreign_private_reads("graphrt.backends.torch.capture.piecewise_capture", same_package) == []
