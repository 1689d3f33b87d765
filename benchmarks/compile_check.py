"""graphrt's kernels and programs compiled for the real chips on a CPU: ``make compile-check``.

Needs no device. Runs these parts with the compile venv's Python (``.venv-compile``: triton with
its bundled ptxas, jax with ``libtpu``; the Makefile builds it), each in its own process
(``benchmarks/compilecheck/``):

* ``triton`` -- every Triton kernel graphrt ships at every plan its planner picks, compiled ahead
  of time for sm_80 / sm_89 / sm_90 and AMD gfx942; shared memory, registers and spills per
  kernel against each target's limits (``compilecheck/limits.py``);
* ``xla``    -- the XLA programs of a representative configuration compiled for TPU v5e and v6e
  (and tensor parallelism over a v5e:2x2 slice) deviceless; ``memory_analysis()`` asserted:
  the caches donated (no whole-cache copy), temp bytes independent of ``num_blocks`` and within
  a stated bound (``compilecheck/xla_checks.py``);
* ``export`` -- the programs exported with ``jax.export`` for cpu, cuda and tpu, reloaded and run
  on CPU, equal to the jitted program.

Writes ``report.md`` and ``report.json`` to ``--out`` (default ``.compile-check/``); each part
leaves ``parts/<name>.json`` (``--only``, ``--report-only`` as for ``gpu_check.py``). ``--plant``
adds the planted regressions (a Triton plan over sm_80's shared memory, an XLA forward that does
not donate its KV cache): the check must then report FAIL and exit 1. Exit status 1 when a part
failed, else 0. This script needs only the standard library.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

from compilecheck.report import PARTS, write_report  # noqa: E402
from gpu_check import revision  # noqa: E402  (the same tree's description in both reports)

#: Seconds each part may run before it is stopped (the whole check: 20 minutes on 2 cores).
PART_TIMEOUT = {"triton": 900, "xla": 900, "export": 300}
OUTPUT_TAIL = 6000


def part_command(name: str, data: Path, plant: bool) -> list[str]:
    """The command line of one part."""
    cmd = [sys.executable, "-m", f"compilecheck.{name}_part", "--json", str(data)]
    return cmd + (["--plant"] if plant and name in ("triton", "xla") else [])


def run_part(name: str, parts_dir: Path, env: dict[str, str], timeout: float, plant: bool) -> dict[str, Any]:
    """Run one part, echo its output, and save its record as ``parts/<name>.json``."""
    data = parts_dir / f"{name}.data.json"
    data.unlink(missing_ok=True)
    cmd = part_command(name, data, plant)
    print(f"compile-check: {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, output = proc.returncode, proc.stdout + _quiet(proc.stderr)
    except subprocess.TimeoutExpired as exc:
        rc = 124
        output = (exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or "")
        output += f"\n(stopped after {timeout:.0f} s)"
    print(output, flush=True)
    record: dict[str, Any] = {"part": name, "command": cmd, "rc": rc,
                              "seconds": round(time.perf_counter() - t0, 1), "output_tail": output[-OUTPUT_TAIL:]}
    if data.exists():
        record["data"] = json.loads(data.read_text())
    (parts_dir / f"{name}.json").write_text(json.dumps(record, indent=1))
    return record


def _quiet(stderr: str) -> str:
    """stderr without libtpu's start-up complaints about the TPU host it is not on."""
    noise = ("WARNING: could not determine", "WARNING: Logging before InitGoogle", "common_lib.cc",
             "=== Source Location Trace", "libtpu_init_utils.cc", "Failed to find host bounds", "UserWarning: TRITON",
             "warn_once(")
    return "\n".join(line for line in stderr.splitlines() if not any(n in line for n in noise))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compile_check", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts ({', '.join(PARTS)})")
    parser.add_argument("--out", default=str(ROOT / ".compile-check"), help="where the report and parts go")
    parser.add_argument("--plant", action="store_true", default=os.environ.get("GRAPHRT_COMPILE_CHECK_PLANT") == "1",
                        help="add the planted regressions (env GRAPHRT_COMPILE_CHECK_PLANT=1): must FAIL")
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
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"))
    env.pop("TRITON_INTERPRET", None)           # the compiler, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(BENCH), env.get("PYTHONPATH")]))
    machine = {"cpu_count": os.cpu_count(), "python": sys.version.split()[0], "revision": revision(),
               "date": datetime.datetime.now().isoformat(timespec="seconds"), "plant": args.plant}
    t0 = time.perf_counter()
    if not args.report_only:
        for name in parts:
            run_part(name, parts_dir, env, args.timeout or PART_TIMEOUT[name], args.plant)
    machine["seconds"] = round(time.perf_counter() - t0, 1)
    md, ok = write_report(out, machine)
    print(md.read_text())
    print(f"compile-check: report in {md} and {md.with_suffix('.json')}: {'ok' if ok else 'FAILED'} "
          f"({machine['seconds']} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
