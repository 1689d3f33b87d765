"""The Triton part: every job of :mod:`compilecheck.triton_jobs` compiled ahead of time,
``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(...))``, on worker
processes, and each kernel's shared memory, registers and spills checked against its target's
limits (:mod:`compilecheck.limits`). NVIDIA targets use the ptxas bundled with Triton (its
``-v`` report gives registers and spills); AMD targets Triton's own LLVM and linker (the
``.amdhsa`` metadata gives VGPRs and spills). No GPU, no driver.

``python -m compilecheck.triton_part --json OUT [--targets sm_80,...] [--plant]``; prints a
summary, writes every record to OUT, exits 1 when a kernel fails to compile or breaks a limit.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib
import io
import json
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Any, Sequence

from compilecheck.limits import AMD, NVIDIA, TARGETS, check_kernel

_PTXAS = {"registers": r"Used (\d+) registers", "spill_bytes": r"(\d+) bytes spill stores",
          "spill_loads": r"(\d+) bytes spill loads", "stack": r"(\d+) bytes stack frame"}
_AMDGCN = {"registers": r"\.vgpr_count:\s+(\d+)", "sgprs": r"\.sgpr_count:\s+(\d+)",
           "vgpr_spills": r"\.vgpr_spill_count:\s+(\d+)", "sgpr_spills": r"\.sgpr_spill_count:\s+(\d+)"}


def _first(pattern: str, text: str) -> int | None:
    found = re.search(pattern, text)
    return int(found.group(1)) if found else None


def parse_ptxas(log: str) -> dict[str, int]:
    """Registers, spill stores / loads and stack bytes from ptxas' ``-v`` report."""
    out = {k: _first(p, log) for k, p in _PTXAS.items()}
    if out["registers"] is None:
        raise ValueError(f"no register count in ptxas' report: {log[-500:]!r}")
    return {k: int(v or 0) for k, v in out.items()}


def parse_amdgcn(asm: str) -> dict[str, int]:
    """VGPRs, SGPRs and spills from the ``.amdhsa`` metadata of an AMDGCN listing; VGPR spills
    (to scratch memory, 4 bytes a lane each) count as spill bytes, SGPR spills go to VGPR lanes."""
    out = {k: _first(p, asm) for k, p in _AMDGCN.items()}
    if out["registers"] is None:
        raise ValueError("no .vgpr_count in the AMDGCN listing")
    out = {k: int(v or 0) for k, v in out.items()}
    out["spill_bytes"] = 4 * out["vgpr_spills"]
    return out


def _init_worker(cache_dir: str) -> None:
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")     # Triton 3.9's default, said aloud


def compile_job(job: dict[str, Any]) -> dict[str, Any]:
    """Compile one job for its target; the record with the compiler's figures, or its error."""
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = TARGETS[job["target"]]
    fn = triton.jit(getattr(importlib.import_module(job["module"]), job["fn"]))
    consts = {k: getattr(tl, v[3:]) if isinstance(v, str) and v.startswith("tl.") else v
              for k, v in job["constexprs"].items()}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in job["signature"].items()
             if t.startswith("*")}
    record = {k: job[k] for k in ("kernel", "plan", "target", "num_warps", "num_stages")}
    record["planted"] = bool(job.get("planted"))
    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.always_compile = True
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(fn, job["signature"], consts, attrs),
                                    target=GPUTarget(target.backend, target.arch, target.warp_size),
                                    options={"num_warps": job["num_warps"], "num_stages": job["num_stages"]})
        if os.environ.get("COMPILE_CHECK_DEBUG"):
            sys.stderr.write(log.getvalue())
        figures = parse_ptxas(log.getvalue()) if target.backend == "cuda" else parse_amdgcn(kernel.asm["amdgcn"])
        record.update(figures, shared=int(kernel.metadata.shared))
    except Exception as exc:  # noqa: BLE001 - a compiler error is this job's result
        record["error"] = f"{type(exc).__name__}: {str(exc).strip()[-1500:]}"
    record["seconds"] = round(time.perf_counter() - t0, 2)
    return record


def judge(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with its ``problems`` (limits broken, or the compile error) and ``ok``."""
    problems = [record["error"]] if "error" in record else check_kernel(record, TARGETS[record["target"]])
    return dict(record, problems=problems, ok=not problems)


def run(jobs: Sequence[dict[str, Any]], workers: int, progress: bool = True) -> list[dict[str, Any]]:
    """Every job compiled on ``workers`` processes (spawned: no state shared with this one), each
    with a fresh Triton cache so every kernel is really compiled; records in job order."""
    cache = tempfile.mkdtemp(prefix="graphrt-compile-check-triton-")
    records: list[dict[str, Any] | None] = [None] * len(jobs)
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                                    initializer=_init_worker, initargs=(cache,)) as pool:
            futures = {pool.submit(compile_job, job): i for i, job in enumerate(jobs)}
            for done, fut in enumerate(concurrent.futures.as_completed(futures), 1):
                rec = judge(fut.result())
                records[futures[fut]] = rec
                if progress and (not rec["ok"] or done % 25 == 0 or done == len(jobs)):
                    mark = "ok" if rec["ok"] else "FAIL: " + "; ".join(rec["problems"])[:300]
                    print(f"triton [{done}/{len(jobs)}] {rec['target']} {rec['kernel']} {rec['plan']}: {mark}",
                          flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return [r for r in records if r is not None]


def summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts and per-target maxima for the report."""
    per_target: dict[str, Any] = {}
    for r in records:
        t = per_target.setdefault(r["target"], {"compiled": 0, "failed": 0, "max_shared": 0, "max_registers": 0,
                                                "max_spill_bytes": 0})
        t["failed" if not r["ok"] else "compiled"] += 1
        if "error" not in r:
            t["max_shared"] = max(t["max_shared"], r["shared"])
            t["max_registers"] = max(t["max_registers"], r["registers"])
            t["max_spill_bytes"] = max(t["max_spill_bytes"], r["spill_bytes"])
    return {"kernels": len(records), "failed": sum(not r["ok"] for r in records),
            "attention_plans": len({r["plan"] for r in records if r["kernel"] == "attention"}),
            "per_target": per_target}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilecheck.triton_part", description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where the records go")
    parser.add_argument("--targets", default=",".join(NVIDIA + AMD))
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--plant", action="store_true", help="add the planted over-sized plan (must FAIL)")
    parser.add_argument("--only-planted", action="store_true", help="compile the planted plan alone")
    parser.add_argument("--limit", type=int, default=0, help="compile only the first N jobs (a smoke run)")
    args = parser.parse_args(argv)
    from compilecheck import triton_jobs

    targets = tuple(t for t in args.targets.split(",") if t)
    t0 = time.perf_counter()
    jobs = ([dict(j, target=t) for t in targets for j in triton_jobs.planted_jobs()] if args.only_planted
            else triton_jobs.all_jobs(targets, plant=args.plant))
    if args.limit:
        jobs = jobs[:args.limit]
    skipped = []
    if any(TARGETS[t].backend == "hip" for t in targets):
        problem = amd_problem()
        if problem:
            skipped = [{"target": t, "reason": problem} for t in targets if TARGETS[t].backend == "hip"]
            jobs = [j for j in jobs if TARGETS[j["target"]].backend != "hip"]
    print(f"triton: {len(jobs)} kernels for {', '.join(targets)} on {args.workers} processes", flush=True)
    records = run(jobs, args.workers)
    import triton

    data = {"triton": triton.__version__, "seconds": round(time.perf_counter() - t0, 1), "workers": args.workers,
            "domain": _domain(), "skipped": skipped, "summary": summary(records), "records": records}
    with open(args.json, "w") as f:
        json.dump(data, f, indent=1)
    s = data["summary"]
    print(f"triton: {s['kernels']} kernels compiled, {s['failed']} failed, in {data['seconds']} s")
    return 1 if s["failed"] else 0


def amd_problem() -> str | None:
    """Why Triton's HIP backend cannot compile offline here (None: it can)."""
    try:
        from triton.backends.amd import compiler  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"Triton's AMD backend does not import ({exc})"
    return None


def _domain() -> dict[str, Any]:
    from compilecheck import triton_jobs

    d = dict(triton_jobs.ATTENTION_DOMAIN)
    d["phases"] = {k: {"num_tokens": v[0], "num_reqs": v[1]} for k, v in d["phases"].items()}
    return d


if __name__ == "__main__":
    sys.exit(main())
