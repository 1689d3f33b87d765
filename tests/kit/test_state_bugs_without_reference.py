"""Issue 47: the kit catches an own recurrent layer's state bugs without a reference.

tests/support/own_mixer.py is the trial's kind of layer (an RWKV-6 / GLA-style mixer: token
shift, a width-4 causal conv, a data-dependent-decay recurrence; three state tensors) in a tiny
hybrid model, with seven bugs an author makes in such a layer planted one at a time. With no
``--reference``, on ``cpu`` with ``k = 0`` and ``k = 2`` speculative tokens, every one fails a
property with a FAIL line that says what happened; the clean model passes every property.
``chunking_invariant`` (the tokens in other chunk splits, ``1 + k`` against ``k + 1`` single
steps) catches the ring order and the unshifted window, ``replay_deterministic`` the value
carried between forwards -- which the other properties now report as that, not as NaN, padding
or a flaky crash.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from graphrt.testing import properties
from graphrt.testing.conformance import check_property, run_conformance
from graphrt.testing.history import CAUSE
from graphrt.testing.runners import RunnerFactory
from support.fast_subset import examples
from support.kit_models import model_dir
from support.own_mixer import BUGS, own_hybrid

SRC = str(Path(__file__).resolve().parents[2] / "src")

#: bug -> (the property that must fail, a fragment of its FAIL line)
CAUGHT_BY: dict[str, tuple[str, str]] = {
    "slot0": ("state_isolated", "state isolation: "),
    "padded_rows": ("padding_invisible", "padding is visible: "),
    "no_trash": ("state_isolated", "changed state entries"),
    "conv_unshifted": ("chunking_invariant", "differ from the whole step"),
    "no_reset": ("state_isolated", "read recurrent state it must not"),
    "carried": ("replay_deterministic", "gave other results"),
    "ring_oldest": ("chunking_invariant", "differ from the whole step"),
}
#: The ring of one checkpoint (k = 0) has one order: the ring bug exists from k = 1 on.
CASES = [(bug, k) for bug in BUGS for k in (0, 2) if (bug, k) != ("ring_oldest", 0)]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def factory(bug: str | None, k: int) -> RunnerFactory:
    return RunnerFactory(functools.partial(own_hybrid, bug), "cpu", num_speculative_tokens=k)


@pytest.mark.parametrize("bug,k", CASES, ids=[f"{b}-k{k}" for b, k in CASES])
def test_a_planted_state_bug_fails_the_kit_without_a_reference(bug: str, k: int) -> None:
    lines: list[str] = []
    prop, fragment = CAUGHT_BY[bug]
    # The whole kit where every FAIL line is checked (the carried value, which fails several
    # properties); elsewhere the property that must catch the bug, a run of the whole kit each
    # costing minutes of the suite (the clean model below runs every property).
    only = None if bug == "carried" else [prop]
    results = run_conformance(factory=factory(bug, k), examples=examples(20), report=lines.append, properties=only)
    text = "\n".join(lines)
    assert "matches_reference" not in [r.name for r in results]
    failed = {r.name: r.error for r in results if not r.passed}
    assert prop in failed and fragment in failed[prop], text
    for name, error in failed.items():        # graphrt's sentence first, numpy's tolerance text after
        assert not error.startswith(("Not equal", "Arrays are not", "Mismatched")), f"{name}: {error}"
        assert "reached real outputs" not in error, f"{name}: {error}"       # no NaN leak blamed where none is
    if bug == "carried":                      # every FAIL line names the carried value first, none crashes
        assert all(CAUSE in error.split("\n")[1 if error.startswith("flaky") else 0] for error in failed.values()), \
            text
    if bug == "no_reset":
        assert "is new, 0 computed tokens: it must start from zeros" in failed["state_isolated"], text


@pytest.mark.parametrize("k", [0, 2])
def test_the_clean_own_mixer_passes_every_property(k: int) -> None:
    lines: list[str] = []
    results = run_conformance(factory=factory(None, k), examples=examples(30), report=lines.append)
    assert [r.name for r in results if not r.passed] == [], "\n".join(lines)
    assert {"chunking_invariant", "replay_deterministic", "state_isolated"} <= {r.name for r in results if r.applicable}


def test_the_ring_order_is_one_order_with_one_checkpoint() -> None:
    """k = 0: a ring of one entry, so "oldest first" is the same ring (why CASES skips it)."""
    outs = []
    for bug in (None, "ring_oldest"):
        runner = factory(bug, 0)()
        runner.execute(token_ids=np.arange(64, dtype=np.int32).reshape(1, 64) % 48,
                       block_table=np.arange(1, 17, dtype=np.int32)[None], req_rows=np.array([0], np.int32),
                       num_computed_tokens=np.array([0], np.int32), num_scheduled_tokens=np.array([5], np.int32))
        outs.append(np.concatenate([t.detach().reshape(-1).numpy() for t in runner.executor.state_caches]))
    assert np.array_equal(*outs)


def test_a_flaky_example_is_a_fail_line_naming_the_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    """An example that fails once and then passes (hypothesis' FlakyFailure) is a FAIL line
    that says the result depends on what ran before, never the raw exception."""
    calls = {"n": 0}

    def fails_once(factory, step) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise AssertionError("padding is visible: logits")
    monkeypatch.setitem(properties.PROPERTIES, "kv_isolated", (fails_once, "step"))
    result = check_property("kv_isolated", factory(None, 0), examples=3)
    assert result.status == "FAIL"
    assert result.error.startswith("flaky: the same example failed, then passed when hypothesis ran it again; "
                                   + CAUSE), result.line()
    assert "the first failure: padding is visible: logits" in result.error, result.line()
    assert "counterexample" in result.line()


def test_the_cli_reports_a_carried_value_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    from graphrt.cli import main

    status = main(["conformance", "--model", "support.own_mixer:carried_model", "--examples", "4",
                   "--property", "replay_deterministic", "--property", "state_isolated"])
    out = capsys.readouterr().out
    assert status == 1 and "Traceback" not in out and "FlakyFailure" not in out, out
    assert "FAIL replay_deterministic" in out and "a value carried between forwards" in out, out
    assert "reached real outputs" not in out, out


def test_the_cli_writes_no_hypothesis_directory_into_the_current_one(tmp_path: Path) -> None:
    """Hypothesis caches constants of local source files under ``.hypothesis/`` even with
    database=None; ``graphrt conformance`` keeps it in a temporary directory (a fresh process:
    in this one the cache is filled already)."""
    code = ("import sys; from graphrt.cli import main; sys.exit(main(['conformance', '--model', sys.argv[1], "
            "'--examples', '3', '--property', 'kv_isolated']))")
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    env.pop("HYPOTHESIS_STORAGE_DIRECTORY", None)
    done = subprocess.run([sys.executable, "-c", code, model_dir()], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS kv_isolated" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []
