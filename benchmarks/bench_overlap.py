"""Overlap scheduling: engine step time with and without it (issues 13 and 25), on xla or cuda.

A decode-heavy workload -- 64 requests, 16-token prompts, 48 generated tokens each (greedy,
EOS ignored) -- through one ``graphrt.LLM``, run with the plain loop (``disable_overlap_schedule``
semantics: each step waits for its tokens) and with overlap (the host schedules and prepares
step n + 1 while the device runs step n), modes interleaved, the same compiled executables or
captured graphs for both. Step time is a ``generate`` call's seconds over its steps; the median
of the rounds is reported. Tokens must be identical. Target: >= 15 % lower step time with
overlap.

``--backend xla`` (the default; a tiny model on the CPU) or ``--backend cuda`` (CUDA graphs, the
step's outputs copied to host slots behind an event; a larger model, so that the device's share
of a step is not negligible; needs a GPU, else it says so and measures nothing). The gain is the
host's share of a step (scheduling, table writes, input preparation, output processing), which
overlap hides behind the device's; on a CPU "device" the two also share the cores, so a host
with more cores gains more.

Run: ``python benchmarks/bench_overlap.py [--backend cuda] [--quick] [--json out.json]`` or
``graphrt bench``; ``make gpu-check`` runs it on cuda (part ``overlap``).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench_common import cpu_line, print_checks, random_prompts, tiny_model_dir

#: The workload: requests, prompt tokens, generated tokens.
NUM_REQUESTS = 64
PROMPT_LEN = 16
MAX_TOKENS = 48
#: Model per backend: a tiny one on xla (the CPU), one whose decode step keeps a GPU busy for a
#: time comparable to the host's share on cuda.
MODELS = {"xla": dict(vocab=512, hidden=64, layers=2), "cuda": dict(vocab=32000, hidden=1024, layers=8)}
VOCAB, HIDDEN, LAYERS = MODELS["xla"]["vocab"], MODELS["xla"]["hidden"], MODELS["xla"]["layers"]
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 1024
MAX_MODEL_LEN = 128
BLOCK_SIZE = 16
NUM_KV_BLOCKS = NUM_REQUESTS * (MAX_MODEL_LEN // BLOCK_SIZE) + 1
#: Step time with overlap at least this much lower than without.
TARGET_REDUCTION = 0.15


def workload(seed: int, vocab: int = VOCAB) -> list[list[int]]:
    return random_prompts(NUM_REQUESTS, PROMPT_LEN, vocab, seed)


def run_once(llm: Any, overlap: bool, prompts: list[list[int]]) -> dict[str, Any]:
    """One timed generate with the loop chosen: seconds, steps, seconds per step, tokens."""
    import graphrt

    llm.overlap = overlap           # switched between calls only: nothing is in flight here
    llm.reset_prefix_cache()
    before = llm.stats
    params = graphrt.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    after = llm.stats
    steps = (after["hits"] + after["misses"]) - (before["hits"] + before["misses"])
    return {"seconds": seconds, "steps": steps, "step_ms": seconds / steps * 1e3,
            "tokens": [o.token_ids for o in outs]}


def bench(model_dir: Path, rounds: int, backend: str = "xla") -> dict[str, dict[str, Any]]:
    import graphrt

    llm = graphrt.LLM(str(model_dir), backend=backend, max_num_seqs=MAX_NUM_SEQS,
                      max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_model_len=MAX_MODEL_LEN,
                      block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS)
    if not llm.overlap:
        raise SystemExit(f"the {backend} backend should overlap its steps by default")
    vocab = MODELS[backend]["vocab"]
    modes = {"plain loop": False, "overlap": True}
    for overlap in modes.values():            # untimed: first-use allocations and dispatch caches
        run_once(llm, overlap, workload(seed=1, vocab=vocab)[:8])
    prompts = workload(seed=0, vocab=vocab)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}
    for _ in range(rounds):
        for name, overlap in modes.items():
            runs[name].append(run_once(llm, overlap, prompts))
    return {name: {"step_ms": float(np.median([r["step_ms"] for r in rs])),
                   "step_ms_all": [r["step_ms"] for r in rs], "steps": rs[-1]["steps"],
                   "seconds": float(np.median([r["seconds"] for r in rs])), "tokens": rs[-1]["tokens"]}
            for name, rs in runs.items()}


def format_report(res: dict[str, dict[str, Any]], rounds: int, host: str, backend: str = "xla") -> str:
    base = res["plain loop"]
    m = MODELS[backend]
    lines = [f"Overlap scheduling, {backend} ({host})",
             f"{NUM_REQUESTS} requests x ({PROMPT_LEN} prompt + {MAX_TOKENS} generated tokens), greedy; random "
             f"Qwen3 hidden {m['hidden']}, {m['layers']} layers, vocab {m['vocab']}; max_num_seqs {MAX_NUM_SEQS}; "
             f"median of {rounds} round(s), modes interleaved", ""]
    head = f"{'loop':<12}{'steps':>7}{'generate s':>12}{'step ms':>10}{'lower':>8}  every round, ms/step"
    lines += [head, "-" * len(head)]
    for name, r in res.items():
        lines.append(f"{name:<12}{r['steps']:>7}{r['seconds']:>12.3f}{r['step_ms']:>10.3f}"
                     f"{1 - r['step_ms'] / base['step_ms']:>7.1%}  "
                     + " ".join(f"{x:.3f}" for x in r["step_ms_all"]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark, print the table and return every number."""
    parser = argparse.ArgumentParser(prog="bench_overlap", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed runs per loop (median)")
    parser.add_argument("--quick", action="store_true", help="two rounds (the workload stays the same)")
    parser.add_argument("--backend", choices=sorted(MODELS), default="xla", help="where the steps run")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args(argv)
    rounds = 2 if args.quick else max(1, args.rounds)

    logging.getLogger("graphrt").setLevel(logging.WARNING)
    if args.backend == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("bench_overlap: no CUDA GPU is available here (torch.cuda.is_available() is False); "
                  "--backend cuda measured nothing")
            return {"machine": None, "checks": {}, "all_pass": True}
        host = f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host {cpu_line()}"
    else:
        host = f"{cpu_line()}, no accelerator"
    with tiny_model_dir("graphrt-bench-overlap-", max_model_len=MAX_MODEL_LEN, **MODELS[args.backend]) as model_dir:
        res = bench(model_dir, rounds, args.backend)
    print(format_report(res, rounds, host, args.backend))
    reduction = 1 - res["overlap"]["step_ms"] / res["plain loop"]["step_ms"]
    checks = {"identical greedy tokens": res["overlap"]["tokens"] == res["plain loop"]["tokens"],
              f"step time >= {TARGET_REDUCTION:.0%} lower with overlap": reduction >= TARGET_REDUCTION}
    out = {"machine": host, "backend": args.backend, "rounds": rounds, "reduction": reduction, "checks": checks,
           "modes": {k: {f: v for f, v in r.items() if f != "tokens"} for k, r in res.items()},
           "all_pass": print_checks(checks)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
