"""The conformance kit on hybrid models: every property, ``state_isolated`` included, holds for
graphrt's Mamba2, Granite-4-H and Qwen3-Next on the torch backends, in FULL decode, FULL mixed
and PIECEWISE graphs, with speculative decoding's K+1 padding, on eager, and on xla.

The default suite draws a few examples per configuration; ``test_state_isolation_sweep``
(``slow``) draws at least 10,000 steps across the models and modes (``GRAPHRT_HYBRID_SWEEP``
sets the total).
"""

from __future__ import annotations

import os

import pytest

from graphrt.testing.conformance import run_conformance
from graphrt.testing.runners import RunnerFactory
from support.hybrid_models import hybrid_model_dir

#: (model, backend, graph mode, speculative tokens): FULL graphs of uniform decode and mixed
#: steps (FULL), PIECEWISE mixed steps (FULL_AND_PIECEWISE), K+1 verification padding.
CONFIGS = [("granite", "cpu", "FULL_AND_PIECEWISE", 0), ("granite", "cpu", "FULL", 2),
           ("mamba2", "cpu", "FULL", 0), ("mamba2", "cpu", "FULL_AND_PIECEWISE", 2),
           ("granite", "eager", "NONE", 1), ("qwen3_next", "cpu", "FULL_AND_PIECEWISE", 1), ("qwen3_next", "cpu", "FULL", 0),
           ("granite", "xla", "FULL", 1), ("mamba2", "xla", "FULL", 0)]
EXAMPLES = 8


#: XLA's token x batch-size grid, kept small (every bucket is compiled at warm-up).
XLA_GRID = dict(precompile_token_paddings=[16, 32], precompile_bs_paddings=[4])


def _factory(arch: str, backend: str, mode: str, k: int) -> RunnerFactory:
    if backend == "xla":
        return RunnerFactory(str(hybrid_model_dir(arch)), backend, num_speculative_tokens=k, **XLA_GRID)
    return RunnerFactory(str(hybrid_model_dir(arch)), backend, mode=mode, num_speculative_tokens=k)


def _run(factory: RunnerFactory, examples: int, seed: int = 0) -> list:
    lines: list[str] = []
    results = run_conformance(factory=factory, examples=examples, report=lines.append, seed=seed)
    failed = [r.name for r in results if not r.passed]
    assert failed == [], "\n".join(lines)
    return results


@pytest.mark.parametrize("arch,backend,mode,k", CONFIGS)
def test_every_property_holds_on_hybrid_models(arch, backend, mode, k):
    results = _run(_factory(arch, backend, mode, k), EXAMPLES)
    status = {r.name: r.status for r in results}
    assert status["state_isolated"] == "PASS" and status["kv_isolated"] == "PASS"


@pytest.mark.slow
def test_state_isolation_sweep():
    """At least 10,000 drawn steps across the models: state_isolated (every padded row against
    every live slot, bitwise; neighbour independence) plus padding_invisible and kv_isolated,
    in FULL decode / FULL mixed / PIECEWISE graphs, with K+1 padding and reused slots."""
    total = int(os.environ.get("GRAPHRT_HYBRID_SWEEP", "10000"))
    per = -(-total // (len(CONFIGS) * 3))
    drawn = 0
    for i, config in enumerate(CONFIGS):
        factory = _factory(*config)
        lines: list[str] = []
        results = run_conformance(factory=factory, examples=per, report=lines.append, seed=1000 + i,
                                  properties=["state_isolated", "padding_invisible", "kv_isolated"])
        assert [r.name for r in results if not r.passed] == [], "\n".join(lines)
        drawn += sum(r.examples for r in results)
    assert drawn >= total
