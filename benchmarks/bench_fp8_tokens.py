"""How often does an fp8 KV cache change greedy tokens? (issue 30)

The same prompts are generated greedily by ``graphrt.LLM`` with ``kv_cache_dtype`` ``auto``
(float32, the weights'), ``fp8`` (float8_e4m3fn) and ``fp8_e5m2``, side by side in one run, on
tiny random-weight Qwen3 models (several seeds and widths: no trained checkpoint is reachable
here). Reported per KV dtype, against the float cache's run:

* **teacher-forced flips**: with every request fed the float run's tokens (prompt + generated,
  as a prompt with ``prompt_logprobs=1``), the share of positions after the prompt where the
  fp8 cache's most likely token differs from the float cache's -- the rate at which fp8 alone
  changes a greedy choice, free of earlier divergence;
* **sequences equal**: requests whose whole greedy continuation is the float run's;
* **first divergence**: the median generated position of the first differing token, over the
  requests that diverge;
* the float run's median top-1 / top-2 logprob gap, for scale: random weights give flat
  distributions (small gaps), where a small perturbation flips a choice more often than in a
  trained model; and the flips at the positions whose float top-1 leads by more than
  ``CLEAR_GAP`` nats (clear choices).

Run: ``python benchmarks/bench_fp8_tokens.py [--quick] [--json out.json]``. Backend ``eager``
(graphrt's reference kernel: fp8 through byte views, scale 1.0).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from bench_common import cpu_line, random_prompts, tiny_model_dir

KV_DTYPES = ("auto", "fp8", "fp8_e5m2")
#: (seed, hidden) of each model; the workload per model: requests, prompt tokens, generated tokens.
MODELS = ((0, 64), (1, 64), (2, 128), (3, 128))
REQUESTS, PROMPT, GENERATED = 16, 24, 32
#: A float top-1 / top-2 logprob gap (nats) above which a choice counts as clear.
CLEAR_GAP = 0.5


def _llm(model_dir: str, kv_cache_dtype: str) -> Any:
    import graphrt

    return graphrt.LLM(model_dir, backend="eager", kv_cache_dtype=kv_cache_dtype, max_model_len=128,
                       max_num_seqs=REQUESTS, max_num_batched_tokens=2048, block_size=16,
                       num_kv_blocks=REQUESTS * 8 + 1, enable_prefix_caching=False, max_logprobs=2,
                       watchdog_timeout=None)


def top1(llm: Any, sequences: list[list[int]]) -> tuple[list[list[int]], list[float]]:
    """Per sequence, the most likely token after each position from ``PROMPT`` on (teacher
    forced), and the top-1 / top-2 logprob gaps there."""
    import graphrt

    outs = llm.generate(sequences, graphrt.SamplingParams(max_tokens=1, prompt_logprobs=2, ignore_eos=True))
    best, gaps = [], []
    for out in outs:
        rows = out.prompt_logprobs[PROMPT:]
        picks = []
        for row in rows:
            ranked = sorted(row.items(), key=lambda kv: kv[1].rank)
            picks.append(ranked[0][0])
            gaps.append(ranked[0][1].logprob - ranked[1][1].logprob)
        best.append(picks)
    return best, gaps


def run_model(seed: int, hidden: int, generated: int) -> dict[str, Any]:
    import graphrt

    prompts = random_prompts(REQUESTS, PROMPT, vocab=256, seed=seed)
    greedy = graphrt.SamplingParams(max_tokens=generated, ignore_eos=True)
    with tiny_model_dir("fp8tok-", vocab=256, hidden=hidden, layers=2, max_model_len=128, seed=seed) as d:
        runs = {}
        for kv in KV_DTYPES:
            llm = _llm(str(d), kv)
            tokens = [o.token_ids for o in llm.generate(prompts, greedy)]
            runs[kv] = {"tokens": tokens, "llm": llm}
        forced_inputs = [p + t[:-1] for p, t in zip(prompts, runs["auto"]["tokens"])]
        picks = {kv: top1(runs[kv]["llm"], forced_inputs) for kv in KV_DTYPES}
        for run in runs.values():
            run["llm"].close()
    want = runs["auto"]["tokens"]
    out: dict[str, Any] = {"seed": seed, "hidden": hidden, "gap": statistics.median(picks["auto"][1])}
    for kv in KV_DTYPES[1:]:
        got = runs[kv]["tokens"]
        forced = [a != b for fa, fb in zip(picks["auto"][0], picks[kv][0]) for a, b in zip(fa, fb)]
        clear = [flip for flip, gap in zip(forced, picks["auto"][1]) if gap > CLEAR_GAP]
        first = [next(i for i, (a, b) in enumerate(zip(g, w)) if a != b) for g, w in zip(got, want) if g != w]
        out[kv] = {"flips": sum(forced), "positions": len(forced), "equal": sum(g == w for g, w in zip(got, want)),
                   "first": first, "clear_flips": sum(clear), "clear": len(clear)}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two models, 16 generated tokens")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    models = MODELS[:2] if args.quick else MODELS
    generated = 16 if args.quick else GENERATED
    results = [run_model(seed, hidden, generated) for seed, hidden in models]
    print(f"\nfp8 KV cache vs float32, greedy, {REQUESTS} requests x {PROMPT}-token prompts x {generated} tokens per "
          f"model; {cpu_line()}")
    print(f"{'model':<16}{'kv':<10}{'teacher-forced flips':>22}{'sequences equal':>17}{'first divergence':>18}"
          f"{'top-1 gap':>11}")
    totals = {kv: [0, 0, 0, [], 0, 0] for kv in KV_DTYPES[1:]}
    for r in results:
        for kv in KV_DTYPES[1:]:
            m = r[kv]
            t = totals[kv]
            t[0] += m["flips"]
            t[1] += m["positions"]
            t[2] += m["equal"]
            t[3] += m["first"]
            t[4] += m["clear_flips"]
            t[5] += m["clear"]
            first = f"{statistics.median(m['first']):.0f}" if m["first"] else "-"
            print(f"{'seed %d, h %d' % (r['seed'], r['hidden']):<16}{kv:<10}"
                  f"{m['flips']:>5} / {m['positions']:<4} {100 * m['flips'] / m['positions']:>5.1f}%"
                  f"{m['equal']:>10} / {REQUESTS:<4}{first:>14}{r['gap']:>13.3f}")
    for kv, (flips, positions, equal, first, clear_flips, clear) in totals.items():
        median = f"{statistics.median(first):.0f}" if first else "-"
        print(f"{'all':<16}{kv:<10}{flips:>5} / {positions:<4} {100 * flips / positions:>5.1f}%"
              f"{equal:>10} / {REQUESTS * len(results):<4}{median:>13}")
    for kv, (_, _, _, _, clear_flips, clear) in totals.items():
        print(f"{kv}: teacher-forced flips where the float top-1 leads by more than {CLEAR_GAP} nats: "
              f"{clear_flips} / {clear}" + (f" ({100 * clear_flips / clear:.1f}%)" if clear else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
