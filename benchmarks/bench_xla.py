"""XLA backend benchmarks (issue 5): precompiled buckets versus a plain ``jax.jit``, dispatch
overhead, and a warm start from the persistent compilation cache.

A tiny random Qwen3 (hidden 64, 2 layers, vocab 256), built here and saved to a temporary
directory, served with ``max_num_seqs`` 8, ``max_num_batched_tokens`` 64, block size 16:

(a) *trace*: 48 requests (prompts of 1-100 tokens, so some prefill in chunks; 2-12 output
    tokens) are scheduled by ``graphrt.LLM`` (recorded once on the torch ``eager`` backend,
    so both arms replay identical steps). The trace is replayed twice through

    * ``graphrt``: ``ModelRunner.execute`` on the ``xla`` backend -- warm-up precompiles every
      bucket (token buckets 16/32/64 at batch 8, decode buckets 1/2/4/8, the samplers), then
      every step runs a precompiled executable;
    * ``jax.jit``: the same reference forward (``jax_decoder.forward`` + ``compute_logits`` +
      argmax) under one plain ``jax.jit`` with the KV cache donated, called on each step's
      unpadded arrays (from the same ``InputPreparer``), so every new (tokens, requests) shape
      compiles.

    Reported: compiles (counted through ``jax.monitoring``), warm-up, first pass (what a
    server sees: compiles included for ``jax.jit``), second pass (everything compiled), and
    whether both arms pick the same greedy tokens.
(b) *dispatch overhead*: one decode step at batch 1, 4 and 8, repeated, three ways --
    ``direct`` (host copies of the padded rows into the compiled forward, the compiled greedy
    sampler, tokens to host: the least a caller of the executables can do),
    ``executor`` (``XlaExecutor.run`` + ``sample``: graphrt's dispatch) and ``runner``
    (``ModelRunner.execute``: input preparation, dispatch, padding and statistics too).
    The arms alternate step by step (rotating their order), every step timed; medians.
    Target: ``executor`` within 5 % of ``direct``.
(c) *precompile, cold versus warm*: fresh processes build a ``ModelRunner`` with a
    ``compilation_cache_dir``; the warm-up (every bucket) is timed with an empty cache
    directory (cold, with 1 compile thread and with one per core) and again with the
    directory the cold run filled (warm). Target: warm at least 5x faster than cold.

Run: ``python benchmarks/bench_xla.py [--quick] [--only a,b,c]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench_common import build_model_dir, cpu_line

VOCAB = 256
HIDDEN = 64
LAYERS = 2
MAX_NUM_SEQS = 8
MAX_NUM_BATCHED_TOKENS = 64
MAX_MODEL_LEN = 128
BLOCK_SIZE = 16
LIMITS = dict(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE)
TRACE_REQUESTS = 48
TRACE_PROMPT_LEN = (1, 100)
TRACE_MAX_TOKENS = (2, 12)
OVERHEAD_BATCHES = (1, 4, 8)
OVERHEAD_CONTEXT = 40
OVERHEAD_TARGET = 0.05
WARM_SPEEDUP_TARGET = 5.0


def machine() -> str:
    """CPU model, cores and JAX's devices, for the report."""
    import jax

    devices = jax.devices()
    return (f"{cpu_line()}; jax {jax.__version__} on {len(devices)} {devices[0].platform} "
            f"device(s), no accelerator")


# ---- (a) trace ---------------------------------------------------------------------------
def record_trace(model_dir: Path, seed: int = 0) -> tuple[list[dict[str, np.ndarray]], int]:
    """The ``execute`` arguments of every step ``graphrt.LLM`` schedules for a random workload,
    and the KV blocks it used (recorded on the torch ``eager`` backend: nothing to compile)."""
    import graphrt

    llm = graphrt.LLM(str(model_dir), backend="eager", **LIMITS)
    steps: list[dict[str, np.ndarray]] = []
    execute = llm.runner.execute

    def recording(**kwargs: Any) -> Any:
        steps.append({k: np.array(v) for k, v in kwargs.items() if k != "sampling"})
        return execute(**kwargs)

    llm.runner.execute = recording
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, VOCAB, size=int(n)).tolist()
               for n in rng.integers(*TRACE_PROMPT_LEN, size=TRACE_REQUESTS, endpoint=True)]
    params = [graphrt.SamplingParams(max_tokens=int(m), ignore_eos=True)
              for m in rng.integers(*TRACE_MAX_TOKENS, size=TRACE_REQUESTS, endpoint=True)]
    llm.generate(prompts, params)
    return steps, llm.runner.num_kv_blocks


def _greedy(n: int) -> Any:
    from graphrt import SamplingParams
    from graphrt.runner import sampling_batch
    return sampling_batch([SamplingParams()] * n, list(range(n)), VOCAB)


def run_graphrt(model_dir: Path, steps: list[dict[str, np.ndarray]], num_kv_blocks: int) -> dict[str, Any]:
    from graphrt import ModelRunner
    from graphrt.backends.xla.compile import CompileCounter
    from graphrt.backends.xla.entries import compile_report

    sampling = [_greedy(len(s["req_rows"])) for s in steps]
    runner = ModelRunner(str(model_dir), backend="xla", num_kv_blocks=num_kv_blocks, warmup=False,
                         progress=False, **LIMITS)
    with CompileCounter() as warm_counter:
        t0 = time.perf_counter()
        runner.warmup()
        warmup_s = time.perf_counter() - t0
    passes, tokens = [], []
    with CompileCounter() as serve_counter:
        for _ in range(2):
            t0 = time.perf_counter()
            out = [runner.execute(**s, sampling=sp) for s, sp in zip(steps, sampling)]
            passes.append(time.perf_counter() - t0)
            tokens.append(out)
    keys = sorted({str(k) for _, k in runner.cache})
    report = compile_report(runner.cache, runner.sampler_cache)
    sampler_s = sum(r["lower_s"] + r["compile_s"] for r in report if r["key"].startswith("sampler"))
    return {"runner": runner, "warmup_s": warmup_s, "pass_s": passes, "tokens": tokens[0],
            "compile_s": warm_counter.seconds + serve_counter.seconds, "sampler_build_s": sampler_s,
            "compiles_warmup": warm_counter.compiles, "compiles_serving": serve_counter.compiles,
            "executables": len(runner.cache) + len(runner.sampler_cache), "buckets": keys,
            "padding_waste": runner.stats.padding_waste}


def run_plain_jit(model_dir: Path, steps: list[dict[str, np.ndarray]], num_kv_blocks: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from graphrt.backends.xla.compile import CompileCounter
    from graphrt.core.inputs.preparer import InputPreparer
    from graphrt.layers.jax.paged_attention import AttentionMetadata
    from graphrt.models.jax.decoder import compute_logits, forward, init_kv_cache
    from graphrt.models.jax.loader import load_jax_params

    cfg, params = load_jax_params(model_dir)

    def step(params, kv, ids, pos, slots, qsl, seq_lens, table):
        meta = AttentionMetadata(slots, qsl, seq_lens, table)
        hidden, kv = forward(params, kv, ids, pos, meta, config=cfg, block_size=BLOCK_SIZE)
        logits = compute_logits(params, hidden[jnp.maximum(qsl[1:] - 1, 0)], config=cfg)
        return jnp.argmax(logits, axis=-1), kv

    fn = jax.jit(step, donate_argnums=(1,))
    preparer = InputPreparer(max_num_reqs=MAX_NUM_SEQS, max_num_tokens=MAX_NUM_BATCHED_TOKENS,
                             block_size=BLOCK_SIZE)
    kv = init_kv_cache(cfg, num_kv_blocks, BLOCK_SIZE, jnp.float32)
    passes, tokens, shapes = [], [], set()
    with CompileCounter() as counter:
        for _ in range(2):
            t0 = time.perf_counter()
            out = []
            for s in steps:
                x = preparer.prepare(**s)
                shapes.add((x.num_tokens, x.num_reqs))
                toks, kv = fn(params, kv, x.input_ids.copy(), x.positions.copy(),
                              x.slot_mapping.astype(np.int32), x.query_start_loc.copy(), x.seq_lens.copy(),
                              x.block_table.copy())
                out.append(np.asarray(toks).astype(np.int64))
            passes.append(time.perf_counter() - t0)
            tokens.append(out)
    return {"pass_s": passes, "tokens": tokens[0], "compiles": counter.compiles, "shapes": len(shapes),
            "compile_s": counter.seconds}


def bench_trace(model_dir: Path) -> dict[str, Any]:
    steps, blocks = record_trace(model_dir)
    g = run_graphrt(model_dir, steps, blocks)
    p = run_plain_jit(model_dir, steps, blocks)
    same = sum(int(np.array_equal(a, b)) for a, b in zip(g["tokens"], p["tokens"]))
    decode = sum(int(s["num_scheduled_tokens"].max() == 1) for s in steps)
    return {"steps": len(steps), "decode_steps": decode, "graphrt": g, "jit": p,
            "same_tokens_steps": same}


# ---- (b) dispatch overhead ---------------------------------------------------------------
def bench_overhead(runner: Any, steps: int, rounds: int) -> dict[int, dict[str, Any]]:
    import jax

    from graphrt.backends.xla.batch import BATCH_FIELDS, XlaBatch
    from graphrt.core.dispatch import SamplerKey
    from graphrt.core.graph_modes import RuntimeMode

    ex = runner.executor
    width = runner.config.max_blocks_per_req
    rng = np.random.default_rng(1)
    token_ids = rng.integers(3, VOCAB, size=(MAX_NUM_SEQS, MAX_MODEL_LEN), dtype=np.int32)
    table = (1 + np.arange(MAX_NUM_SEQS * width, dtype=np.int32)).reshape(MAX_NUM_SEQS, width)
    out: dict[int, dict[str, Any]] = {}
    for batch in OVERHEAD_BATCHES:
        args = dict(token_ids=token_ids, block_table=table, req_rows=np.arange(batch, dtype=np.int32),
                    num_computed_tokens=np.full(batch, OVERHEAD_CONTEXT, np.int32),
                    num_scheduled_tokens=np.ones(batch, np.int32))
        sampling = _greedy(batch)
        inputs = runner.preparer.prepare(**args)
        key = runner.dispatcher.dispatch(inputs.num_tokens, inputs.num_reqs, inputs.uniform_decode).key
        entry = runner.cache.get((RuntimeMode.FULL, key))
        sampler_entry = runner.sampler_cache.get(SamplerKey(key.num_reqs, True))
        padded = runner.preparer.padder.pad(inputs, num_tokens=key.num_tokens, num_reqs=key.num_reqs,
                                   out=ex.host_buffers).copy()
        host = [getattr(padded, f) for f in BATCH_FIELDS]
        fwd, smp = entry.executable, sampler_entry.executable
        # No future tokens: a zero token row on the device, and -1 (keep the id) for each request.
        no_tokens = jax.device_put(np.zeros(ex.programs.max_reqs, np.int32), ex.programs.replicated)
        no_rows = np.full(key.num_reqs, -1, np.int32)

        def direct() -> np.ndarray:
            b = XlaBatch(*(a.copy() for a in host), key.num_tokens, key.num_reqs, True)
            logits, _, ex.kv_cache = fwd(ex.weights, ex.kv_cache, b, no_tokens, no_rows)
            return np.asarray(smp(logits))[:batch].astype(np.int64)

        def executor() -> np.ndarray:
            logits = ex.run(RuntimeMode.FULL, key, entry, padded)
            return ex.sample(logits, batch, sampling, padded_reqs=key.num_reqs, entry=sampler_entry)

        def full() -> np.ndarray:
            return runner.execute(**args, sampling=sampling)

        arms = {"direct": direct, "executor": executor, "runner": full}
        assert np.array_equal(direct(), executor()) and np.array_equal(direct(), full())
        samples: dict[str, list[float]] = {name: [] for name in arms}
        names = list(arms)
        for fn in arms.values():
            for _ in range(max(5, steps // 20)):
                fn()
        for i in range(rounds * steps):   # arms alternate step by step: load spikes hit all three
            for name in names[i % 3:] + names[:i % 3]:
                t0 = time.perf_counter_ns()
                arms[name]()
                samples[name].append((time.perf_counter_ns() - t0) / 1e3)
        med = {name: float(np.median(v)) for name, v in samples.items()}
        out[batch] = {"key": str(key), "median_us": med,
                      "p90_us": {name: float(np.percentile(v, 90)) for name, v in samples.items()},
                      "executor_overhead": med["executor"] / med["direct"] - 1.0,
                      "runner_overhead": med["runner"] / med["direct"] - 1.0}
        out[batch]["pass"] = out[batch]["executor_overhead"] <= OVERHEAD_TARGET
    return out


# ---- (c) cold versus warm ------------------------------------------------------------------
def precompile_child(model_dir: str, cache_dir: str, workers: int) -> dict[str, Any]:
    """In a fresh process: build a runner on ``cache_dir``, time its warm-up."""
    t_start = time.perf_counter()
    from graphrt import ModelRunner
    from graphrt.backends.xla.backend import XlaBackend
    from graphrt.backends.xla.compile import CompileCounter
    from graphrt.backends.xla.entries import compile_report

    runner = ModelRunner(model_dir, backend=XlaBackend(compile_workers=workers), warmup=False,
                         progress=False, compilation_cache_dir=cache_dir, **LIMITS)
    with CompileCounter() as counter:
        t0 = time.perf_counter()
        runner.warmup()
        warmup_s = time.perf_counter() - t0
    report = compile_report(runner.cache, runner.sampler_cache)
    return {"warmup_s": warmup_s, "process_s": time.perf_counter() - t_start, "workers": workers,
            "executables": len(report), "compiles": counter.compiles,
            "persistent_cache_hits": counter.persistent_cache_hits,
            "disk_loads": sum(bool(r["persistent_cache_hit"]) for r in report),
            "lower_s": sum(r["lower_s"] for r in report), "compile_s": sum(r["compile_s"] for r in report)}


def _child(model_dir: Path, cache_dir: Path, workers: int) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--precompile-child", str(model_dir),
                           str(cache_dir), str(workers)], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_cold_warm(model_dir: Path, root: Path, repeats: int) -> dict[str, Any]:
    workers = min(os.cpu_count() or 1, 8)
    runs: dict[str, list[dict[str, Any]]] = {"cold_1_thread": [], f"cold_{workers}_threads": [], "warm": []}
    for i in range(repeats):
        runs["cold_1_thread"].append(_child(model_dir, root / f"cache-seq-{i}", 1))
        cache = root / f"cache-{i}"
        runs[f"cold_{workers}_threads"].append(_child(model_dir, cache, workers))
        runs["warm"].append(_child(model_dir, cache, workers))
    med = {name: {k: float(np.median([r[k] for r in rs])) for k in rs[0]} for name, rs in runs.items()}
    speedup = med[f"cold_{workers}_threads"]["warmup_s"] / med["warm"]["warmup_s"]
    return {"runs": runs, "median": med, "warm_speedup": speedup, "pass": speedup >= WARM_SPEEDUP_TARGET}


# ---- report ------------------------------------------------------------------------------
def format_report(host: str, trace: dict | None, overhead: dict | None, coldwarm: dict | None) -> str:
    lines = [f"XLA backend benchmarks ({host})",
             f"tiny Qwen3: hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}; max_num_seqs {MAX_NUM_SEQS}, "
             f"max_num_batched_tokens {MAX_NUM_BATCHED_TOKENS}, block_size {BLOCK_SIZE}", ""]
    if trace:
        g, p = trace["graphrt"], trace["jit"]
        lines += [f"(a) trace: {trace['steps']} steps ({trace['decode_steps']} decode), "
                  f"{p['shapes']} distinct (tokens, requests) shapes",
                  f"{'arm':<10}{'compiles':>9}{'compile s':>10}{'warm-up s':>11}{'pass 1 s':>10}"
                  f"{'warm-up+pass 1 s':>18}{'pass 2 s':>10}{'ms/step (2)':>13}"]
        n = trace["steps"]
        compiles = g["compiles_warmup"] + g["compiles_serving"]
        lines.append(f"{'graphrt':<10}{compiles:>9}{g['compile_s']:>10.2f}"
                     f"{g['warmup_s']:>11.2f}{g['pass_s'][0]:>10.2f}{g['warmup_s'] + g['pass_s'][0]:>18.2f}"
                     f"{g['pass_s'][1]:>10.2f}{1e3 * g['pass_s'][1] / n:>13.3f}")
        lines.append(f"{'jax.jit':<10}{p['compiles']:>9}{p['compile_s']:>10.2f}{0.0:>11.2f}"
                     f"{p['pass_s'][0]:>10.2f}{p['pass_s'][0]:>18.2f}{p['pass_s'][1]:>10.2f}"
                     f"{1e3 * p['pass_s'][1] / n:>13.3f}")
        lines += [f"graphrt compiles while serving: {g['compiles_serving']}; executables "
                  f"{g['executables']} (samplers {g['sampler_build_s']:.2f} s of the warm-up); padding "
                  f"waste {100 * g['padding_waste']:.1f} %; same greedy tokens in "
                  f"{trace['same_tokens_steps']}/{n} steps", ""]
    if overhead:
        lines += ["(b) decode step, us (median / p90)",
                  f"{'batch':>6}{'key':>30}{'direct':>16}{'executor':>16}{'runner':>16}{'exec +%':>9}"
                  f"{'runner +%':>11}{'target':>8}"]
        for b, o in overhead.items():
            m, q = o["median_us"], o["p90_us"]
            lines.append(f"{b:>6}{o['key']:>30}" + "".join(f"{m[a]:>9.1f} /{q[a]:>5.0f}" for a in
                                                          ("direct", "executor", "runner"))
                         + f"{100 * o['executor_overhead']:>9.1f}{100 * o['runner_overhead']:>11.1f}"
                         + f"{'PASS' if o['pass'] else 'FAIL':>8}")
        lines.append("")
    if coldwarm:
        lines += ["(c) precompile (ModelRunner.warmup), fresh process each, medians",
                  f"{'run':<18}{'warm-up s':>10}{'lower s':>9}{'compile s':>10}{'executables':>12}"
                  f"{'from disk':>10}{'process s':>10}"]
        for name, m in coldwarm["median"].items():
            lines.append(f"{name:<18}{m['warmup_s']:>10.2f}{m['lower_s']:>9.2f}{m['compile_s']:>10.2f}"
                         f"{m['executables']:>12.0f}{m['disk_loads']:>10.0f}"
                         f"{m['process_s']:>10.2f}")
        lines.append(f"warm speed-up {coldwarm['warm_speedup']:.1f}x (target {WARM_SPEEDUP_TARGET:.0f}x): "
                     f"{'PASS' if coldwarm['pass'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmarks, print the tables and return every number."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--precompile-child":
        result = precompile_child(argv[1], argv[2], int(argv[3]))
        print(json.dumps(result))
        return result
    parser = argparse.ArgumentParser(prog="bench_xla", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="a,b,c", help="comma-separated parts to run (a, b, c)")
    parser.add_argument("--steps", type=int, default=300, help="(b) timed steps per arm and round")
    parser.add_argument("--rounds", type=int, default=7, help="(b) timed steps = rounds x steps per arm")
    parser.add_argument("--repeats", type=int, default=2, help="(c) cold/warm repetitions")
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions (smoke run)")
    parser.add_argument("--json", help="also write every number to this file")
    args = parser.parse_args(argv)
    parts = set(args.only.split(","))
    steps, rounds, repeats = ((max(20, args.steps // 10), 2, 1) if args.quick
                              else (args.steps, args.rounds, args.repeats))
    logging.getLogger("graphrt").setLevel(logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="graphrt-bench-xla-"))
    trace = overhead = coldwarm = None
    try:
        model_dir = build_model_dir(root, vocab=VOCAB, hidden=HIDDEN, layers=LAYERS,
                                    max_model_len=MAX_MODEL_LEN)
        if "a" in parts or "b" in parts:
            trace = bench_trace(model_dir)
            runner = trace["graphrt"].pop("runner")
            if "b" in parts:
                overhead = bench_overhead(runner, steps, rounds)
            if "a" not in parts:
                trace = None
        if "c" in parts:
            coldwarm = bench_cold_warm(model_dir, root, repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    host = machine()
    print(format_report(host, trace, overhead, coldwarm))
    if trace:
        for arm in ("graphrt", "jit"):
            trace[arm].pop("tokens")
    checks = [o["pass"] for o in (overhead or {}).values()] + ([coldwarm["pass"]] if coldwarm else [])
    result = {"machine": host, "trace": trace, "overhead": overhead, "cold_warm": coldwarm,
              "all_pass": all(checks)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
