"""Paged attention alone on a GPU: graphrt's reference kernel against its Triton kernel (issue 23).

Qwen3-0.6B's attention: 16 query / 8 KV heads of 128, bf16, block size 16. A call is one
kernel's whole job: write the step's K/V into the paged cache, then attend.

* **Decode**: batch 1, 8, 64, 256 x context 512, 4096, 32768 -- one new token per request at
  position ``context - 1``; every request has its own blocks, in a shuffled order.
* **Prefill**: 4 requests x 2048 new tokens continuing a 2048-token cached prefix (8192
  tokens, contexts of 4096).

Each call is captured ``reps`` times into one CUDA graph (``reps`` chosen so a replay takes
about ``TARGET_REPLAY_MS``); ms per call is the median over ``--iters`` replays timed with CUDA
events, divided by ``reps``. Where capture fails the call is timed eagerly and marked so.
Columns: the reference kernel, the Triton kernel, and dense SDPA
(``torch.nn.functional.scaled_dot_product_attention`` on contiguous per-request K/V: no paging,
no KV write -- a yardstick of what fused attention costs on this GPU), the speed-ups, the Triton
kernel's tiling (tokens per tile, KV splits) and its throughput: K and V bytes read per second
for decode, causal TFLOP/s for prefill. A column is skipped, with the memory it would need,
where it does not fit in ``MEMORY_FRACTION`` of the free device memory (the reference gathers
``[tokens, context, heads, dim]``, which is why it cannot run the prefill).

``--quick``: batch 1 and 64 x context 512 and 4096, and the prefill, fewer replays (well under a
minute on an H200). ``--sweep``: also times a few Triton tile / launch configurations (tuning
constants of ``triton_attention``) on two decode shapes and the prefill. ``--json out.json``
writes the numbers. Without a CUDA GPU it says why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable, Sequence

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
BATCHES = (1, 8, 64, 256)
CONTEXTS = (512, 4096, 32768)
QUICK_BATCHES, QUICK_CONTEXTS = (1, 64), (512, 4096)
#: (requests, new tokens each, cached prefix each)
PREFILL = (4, 2048, 2048)
#: Share of the free device memory one measurement may plan to use.
MEMORY_FRACTION = 0.8
#: Calls per captured graph: enough that one replay takes about this long.
TARGET_REPLAY_MS = 2.0
MAX_REPS = 100
ITERS, QUICK_ITERS = 30, 10
#: Sweep: tuning constants of graphrt.layers.torch.attention.triton_attention to try, one dict per row.
SWEEP = (
    {},
    {"DECODE_LAUNCH": (4, 2)},
    {"DECODE_LAUNCH": (8, 3)},
    {"DECODE_LAUNCH": (2, 3)},
    {"KV_TILE_BYTES": 32 * 128 * 2, "MAX_TILE_KEYS": 32},
    {"KV_TILE_BYTES": 128 * 128 * 2, "MAX_TILE_KEYS": 128},
    {"PROGRAMS_PER_SM": 1},
    {"PROGRAMS_PER_SM": 4},
    {"PREFILL_LAUNCH": (8, 2)},
    {"PREFILL_LAUNCH": (4, 3)},
    {"PREFILL_ROWS": 128, "PREFILL_LAUNCH": (8, 2)},
)
SWEEP_SHAPES = ((64, 4096, 1), (1, 32768, 1), (PREFILL[0], PREFILL[1] + PREFILL[2], PREFILL[1]))


def make_step(batch: int, context: int, new: int) -> dict[str, Any]:
    """Inputs of one call on the GPU: ``batch`` requests of ``context`` tokens, the last ``new``
    of them computed now; block tables over a shuffled pool; random bf16 K/V everywhere."""
    import torch

    dev, bf16 = "cuda", torch.bfloat16
    per_req = -(-context // BLOCK_SIZE)
    num_blocks = 1 + batch * per_req
    cache = torch.empty(2, num_blocks * BLOCK_SIZE + 1, KV_HEADS, HEAD_DIM, dtype=bf16, device=dev).normal_()
    table = (torch.randperm(num_blocks - 1, device=dev) + 1).to(torch.int32).view(batch, per_req)
    tokens = batch * new
    req = torch.arange(batch, device=dev).repeat_interleave(new)
    pos = context - new + torch.arange(new, device=dev).repeat(batch)
    slots = table[req, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
    return dict(q=torch.randn(tokens, HEADS * HEAD_DIM, dtype=bf16, device=dev),
                k=torch.randn(tokens, KV_HEADS * HEAD_DIM, dtype=bf16, device=dev),
                v=torch.randn(tokens, KV_HEADS * HEAD_DIM, dtype=bf16, device=dev),
                cache=cache, slot_mapping=slots,
                query_start_loc=(torch.arange(batch + 1, device=dev) * new).to(torch.int32),
                seq_lens=torch.full((batch,), context, dtype=torch.int32, device=dev),
                block_table=table, token_req_idx=req)


def paged_call(kernel: Callable[..., Any], s: dict[str, Any]) -> Callable[[], Any]:
    return lambda: kernel(s["q"], s["k"], s["v"], s["cache"], s["slot_mapping"], s["query_start_loc"],
                          s["seq_lens"], s["block_table"], s["token_req_idx"], BLOCK_SIZE, HEAD_DIM ** -0.5)


def sdpa_call(batch: int, context: int, new: int) -> Callable[[], Any]:
    """Dense SDPA over contiguous K/V of the same shapes (GQA, bottom-right causal)."""
    import torch
    import torch.nn.functional as F

    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(batch, HEADS, new, HEAD_DIM, dtype=bf16, device=dev)
    k = torch.randn(batch, KV_HEADS, context, HEAD_DIM, dtype=bf16, device=dev)
    v = torch.randn_like(k)
    mask = None
    if new > 1:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(new, context)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def time_call(fn: Callable[[], Any], iters: int) -> tuple[float, int, bool]:
    """(ms per call, calls per replay, captured?): median of CUDA-event-timed graph replays."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles, autotunes, allocates
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the capture allocates from its own pool
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    reps = max(1, min(MAX_REPS, round(TARGET_REPLAY_MS / max(start.elapsed_time(end), 1e-3))))
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        run, captured = graph.replay, True
    except Exception:  # noqa: BLE001 - not capturable: time it eagerly instead
        graph, captured = None, False

        def run() -> None:
            for _ in range(reps):
                fn()
    run()
    times = []
    for _ in range(iters):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    del graph
    return statistics.median(times), reps, captured


def bytes_needed(kind: str, batch: int, context: int, new: int) -> int:
    """Device bytes a measurement allocates (inputs and cache included), roughly from above."""
    tokens = batch * new
    cache = 2 * (batch * context + BLOCK_SIZE + 1) * KV_HEADS * HEAD_DIM * 2
    if kind == "triton":
        return cache + tokens * HEADS * HEAD_DIM * 2 * 70  # split-KV partials at most
    if kind == "reference":  # gathered keys / values / masked values, scores and probabilities
        return cache + 5 * tokens * context * KV_HEADS * HEAD_DIM * 2 + 6 * tokens * HEADS * context * 4
    return 3 * batch * context * KV_HEADS * HEAD_DIM * 2 + 2 * tokens * HEADS * HEAD_DIM * 2  # sdpa


def measure(kind: str, batch: int, context: int, new: int, iters: int) -> dict[str, Any]:
    """One column of one row: {"ms", "reps", "captured"} or {"skipped": why}."""
    import torch

    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    need = bytes_needed(kind, batch, context, new)
    if need > MEMORY_FRACTION * free:
        return {"skipped": f"needs ~{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"}
    try:
        if kind == "sdpa":
            fn = sdpa_call(batch, context, new)
        else:
            from graphrt.layers.torch.attention.paged import paged_attention_kernel
            from graphrt.layers.torch.attention.triton_attention import triton_paged_attention

            fn = paged_call(triton_paged_attention if kind == "triton" else paged_attention_kernel,
                            make_step(batch, context, new))
        ms, reps, captured = time_call(fn, iters)
        return {"ms": ms, "reps": reps, "captured": captured}
    except Exception as exc:  # noqa: BLE001 - report it in the table, keep going
        return {"skipped": f"failed: {type(exc).__name__}: {str(exc)[:120]}"}
    finally:
        fn = None
        torch.cuda.empty_cache()


def throughput(batch: int, context: int, new: int, ms: float) -> str:
    """Decode: K+V bytes read per second; prefill: causal attention TFLOP/s."""
    if new == 1:
        return f"{batch * context * KV_HEADS * HEAD_DIM * 2 * 2 / (ms * 1e-3) / 1e9:.0f} GB/s"
    prefix = context - new
    flops = 4 * HEAD_DIM * HEADS * batch * (new * prefix + new * (new + 1) / 2)
    return f"{flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s"


def plan_text(batch: int, context: int, new: int) -> str:
    import torch

    from graphrt.layers.torch.attention.triton_attention import plan_attention

    p = plan_attention(batch * new, batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM, torch.bfloat16,
                       -(-context // BLOCK_SIZE), BLOCK_SIZE, "cuda")
    return f"{p.block_q} tok/tile, {p.tile_n} keys/tile, {p.num_splits} splits, {p.num_warps}w{p.num_stages}s"


def fmt(col: dict[str, Any]) -> str:
    if "ms" not in col:
        return col["skipped"]
    return f"{col['ms']:.4f}" + ("" if col["captured"] else " (eager)")


def ratio(a: dict[str, Any], b: dict[str, Any]) -> str:
    return f"{a['ms'] / b['ms']:.2f}x" if "ms" in a and "ms" in b else "-"


def run_rows(shapes: Sequence[tuple[int, int, int]], iters: int) -> list[dict[str, Any]]:
    rows = []
    for batch, context, new in shapes:
        t0 = time.perf_counter()
        row = {"batch": batch, "context": context, "new_tokens": new, "plan": plan_text(batch, context, new)}
        for kind in ("reference", "triton", "sdpa"):
            row[kind] = measure(kind, batch, context, new, iters)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(f"  measured {'decode' if new == 1 else 'prefill'} batch {batch} context {context} "
              f"in {row['seconds']} s", flush=True)
    return rows


def table(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "",
             "| case | batch | context | new tokens | reference ms | triton ms | sdpa (dense) ms | "
             "triton vs reference | triton vs sdpa | triton tiling | triton throughput |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        tri = r["triton"]
        lines.append(f"| {'decode' if r['new_tokens'] == 1 else 'prefill'} | {r['batch']} | {r['context']} | "
                     f"{r['new_tokens']} | {fmt(r['reference'])} | {fmt(tri)} | {fmt(r['sdpa'])} | "
                     f"{ratio(r['reference'], tri)} | {ratio(r['sdpa'], tri)} | {r['plan']} | "
                     f"{throughput(r['batch'], r['context'], r['new_tokens'], tri['ms']) if 'ms' in tri else '-'} |")
    lines += ["", "x = how many times faster the Triton kernel is (above 1: Triton is faster). "
              "Reference and Triton include the KV write; sdpa does not page and writes nothing."]
    return "\n".join(lines)


def sweep(iters: int) -> list[dict[str, Any]]:
    """Triton alone under each SWEEP setting of triton_attention's tuning constants."""
    from graphrt.layers.torch.attention import triton_attention as ta

    out = []
    for setting in SWEEP:
        saved = {name: getattr(ta, name) for name in setting}
        for name, value in setting.items():
            setattr(ta, name, value)
        try:
            times = {f"{b}x{c}+{n}": measure("triton", b, c, n, iters) for b, c, n in SWEEP_SHAPES}
        finally:
            for name, value in saved.items():
                setattr(ta, name, value)
        out.append({"setting": setting or "defaults", **times})
        print(f"  swept {setting or 'defaults'}", flush=True)
    return out


def sweep_table(rows: list[dict[str, Any]]) -> str:
    names = [f"{b}x{c}+{n}" for b, c, n in SWEEP_SHAPES]
    lines = ["Triton tuning sweep, ms per call (batch x context + new tokens)", "",
             "| setting | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for r in rows:
        lines.append(f"| {r['setting']} | " + " | ".join(fmt(r[n]) for n in names) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 1, 64 x context 512, 4096 + prefill")
    parser.add_argument("--sweep", action="store_true", help="also time Triton tuning settings")
    parser.add_argument("--iters", type=int, help=f"timed replays per measurement ({ITERS}; quick {QUICK_ITERS})")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench_attention: torch is not installed; nothing to measure")
        return 0
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA GPU is available here (torch.cuda.is_available() is False); "
              "this benchmark needs one and measured nothing")
        return 0
    from graphrt.layers.torch.attention.triton_attention import triton_unavailable_reason

    problem = triton_unavailable_reason("cuda")
    if problem:
        print(f"bench_attention: the Triton kernel cannot run here ({problem}); measured nothing")
        return 0
    import triton

    iters = args.iters or (QUICK_ITERS if args.quick else ITERS)
    batches, contexts = (QUICK_BATCHES, QUICK_CONTEXTS) if args.quick else (BATCHES, CONTEXTS)
    shapes = [(b, c, 1) for c in contexts for b in batches]
    shapes.append((PREFILL[0], PREFILL[1] + PREFILL[2], PREFILL[1]))
    props = torch.cuda.get_device_properties(0)
    header = (f"Device: {torch.cuda.get_device_name()} ({props.multi_processor_count} SMs, "
              f"{props.total_memory / 2**30:.0f} GiB); torch {torch.__version__}, triton {triton.__version__}. "
              f"{HEADS} query / {KV_HEADS} KV heads of {HEAD_DIM}, bf16, block size {BLOCK_SIZE}; ms per call: "
              f"median of {iters} CUDA-graph replays timed with CUDA events, each replaying the call about "
              f"{TARGET_REPLAY_MS:g} ms worth of times.")
    t0 = time.perf_counter()
    rows = run_rows(shapes, iters)
    text = table(rows, header)
    swept = sweep(iters) if args.sweep else []
    if swept:
        text += "\n\n" + sweep_table(swept)
    print(text)
    print(f"\nbench_attention: {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows, "sweep": swept}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
