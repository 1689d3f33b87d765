"""The ``graphrt`` command line: plan, demo, their pictures, and flag errors."""

from __future__ import annotations

import re
import struct
import sys

import pytest

from graphrt.cli import main


def test_plan_compares_policies(capsys):
    assert main(["plan", "--max-num-seqs", "32", "--max-num-batched-tokens", "256", "--steps", "300"]) == 0
    out = capsys.readouterr().out
    for name in ("vLLM default", "SGLang default", "powers of two", "fitted"):
        assert name in out
    # Every policy row reports a waste percentage between 0 and 100.
    wastes = [float(w) for w in re.findall(r"\s(\d+\.\d+)\s+\d+\s+\d", out)]
    assert wastes and all(0.0 <= w <= 100.0 for w in wastes)


def test_demo_runs_graphs_on_cpu(capsys):
    assert main(["demo", "--backend", "cpu", "--num-prompts", "3", "--max-tokens", "2",
                 "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "graph mode FULL_AND_PIECEWISE" in out
    steps = re.findall(r"^\s+\d+\s+\d+\s+\d+\s+(FULL|PIECEWISE|NONE)\s", out, flags=re.M)
    assert steps and "FULL" in steps and "PIECEWISE" in steps
    assert re.search(r"eager_steps\s+0\b", out)


def test_bad_flags_are_rejected(capsys):
    assert main(["demo", "--backend", "cpu", "--max-num-seqs", "64", "--max-num-batched-tokens", "8"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--mode", "SOMETIMES"])


def test_engine_flags_reach_the_engine_and_the_data_parallel_demo_is_wired():
    from graphrt.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["demo", "--disable-overlap-schedule", "--data-parallel-size", "2",
                                      "--load-balance-method", "shortest_queue"])
    assert engine_kwargs(args)["disable_overlap_schedule"] is True
    assert (args.data_parallel_size, args.load_balance_method) == (2, "shortest_queue")
    assert engine_kwargs(build_parser().parse_args(["demo"]))["disable_overlap_schedule"] is False


# ---- pictures ---------------------------------------------------------------------------------

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path, *, min_bytes: int = 10_000, max_bytes: int = 5_000_000) -> tuple[int, int]:
    """``path`` is a PNG file of a plausible size; returns its width and height (IHDR)."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", data[:16]
    assert min_bytes < len(data) < max_bytes, len(data)
    width, height = struct.unpack(">II", data[16:24])
    assert 400 <= width <= 4000 and 200 <= height <= 8000, (width, height)
    return width, height


def test_plan_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    assert main(["plan", "--max-num-seqs", "32", "--max-num-batched-tokens", "256", "--steps", "300",
                 "--plot", str(png)]) == 0
    assert "vLLM default" in capsys.readouterr().out       # the table still comes first
    assert_png(png)


def test_demo_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "warmup.png"
    assert main(["demo", "--backend", "cpu", "--num-prompts", "1", "--max-tokens", "1", "--max-num-seqs", "2",
                 "--max-num-batched-tokens", "16", "--plot", str(png)]) == 0
    assert f"plot: {png}" in capsys.readouterr().out
    width, height = assert_png(png)
    assert height > 300                                     # a row per warm-up key


@pytest.mark.parametrize("command", [["plan", "--steps", "50"], ["demo", "--backend", "cpu"]])
def test_plot_without_matplotlib_is_a_one_line_error(command, tmp_path, capsys, monkeypatch):
    """No matplotlib: exit status 2 and one line saying what to install, before any work."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    png = tmp_path / "x.png"
    assert main([*command, "--plot", str(png)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not png.exists()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "--plot needs matplotlib" in lines[0] and "graphrt[plot]" in lines[0], lines


def test_plot_into_a_missing_directory_is_refused(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["plan", "--steps", "50", "--plot", str(tmp_path / "nowhere" / "plan.png")]) == 2
    assert "--plot: directory" in capsys.readouterr().err


def test_plan_refuses_fewer_than_one_step(capsys):
    assert main(["plan", "--steps", "0"]) == 2
    assert capsys.readouterr().err.strip() == "graphrt plan: --steps must be >= 1"


# ---- usage errors: exit 2 and one line on stderr, as argparse's own (issue 46, item 11) ---------

def one_line_usage_error(capsys, command: str) -> str:
    """The one stderr line of a usage error (nothing on stdout)."""
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and len(lines) == 1 and lines[0].startswith(f"graphrt {command}: "), captured
    return lines[0]


@pytest.mark.parametrize("flags, says", [
    (["--backend", "nosuch"], "unknown backend 'nosuch'; valid names:"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
    (["--max-tokens", "0"], "max_tokens: must be >= 1, got 0"),
    (["--temperature", "-1"], "temperature: must be in [0, 1e+06]"),
    (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1, got 0"),
])
def test_demo_flags_are_checked_before_any_work(flags, says, capsys):
    assert main(["demo", "--backend", "eager", "--num-prompts", "1", "--max-tokens", "1", *flags]) == 2
    assert says in one_line_usage_error(capsys, "demo")


def test_demo_reports_a_model_directory_the_engine_refuses_in_one_line(tmp_path, capsys):
    assert main(["demo", "--backend", "eager", "--model-dir", str(tmp_path), "--num-prompts", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"graphrt demo: model_dir: {tmp_path} has no config.json"]


@pytest.mark.parametrize("flags, says", [
    (["--model", "no_such_module_xyz:build"],
     "loading the model 'no_such_module_xyz:build' raised ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    (["--model", "{dir}/build.py:build", "--reference", "no_such_module_xyz:ref"],
     "loading the reference 'no_such_module_xyz:ref' raised ModuleNotFoundError"),
    (["--model", "{dir}/build.py:build", "--examples", "0"], "--examples must be >= 1, got 0"),
])
def test_conformance_refuses_what_it_cannot_load_in_one_line(flags, says, tmp_path, capsys):
    (tmp_path / "build.py").write_text("def build():\n    raise RuntimeError('no weights here')\n")
    flags = [f.format(dir=tmp_path) for f in flags]
    assert main(["conformance", "--backend", "cpu", *flags]) == 2
    assert says in one_line_usage_error(capsys, "conformance")


def test_conformance_names_a_builder_that_raises(tmp_path, capsys):
    (tmp_path / "build.py").write_text("def build():\n    raise RuntimeError('no weights here')\n")
    spec = f"{tmp_path / 'build.py'}:build"
    assert main(["conformance", "--model", spec, "--backend", "cpu", "--examples", "1",
                 "--property", "kv_isolated"]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"graphrt conformance: the model builder {spec} raised RuntimeError: no weights here"]


def test_bench_checks_its_flags_before_running_a_benchmark(tmp_path, capsys, monkeypatch):
    """A bad plan flag is refused before minutes of benchmarks, not after them."""
    import graphrt.cli as cli

    (tmp_path / "bench_probe.py").write_text("def main(argv):\n    print('PROBE RAN')\n    return {}\n")
    monkeypatch.setattr(cli, "benchmarks_dir", lambda: tmp_path)
    monkeypatch.setattr(cli, "BENCHMARKS", ["bench_probe"])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bench_probe", raising=False)     # and gone again after the test
    assert main(["bench", "--quick", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in one_line_usage_error(capsys, "bench")
    assert main(["bench", "--quick", "--steps", "10", "--max-num-seqs", "8"]) == 0
    assert "PROBE RAN" in capsys.readouterr().out     # the probe is a benchmark the command runs
