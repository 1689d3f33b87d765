"""CUDA graphs on a GPU: decode step time, capture cost and replay overhead (issue 4).

A Qwen3-0.6B-shaped model (28 layers, hidden 1024, 16 query / 8 KV heads of 128, vocab
151936, tied embeddings) with random bf16 weights, on one GPU:

1. **Decode step time** at batch 1, 8, 64 and 256, side by side in one run:

   * ``eager``            -- graphrt's ``eager`` backend (the same buffers, no graph);
   * ``graphrt FULL``     -- the ``cuda`` backend, mode FULL: one CUDA graph per bucket;
   * ``graphrt FULL+compile`` -- the same with ``compile_model`` (Inductor-compiled pieces,
     static shapes, captured into one graph per bucket);
   * ``reduce-overhead``  -- ``torch.compile(model, mode="reduce-overhead")`` (Inductor plus
     CUDA-graph trees), KV cache and input buffers marked static.

   A step is: copy the padded host inputs to the device, run the forward, project the
   logits of each request's last token. Every request decodes one token at position
   ``--context - 1``; all rows share one block table (the KV contents do not change the
   time, and this keeps the KV cache small at batch 256). Times are the mean over
   ``--iters`` back-to-back steps after ``--warmup`` steps, wall clock with a device sync
   at the end.
2. **Capture time and graph memory** of ``BucketPolicy.vllm_default(512)`` (51 sizes,
   ``max_num_seqs=256``): the warm-up's wall time, the forward graphs' capture seconds
   and the bytes the allocator reserved for them (plus the sampler graphs, listed apart).
3. **Replay overhead**: ``executor.run`` (staging copies + replay) against a bare
   ``CUDAGraph.replay()`` of the same graph, per batch size.

Targets (issue 4): batch 1 at least 3x faster than eager; no slower than reduce-overhead
at any batch size; replay overhead within 2 % of bare replay; 51 sizes captured in
under 10 s.

The attention kernel is graphrt's default on CUDA (Triton where it runs, else the reference;
``layers/torch/attention/paged.py``); ``--attention reference|triton`` sets ``GRAPHRT_ATTENTION`` to
compare both, and the first line of the output names the kernel used.

Run: ``python benchmarks/bench_cuda.py [--quick] [--attention KERNEL] [--json out.json]``.
Without a CUDA GPU it says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import Any, Callable, Sequence

#: Qwen3-0.6B's architecture (config.json of Qwen/Qwen3-0.6B).
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                  rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=True)
BATCHES = (1, 8, 64, 256)
MAX_NUM_SEQS = 256
MAX_CAPTURE = 512
BLOCK_SIZE = 16
CONTEXT = 512
INIT_STD = 0.02
METHODS = ("eager", "graphrt FULL", "graphrt FULL+compile", "reduce-overhead")
#: Issue 4's targets.
TARGET_SPEEDUP_BATCH1 = 3.0
TARGET_REPLAY_OVERHEAD = 0.02
TARGET_CAPTURE_SECONDS = 10.0
#: Where the benchmark runs: the torch device and graphrt's graph backend for it.
DEVICE = "cuda"
GRAPH_BACKEND = "cuda"

logger = logging.getLogger("bench_cuda")


def build_model(layers: int, seed: int) -> Any:
    """The Qwen3-0.6B-shaped reference model with random bf16 weights, on the GPU."""
    import torch

    from graphrt.models.hf_config import DecoderConfig
    from graphrt.models.torch.decoder import DecoderForCausalLM

    config = DecoderConfig(architecture="Qwen3ForCausalLM", attention_bias=False, qk_norm=True,
                           eos_token_id=(151645,), torch_dtype="bfloat16",
                           **{**QWEN3_0_6B, "num_hidden_layers": layers})
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = DecoderForCausalLM(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, INIT_STD)
    model.bind_parameters()
    return model.eval()


def runner_for(model: Any, backend: Any, sizes: Sequence[int] | None, context: int, **fields: Any) -> Any:
    """A ModelRunner in mode FULL with room for ``MAX_NUM_SEQS`` decodes of ``context`` tokens."""
    from graphrt.runner import ModelRunner

    config = dict(mode="FULL", max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_CAPTURE,
                  max_model_len=context, block_size=BLOCK_SIZE, **fields)
    if sizes is not None:
        config["cudagraph_capture_sizes"] = list(sizes)
    return ModelRunner(model, backend=backend, num_kv_blocks=context // BLOCK_SIZE + 1, progress=False,
                       **config)


def decode_step(runner: Any, batch: int, context: int) -> tuple[Any, Any, Any, Any]:
    """(mode, key, entry, padded inputs) of a decode step of ``batch`` requests at ``context``."""
    import numpy as np

    from graphrt.core.graph_modes import RuntimeMode
    from graphrt.runner import FailedBuild

    width = context // BLOCK_SIZE
    tables = np.tile(np.arange(1, width + 1, dtype=np.int32), (MAX_NUM_SEQS, 1))
    tokens = np.ones((MAX_NUM_SEQS, context), dtype=np.int32)
    inputs = runner.preparer.prepare(token_ids=tokens, block_table=tables, req_rows=np.arange(batch),
                                     num_computed_tokens=np.full(batch, context - 1),
                                     num_scheduled_tokens=np.ones(batch, dtype=np.int32))
    d = runner.dispatcher.dispatch(inputs.num_tokens, inputs.num_reqs, inputs.uniform_decode)
    mode, key, entry = d.mode, d.key, None
    if mode is not RuntimeMode.NONE:
        entry = runner.cache.get((mode, key))
        if entry is None or isinstance(entry, FailedBuild):
            raise RuntimeError(f"{key} has no graph ({getattr(entry, 'reason', 'not captured')})")
    padded = runner.preparer.padder.pad(inputs, num_tokens=key.num_tokens,
                               num_reqs=key.num_reqs if key.num_reqs is not None else inputs.num_reqs,
                               out=runner.executor.host_buffers)
    return mode, key, entry, padded


def per_step(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """Mean seconds per call of ``fn`` over ``iters`` back-to-back calls (device synced)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def reduce_overhead_step(runner: Any, batch: int, context: int) -> Callable[[], Any]:
    """A step of ``torch.compile(model, mode="reduce-overhead")`` on the eager runner's buffers."""
    import torch

    from graphrt.layers.torch.forward_context import forward_context

    executor = runner.executor
    model = executor.model
    torch._dynamo.mark_static_address(executor.kv_cache)
    for layer in model.attention_layers():
        torch._dynamo.mark_static_address(layer.kv_cache)
    for buf in executor.static.values():
        torch._dynamo.mark_static_address(buf)
    compiled = getattr(runner, "_bench_compiled", None)
    if compiled is None:
        compiled = torch.compile(model, mode="reduce-overhead", dynamic=False, fullgraph=True)
        runner._bench_compiled = compiled
    _, key, _, padded = decode_step(runner, batch, context)
    t, r = padded.padded_num_tokens, padded.padded_num_reqs
    static = executor.static

    def step() -> Any:
        executor.buffers.to_device(t, r)
        with torch.no_grad(), forward_context(executor.fwd.metadata(t, r, executor.fwd.dummy_host(t, r))):
            hidden = compiled(static["input_ids"][:t], static["positions"][:t])
            last = (static["query_start_loc"][1:r + 1] - 1).long()
            return model.compute_logits(hidden.index_select(0, last))
    return step


def measure_decode(model_factory: Callable[[int], Any], args: argparse.Namespace) -> dict[str, dict[int, Any]]:
    """Seconds per decode step, per method and batch size (an error string where one failed)."""
    results: dict[str, dict[int, Any]] = {m: {} for m in METHODS}
    from graphrt.backends.torch.eager import EagerBackend

    runners = {
        "eager": lambda: runner_for(model_factory(1), EagerBackend(DEVICE), None, args.context),
        "graphrt FULL": lambda: runner_for(model_factory(2), GRAPH_BACKEND, args.batches, args.context),
        "graphrt FULL+compile": lambda: runner_for(model_factory(3), GRAPH_BACKEND, args.batches, args.context,
                                                   compile_model=True, compile_max_size=max(args.batches)),
    }
    built: dict[str, Any] = {}
    for method in args.methods:
        try:
            if method == "reduce-overhead":
                runner = built.get("eager") or runners["eager"]()
            else:
                runner = built.setdefault(method, runners[method]())
        except Exception as exc:  # noqa: BLE001 - report the failure in the table, keep going
            results[method] = {b: f"failed: {type(exc).__name__}: {exc}" for b in args.batches}
            continue
        for batch in args.batches:
            try:
                if method == "reduce-overhead":
                    fn = reduce_overhead_step(runner, batch, args.context)
                else:
                    mode, key, entry, padded = decode_step(runner, batch, args.context)
                    fn = (lambda r=runner, m=mode, k=key, e=entry, p=padded: r.executor.run(m, k, e, p))
                results[method][batch] = per_step(fn, args.warmup, args.iters)
            except Exception as exc:  # noqa: BLE001
                results[method][batch] = f"failed: {type(exc).__name__}: {exc}"
        if method == "graphrt FULL":
            built["overhead"] = measure_overhead(runner, args)
    results["_overhead"] = built.get("overhead", {})
    return results


def measure_overhead(runner: Any, args: argparse.Namespace) -> dict[int, tuple[float, float]]:
    """(executor.run, bare replay) seconds per step for each batch size."""
    out = {}
    for batch in args.batches:
        mode, key, entry, padded = decode_step(runner, batch, args.context)
        if entry is None:
            continue
        run = per_step(lambda: runner.executor.run(mode, key, entry, padded), args.warmup, args.iters)
        bare = per_step(entry.graph.replay, args.warmup, args.iters)
        out[batch] = (run, bare)
    return out


def measure_capture(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up of vllm_default(512) in mode FULL: seconds and graph bytes."""
    import torch

    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    runner = runner_for(model, GRAPH_BACKEND, None, args.context)
    seconds = time.perf_counter() - t0
    free_after = torch.cuda.mem_get_info()[0]
    report = runner.executor.builder.report
    forward = [r for r in report if "sample" not in r["key"]]
    sampler = [r for r in report if "sample" in r["key"]]
    return {"sizes": len(runner.config.capture_policy()), "graphs": len(forward),
            "warmup_seconds": seconds,
            "forward_capture_seconds": sum(r["seconds"] for r in forward),
            "sampler_capture_seconds": sum(r["seconds"] for r in sampler),
            "forward_graph_bytes": sum(r["bytes"] for r in forward),
            "sampler_graph_bytes": sum(r["bytes"] for r in sampler),
            "device_bytes_used_by_warmup": free_before - free_after,
            "eager_fallbacks": len(runner.cache) - len(forward)}


def attention_kernel_used(choice: str | None) -> str:
    """Set ``GRAPHRT_ATTENTION`` to ``choice`` (if given); the kernel graphrt's attention then runs
    for this model on the GPU, and why."""
    import torch

    from graphrt.layers.torch.attention.paged import ATTENTION_ENV, choose_attention_kernel

    if choice:
        os.environ[ATTENTION_ENV] = choice
    kernel, reason = choose_attention_kernel(DEVICE, QWEN3_0_6B["head_dim"], torch.bfloat16, torch.bfloat16)
    return f"{kernel} ({reason})"


def fmt_ms(value: Any) -> str:
    return f"{value * 1e3:.3f}" if isinstance(value, float) else str(value)[:60]


def table(results: dict[str, Any], capture: dict[str, Any], device: str, args: argparse.Namespace) -> str:
    """The Markdown tables for docs/benchmarks.md."""
    lines = [f"Device: {device}; torch {args.torch_version}; {args.layers} layers, bf16, context "
             f"{args.context}, mean of {args.iters} steps; attention kernel: {args.attention_used}.", "",
             "Decode step time, ms (lower is better)", "",
             "| batch | " + " | ".join(METHODS) + " | speed-up vs eager (FULL) |",
             "|---:|" + "---:|" * len(METHODS) + "---:|"]
    for b in args.batches:
        row = [fmt_ms(results[m].get(b, "-")) for m in METHODS]
        e, g = results["eager"].get(b), results["graphrt FULL"].get(b)
        speed = f"{e / g:.2f}x" if isinstance(e, float) and isinstance(g, float) else "-"
        lines.append(f"| {b} | " + " | ".join(row) + f" | {speed} |")
    lines += ["", "Replay overhead: executor.run (staging copies + replay) vs bare CUDAGraph.replay()", "",
              "| batch | executor.run ms | bare replay ms | overhead |", "|---:|---:|---:|---:|"]
    for b, (run, bare) in sorted(results["_overhead"].items()):
        lines.append(f"| {b} | {run * 1e3:.3f} | {bare * 1e3:.3f} | {100 * (run - bare) / bare:+.2f} % |")
    if capture:
        lines += ["", f"Capture of vllm_default({MAX_CAPTURE}) in mode FULL ({capture['sizes']} sizes)", "",
                  "| forward graphs | forward capture s | warm-up total s | forward graph MiB | "
                  "sampler graphs s / MiB | device MiB used by warm-up | eager fallbacks |",
                  "|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {capture['graphs']} | {capture['forward_capture_seconds']:.2f} | "
                  f"{capture['warmup_seconds']:.2f} | {capture['forward_graph_bytes'] / 2**20:.1f} | "
                  f"{capture['sampler_capture_seconds']:.2f} / {capture['sampler_graph_bytes'] / 2**20:.1f} | "
                  f"{capture['device_bytes_used_by_warmup'] / 2**20:.1f} | {capture['eager_fallbacks']} |"]
    lines += ["", "Targets (issue 4)", ""] + [f"* {t}" for t in targets(results, capture, args)]
    return "\n".join(lines)


def targets(results: dict[str, Any], capture: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """One PASS / FAIL / n/a line per issue-4 target."""
    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("PASS" if ok else "FAIL")

    out = []
    eager, full = results["eager"].get(1), results["graphrt FULL"].get(1)
    ok = eager / full >= TARGET_SPEEDUP_BATCH1 if isinstance(eager, float) and isinstance(full, float) else None
    out.append(f"{verdict(ok)}: batch 1 at least {TARGET_SPEEDUP_BATCH1:g}x faster than eager (FULL)")
    for method in ("graphrt FULL", "graphrt FULL+compile"):
        pairs = [(results[method].get(b), results["reduce-overhead"].get(b)) for b in args.batches]
        pairs = [(g, r) for g, r in pairs if isinstance(g, float) and isinstance(r, float)]
        ok = all(g <= r for g, r in pairs) if pairs else None
        out.append(f"{verdict(ok)}: {method} no slower than reduce-overhead at any batch size")
    overheads = [(run - bare) / bare for run, bare in results["_overhead"].values()]
    ok = all(o <= TARGET_REPLAY_OVERHEAD for o in overheads) if overheads else None
    out.append(f"{verdict(ok)}: replay overhead within {TARGET_REPLAY_OVERHEAD:.0%} of bare replay")
    ok = capture["forward_capture_seconds"] < TARGET_CAPTURE_SECONDS if capture else None
    out.append(f"{verdict(ok)}: {capture.get('sizes', 51)} sizes captured in under {TARGET_CAPTURE_SECONDS:g} s")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--context", type=int, default=CONTEXT, help="tokens per request (max_model_len)")
    parser.add_argument("--layers", type=int, default=QWEN3_0_6B["num_hidden_layers"])
    parser.add_argument("--iters", type=int, default=100, help="timed steps per (method, batch)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps before timing")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--skip-capture", action="store_true", help="skip the 51-size capture measurement")
    parser.add_argument("--quick", action="store_true", help="4 layers, 20 steps: a smoke run")
    parser.add_argument("--attention", choices=("auto", "reference", "triton"),
                        help="graphrt's attention kernel (sets GRAPHRT_ATTENTION; default: as set, else auto)")
    parser.add_argument("--json", help="also write the raw numbers to this file")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench_cuda: torch is not installed; nothing to measure")
        return 0
    if not torch.cuda.is_available():
        print("bench_cuda: no CUDA GPU is available here (torch.cuda.is_available() is False); "
              "this benchmark needs one and measured nothing")
        return 0
    if args.quick:
        args.layers, args.iters, args.warmup = 4, 20, 5
    if any(b > MAX_NUM_SEQS for b in args.batches) or args.context % BLOCK_SIZE:
        parser.error(f"batches must be <= {MAX_NUM_SEQS} and --context a multiple of {BLOCK_SIZE}")
    logging.basicConfig(level=logging.WARNING)
    args.torch_version = torch.__version__
    args.attention_used = attention_kernel_used(args.attention)
    print(f"bench_cuda: attention kernel: {args.attention_used}", flush=True)
    device = torch.cuda.get_device_name()
    factory = lambda seed: build_model(args.layers, seed)  # noqa: E731 - one fresh model per runner
    capture = {} if args.skip_capture else measure_capture(factory(0), args)
    torch.cuda.empty_cache()
    results = measure_decode(factory, args)
    text = table(results, capture, device, args)
    print(text)
    if args.json:
        raw = {"device": device, "torch": args.torch_version, "attention": args.attention_used, "capture": capture,
               "decode_seconds": {m: {str(b): v for b, v in results[m].items()} for m in METHODS},
               "overhead_seconds": {str(b): v for b, v in results["_overhead"].items()}}
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
