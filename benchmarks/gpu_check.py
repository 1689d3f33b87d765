"""graphrt on a CUDA machine, in one command: ``make gpu-check``.

Runs these parts with the machine's own torch and JAX (it never installs either), each in
its own process:

* ``tests``      -- the ``gpu``-marked tests (``pytest -m gpu``);
* ``attention``  -- ``benchmarks/bench_attention.py``: paged attention alone, reference against Triton;
* ``cuda-quick`` -- ``benchmarks/bench_cuda.py --quick``, a smoke run (4 layers, 20 steps);
* ``cuda``       -- ``benchmarks/bench_cuda.py``, the full run (Qwen3-0.6B shape, 28 layers);
* ``xla``        -- ``benchmarks/bench_xla.py`` with JAX on the GPU;
* ``overlap``    -- ``benchmarks/bench_overlap.py --backend cuda``: engine step time, plain loop
  against overlap scheduling on CUDA graphs (the same tokens).

and writes ``report.md`` and ``report.json`` to ``--out`` (default ``.gpu-check/``), the
device, driver, torch, CUDA and JAX versions named at the top. Every part also leaves
``parts/<name>.json`` there, so parts run at different times (``--only cuda``) make one report
(``--report-only``). Exit status 1 when a part failed or a test failed, else 0.

pydantic may be missing on such a machine (it has no network). When it does not import, the
wheels in ``--wheels`` (default: ``$GRAPHRT_WHEELS``, else ``../shared/gpu-wheels``, else
``.whl``) are installed into ``<out>/site`` with ``pip --no-index --no-deps``, and the parts
run with that folder and ``src/`` on ``PYTHONPATH``.

Without a CUDA GPU it prints ``gpu-check: no CUDA GPU: nothing measured`` with the reason and
exits 0. This script needs only the standard library.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
PARTS = ("tests", "attention", "cuda-quick", "cuda", "xla", "overlap")
#: Seconds each part may run before it is stopped and reported as timed out.
PART_TIMEOUT = {"tests": 600, "attention": 600, "cuda-quick": 300, "cuda": 900, "xla": 600, "overlap": 600}
#: Characters of a part's output kept in its record (the tables are at the end).
OUTPUT_TAIL = 6000

PROBE = """
import json, torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda}
if torch.version.cuda is None:
    info["reason"] = f"this torch ({torch.__version__}) is a build without CUDA"
elif not torch.cuda.is_available():
    info["reason"] = "torch.cuda.is_available() is False (no device or no driver)"
else:
    p = torch.cuda.get_device_properties(0)
    info.update(device=torch.cuda.get_device_name(0), capability=f"{p.major}.{p.minor}",
                memory_gib=round(p.total_memory / 2**30, 1), multiprocessors=p.multi_processor_count)
print(json.dumps(info))
"""
JAX_PROBE = "import json, jax; print(json.dumps({'jax': jax.__version__, 'jax_devices': [str(d) for d in jax.devices()]}))"


def probe(env: dict[str, str]) -> dict[str, Any]:
    """What this machine has: torch, CUDA, the GPU, JAX and its devices, the driver."""
    try:
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env,
                             timeout=300)
    except subprocess.TimeoutExpired:
        return {"reason": "probing torch timed out"}
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {"reason": f"torch does not import with {sys.executable} ({last})"}
    info = json.loads(out.stdout.strip().splitlines()[-1])
    if "reason" in info:
        return info
    jax = subprocess.run([sys.executable, "-c", JAX_PROBE], capture_output=True, text=True, env=env,
                         timeout=300)
    info.update(json.loads(jax.stdout.strip().splitlines()[-1]) if jax.returncode == 0
                else {"jax": None, "jax_devices": [], "jax_problem": jax.stderr.strip()[-300:]})
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
        info["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        info["driver"] = None
    info["cpu_count"] = os.cpu_count()
    return info


def wheel_dirs(explicit: str | None) -> list[Path]:
    """Where pydantic's wheels may be, in the order tried."""
    if explicit:
        return [Path(explicit)]
    env = os.environ.get("GRAPHRT_WHEELS")
    return [Path(env)] if env else [ROOT.parent / "shared" / "gpu-wheels", ROOT / ".whl"]


def ensure_pydantic(out: Path, wheels: str | None, env: dict[str, str]) -> str | None:
    """Make pydantic importable for the parts; None when it is, else why not."""
    check = [sys.executable, "-c", "import pydantic"]
    if subprocess.run(check, env=env, capture_output=True).returncode == 0:
        return None
    found = [d for d in wheel_dirs(wheels) if d.is_dir() and list(d.glob("*.whl"))]
    if not found:
        tried = ", ".join(str(d) for d in wheel_dirs(wheels))
        return f"pydantic does not import and no wheels were found (tried {tried})"
    site = out / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, sorted(found[0].glob("*.whl")))]
    done = subprocess.run(pip, capture_output=True, text=True)
    if done.returncode != 0:
        return f"installing the wheels of {found[0]} failed: {done.stderr.strip()[-300:]}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    if subprocess.run(check, env=env, capture_output=True).returncode != 0:
        return f"pydantic still does not import after installing the wheels of {found[0]}"
    return None


def part_command(name: str, parts_dir: Path) -> list[str]:
    """The command line of one part (run from the repository root)."""
    py = sys.executable
    return {
        "tests": [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                  f"--junitxml={parts_dir / 'tests.xml'}", "tests"],
        "attention": [py, str(BENCH / "bench_attention.py"), "--json", str(parts_dir / "attention.data.json")],
        "cuda-quick": [py, str(BENCH / "bench_cuda.py"), "--quick", "--json", str(parts_dir / "cuda-quick.data.json")],
        "cuda": [py, str(BENCH / "bench_cuda.py"), "--json", str(parts_dir / "cuda.data.json")],
        "xla": [py, str(BENCH / "bench_xla.py"), "--json", str(parts_dir / "xla.data.json")],
        "overlap": [py, str(BENCH / "bench_overlap.py"), "--backend", "cuda", "--json",
                    str(parts_dir / "overlap.data.json")],
    }[name]


def test_counts(xml_path: Path) -> dict[str, Any]:
    """passed / failed / skipped and the failing test ids, from pytest's JUnit XML."""
    if not xml_path.exists():
        return {}
    suites = ET.parse(xml_path).getroot().iter("testsuite")
    counts = {"tests": 0, "failed": 0, "skipped": 0, "failures": []}
    for suite in suites:
        counts["tests"] += int(suite.get("tests", 0))
        counts["failed"] += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        counts["skipped"] += int(suite.get("skipped", 0))
        for case in suite.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                counts["failures"].append(f"{case.get('classname')}::{case.get('name')}")
    counts["passed"] = counts["tests"] - counts["failed"] - counts["skipped"]
    return counts


def run_part(name: str, parts_dir: Path, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run one part, echo its output, and save its record as ``parts/<name>.json``."""
    cmd = part_command(name, parts_dir)
    print(f"gpu-check: {name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        output = ((exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or ""))
        output += f"\n(stopped after {timeout:.0f} s)"
    seconds = time.perf_counter() - t0
    print(output, flush=True)
    record: dict[str, Any] = {"part": name, "command": cmd, "rc": rc, "seconds": round(seconds, 1),
                              "output_tail": output[-OUTPUT_TAIL:]}
    data = parts_dir / f"{name}.data.json"
    if data.exists():
        record["data"] = json.loads(data.read_text())
    if name == "tests":
        record["counts"] = test_counts(parts_dir / "tests.xml")
    (parts_dir / f"{name}.json").write_text(json.dumps(record, indent=2))
    return record


def part_ok(record: dict[str, Any]) -> bool:
    """Exit 0, and for the tests: none failed and some ran (all skipped on a GPU is a failure)."""
    counts = record.get("counts")
    if record["part"] == "tests":
        return record["rc"] == 0 and bool(counts) and counts["failed"] == 0 and counts["passed"] > 0
    return record["rc"] == 0


def bench_table(output: str) -> str:
    """The tables a benchmark printed (from its first table-ish line to the end)."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(("Device:", "Machine", "(a)", "|"))), 0)
    return "\n".join(lines[start:]).strip()


def write_report(out: Path, machine: dict[str, Any]) -> tuple[Path, bool]:
    """report.md and report.json from every ``parts/*.json`` in ``out``; (path, all ok)."""
    records = {}
    for name in PARTS:
        path = out / "parts" / f"{name}.json"
        if path.exists():
            records[name] = json.loads(path.read_text())
    ok = all(part_ok(r) for r in records.values())
    device = machine.get("device", "?")
    lines = ["# graphrt GPU check", "",
             f"**Device:** {device} (compute capability {machine.get('capability', '?')}, "
             f"{machine.get('memory_gib', '?')} GiB, {machine.get('multiprocessors', '?')} SMs), "
             f"driver {machine.get('driver') or '?'}, {machine.get('cpu_count', '?')} CPU cores.  ",
             f"**Software:** torch {machine.get('torch')} (CUDA {machine.get('cuda')}), "
             f"jax {machine.get('jax')} on {', '.join(machine.get('jax_devices') or ['?'])}, "
             f"Python {sys.version.split()[0]}.  ",
             f"**graphrt:** {machine.get('revision', '?')}; written {machine.get('date', '?')}.", "",
             "| part | result | seconds | command |", "|---|---|---:|---|"]
    for name, r in records.items():
        result = "ok" if part_ok(r) else ("timed out" if r["rc"] == 124 else f"FAILED (exit {r['rc']})")
        if r.get("counts"):
            c = r["counts"]
            result += f": {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
        cmd = " ".join(Path(a).name if a.startswith("/") else a.split("=")[0]
                       for a in r["command"][1:])
        lines.append(f"| {name} | {result} | {r['seconds']} | `{cmd}` |")
    for name, r in records.items():
        lines += ["", f"## {name}", ""]
        if name == "tests":
            failures = r.get("counts", {}).get("failures", [])
            c = r.get("counts") or {}
            lines += [f"* failed: `{f}`" for f in failures] or [
                f"{c.get('passed', 0)} `gpu`-marked tests passed, {c.get('skipped', 0)} skipped."]
            if failures or not part_ok(r):
                lines += ["", "```", r["output_tail"][-3000:].strip(), "```"]
        else:
            lines += ["```" if r["rc"] else "", bench_table(r["output_tail"]), "```" if r["rc"] else ""]
    report = {"machine": machine, "ok": ok, "parts": records}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    md = out / "report.md"
    md.write_text("\n".join(lines).rstrip() + "\n")
    return md, ok


def revision() -> str:
    try:
        rev = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        rev = ""
    return rev or "unknown revision"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts ({', '.join(PARTS)})")
    parser.add_argument("--out", default=str(ROOT / ".gpu-check"), help="where the report and parts go")
    parser.add_argument("--wheels", help="folder of wheels for what the machine lacks (pydantic)")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from saved parts")
    parser.add_argument("--timeout", type=float, help="seconds per part (default: each part's own limit)")
    args = parser.parse_args(argv)
    parts = [p for p in args.only.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    out = Path(args.out).resolve()
    parts_dir = out / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    machine = probe(env)
    if "reason" in machine:
        print(f"gpu-check: no CUDA GPU: nothing measured ({machine['reason']})")
        return 0
    machine.update(revision=revision(), date=datetime.datetime.now().isoformat(timespec="seconds"))
    if not args.report_only:
        problem = ensure_pydantic(out, args.wheels, env)
        if problem:
            print(f"gpu-check: {problem}; bring the wheels (see the docstring) and run again")
            return 1
        for name in parts:
            run_part(name, parts_dir, env, args.timeout or PART_TIMEOUT[name])
    md, ok = write_report(out, machine)
    print(md.read_text())
    print(f"gpu-check: report in {md} and {md.with_suffix('.json')}: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
