"""The ``graphrt`` command line: plan, demo, and flag errors."""

from __future__ import annotations

import re

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
