"""What the Triton part compiles: every Triton kernel graphrt ships, at every plan its planner
picks over a stated domain, as plain job records (JSON-able, for worker processes).

Paged attention (``layers/torch/attention/triton_attention*.py``): the planner
(:func:`~graphrt.layers.torch.attention.triton_attention.plan_attention`) is asked for every phase x head
size x GQA group x dtype of :data:`ATTENTION_DOMAIN`, and each distinct plan becomes one job per
target, with the constants, launch configuration and argument types ``triton_paged_attention``
passes at run time. The KV write and split-KV combine kernels, and the recurrent kernels
(``layers/torch/state/triton_recurrent*.py``: causal conv1d, the SSD scan, the gated delta rule) at the
block sizes their wrappers pick for common model shapes. graphrt has no Triton sampling kernel of
its own (sampling is torch ops, or FlashInfer's kernels).

Needs torch and triton (the planner's module imports both); compiles nothing.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import torch

from graphrt.layers.torch.attention import triton_attention as ta
from graphrt.layers.torch.attention import triton_attention_kernels as tak
from graphrt.layers.torch.state import triton_recurrent as tr
from graphrt.layers.torch.state import triton_recurrent_kernels as trk

from compilecheck.limits import AMD, NVIDIA, TARGETS

#: Query / KV-cache dtype pairs (the dot dtype follows as in ``triton_paged_attention``).
DTYPES = {"bf16": (torch.bfloat16, torch.bfloat16), "fp32": (torch.float32, torch.float32),
          "fp8": (torch.bfloat16, torch.float8_e4m3fn)}
#: The planner's inputs compiled: phase -> (num_tokens, num_reqs) of a typical step, and per
#: dtype the (head sizes, GQA groups) asked for. bf16: the common head sizes at MHA, GQA 4 / 8
#: and MQA-like 32 groups, the small head sizes at GQA 4; fp8 caches and float32 (the IEEE dot, its
#: own smaller tiles) at GQA 4 / 8. fp16 plans equal bf16's in every tile and are not compiled again.
ATTENTION_DOMAIN: dict[str, Any] = {
    "phases": {"decode": (64, 64), "prefill": (512, 4)},
    "plans": {"bf16": [((64, 128, 256), (1, 4, 8, 32)), ((16, 32), (4,))],
              "fp8": [((64, 128, 256), (4, 8))],
              "fp32": [((64, 128, 256), (4, 8))]},
    "block_size": 16,
    "table_width": 256,
    "num_kv_heads": 8,
}
#: (KV heads x head_dim) rows the KV write kernel copies, for the cache element sizes it sees.
STORE_WIDTHS = ((512, "*i16"), (4096, "*i16"), (1024, "*u8"), (1024, "*i32"))
#: Recurrent kernels: (kernel, constants) at the shapes of Mamba2 / Granite-4-H (head 64, state
#: 128 or 256) and Qwen3-Next (key / value heads of 128); CHECKPOINTS 4: speculative decoding.
RECURRENT = (
    ("conv1d", dict(K=4, HAS_BIAS=True, BLOCK=tr.CONV_BLOCK)),
    ("conv1d", dict(K=4, HAS_BIAS=False, BLOCK=tr.CONV_BLOCK)),
    ("ssd", dict(CHECKPOINTS=1, BLOCK_P=tr.SCAN_BLOCK, BLOCK_N=128)),
    ("ssd", dict(CHECKPOINTS=4, BLOCK_P=tr.SCAN_BLOCK, BLOCK_N=256)),
    ("delta", dict(CHECKPOINTS=1, BLOCK_K=128, BLOCK_V=tr.SCAN_BLOCK)),
    ("delta", dict(CHECKPOINTS=4, BLOCK_K=256, BLOCK_V=tr.SCAN_BLOCK)),
)
#: Triton's launch defaults (the recurrent and store kernels are launched without options).
DEFAULT_LAUNCH = (4, 3)
_TL = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float8_e4m3fn: "*fp8e4nv"}


def _signature(fn: Any, pointers: dict[str, str], constexprs: dict[str, Any],
               floats: tuple[str, ...] = (), wide: tuple[str, ...] = ()) -> dict[str, str]:
    """Triton's signature of ``fn``: pointers as given, ``floats`` fp32, ``wide`` i64, other
    scalars i32, constants constexpr (as the runtime binds graphrt's arguments)."""
    sig = {}
    for name in inspect.signature(fn).parameters:
        sig[name] = ("constexpr" if name in constexprs else pointers.get(name) or
                     ("fp32" if name in floats else "i64" if name in wide else "i32"))
    return sig


def _job(kernel: str, fn: Any, plan: str, sig: dict[str, str], consts: dict[str, Any],
         launch: tuple[int, int], **meta: Any) -> dict[str, Any]:
    return {"kernel": kernel, "module": fn.__module__, "fn": fn.__name__, "plan": plan, "signature": sig,
            "constexprs": consts, "num_warps": launch[0], "num_stages": launch[1], **meta}


def attention_jobs() -> list[dict[str, Any]]:
    """One job per distinct attention plan of :data:`ATTENTION_DOMAIN` (targets not yet set)."""
    d = ATTENTION_DOMAIN
    jobs: dict[str, dict[str, Any]] = {}
    for dtype_name, grid in d["plans"].items():
        q_dtype, cache_dtype = DTYPES[dtype_name]
        dot_dtype = q_dtype if cache_dtype == torch.float8_e4m3fn else cache_dtype
        points = [(hd, g) for head_dims, group_list in grid for hd in head_dims for g in group_list]
        for phase, (tokens, reqs) in d["phases"].items():
            for head_dim, groups in points:
                plan = ta.plan_attention(tokens, reqs, d["num_kv_heads"], groups, head_dim, dot_dtype,
                                         d["table_width"], d["block_size"], device="cpu")
                consts = dict(GROUPS=groups, GROUPS_PAD=ta._next_pow2(groups), HEAD_DIM=head_dim,
                              BLOCK_Q=plan.block_q, BLOCK_M=plan.block_m, TILE_N=plan.tile_n,
                              BLOCK_SIZE=d["block_size"], DOT_DTYPE=f"tl.{_TL[dot_dtype]}",
                              IEEE=dot_dtype == torch.float32, WINDOWED=False)
                q_ptr = _PTR[q_dtype]
                sig = _signature(tak.attention_kernel, {
                    "q": q_ptr, "out": q_ptr, "cache_k": _PTR[cache_dtype], "cache_v": _PTR[cache_dtype],
                    "part_acc": "*fp32", "part_ml": "*fp32", "query_start_loc": "*i32", "seq_lens": "*i32",
                    "block_table": "*i32"}, consts, floats=("qk_scale", "out_scale"))
                name = (f"{phase} hd{head_dim} gqa{groups} {dtype_name}: BLOCK_M={plan.block_m} "
                        f"TILE_N={plan.tile_n} warps={plan.num_warps} stages={plan.num_stages}")
                jobs[name] = _job("attention", tak.attention_kernel, name, sig, consts,
                                  (plan.num_warps, plan.num_stages), fp8=dtype_name == "fp8")
    # One sliding-window plan per phase (WINDOWED adds the window's mask and lower bound).
    for phase in d["phases"]:
        base = next(j for j in jobs.values() if j["plan"].startswith(f"{phase} hd128 gqa4 bf16"))
        consts = dict(base["constexprs"], WINDOWED=True)
        name = base["plan"].replace("bf16:", "bf16 windowed:")
        jobs[name] = dict(base, plan=name, constexprs=consts)
    return list(jobs.values())


def other_jobs() -> list[dict[str, Any]]:
    """The KV write and split-KV combine kernels, and the recurrent kernels."""
    jobs = []
    for width, ptr in STORE_WIDTHS:
        block = min(ta.STORE_BLOCK, ta._next_pow2(width))
        consts = dict(WIDTH=width, BLOCK=block)
        sig = _signature(tak.kv_store_kernel, {"src_k": ptr, "src_v": ptr, "cache_k": ptr, "cache_v": ptr,
                                               "slot_mapping": "*i64"}, consts)
        jobs.append(_job("kv_store", tak.kv_store_kernel, f"WIDTH={width} {ptr[1:]}", sig, consts, DEFAULT_LAUNCH))
    for head_dim in (64, 128, 256):
        consts = dict(HEAD_DIM=head_dim)
        sig = _signature(tak.combine_kernel, {"part_acc": "*fp32", "part_ml": "*fp32", "out": "*bf16"}, consts,
                         floats=("out_scale",))
        jobs.append(_job("combine", tak.combine_kernel, f"hd{head_dim} bf16", sig, consts, (1, DEFAULT_LAUNCH[1])))
    fns = {"conv1d": trk.conv1d_kernel, "ssd": trk.ssd_kernel, "delta": trk.delta_kernel}
    for kind, consts in RECURRENT:
        fn = fns[kind]
        params = inspect.signature(fn).parameters
        index = {"token_req", "token_index", "starts", "query_lens"}
        pointers = {n: ("*i64" if n in index else "*fp32") for n in params
                    if n not in consts and n not in {"num_channels", "heads", "groups", "head_dim", "d_state",
                                                     "value_heads", "rep", "key_dim", "value_dim"}}
        sig = _signature(fn, pointers, consts)
        plan = " ".join(f"{k}={v}" for k, v in consts.items())
        jobs.append(_job(kind, fn, plan, sig, consts, DEFAULT_LAUNCH))
    return jobs


@contextlib.contextmanager
def planted_smem() -> Iterator[None]:
    """The planted regression: the planner's decode tiles 4x as tall and its KV tiles 8x as
    large (64 rows x 256 keys at head_dim 256: 128 KB of K in bf16), more than an sm_80 block's
    shared memory holds (it still fits an sm_90 block)."""
    saved = (ta.KV_TILE_BYTES, ta.MAX_TILE_KEYS, ta.DECODE_ROWS)
    ta.KV_TILE_BYTES, ta.MAX_TILE_KEYS, ta.DECODE_ROWS = 8 * ta.KV_TILE_BYTES, 256, 4 * ta.DECODE_ROWS
    try:
        yield
    finally:
        ta.KV_TILE_BYTES, ta.MAX_TILE_KEYS, ta.DECODE_ROWS = saved


def planted_jobs() -> list[dict[str, Any]]:
    """The planted plan (:func:`planted_smem`): decode, head_dim 256, GQA 4, bf16."""
    with planted_smem():
        base = [j for j in attention_jobs() if j["plan"].startswith("decode hd256 gqa4 bf16:")]
    return [dict(j, kernel="attention (planted)", plan="PLANTED " + j["plan"], planted=True) for j in base]


def all_jobs(targets: tuple[str, ...] = NVIDIA + AMD, plant: bool = False) -> list[dict[str, Any]]:
    """Every job for every target (fp8 plans only where the target takes an fp8 cache; AMD:
    the bf16 plans), largest first so the pool's tail is short; ``plant``: the planted plan
    (:func:`planted_jobs`) for sm_80, whose shared memory it exceeds."""
    base = attention_jobs() + other_jobs()
    out = [dict(j, target="sm_80") for j in planted_jobs()] if plant and "sm_80" in targets else []
    for name in targets:
        target = TARGETS[name]
        for job in base:
            if job.get("fp8") and not target.fp8_e4m3:
                continue
            if target.backend == "hip" and job["kernel"] == "attention" and " fp32" in job["plan"]:
                continue
            out.append(dict(job, target=name))
    weight = lambda j: (j["kernel"].startswith("attention"), j["constexprs"].get("HEAD_DIM", 0)  # noqa: E731
                        * j["constexprs"].get("BLOCK_M", 0))
    return sorted(out, key=weight, reverse=True)


__all__ = ["ATTENTION_DOMAIN", "all_jobs", "attention_jobs", "other_jobs", "planted_jobs", "planted_smem"]
