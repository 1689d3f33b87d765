"""Tensor parallelism on a CPU: engine step time at TP=2 against TP=1 (issue 12, informative).

A decode-heavy workload -- 16 requests, 16-token prompts, 32 generated tokens each (greedy, EOS
ignored) -- through ``graphrt.LLM`` on the ``cpu`` backend (recorded graphs, the all-reduces
replayed over gloo) and on ``eager``, side by side:

* TP=1 with as many torch threads as cores, and with one thread;
* TP=2: rank 0 and one worker process, one thread each (two ranks on two cores).

Each round adds every request and steps the engine to the end, timing each ``step()``; a
round's figure is its median step, the report the median of the rounds. Greedy tokens must be
identical at TP=1 and TP=2 (the only check: on one CPU, sharding only adds the collectives'
cost -- the point is what that cost is).

Run: ``python benchmarks/bench_tensor_parallel.py [--quick]`` or ``graphrt bench``.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench_common import cpu_line, print_checks, random_prompts, tiny_model_dir

NUM_REQUESTS = 16
PROMPT_LEN = 16
MAX_TOKENS = 32
VOCAB = 2048
HIDDEN = 256
LAYERS = 4
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=64, block_size=16,
              cudagraph_capture_sizes=[4, 8, 16, 64, 256])


def workload(seed: int = 0) -> list[list[int]]:
    return random_prompts(NUM_REQUESTS, PROMPT_LEN, VOCAB, seed)


def run_round(llm: Any, prompts: list[list[int]]) -> tuple[list[float], list[list[int]]]:
    """Every request added, then the engine stepped to the end: seconds per step, tokens."""
    import graphrt

    params = graphrt.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts]
    done, steps = {}, []
    while llm.has_unfinished():
        t0 = time.perf_counter()
        outs = llm.step()
        steps.append(time.perf_counter() - t0)
        done.update((o.request_id, o.token_ids) for o in outs)
    return steps, [done[i] for i in ids]


def bench(model_dir: Path, backend: str, tp: int, threads: int, rounds: int) -> dict[str, Any]:
    """One engine: start-up seconds, per-round median step, and the last round's tokens."""
    import graphrt
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        llm = graphrt.LLM(str(model_dir), backend=backend, tensor_parallel_size=tp, **ENGINE)
        start = time.perf_counter() - t0
        run_round(llm, workload(seed=1)[:4])                 # untimed: first-use costs
        medians, tokens, steps = [], [], 0
        for _ in range(rounds):
            times, tokens = run_round(llm, workload())
            medians.append(float(np.median(times)) * 1e3)
            steps = len(times)
        llm.close()
    finally:
        torch.set_num_threads(saved)
    return {"backend": backend, "tp": tp, "threads": threads, "start_s": start, "steps": steps,
            "step_ms": float(np.median(medians)), "step_ms_all": medians, "tokens": tokens}


def format_report(rows: list[dict[str, Any]], rounds: int, host: str) -> str:
    lines = [f"Tensor parallelism on a CPU ({host})",
             f"{NUM_REQUESTS} requests x ({PROMPT_LEN} prompt + {MAX_TOKENS} generated tokens), greedy; tiny "
             f"Qwen3 hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}; median step of each round, median of "
             f"{rounds} round(s)", ""]
    head = (f"{'backend':<8}{'TP':>4}{'threads/rank':>14}{'start s':>9}{'steps':>7}{'step ms':>10}"
            f"{'vs TP=1 same threads':>22}  every round, ms")
    lines += [head, "-" * len(head)]
    for r in rows:
        base = next(b for b in rows if b["backend"] == r["backend"] and b["tp"] == 1 and b["threads"] == r["threads"])
        lines.append(f"{r['backend']:<8}{r['tp']:>4}{r['threads']:>14}{r['start_s']:>9.2f}{r['steps']:>7}"
                     f"{r['step_ms']:>10.3f}{r['step_ms'] / base['step_ms']:>21.2f}x  "
                     + " ".join(f"{x:.3f}" for x in r["step_ms_all"]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark, print the table and return every number."""
    parser = argparse.ArgumentParser(prog="bench_tensor_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per engine (median)")
    parser.add_argument("--quick", action="store_true", help="two rounds, cpu backend only")
    args = parser.parse_args(argv)
    rounds = 2 if args.quick else max(1, args.rounds)
    backends = ("cpu",) if args.quick else ("cpu", "eager")
    cores = os.cpu_count() or 1

    logging.getLogger("graphrt").setLevel(logging.WARNING)
    rows = []
    with tiny_model_dir("graphrt-bench-tp-", vocab=VOCAB, hidden=HIDDEN, layers=LAYERS,
                        max_model_len=ENGINE["max_model_len"]) as model_dir:
        for backend in backends:
            for tp, threads in ((1, cores), (1, 1), (2, 1)):
                rows.append(bench(model_dir, backend, tp, threads, rounds))
    load = os.getloadavg()[0]
    host = f"{cpu_line()}, no accelerator, load average {load:.1f} before the report"
    print(format_report(rows, rounds, host))
    checks = {f"{b}: TP=2 greedy tokens == TP=1's": all(
        r["tokens"] == rows[[x["backend"] for x in rows].index(b)]["tokens"] for r in rows if r["backend"] == b)
        for b in backends}
    return {"machine": host, "rounds": rounds, "checks": checks,
            "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
            "all_pass": print_checks(checks)}


if __name__ == "__main__":
    main()
