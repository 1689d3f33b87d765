"""``make gpu-check`` (benchmarks/gpu_check.py) on a CPU, and its report from saved parts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402

JUNIT = """<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="3" failures="1" errors="0"
skipped="1"><testcase classname="tests.test_a" name="test_ok"/><testcase classname="tests.test_a"
name="test_bad"><failure message="boom"/></testcase><testcase classname="tests.test_a" name="test_skip">
<skipped/></testcase></testsuite></testsuites>"""
MACHINE = {"device": "NVIDIA Test GPU", "capability": "9.0", "memory_gib": 80.0, "multiprocessors": 132,
           "driver": "580.1", "torch": "2.11.0", "cuda": "13.0", "jax": "0.11.2", "jax_devices": ["cuda:0"],
           "cpu_count": 16, "revision": "abc1234", "date": "2026-11-23T00:00:00"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_without_a_gpu_it_measures_nothing_and_exits_0(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "no CUDA GPU: nothing measured" in done.stdout
    assert not (tmp_path / "report.md").exists()


def test_junit_counts_name_the_failures(tmp_path: Path) -> None:
    (tmp_path / "tests.xml").write_text(JUNIT)
    counts = gpu_check.test_counts(tmp_path / "tests.xml")
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 1, 1)
    assert counts["failures"] == ["tests.test_a::test_bad"]


def _part(out: Path, name: str, rc: int, **extra: object) -> None:
    record = {"part": name, "command": ["python", f"{name}.py"], "rc": rc, "seconds": 1.0,
              "output_tail": f"Device: NVIDIA Test GPU\n| batch | ms |\n| 1 | 0.5 |  <- {name}", **extra}
    (out / "parts").mkdir(parents=True, exist_ok=True)
    (out / "parts" / f"{name}.json").write_text(json.dumps(record))


def test_report_names_the_device_and_every_part(tmp_path: Path) -> None:
    _part(tmp_path, "tests", 0, counts={"tests": 16, "passed": 16, "failed": 0, "skipped": 0, "failures": []})
    _part(tmp_path, "cuda", 0)
    md, ok = gpu_check.write_report(tmp_path, MACHINE)
    text = md.read_text()
    assert ok
    assert "NVIDIA Test GPU" in text and "torch 2.11.0 (CUDA 13.0)" in text and "driver 580.1" in text
    assert "| tests | ok: 16 passed, 0 failed, 0 skipped |" in text and "<- cuda" in text
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["machine"]["device"] == "NVIDIA Test GPU" and set(report["parts"]) == {"tests", "cuda"}


@pytest.mark.parametrize(("counts", "rc"), [
    ({"tests": 16, "passed": 15, "failed": 1, "skipped": 0, "failures": ["t::x"]}, 1),
    ({"tests": 16, "passed": 0, "failed": 0, "skipped": 16, "failures": []}, 0),  # all skipped on a GPU
    (None, 0),  # pytest never wrote its report
])
def test_report_fails_on_failed_or_skipped_tests(tmp_path: Path, counts: dict | None, rc: int) -> None:
    _part(tmp_path, "tests", rc, **({"counts": counts} if counts else {}))
    md, ok = gpu_check.write_report(tmp_path, MACHINE)
    assert not ok


def test_a_timed_out_benchmark_fails_the_report(tmp_path: Path) -> None:
    _part(tmp_path, "cuda", 124)
    md, ok = gpu_check.write_report(tmp_path, MACHINE)
    assert not ok and "| cuda | timed out |" in md.read_text()
