"""PIECEWISE capture time: breakable capture against the torch.fx split (issue 14).

A tiny random Qwen3 (hidden 64, 4 layers, vocab 256), built here, is warmed up by a
``ModelRunner`` on the CPU recording graph in PIECEWISE mode over vLLM's default capture
sizes up to 512 tokens (51 sizes), once with ``piecewise_capture="fx"`` (trace and split the
model at attention, then capture each piece per size) and once with ``"breakable"`` (run the
forward once per size, breaking the capture at each attention call), alternating the two
so both see the same machine load. Reported per strategy: the warm-up's wall time (median
over rounds), the summed capture seconds of the 51 keys and the median per key, and the
bytes the graphs hold. No target: the table says which is cheaper here, and by how much.

Run: ``python benchmarks/bench_capture.py [--quick]`` or ``graphrt bench``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench_common import build_model_dir, cpu_line

VOCAB, HIDDEN, LAYERS = 256, 64, 4
LIMITS = dict(max_num_seqs=256, max_num_batched_tokens=512, max_model_len=512, block_size=16,
              max_cudagraph_capture_size=512, mode="PIECEWISE")
STRATEGIES = ("fx", "breakable")


def warm_up(model_dir: Path, strategy: str) -> dict[str, Any]:
    """Build and warm up one runner; its wall time and the per-key capture report."""
    from graphrt import ModelRunner

    t0 = time.perf_counter()
    runner = ModelRunner(str(model_dir), backend="cpu", num_kv_blocks=64, progress=False,
                         piecewise_capture=strategy, **LIMITS)
    wall = time.perf_counter() - t0
    report = [r for r in runner.executor.builder.report if r["mode"] == "PIECEWISE"]
    assert runner.executor.pieces.capture == strategy, runner.executor.pieces.capture
    return {"wall_s": wall, "keys": len(report), "capture_s": sum(r["seconds"] for r in report),
            "per_key_ms": float(np.median([r["seconds"] for r in report])) * 1e3,
            "bytes": sum(r["bytes"] for r in report)}


def format_report(results: dict[str, list[dict[str, Any]]], host: str) -> str:
    rows = {name: {k: float(np.median([run[k] for run in runs])) for k in runs[0]} for name, runs in results.items()}
    fx, br = rows["fx"], rows["breakable"]
    lines = [f"PIECEWISE capture, {int(fx['keys'])} sizes (vLLM default to 512), CPU recording graph; {host}; "
             f"median of {len(results['fx'])} round(s)",
             f"{'strategy':<10} {'warm-up s':>10} {'capture s':>10} {'per key ms':>11} {'graph MiB':>10}"]
    for name, row in rows.items():
        lines.append(f"{name:<10} {row['wall_s']:>10.2f} {row['capture_s']:>10.2f} {row['per_key_ms']:>11.1f} "
                     f"{row['bytes'] / 2**20:>10.1f}")
    lines.append(f"breakable / fx: warm-up {br['wall_s'] / fx['wall_s']:.2f}x, capture {br['capture_s'] / fx['capture_s']:.2f}x")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark, print the table and return every number."""
    parser = argparse.ArgumentParser(prog="bench_capture", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="warm-ups per strategy, alternating")
    parser.add_argument("--quick", action="store_true", help="one round (smoke run)")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds

    import torch

    torch.set_num_threads(1)
    logging.getLogger("graphrt").setLevel(logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="graphrt-bench-capture-"))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in STRATEGIES}
    try:
        model_dir = build_model_dir(root, vocab=VOCAB, hidden=HIDDEN, layers=LAYERS,
                                    max_model_len=LIMITS["max_model_len"])
        for i in range(rounds):
            for name in (STRATEGIES if i % 2 == 0 else STRATEGIES[::-1]):
                results[name].append(warm_up(model_dir, name))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    host = cpu_line() + ", 1 torch thread"
    print(format_report(results, host))
    return {"machine": host, "results": results}


if __name__ == "__main__":
    main()
