"""Adding a recurrent kernel touches one file and its registration: a toy set
(tests/support/toy_recurrent.py) registered by name is chosen once by the state backend, runs
in graphrt's mixers, gives the reference kernels' logits and passes the kit's state properties."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import graphrt
from graphrt.layers.torch.state.kernels import (register_recurrent_kernels, select_recurrent_kernels,
                                                  unregister_recurrent_kernels)
from graphrt.testing.conformance import run_conformance
from graphrt.testing.runners import RunnerFactory
from support.hybrid_models import hybrid_model_dir
from support.toy_recurrent import CALLS, make_toy_kernels


@pytest.fixture
def toy_kernels(monkeypatch):
    register_recurrent_kernels("toy", make_toy_kernels)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield monkeypatch
    torch.set_num_threads(threads)
    unregister_recurrent_kernels("toy")


def _logits(d: str) -> tuple[np.ndarray, graphrt.ModelRunner]:
    runner = graphrt.ModelRunner(d, backend="cpu", mode="FULL", max_num_seqs=2, max_num_batched_tokens=16,
                                 max_model_len=32, block_size=4, num_kv_blocks=17, progress=False,
                                 cudagraph_capture_sizes=[2, 4])
    tokens = np.arange(64, dtype=np.int32).reshape(2, 32) % 120 + 3
    table = np.arange(1, 17, dtype=np.int32).reshape(2, 8)
    out = []
    for computed, scheduled in (((0, 0), (5, 3)), ((5, 3), (1, 1))):
        runner.execute(token_ids=tokens, block_table=table, req_rows=np.array([0, 1]),
                       num_computed_tokens=np.array(computed), num_scheduled_tokens=np.array(scheduled))
        out.append(runner.outputs.logits())
    return np.stack(out), runner


def test_a_toy_recurrent_kernel_added_in_one_file_and_registered_runs_and_passes_the_kit(toy_kernels):
    d = str(hybrid_model_dir("mamba2"))
    toy_kernels.setenv("GRAPHRT_RECURRENT", "reference")
    want, _ = _logits(d)
    toy_kernels.setenv("GRAPHRT_RECURRENT", "toy")
    before = CALLS["conv"]
    got, runner = _logits(d)
    assert runner.executor.state_backend.kernels.name == "toy" and CALLS["conv"] > before
    tol = graphrt.reduction_tolerance("float32", magnitude=float(np.abs(want).max()), width=64)
    np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=tol.atol)
    lines: list[str] = []
    results = run_conformance(factory=RunnerFactory(d, "cpu", mode="FULL", cudagraph_capture_sizes=[2, 4]),
                              examples=3, report=lines.append,
                              properties=["state_isolated", "padding_invisible", "replay_matches_eager"])
    assert [r.name for r in results if not r.passed] == [] and all(r.examples >= 1 for r in results), "\n".join(lines)


def test_a_wrong_kernel_name_is_refused_naming_the_variable_and_every_set(toy_kernels):
    """``GRAPHRT_RECURRENT`` is read and checked in one place: a value that is no set is refused,
    naming the variable and every allowed value, registered sets too."""
    toy_kernels.setenv("GRAPHRT_RECURRENT", "toyy")
    with pytest.raises(graphrt.ConfigError,
                       match=r"GRAPHRT_RECURRENT='toyy' is not one of \('auto', 'reference', 'triton', 'toy'\)"):
        select_recurrent_kernels("cpu")          # what the state backend calls when a runner is built


def test_one_function_reads_the_kernel_variable():
    """The environment variable has one reader (``kernels.requested_recurrent_kernels``)."""
    import ast
    from pathlib import Path

    def reads_it(node: ast.AST) -> bool:
        target = node.args[0] if isinstance(node, ast.Call) and node.args else \
            node.slice if isinstance(node, ast.Subscript) else None
        if target is None or "environ" not in ast.unparse(node.func if isinstance(node, ast.Call) else node.value) \
                and "getenv" not in ast.unparse(getattr(node, "func", node)):
            return False
        return "RECURRENT_ENV" in ast.unparse(target) or "GRAPHRT_RECURRENT" in ast.unparse(target)

    root = Path(graphrt.__file__).parent
    readers = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if "RECURRENT" not in text:
            continue
        tree = ast.parse(text)
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Module))):
            body = fn.body if isinstance(fn, ast.FunctionDef) else [s for s in fn.body if not isinstance(s, ast.FunctionDef)]
            if any(reads_it(n) for s in body for n in ast.walk(s) if isinstance(n, (ast.Call, ast.Subscript))):
                readers.append(f"{path.relative_to(root)}:{getattr(fn, 'name', '<module>')}")
    assert readers == ["layers/torch/state/kernels.py:requested_recurrent_kernels"], readers
