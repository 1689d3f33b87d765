"""Prefix cache on a shared-prefix workload: prefill tokens computed and end-to-end time (issue 13).

64 requests share a 512-token prefix (a system prompt) and each has its own 32-token suffix;
each generates 4 tokens (greedy). ``graphrt.LLM`` runs the same prompts side by side:

* without the prefix cache (``enable_prefix_caching=False``): every request prefills 544 tokens;
* with it, ``schedule_policy="fcfs"`` (the defaults): the first requests admitted compute the
  prefix (those admitted in the same step compute it too), every later one reuses its blocks;
* with it, ``schedule_policy="lpm"``: SGLang's in-batch prefix check holds back the requests
  that share the uncached prefix with one ahead of them, so it is computed once.

Each run starts with an empty cache (``reset_prefix_cache``), after an untimed warm-up run on
other prompts. Prefill tokens are the engine's ``stats["prefill_tokens"]`` (every scheduled
token except one-token decodes); end-to-end time is ``generate`` from call to return, the
median of the rounds, modes interleaved. Greedy tokens must be identical in every mode.
Targets (the default mode against no cache): >= 8x fewer prefill tokens, >= 3x faster.

Run: ``python benchmarks/bench_prefix_cache.py [--quick] [--backend eager|cpu]`` or ``graphrt bench``.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench_common import cpu_line, print_checks, tiny_model_dir

#: The workload (the issue's): requests, shared prefix, distinct suffix, generated tokens.
NUM_REQUESTS = 64
PREFIX_LEN = 512
SUFFIX_LEN = 32
MAX_TOKENS = 4
#: Tiny model and serving limits (LLM's defaults for the budget and the slots).
VOCAB = 512
HIDDEN = 64
LAYERS = 2
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 2048
MAX_MODEL_LEN = 560          # 35 blocks: the longest request (548 tokens) fits
BLOCK_SIZE = 16
#: Enough KV for every request at once without the cache (35 blocks each), plus the null block.
NUM_KV_BLOCKS = NUM_REQUESTS * -(-(PREFIX_LEN + SUFFIX_LEN + MAX_TOKENS) // BLOCK_SIZE) + 1
#: name -> LLM keywords; the first is the baseline, the second is checked against the targets.
MODES: dict[str, dict[str, Any]] = {
    "no cache": dict(enable_prefix_caching=False),
    "cache, fcfs": dict(enable_prefix_caching=True, schedule_policy="fcfs"),
    "cache, lpm": dict(enable_prefix_caching=True, schedule_policy="lpm"),
}
TARGET_PREFILL_RATIO = 8.0
TARGET_SPEEDUP = 3.0


def workload(seed: int) -> list[list[int]]:
    """NUM_REQUESTS prompts: one shared prefix, distinct suffixes."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, VOCAB, PREFIX_LEN).tolist()
    return [prefix + rng.integers(3, VOCAB, SUFFIX_LEN).tolist() for _ in range(NUM_REQUESTS)]


def run_once(llm: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """One timed generate from an empty prefix cache: seconds, prefill / cached tokens, tokens."""
    import graphrt

    llm.reset_prefix_cache()
    before = llm.stats
    params = graphrt.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    after = llm.stats
    return {"seconds": seconds, "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
            "cached_tokens": after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
            "tokens": [o.token_ids for o in outs]}


def bench(model_dir: Path, backend: str, rounds: int) -> dict[str, dict[str, Any]]:
    import graphrt

    engines = {name: graphrt.LLM(str(model_dir), backend=backend, max_num_seqs=MAX_NUM_SEQS,
                                 max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                                 max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                                 num_kv_blocks=NUM_KV_BLOCKS, **kw)
               for name, kw in MODES.items()}
    for llm in engines.values():            # untimed: first-use allocations, lazy initialisation
        run_once(llm, workload(seed=1)[:3])
    prompts = workload(seed=0)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in MODES}
    for _ in range(rounds):
        for name, llm in engines.items():
            runs[name].append(run_once(llm, prompts))
    out = {}
    for name, rs in runs.items():
        out[name] = {"seconds": float(np.median([r["seconds"] for r in rs])),
                     "seconds_all": [r["seconds"] for r in rs],
                     "prefill_tokens": rs[-1]["prefill_tokens"], "cached_tokens": rs[-1]["cached_tokens"],
                     "tokens": rs[-1]["tokens"]}
    return out


def format_report(res: dict[str, dict[str, Any]], backend: str, rounds: int, host: str) -> str:
    base = res[next(iter(MODES))]
    lines = [f"Prefix cache, shared-prefix workload ({host}; backend {backend})",
             f"{NUM_REQUESTS} requests: {PREFIX_LEN}-token shared prefix + {SUFFIX_LEN}-token distinct "
             f"suffix, {MAX_TOKENS} generated tokens each (greedy); tiny Qwen3 hidden {HIDDEN}, {LAYERS} "
             f"layers, vocab {VOCAB}; max_num_seqs {MAX_NUM_SEQS}, max_num_batched_tokens "
             f"{MAX_NUM_BATCHED_TOKENS}, block_size {BLOCK_SIZE}; end to end: median of {rounds} round(s)", ""]
    head = (f"{'mode':<14}{'prefill tokens':>16}{'cached tokens':>15}{'fewer':>8}"
            f"{'end to end s':>14}{'faster':>8}  every round, s")
    lines += [head, "-" * len(head)]
    for name, r in res.items():
        lines.append(f"{name:<14}{r['prefill_tokens']:>16}{r['cached_tokens']:>15}"
                     f"{base['prefill_tokens'] / max(r['prefill_tokens'], 1):>7.1f}x"
                     f"{r['seconds']:>14.3f}{base['seconds'] / r['seconds']:>7.2f}x  "
                     + " ".join(f"{x:.2f}" for x in r["seconds_all"]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark, print the table and return every number."""
    parser = argparse.ArgumentParser(prog="bench_prefix_cache", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="eager", choices=["eager", "cpu"])
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per mode (median)")
    parser.add_argument("--quick", action="store_true", help="one round (the workload stays the same)")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else max(1, args.rounds)

    logging.getLogger("graphrt").setLevel(logging.WARNING)
    with tiny_model_dir("graphrt-bench-prefix-", vocab=VOCAB, hidden=HIDDEN, layers=LAYERS,
                        max_model_len=MAX_MODEL_LEN) as model_dir:
        res = bench(model_dir, args.backend, rounds)
    host = f"{cpu_line()}, no accelerator"
    print(format_report(res, args.backend, rounds, host))
    names = list(MODES)
    base, default = res[names[0]], res[names[1]]
    identical = all(r["tokens"] == base["tokens"] for r in res.values())
    ratio = base["prefill_tokens"] / max(default["prefill_tokens"], 1)
    speedup = base["seconds"] / default["seconds"]
    checks = {"identical greedy tokens": identical,
              f"prefill tokens >= {TARGET_PREFILL_RATIO:g}x fewer": ratio >= TARGET_PREFILL_RATIO,
              f"end to end >= {TARGET_SPEEDUP:g}x faster": speedup >= TARGET_SPEEDUP}
    return {"machine": host, "backend": args.backend, "rounds": rounds,
            "modes": {k: {f: v for f, v in r.items() if f != "tokens"} for k, r in res.items()},
            "prefill_ratio": ratio, "speedup": speedup, "checks": checks, "all_pass": print_checks(checks)}


if __name__ == "__main__":
    main()
