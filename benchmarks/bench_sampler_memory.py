"""Warm-up memory of the sampler graphs beside the forward graphs' (issue 35), from the warm-up
report of ``graphrt.LLM`` on the ``cpu`` backend (the recording graph: every graph keeps its own
intermediates), with a 2-layer, 64-wide random Qwen3 and the Qwen vocabulary (151,936).

Run it once per source tree to compare (it reads only ``runner.warmup_report``, which every
graphrt version has):  ``PYTHONPATH=<tree>/src python benchmarks/bench_sampler_memory.py --max-num-seqs 32``.
Prints the forward and sampler graphs' bytes, the sampler's shared buffers where the version
reports them, the process's peak resident memory and the warm-up seconds. Not in ``graphrt bench``:
one run at ``--max-num-seqs 256`` takes a few GiB.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time

VOCAB = 151_936


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = parser.parse_args(argv)
    import graphrt
    from graphrt.models.random_checkpoint import write_random_checkpoint

    model = write_random_checkpoint(tempfile.mkdtemp(prefix="graphrt-sampler-memory-"), "qwen3",
                                    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    t0 = time.perf_counter()
    llm = graphrt.LLM(str(model), backend="cpu", max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=256)
    seconds = time.perf_counter() - t0
    report = llm.runner.warmup_report
    forward = [r for r in report if not r["key"].startswith("sampler")]
    sampler = [r for r in report if r["key"].startswith("sampler")]
    mib = 2**20
    buffers = getattr(llm.runner.graph_memory, "sampler_buffers", None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"max_num_seqs={args.max_num_seqs}, vocab {VOCAB}: forward {len(forward)} graphs "
          f"{sum(r['bytes'] for r in forward) / mib:.1f} MiB; sampler {len(sampler)} graphs "
          f"{sum(r['bytes'] for r in sampler) / mib:.1f} MiB"
          + (f" (+ {buffers / mib:.1f} MiB shared buffers)" if buffers is not None else "")
          + f"; warm-up {seconds:.1f} s; peak RSS {peak:.0f} MiB")
    for kind in ("greedy", "random", "logprobs"):
        rows = [r for r in sampler if r["key"].endswith(f"{kind})")]
        if rows:
            print(f"  {kind:<8} largest {rows[0]['key']}: {rows[0]['bytes'] / mib:.2f} MiB")
    return {"forward": sum(r["bytes"] for r in forward), "sampler": sum(r["bytes"] for r in sampler),
            "buffers": buffers, "peak_rss_mib": peak}


if __name__ == "__main__":
    main()
    sys.exit(0)
