"""Random paged-attention steps for the kernel tests (test_triton_attention*.py): a step's
tensors on any device, and the parity check of the Triton kernel against the reference.

What "the same" means (``check_parity``):

* **KV rows: bytes.** Every row both kernels write holds the same bytes (they quantize with the
  same function, and the Triton store copies bits); rows outside the step's real slots keep
  their bytes (the trash row, which padded tokens scribble on, excepted).
* **Outputs**: ``graphrt.reduction_tolerance(q dtype, magnitude=max |reference|, width=max(head_dim,
  longest context))``: the kernels add the same products in another order (tiles, online
  softmax, split-KV); the reference also rounds bf16 / fp16 scores to that dtype before its
  softmax, which the Triton kernel keeps in float32.
* **fp8 against a float cache**: ``graphrt.core.numerics.kv_quantization_tolerance`` (stored values
  are off by up to half an fp8 eps; see its docstring).
* **Padded tokens**: zeros (finite, as the contract requires).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, Phase, settings, strategies as st

from graphrt import reduction_tolerance
from graphrt.core.numerics import kv_quantization_tolerance
from graphrt.layers.torch.attention.paged import TorchAttentionMetadata, paged_attention_kernel
from graphrt.layers.torch.attention.kv_quant import FP8_KV_DTYPES, quantize_kv
from graphrt.layers.torch.attention.triton_attention import triton_paged_attention

FP8 = FP8_KV_DTYPES


@dataclass
class Spec:
    """One drawn step: shapes, requests ``(computed, scheduled)``, padding and kernel options."""

    kv_heads: int
    groups: int
    head_dim: int
    block_size: int
    q_dtype: torch.dtype
    cache_dtype: torch.dtype
    reqs: list[tuple[int, int]]
    pad_reqs: int = 0
    pad_tokens: int = 0
    window: int | None = None
    num_splits: int | None = None
    extra_columns: int = 0
    table_width: int | None = None  # None: the longest request's blocks + extra_columns
    nan_fill: bool = False
    k_scale: float = 1.0
    v_scale: float = 1.0
    seed: int = 0


@dataclass
class Step:
    """The tensors of a step, on one device; ``cache`` is the initial KV cache (not mutated)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache: torch.Tensor
    float_cache: torch.Tensor  # the same context in q's dtype, unquantized (fp8 comparisons)
    meta: TorchAttentionMetadata
    real_tokens: int
    real_slots: torch.Tensor
    max_context: int


def build_step(spec: Spec, device: str) -> Step:
    """Distinct random blocks per request (block 0 stays null), random context K/V, NaN in
    every row no request reads when ``nan_fill``, padded tokens (slot -1) and requests."""
    gen = torch.Generator().manual_seed(spec.seed)
    bs, hkv, d = spec.block_size, spec.kv_heads, spec.head_dim
    lens = [c + s for c, s in spec.reqs]
    width = spec.table_width or max(-(-n // bs) for n in lens) + spec.extra_columns
    num_blocks = 1 + sum(-(-n // bs) for n in lens) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    rows = len(spec.reqs) + spec.pad_reqs
    table = torch.zeros(rows, width, dtype=torch.int32)
    qsl, slots, read = [0], [], []
    for r, ((computed, scheduled), n) in enumerate(zip(spec.reqs, lens)):
        blocks = [order.pop() for _ in range(-(-n // bs))]
        table[r, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        where = [blocks[p // bs] * bs + p % bs for p in range(n)]
        read += where
        slots += where[computed:]
        qsl.append(qsl[-1] + scheduled)
    qsl += [qsl[-1]] * spec.pad_reqs
    seq = lens + [0] * spec.pad_reqs
    real_tokens = len(slots)
    slots += [-1] * spec.pad_tokens
    t = len(slots)
    context = torch.randn(2, num_blocks * bs + 1, hkv, d, generator=gen)
    if spec.nan_fill:
        unread = torch.ones(context.shape[1], dtype=torch.bool)
        unread[torch.tensor(read, dtype=torch.int64)] = False
        context[:, unread] = float("nan")
    float_cache = context.to(spec.q_dtype)
    cache = torch.stack([quantize_kv(context[i], spec.cache_dtype, s) for i, s in enumerate((spec.k_scale,
                                                                                               spec.v_scale))])
    q = torch.randn(t, hkv * spec.groups * d, generator=gen).to(spec.q_dtype)
    k = torch.randn(t, hkv * d, generator=gen).to(spec.q_dtype)
    v = torch.randn(t, hkv * d, generator=gen).to(spec.q_dtype)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    meta = TorchAttentionMetadata.build(slot_mapping.to(device), torch.tensor(qsl, dtype=torch.int32, device=device),
                                        torch.tensor(seq, dtype=torch.int32, device=device), table.to(device), bs)
    return Step(q.to(device), k.to(device), v.to(device), cache.to(device), float_cache.to(device), meta,
                real_tokens, slot_mapping[:real_tokens].to(device), max(lens))


def run_kernel(kernel, step: Step, spec: Spec, cache: torch.Tensor, **extra) -> torch.Tensor:
    m = step.meta
    return kernel(step.q, step.k, step.v, cache, m.slot_mapping, m.query_start_loc, m.seq_lens, m.block_table,
                  m.token_req_idx, spec.block_size, spec.head_dim ** -0.5, spec.window, spec.k_scale, spec.v_scale,
                  **extra)


def bytes_of(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8) if cache.element_size() == 1 else cache.view(torch.int16 if cache.element_size()
                                                                                 == 2 else torch.int32)


def check_parity(spec: Spec, device: str) -> None:
    """Triton against the reference on one step: outputs, padded rows, every KV byte."""
    step = build_step(spec, device)
    ref_cache, tri_cache = step.cache.clone(), step.cache.clone()
    ref = run_kernel(paged_attention_kernel, step, spec, ref_cache)
    out = run_kernel(triton_paged_attention, step, spec, tri_cache, num_splits=spec.num_splits)
    n = step.real_tokens
    assert torch.isfinite(out).all(), "non-finite output"
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padded tokens must get zeros"
    want = ref[:n].double()
    tol = reduction_tolerance(spec.q_dtype, magnitude=float(want.abs().max()) if n else 0.0,
                              width=max(spec.head_dim, step.max_context))
    torch.testing.assert_close(out[:n].double(), want, **tol._asdict(), msg=lambda m: f"{spec}\n{m}")
    trash = step.cache.shape[1] - 1
    assert torch.equal(bytes_of(tri_cache)[:, :trash], bytes_of(ref_cache)[:, :trash]), "KV bytes differ"
    untouched = torch.ones(trash, dtype=torch.bool, device=device)
    untouched[step.real_slots] = False
    assert torch.equal(bytes_of(tri_cache)[:, :trash][:, untouched], bytes_of(step.cache)[:, :trash][:, untouched])
    if spec.cache_dtype in FP8 and not spec.nan_fill:
        float_cache = step.float_cache.clone()
        exact = run_kernel(paged_attention_kernel, step, Spec(**{**spec.__dict__, "cache_dtype": spec.q_dtype}),
                           float_cache)
        tol8 = kv_quantization_tolerance(spec.cache_dtype, magnitude=float(exact[:n].abs().max()) if n else 0.0)
        torch.testing.assert_close(out[:n].double(), exact[:n].double(), **tol8._asdict(),
                                   msg=lambda m: f"fp8 against float KV, {spec}\n{m}")


@st.composite
def specs(draw: st.DrawFn, cache_dtypes: tuple[str, ...], q_dtypes: tuple[str, ...]) -> Spec:
    """Small steps: decodes, chunked prefills continuing a cached prefix, fresh prefills, mixed."""
    n = draw(st.integers(1, 4))
    reqs = [(draw(st.integers(0, 70)), draw(st.one_of(st.just(1), st.integers(1, 24)))) for _ in range(n)]
    q_dtype = getattr(torch, draw(st.sampled_from(q_dtypes)))
    cache = draw(st.sampled_from(cache_dtypes))
    fp8 = cache.startswith("float8")
    return Spec(kv_heads=draw(st.sampled_from([1, 2])), groups=draw(st.sampled_from([1, 2, 3, 4, 8])),
                head_dim=draw(st.sampled_from([16, 32, 64])), block_size=draw(st.sampled_from([16, 32])),
                q_dtype=q_dtype, cache_dtype=q_dtype if cache == "same" else getattr(torch, cache), reqs=reqs,
                pad_reqs=draw(st.integers(0, 2)), pad_tokens=draw(st.integers(0, 4)),
                window=draw(st.one_of(st.none(), st.integers(1, 48))),
                num_splits=draw(st.sampled_from([None, 1, 2, 4])), extra_columns=draw(st.integers(0, 2)),
                nan_fill=draw(st.booleans()) and not fp8,
                k_scale=draw(st.sampled_from([0.25, 1.0, 3.0])) if fp8 else 1.0,
                v_scale=draw(st.sampled_from([0.5, 1.0, 2.0])) if fp8 else 1.0,
                seed=draw(st.integers(0, 2**31 - 1)))


#: Kernel runs are slow under the interpreter: fixed examples (derandomized), and no shrinking
#: (a failure prints its whole Spec instead).
SLOW_OK = settings(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow],
                   phases=(Phase.explicit, Phase.generate))
FLOAT_STEPS = specs(cache_dtypes=("same",), q_dtypes=("float32", "float32", "bfloat16", "float16"))
FP8_STEPS = specs(cache_dtypes=("float8_e4m3fn", "float8_e5m2"), q_dtypes=("float32", "bfloat16"))
