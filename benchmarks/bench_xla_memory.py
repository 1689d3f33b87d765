"""Peak resident memory of ``graphrt.LLM`` on ``xla`` (this CPU) against the KV cache's size
(issue 41): the process should grow by about the cache itself, not several times it.

Each budget runs in a fresh process (``--child``): a random bfloat16 Qwen3 (8 layers, 4 KV heads
of 128: 256 KiB a 16-token block), ``kv_cache_memory`` bytes for the cache and the executables,
warm-up, then a few requests generated; the child prints its peak RSS (``VmHWM``), the cache's bytes and
the largest executable temp bytes. The parent prints each run and the growth of the peak between
them over the growth of the cache. Run it once per source tree to compare:
``PYTHONPATH=<tree>/src python benchmarks/bench_xla_memory.py --budget-mib 256 768``.
Not in ``graphrt bench``: the larger run takes ~1 GiB and, before issue 41, 5x its cache more.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

#: The model: 8 layers x (K, V) x 16 rows x 4 heads x 128 x 2 bytes = 256 KiB a block.
SIZES = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=128, max_position_embeddings=8192)
#: Enough requests x context for a 512 MiB cache (32 x 64 blocks); one context bucket, so warm-up
#: compiles three forwards (decode of 1 and 32 requests, mixed of 32 tokens) and their samplers.
LIMITS = dict(max_num_seqs=32, max_model_len=1024, max_num_batched_tokens=32, block_size=16,
              precompile_token_paddings=[32], precompile_bs_paddings=[1, 32], context_buckets=[1024])


#: ``--quick`` (the slow test's): 16 layers x 2 KV heads (256 KiB a block, 256 MiB for 32 x 32
#: blocks; the layers are one scan, so they cost no compile time), context 512 (the executables'
#: temp memory: ~tokens x context x heads) and one forward per kind.
QUICK_SIZES = {**SIZES, "num_hidden_layers": 16, "num_key_value_heads": 2}
QUICK_LIMITS = {**LIMITS, "max_model_len": 512, "context_buckets": [512], "precompile_bs_paddings": [32]}


def child(budget: int, quick: bool = False) -> dict:
    """In this process: the LLM with a ``budget``-byte KV budget, a few requests, and the figures."""
    import graphrt
    from graphrt.models.random_checkpoint import write_random_checkpoint

    sizes, limits = (QUICK_SIZES, QUICK_LIMITS) if quick else (SIZES, LIMITS)
    model = write_random_checkpoint(tempfile.mkdtemp(prefix="graphrt-xla-memory-"), "qwen3", **sizes)
    llm = graphrt.LLM(str(model), backend="xla", dtype="bfloat16", kv_cache_memory=budget, **limits)
    prompts = [[3 + (7 * i + j) % 500 for j in range(40 + 9 * i)] for i in range(6)]
    outs = llm.generate(prompts, graphrt.SamplingParams(max_tokens=8, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in outs)
    runner = llm.runner
    report = runner.warmup_report
    return {"cache_bytes": int(runner.num_kv_blocks * runner.executor.kv_cache_bytes_per_block(limits["block_size"])),
            "num_kv_blocks": int(runner.num_kv_blocks),
            "max_temp_bytes": max((r.get("temp_bytes", 0) for r in report), default=0),
            "peak_rss_bytes": peak_rss_bytes()}


def peak_rss_bytes() -> int:
    """This process's own peak RSS: ``VmHWM`` of /proc/self/status, which exec resets. Not
    ``ru_maxrss``: Linux carries it across fork and exec, so a child started by a large parent (a
    pytest worker at 2.3 GB) reports the parent's peak whatever it uses itself."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(budget_mib: int, quick: bool = False, env: dict | None = None) -> dict:
    """:func:`child` in a fresh Python process (its own peak RSS), a ``budget_mib`` MiB KV budget."""
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(budget_mib << 20)]
                          + (["--quick"] if quick else []), capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"bench_xla_memory child ({budget_mib} MiB) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=int, nargs=2, default=[256, 768], metavar=("SMALL", "LARGE"))
    parser.add_argument("--quick", action="store_true", help="a 2-layer model, one forward per kind (seconds)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.quick)))
        return {}
    mib = 2**20
    runs = [measure(m, args.quick) for m in args.budget_mib]
    for run in runs:
        print(f"cache {run['cache_bytes'] / mib:7.1f} MiB ({run['num_kv_blocks']} blocks): peak RSS "
              f"{run['peak_rss_bytes'] / mib:7.1f} MiB, largest executable temp {run['max_temp_bytes'] / mib:.1f} MiB")
    small, large = runs
    growth = (large["peak_rss_bytes"] - small["peak_rss_bytes"]) / (large["cache_bytes"] - small["cache_bytes"])
    print(f"peak RSS growth / cache growth: {growth:.2f}")
    return {"runs": runs, "rss_growth_per_cache_byte": growth}


if __name__ == "__main__":
    main()
    sys.exit(0)
