"""The conformance kit on hybrid models: every property, ``state_isolated`` included, holds for
graphrt's Mamba2, Granite-4-H and Qwen3-Next on the torch backends, in FULL decode, FULL mixed
and PIECEWISE graphs, with speculative decoding's K+1 padding, on eager, and on xla.

The default suite draws a few examples per configuration; the state sweep
(``python -m graphrt.testing.state_sweep --steps 10000``, figures in docs/hybrid.md) draws
thousands of steps: here a sample of it, that it catches a planted padding bug, and (``slow``)
400 steps (``GRAPHRT_HYBRID_SWEEP`` sets how many).
"""

from __future__ import annotations

import os

import pytest
import torch

from graphrt.layers.torch.state import backend as state_cache   # where the state backend builds its metadata
from graphrt.testing import state_sweep
from graphrt.testing.conformance import run_conformance
from graphrt.testing.runners import RunnerFactory
from support.hybrid_models import HYBRID_ARCHS, hybrid_model_dir

#: (model, backend, graph mode, speculative tokens): FULL graphs of uniform decode and mixed
#: steps (FULL), PIECEWISE mixed steps (FULL_AND_PIECEWISE), K+1 verification padding.
CONFIGS = [("granite", "cpu", "FULL_AND_PIECEWISE", 0), ("granite", "cpu", "FULL", 2),
           ("mamba2", "cpu", "FULL", 0), ("mamba2", "cpu", "FULL_AND_PIECEWISE", 2),
           ("granite", "eager", "NONE", 1), ("qwen3_next", "cpu", "FULL_AND_PIECEWISE", 1), ("qwen3_next", "cpu", "FULL", 0),
           ("granite", "xla", "FULL", 1), ("mamba2", "xla", "FULL", 0)]
#: Examples per property and configuration (the sweep draws the state properties by thousands).
EXAMPLES = 4


def _factory(arch: str, backend: str, mode: str, k: int) -> RunnerFactory:
    """A configuration's runner factory: this module's checkpoints (support/hybrid_models.py) with
    the sweep's capture sizes and XLA grid; the sweep's other architectures, the sweep's own."""
    if arch not in HYBRID_ARCHS:
        return sweep_factory_for(arch, backend, mode, k)
    if backend == "xla":
        return RunnerFactory(str(hybrid_model_dir(arch)), backend, num_speculative_tokens=k, **state_sweep.XLA_GRID)
    return RunnerFactory(str(hybrid_model_dir(arch)), backend, mode=mode, num_speculative_tokens=k,
                         cudagraph_capture_sizes=state_sweep.CAPTURE_SIZES)


#: The sweep's own factory (the sweep tests point ``state_sweep.factory_for`` at the shared ones).
sweep_factory_for = state_sweep.factory_for


@pytest.fixture(scope="module")
def factories():
    """One runner factory per configuration for the module: the properties' tests and the
    in-suite sweeps draw on the same warmed-up runners (the kit runs every property and every
    drawn step of a configuration on one runner anyway) instead of building and warming up each
    configuration twice. The sweep's state property is exact (which state entries a step wrote),
    so it holds on any weights; ``python -m graphrt.testing.state_sweep`` keeps its own."""
    made: dict[tuple, RunnerFactory] = {}

    def get(arch: str, backend: str, mode: str, k: int) -> RunnerFactory:
        key = (arch, backend, mode, k)
        if key not in made:
            made[key] = _factory(*key)
        return made[key]
    yield get
    made.clear()


def _run(factory: RunnerFactory, examples: int, seed: int = 0) -> list:
    lines: list[str] = []
    results = run_conformance(factory=factory, examples=examples, report=lines.append, seed=seed)
    failed = [r.name for r in results if not r.passed]
    assert failed == [], "\n".join(lines)
    return results


@pytest.mark.parametrize("arch,backend,mode,k", CONFIGS)
def test_every_property_holds_on_hybrid_models(arch, backend, mode, k, factories):
    results = _run(factories(arch, backend, mode, k), EXAMPLES)
    status = {r.name: r.status for r in results}
    assert status["state_isolated"] == "PASS" and status["kv_isolated"] == "PASS"


#: The sweep's sample: one configuration with FULL decode, PIECEWISE and K+1 steps.
SAMPLE = ("mamba2", "cpu", "FULL_AND_PIECEWISE", 2)


def test_the_state_sweep_draws_every_kind_and_finds_no_violation(factories, monkeypatch):
    monkeypatch.setattr(state_sweep, "factory_for", factories)
    lines = state_sweep.run_sweep(40, configs=[(*SAMPLE, 1)], report=None)
    assert [x.violation for x in lines] == [None] and lines[0].steps == 40
    kinds = lines[0].kinds
    assert min(kinds["FULL decode"], kinds["PIECEWISE"], kinds["K+1"], kinds["padded"], kinds["restart"]) > 0, kinds
    assert state_sweep.totals(lines).startswith("40 steps, 0 violations")


def test_the_state_sweep_finds_padded_writes_into_a_live_slot(monkeypatch):
    """Planted: every write meant for the trash slot (padded requests and tokens) goes to slot 0."""
    real = state_cache.build_state_metadata

    def into_slot_0(*args, **kw):
        meta = real(*args, **kw)
        meta.write_slot = torch.where(meta.write_slot == meta.num_slots, 0, meta.write_slot)
        return meta
    monkeypatch.setattr(state_cache, "build_state_metadata", into_slot_0)
    line = state_sweep.sweep_config(SAMPLE, 40, shrink=False)
    assert line.violation is not None and "changed state entries" in line.violation, line.line()


@pytest.mark.slow
def test_state_sweep_400_steps(factories, monkeypatch):
    """400 drawn steps (``GRAPHRT_HYBRID_SWEEP``: more) over every sweep configuration;
    docs/hybrid.md records the 10,000-step run of ``python -m graphrt.testing.state_sweep``.
    The configurations the properties' tests above share run on their runners."""
    monkeypatch.setattr(state_sweep, "factory_for", factories)
    total = int(os.environ.get("GRAPHRT_HYBRID_SWEEP", "400"))
    lines = state_sweep.run_sweep(total, report=None)
    assert [x.line() for x in lines if x.violation] == []
    assert sum(x.steps for x in lines) >= total
