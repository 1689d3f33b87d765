"""The Triton paged-attention kernel compiled on a CUDA GPU (``gpu``-marked; skipped elsewhere).

* the hypothesis-drawn steps of tests/attention/test_triton_attention.py (fewer), compiled;
* parity at realistic shapes: 16 query / 8 KV heads of 128, a mixed batch of two prefill chunks
  (one continuing a 3840-token prefix to 4096) and 24 decodes with contexts up to 4096, padded
  requests and tokens; bf16, block size 32 with a window, fp8 e4m3 / e5m2, fp16 with 8 query
  heads per KV head, fp32, and decode-only at 4k (split-KV);
* the default kernel on CUDA is Triton;
* a capture in a ``torch.cuda.CUDAGraph`` replayed with new tokens, sequence lengths and block
  tables equals eager calls bit for bit, and the reference within tolerance.

What "the same" means: tests/support/attention_steps.py (``check_parity``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from support.attention_steps import FLOAT_STEPS, FP8, FP8_STEPS, SLOW_OK, Spec, build_step, bytes_of, check_parity
from support.fast_subset import examples
from graphrt import reduction_tolerance
from graphrt.layers.torch.attention import paged as attention_mod
from graphrt.layers.torch.attention.paged import choose_attention_kernel, paged_attention_kernel
from graphrt.layers.torch.attention.triton_attention import triton_paged_attention, triton_unavailable_reason

CUDA_PROBLEM = triton_unavailable_reason("cuda") if torch.cuda.is_available() else "needs a CUDA GPU"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(CUDA_PROBLEM is not None, reason=f"Triton on CUDA: {CUDA_PROBLEM}")]


@settings(SLOW_OK, max_examples=examples(6))
@given(spec=FLOAT_STEPS)
def test_gpu_float_cache_steps_match_the_reference(spec: Spec) -> None:
    check_parity(spec, "cuda")


@settings(SLOW_OK, max_examples=examples(4))
@given(spec=FP8_STEPS)
def test_gpu_fp8_cache_steps_match_the_reference(spec: Spec) -> None:
    check_parity(spec, "cuda")


GPU_SHAPE = dict(kv_heads=8, groups=2, head_dim=128)


def _mixed(**over: object) -> Spec:
    """Two prefill chunks (one continuing a 3840-token prefix to 4096), 24 decodes with contexts
    up to 4096, padded requests and tokens."""
    gen = torch.Generator().manual_seed(11)
    decodes = [(int(c), 1) for c in torch.randint(0, 4096, (24,), generator=gen)]
    base = dict(GPU_SHAPE, block_size=16, q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16,
                reqs=[(3840, 256), (0, 96)] + decodes, pad_reqs=3, pad_tokens=5, seed=3)
    return Spec(**{**base, **over})


GPU_CASES = {
    "bf16": _mixed(),
    "bf16-bs32-window": _mixed(block_size=32, window=1000),
    "fp8e4m3": _mixed(cache_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=0.25),
    "fp8e5m2-window": _mixed(cache_dtype=torch.float8_e5m2, window=700, k_scale=2.0, v_scale=1.0),
    "fp16-gqa8-d64": _mixed(kv_heads=4, groups=8, head_dim=64, q_dtype=torch.float16, cache_dtype=torch.float16),
    "fp32": _mixed(q_dtype=torch.float32, cache_dtype=torch.float32, reqs=[(1000, 64), (0, 40), (3000, 1)]),
    "decode-only-4k": _mixed(reqs=[(4095, 1), (3000, 1), (17, 1), (4000, 1), (2048, 1)], pad_reqs=1, pad_tokens=1),
}


@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gpu_parity_at_realistic_shapes(case: str) -> None:
    check_parity(GPU_CASES[case], "cuda")


def test_gpu_default_kernel_on_cuda_is_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(attention_mod.ATTENTION_ENV, raising=False)
    assert choose_attention_kernel("cuda", 128, torch.bfloat16, torch.bfloat16).kernel == "triton"


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_gpu_cuda_graph_replay_with_new_metadata_matches_eager(cache_dtype: torch.dtype) -> None:
    """Capture the kernel once on static buffers (an all-padding step), then replay three
    different steps copied into them: decode-only at 4k (split-KV), mixed prefill + decode,
    and a short one. Each replay equals an eager call on the same inputs, bit for bit."""
    tokens, reqs, width = 160, 6, 4096 // 16
    steps = [_mixed(cache_dtype=cache_dtype, reqs=[(4095, 1), (3000, 1), (100, 1), (4000, 1)], pad_reqs=2,
                    pad_tokens=tokens - 4, table_width=width),
             _mixed(cache_dtype=cache_dtype, reqs=[(2000, 100), (0, 50), (4095, 1)], pad_reqs=3,
                    pad_tokens=tokens - 151, table_width=width, seed=4),
             _mixed(cache_dtype=cache_dtype, reqs=[(0, 7)], pad_reqs=5, pad_tokens=tokens - 7, table_width=width,
                    seed=5)]
    built = [build_step(s, "cuda") for s in steps]
    rows = max(b.cache.shape[1] for b in built)
    spec = steps[0]
    q_cols, kv_cols = built[0].q.shape[1], built[0].k.shape[1]
    static = dict(q=torch.zeros(tokens, q_cols, dtype=torch.bfloat16, device="cuda"),
                  k=torch.zeros(tokens, kv_cols, dtype=torch.bfloat16, device="cuda"),
                  v=torch.zeros(tokens, kv_cols, dtype=torch.bfloat16, device="cuda"),
                  slots=torch.full((tokens,), -1, dtype=torch.int64, device="cuda"),
                  qsl=torch.zeros(reqs + 1, dtype=torch.int32, device="cuda"),
                  lens=torch.zeros(reqs, dtype=torch.int32, device="cuda"),
                  table=torch.zeros(reqs, width, dtype=torch.int32, device="cuda"))
    cache = torch.zeros(2, rows, spec.kv_heads, spec.head_dim, dtype=torch.uint8 if cache_dtype in FP8 else
                        cache_dtype, device="cuda").view(cache_dtype)
    zero = lambda c: bytes_of(c).zero_()  # noqa: E731 - through bytes: fill_ need not know fp8

    def call(c: torch.Tensor) -> torch.Tensor:
        s = static
        return triton_paged_attention(s["q"], s["k"], s["v"], c, s["slots"], s["qsl"], s["lens"], s["table"], None,
                                      spec.block_size, spec.head_dim ** -0.5, None, spec.k_scale, spec.v_scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(cache)  # compiles every kernel of this shape before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(cache)
    for step in built:
        m = step.meta
        for name, value in (("q", step.q), ("k", step.k), ("v", step.v), ("slots", m.slot_mapping),
                            ("qsl", m.query_start_loc), ("lens", m.seq_lens), ("table", m.block_table)):
            static[name].copy_(value)
        zero(cache)
        cache[:, :step.cache.shape[1] - 1] = step.cache[:, :-1]
        start = cache.clone()
        graph.replay()
        replayed, replay_cache = captured.clone(), cache.clone()
        cache.copy_(start)
        eager = call(cache)
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager), f"replay differs from eager: {(replayed - eager).abs().max()}"
        assert torch.equal(bytes_of(replay_cache)[:, :-1], bytes_of(cache)[:, :-1])  # the trash row apart
        ref = paged_attention_kernel(step.q, step.k, step.v, start.clone(), m.slot_mapping, m.query_start_loc,
                                     m.seq_lens, m.block_table, m.token_req_idx, spec.block_size,
                                     spec.head_dim ** -0.5, None, spec.k_scale, spec.v_scale)
        n = step.real_tokens
        tol = reduction_tolerance(torch.bfloat16, magnitude=float(ref[:n].abs().max()), width=4096)
        torch.testing.assert_close(replayed[:n].double(), ref[:n].double(), **tol._asdict())
