"""Time per sampled step of the random sampler (issue 35): the threshold sampler against the
sort-based sampler it replaced, side by side in one run, on a Qwen-sized vocabulary (151,936).

A step is what the torch executor does for a random batch: fresh Exp(1) noise for every row
(``exponential_``, the same for both) and the sampler on ``[rows, vocab]`` float32 logits.

* ``sort``      -- the old sampler: sort each row, top-k / top-p on the sorted prefix, scatter
  back (kept as the test oracle in ``tests/support/sampler_reference.py``, imported from there);
* ``threshold`` -- :func:`graphrt.backends.torch.sampling.sampler_ops.sample_rows` on a persistent
  :class:`~graphrt.backends.torch.sampling.sampler_ops.Workspace`, as the captured graph runs it (its
  top-p search runs whatever the rows ask: the graph is static).

Settings: ``temperature`` (T=0.8, no filter), ``top-p`` (T=0.8, top_p=0.9), ``top-k+top-p``
(top_k=50, top_p=0.9), at 1, 8, 64 and 256 rows. Reports the median milliseconds of a few runs;
the checks: the threshold sampler is not slower at any size and faster at 64 and 256 rows with
top-p.

Run: ``python benchmarks/bench_sampler.py [--quick]`` (quick: 1, 8 and 64 rows, fewer runs).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from bench_common import cpu_line, print_checks

from graphrt.backends.torch.sampling.sampler_ops import Workspace, sample_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.sampler_reference import sort_sample  # noqa: E402  (the oracle lives with the tests)

VOCAB = 151_936
SETTINGS = {"temperature": (-1, 1.0), "top-p": (-1, 0.9), "top-k+top-p": (50, 0.9)}


def _median_ms(fn: Callable[[], object], runs: int) -> float:
    fn()                                     # first call: allocator and thread pool warm
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def time_step(rows: int, top_k: int, top_p: float, runs: int) -> dict[str, float]:
    """Median ms per step of both samplers for one setting; checks they draw the same tokens."""
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, VOCAB, generator=g) * 3
    temperature = torch.full((rows,), 0.8)
    k = torch.full((rows,), VOCAB if top_k < 0 else top_k, dtype=torch.int64)
    p, min_p = torch.full((rows,), top_p), torch.zeros(rows)
    noise = torch.empty(rows, VOCAB)
    ws = Workspace(rows, VOCAB, logits.device)

    def new() -> torch.Tensor:
        noise.exponential_(generator=g)
        return sample_rows(logits, temperature, k, p, min_p, noise, ws)

    def old() -> torch.Tensor:
        noise.exponential_(generator=g)
        return sort_sample(logits, temperature, k, p, noise)

    with torch.no_grad():
        noise.exponential_(generator=g)
        same = torch.equal(sample_rows(logits, temperature, k, p, min_p, noise.clone(), ws),
                           sort_sample(logits, temperature, k, p, noise))
        return {"sort": _median_ms(old, runs), "threshold": _median_ms(new, runs), "same": same}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1, 8 and 64 rows, fewer runs")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a shared machine a parallel op waits for a "
                             "descheduled peer thread, milliseconds per op, whatever its size)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = (1, 8, 64) if args.quick else (1, 8, 64, 256)
    print(f"sampler step, vocabulary {VOCAB}, torch {torch.__version__} on {cpu_line()}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'rows':>5} {'setting':<12} {'sort ms':>10} {'threshold ms':>13} {'speed-up':>9}  same tokens")
    results, checks = {}, {}
    for rows in sizes:
        runs = 3 if rows >= 64 else 7
        for name, (top_k, top_p) in SETTINGS.items():
            r = results[(rows, name)] = time_step(rows, top_k, top_p, 2 if args.quick else runs)
            print(f"{rows:>5} {name:<12} {r['sort']:>10.2f} {r['threshold']:>13.2f} "
                  f"{r['sort'] / r['threshold']:>8.1f}x  {r['same']}")
            checks[f"{rows} rows, {name}: same tokens as the sort-based sampler"] = r["same"]
            checks[f"{rows} rows, {name}: not slower"] = r["threshold"] <= r["sort"]
    for rows in (64, 256):
        if rows in sizes:
            r = results[(rows, "top-p")]
            checks[f"{rows} rows, top-p: faster"] = r["threshold"] < r["sort"]
    ok = print_checks(checks)
    return {"results": {f"{k[0]}/{k[1]}": v for k, v in results.items()}, "all_pass": ok}


if __name__ == "__main__":
    sys.exit(0 if main()["all_pass"] else 1)
