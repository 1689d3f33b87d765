"""The conformance kit's entry points, as a user meets them: ``graphrt conformance`` (a model
file importing its siblings, ``--strict``, ``--reference``), the pytest entry and its plugin
(options, ini keys, thread pinning), the docs' example, and ``import graphrt`` without the kit.
The models and references are handed in by name from :mod:`kit_models`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from graphrt.testing.conformance import run_conformance
from support.kit_models import THREADS_SEEN, docs_example_code, model_dir


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread, as in test_testing_kit.py (the CLI and the plugin pin it themselves)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_capture_failure_in_strict_mode_is_a_fail_line(capsys: pytest.CaptureFixture[str]) -> None:
    """``--strict`` and a model no graph can hold: each property is a FAIL line naming the
    capture error (not a traceback), the summary counts them, the exit status is 1."""
    from graphrt.cli import main

    status = main(["conformance", "--model", "support.kit_models:item_reading_model", "--backend", "cpu",
                   "--strict", "--examples", "2", "--property", "kv_isolated", "--property", "bad_input_rejected"])
    out = capsys.readouterr().out
    assert status == 1, out
    assert "warm-up: failed" in out and "GraphCaptureError" in out, out
    for name in ("kv_isolated", "bad_input_rejected"):
        line = next(line for line in out.splitlines() if line.startswith(f"FAIL {name} "))
        error = out.split(line, 1)[1].splitlines()[1]
        assert "warm-up failed: GraphCaptureError" in error and "`.item()`" in error, out
    assert "0 of 2 properties hold; failed: kv_isolated, bad_input_rejected" in out


def test_the_cli_prints_one_line_per_property(capsys: pytest.CaptureFixture[str]) -> None:
    from graphrt.cli import main

    assert main(["conformance", "--model", model_dir(), "--backend", "eager", "--examples", "3",
                 "--property", "kv_isolated", "--property", "bad_input_rejected", "--property", "matches_reference",
                 "--reference", "support.kit_models:hf_reference_tokens"]) == 0
    out = capsys.readouterr().out
    assert "PASS kv_isolated" in out and "PASS bad_input_rejected" in out and "PASS matches_reference" in out
    assert "3 of 3 properties hold" in out


def test_the_pytest_entry_runs_the_suite(capsys: pytest.CaptureFixture[str]) -> None:
    """``pytest --pyargs graphrt.testing.conformance`` with the plugin's options (in-process:
    a second interpreter would spend most of this test importing torch)."""
    status = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "graphrt.testing.plugin",
                          "--pyargs", "graphrt.testing.conformance", "--graphrt-model", model_dir(),
                          "--graphrt-backend", "eager", "--graphrt-examples", "2",
                          "-k", "kv_isolated or bad_input or test_matches_reference"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "2 passed, 1 skipped" in out, out          # no reference given: not applicable


def run_pytest(*args: str) -> int:
    """The conformance suite's pytest entry, in-process, with the plugin loaded by hand."""
    return pytest.main(["-q", "-p", "no:cacheprovider", "-p", "graphrt.testing.plugin",
                        "--pyargs", "graphrt.testing.conformance", *args])


def test_the_pytest_plugin_pins_threads_and_takes_options_and_ini_keys(tmp_path, capsys) -> None:
    """Without a thread setting the suite pins torch to one thread (a busy machine ran it 4x
    slower unpinned) and restores it; every setting is an option and an ini key, relative
    paths in ini keys are relative to the ini file, and the suite runs once per backend."""
    THREADS_SEEN.clear()
    torch.set_num_threads(2)
    try:
        status = run_pytest("--graphrt-model", "support.kit_models:recording_model", "--graphrt-backend", "eager",
                            "--graphrt-examples", "2", "--graphrt-reference", "support.kit_models:hf_reference",
                            "-k", "bad_input or test_matches_reference")
        out = capsys.readouterr().out
        assert status == 0 and "2 passed" in out, out
        assert THREADS_SEEN == [1] and torch.get_num_threads() == 2

        (tmp_path / "strict_model.py").write_text("from support.kit_models import item_reading_model as build\n")
        ini = tmp_path / "pytest.ini"
        ini.write_text("[pytest]\ngraphrt_model = strict_model.py:build\ngraphrt_backend = cpu\n"
                       "graphrt_examples = 1\ngraphrt_threads = 3\ngraphrt_strict = true\n")
        status = run_pytest("-c", str(ini), "-k", "bad_input")
        out = capsys.readouterr().out
        assert status == 1 and "1 failed" in out, out
        assert "FAIL bad_input_rejected" in out and "warm-up failed: GraphCaptureError" in out, out
        assert THREADS_SEEN == [1, 3] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)

    ini.write_text("[pytest]\ngraphrt_model = strict_model.py:build\ngraphrt_backend = eager xla\n")
    assert run_pytest("-c", str(ini), "--collect-only", "-k", "kv_isolated") == 0
    assert "test_kv_isolated[eager]" in (out := capsys.readouterr().out) and "test_kv_isolated[xla]" in out, out
    assert run_pytest("-c", str(ini), "--collect-only", "-k", "kv_isolated", "--graphrt-backend", "cpu,eager",
                      "--graphrt-backend", "xla") == 0
    out = capsys.readouterr().out
    assert all(f"test_kv_isolated[{b}]" in out for b in ("cpu", "eager", "xla")), out
    ini.write_text("[pytest]\ngraphrt_threads = many\n")
    assert run_pytest("-c", str(ini), "--collect-only") == pytest.ExitCode.USAGE_ERROR
    assert "graphrt_threads: expected an integer, got 'many'" in capsys.readouterr().err


def test_the_docs_example_model_passes(tmp_path) -> None:
    """docs/testing.md's user-written model and attention, run as the page says."""
    (tmp_path / "my_model.py").write_text(docs_example_code())
    results = run_conformance(f"{tmp_path / 'my_model.py'}:build", "cpu", examples=3, report=None)
    assert [r.name for r in results if not r.passed] == [], [r.line() for r in results]


@pytest.fixture
def forget_modules():
    """Names of modules a test loads from its own files, dropped from ``sys.modules`` after it."""
    names: list[str] = []
    yield names
    for name in names:
        sys.modules.pop(name, None)


def test_a_model_file_imports_its_sibling_modules(tmp_path, capsys, forget_modules) -> None:
    """``--model file.py:fn`` whose file imports a module beside it, at load time and inside
    the builder, works without PYTHONPATH, and leaves ``sys.path`` as it was."""
    from graphrt.cli import main

    forget_modules += ["kit_sibling_attention", "kit_sibling_seed", "kit_sibling_model"]
    (tmp_path / "kit_sibling_attention.py").write_text(docs_example_code())
    (tmp_path / "kit_sibling_seed.py").write_text("SEED = 0\n")
    (tmp_path / "kit_sibling_model.py").write_text(
        "import torch\n\nfrom kit_sibling_attention import TinyLM\n\n\n"
        "def build():\n    from kit_sibling_seed import SEED\n\n"
        "    torch.manual_seed(SEED)\n    return TinyLM().eval()\n")
    path = list(sys.path)
    assert main(["conformance", "--model", f"{tmp_path / 'kit_sibling_model.py'}:build", "--backend", "eager",
                 "--examples", "2", "--property", "bad_input_rejected"]) == 0
    assert "PASS bad_input_rejected" in capsys.readouterr().out
    assert sys.path == path


def test_import_graphrt_stays_free_of_the_kit() -> None:
    code = ("import sys, graphrt; heavy = {'hypothesis', 'pytest', 'torch', 'jax', 'graphrt.testing'}; "
            "print(sorted(heavy & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
