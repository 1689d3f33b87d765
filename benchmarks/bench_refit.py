"""In-place weight refit and sleep / wake on the CPU (issue 43).

**Refit against copy_.** A model of Qwen3-0.6B's shape -- 28 layers, hidden 1024, 16 / 8 heads
of 128, intermediate 3072, vocabulary 151936, tied embeddings, bf16 -- built on the CPU with
graphrt's decoder, and random tensors in its checkpoint's names (q/k/v and gate/up separate, as
a trainer sends them). Timed: ``TorchWeights.update`` of them all (every name resolved, every
tensor checked on meta tensors, then copied into the fused parameters) against a plain
``copy_`` of the same tensors into preallocated ones of the same shapes (the bytes alone).
Target: the refit within 2x the copy (median of ``--reps`` each, alternating).

**Sleep and wake.** The same model under a ``ModelRunner`` (eager backend, a KV cache of
``--kv-blocks`` blocks): ``sleep(1)``, ``wake()``, ``sleep(2)``, ``wake()`` with the bytes
released (weights and caches) and the drop of the process's resident memory measured at each
sleep, and the seconds each call took.

``--quick``: hidden 512, vocabulary 32768 (the 28 layers kept), fewer repetitions.
``--threads N``: torch's intra-op threads (on a machine other jobs share, 1: an oversubscribed
thread pool waits milliseconds per op). ``--json out.json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench_common import cpu_line, print_checks

SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128)
QUICK_SHAPE = dict(SHAPE, vocab_size=32768, hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64)
#: The refit may take this many times a plain copy_ of the same bytes.
TARGET_RATIO = 2.0


def build_model(shape: dict) -> object:
    """graphrt's Qwen3 decoder of ``shape`` in bf16 on the CPU (uninitialised storage)."""
    import torch

    from graphrt.models.hf_config import DecoderConfig
    from graphrt.models.torch.decoder import DecoderForCausalLM

    config = DecoderConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                                      "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
                                      "tie_word_embeddings": True, "torch_dtype": "bfloat16", **shape})
    with torch.device("meta"):
        model = DecoderForCausalLM(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    model.bind_parameters()
    return model.eval().requires_grad_(False)


def checkpoint_tensors(model: object) -> dict:
    """Random bf16 tensors in the checkpoint's names and shapes (fused parameters split back)."""
    import torch

    out = {}
    gen = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        offsets = getattr(param, "shard_offsets", None) or getattr(_owner(model, name), "shard_offsets", None)
        if not offsets:
            out[name] = torch.randn(param.shape, generator=gen).to(torch.bfloat16)
            continue
        inverse = {v: k for k, v in model.packed_modules_mapping.items()}
        for shard, place in offsets.items():
            rows = place[1]
            ckpt = name.replace(_fused(name), _part(inverse, _fused(name), shard))
            out[ckpt] = torch.randn((rows, *param.shape[1:]), generator=gen).to(torch.bfloat16)
    return out


def _owner(model: object, name: str) -> object:
    module = model
    for part in name.split(".")[:-1]:
        module = getattr(module, part)
    return module


def _fused(name: str) -> str:
    return name.split(".")[-2]


def _part(inverse: dict, fused: str, shard: object) -> str:
    return inverse[(fused, shard)]


def time_refit(model: object, tensors: dict, reps: int) -> dict:
    """Median seconds of a full refit and of a plain copy_ of the same tensors, alternating."""
    import torch

    from graphrt.backends.torch.weights import TorchWeights

    weights = TorchWeights(model)
    targets = {n: torch.empty_like(t) for n, t in tensors.items()}
    refit, copy = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        weights.update(tensors)
        refit.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.no_grad():
            for n, t in tensors.items():
                targets[n].copy_(t)
        copy.append(time.perf_counter() - t0)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"tensors": len(tensors), "bytes": nbytes, "refit_s": statistics.median(refit),
            "copy_s": statistics.median(copy), "ratio": statistics.median(refit) / statistics.median(copy)}


def time_sleep(model: object, tensors: dict, kv_blocks: int) -> dict:
    """Sleep levels 1 and 2 and their wakes under an eager ModelRunner: bytes and seconds (after
    level 2, the runner's refit of every weight too)."""
    import graphrt

    runner = graphrt.ModelRunner(model, backend="eager", num_kv_blocks=kv_blocks, block_size=16, max_num_seqs=8,
                                 max_num_batched_tokens=256, max_model_len=1024, warmup=False, progress=False)
    out = {}
    for kv in runner.executor.kv_views():        # a cache in use: its pages resident, as after serving
        kv.fill_(1)
    try:
        for level in (1, 2):
            t0 = time.perf_counter()
            slept = runner.sleep(level)
            slept["call_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            woke = runner.wake()
            woke["call_s"] = time.perf_counter() - t0
            out[f"level{level}"] = {"sleep": slept, "wake": woke}
        out["refit_after_level2"] = runner.update_weights(tensors)
    finally:
        runner.close()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--kv-blocks", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default torch's; 1 on a machine other jobs share)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    shape = QUICK_SHAPE if args.quick else SHAPE
    reps = args.reps or (3 if args.quick else 7)
    print(f"machine: {cpu_line()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    model = build_model(shape)
    tensors = checkpoint_tensors(model)
    refit = time_refit(model, tensors, reps)
    print(f"refit of {refit['tensors']} tensors, {refit['bytes'] / 2**20:.0f} MiB (28 layers, bf16): "
          f"{refit['refit_s'] * 1e3:.1f} ms; copy_ of the same bytes {refit['copy_s'] * 1e3:.1f} ms; "
          f"ratio {refit['ratio']:.2f}")
    sleep = time_sleep(model, tensors, args.kv_blocks)
    for level in ("level1", "level2"):
        both = sleep[level]
        s, w = both["sleep"], both["wake"]
        measured = "n/a" if s["measured_bytes"] is None else f"{s['measured_bytes'] / 2**20:.0f} MiB"
        print(f"sleep({level[-1]}): released {s['released_bytes'] / 2**20:.0f} MiB (weights "
              f"{s['weight_bytes'] / 2**20:.0f}, caches {s['cache_bytes'] / 2**20:.0f}; "
              f"{s['offloaded_bytes'] / 2**20:.0f} kept on the host), resident memory -{measured}, "
              f"{s['call_s'] * 1e3:.0f} ms; wake {w['call_s'] * 1e3:.0f} ms")
    print(f"runner.update_weights after wake from level 2: {sleep['refit_after_level2']['seconds'] * 1e3:.1f} ms")
    checks = {f"refit within {TARGET_RATIO}x a plain copy_ ({refit['ratio']:.2f}x)": refit["ratio"] <= TARGET_RATIO}
    result = {"machine": cpu_line(), "refit": refit, "sleep": sleep, "all_pass": print_checks(checks)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return result


if __name__ == "__main__":
    raise SystemExit(0 if main()["all_pass"] else 1)
