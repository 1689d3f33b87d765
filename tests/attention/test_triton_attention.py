"""The Triton paged-attention kernel (layers/torch/attention/triton_attention.py) against the reference.

Two ways to run the kernel:

* **Interpreted, on a CPU** (every machine): Triton's interpreter runs the kernels on CPU
  tensors. It must be switched on (``TRITON_INTERPRET=1``) before triton is first imported in
  the process: tests/support/triton_interpreter.py does that (tests/conftest.py imports it
  first, so a full-suite run has it too) and puts the variable back; this module sets it again
  only while its own interpreter tests run. Where triton was imported earlier all the same,
  ``test_interpreter_suite_in_a_fresh_process`` runs them in a child pytest instead. Triton's
  interpreter multiplies bf16 as raw integers, so bf16 dots run in float32 there
  (``triton_attention`` chooses that); everything else is the compiled code path.
* **Compiled, on a GPU**: tests/attention/test_triton_attention_gpu.py (``gpu``-marked).

What "the same" means: tests/support/attention_steps.py (``check_parity``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.triton_interpreter import CHILD_ENV, INTERPRETER_PROBLEM  # before torch._dynamo imports triton

from hypothesis import given, settings  # noqa: E402

from support.attention_steps import (FLOAT_STEPS, FP8_STEPS, SLOW_OK, Spec, build_step, bytes_of,  # noqa: E402
                             check_parity, run_kernel)
from support.fast_subset import examples  # noqa: E402
from graphrt.core.errors import ConfigError  # noqa: E402
from graphrt.layers.torch.attention import paged as attention_mod  # noqa: E402
from graphrt.layers.torch.attention.paged import PagedAttention, choose_attention_kernel, paged_attention_kernel  # noqa: E402
from graphrt.layers.torch.attention.kv_quant import quantize_kv  # noqa: E402
from graphrt.layers.torch.attention.triton_attention import triton_config_problem, triton_paged_attention  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()

interpreted = pytest.mark.skipif(INTERPRETER_PROBLEM is not None, reason=f"Triton interpreter: {INTERPRETER_PROBLEM}")


@pytest.fixture(autouse=True)
def _interpret_while_testing(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_INTERPRET=1 during this module's tests only (the kernel checks it for CPU tensors)."""
    if INTERPRETER_PROBLEM is None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@interpreted
@settings(SLOW_OK, max_examples=examples(30))
@given(spec=FLOAT_STEPS)
def test_interpret_float_cache_steps_match_the_reference(spec: Spec) -> None:
    check_parity(spec, "cpu")


@interpreted
@settings(SLOW_OK, max_examples=examples(15))
@given(spec=FP8_STEPS)
def test_interpret_fp8_cache_steps_match_the_reference(spec: Spec) -> None:
    check_parity(spec, "cpu")


@interpreted
@pytest.mark.parametrize("splits", [1, 4])
def test_interpret_decodes_chunked_prefill_padding_and_window(splits: int) -> None:
    """A fixed step with every case at once (for a readable failure before the drawn ones)."""
    spec = Spec(kv_heads=2, groups=3, head_dim=32, block_size=16, q_dtype=torch.float32,
                cache_dtype=torch.float32, reqs=[(40, 9), (0, 1), (70, 1), (0, 20), (16, 1)], pad_reqs=2,
                pad_tokens=3, window=23, num_splits=splits, extra_columns=1, nan_fill=True, seed=5)
    check_parity(spec, "cpu")


@interpreted
def test_interpret_paged_attention_module_runs_triton_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """``GRAPHRT_ATTENTION=triton``: the model's attention module runs the Triton kernel (here
    interpreted) with its window and scales, and matches ``reference``."""
    from graphrt.layers.torch.forward_context import forward_context

    spec = Spec(kv_heads=2, groups=2, head_dim=16, block_size=16, q_dtype=torch.float32,
                cache_dtype=torch.float8_e4m3fn, reqs=[(5, 3), (0, 1)], pad_tokens=1, window=4, k_scale=2.0,
                v_scale=0.5)
    step = build_step(spec, "cpu")
    layer = PagedAttention(4, 2, 16, sliding_window=4, k_scale=2.0, v_scale=0.5)
    outs = {}
    for name in ("reference", "triton"):
        monkeypatch.setenv(attention_mod.ATTENTION_ENV, name)
        assert choose_attention_kernel("cpu", 16, torch.float32, spec.cache_dtype).kernel == name
        layer.kv_cache = step.cache.clone()
        with forward_context(step.meta):
            outs[name] = layer(step.q, step.k, step.v)
        outs[name + " cache"] = layer.kv_cache
    n = step.real_tokens
    torch.testing.assert_close(outs["triton"][:n], outs["reference"][:n], rtol=1e-5, atol=1e-5)
    assert torch.equal(bytes_of(outs["triton cache"])[:, :-1], bytes_of(outs["reference cache"])[:, :-1])


@interpreted
def test_interpret_kernels_replay_in_a_recording_graph() -> None:
    """Captured in graphrt's CPU recording graph (the ``cpu`` backend's), the interpreted kernels
    (K/V store, attention, split-KV combine) run again at each replay on the step then in the
    captured buffers, bit for bit as an eager call on it (before: no aten op, nothing recorded, the
    capture's output left in place)."""
    from graphrt.backends.torch.recording_graph import RecordingGraph, recording_graph

    spec = Spec(kv_heads=1, groups=2, head_dim=16, block_size=16, q_dtype=torch.float32, cache_dtype=torch.float32,
                reqs=[(20, 2), (5, 1)], pad_reqs=1, pad_tokens=1, num_splits=2, seed=1)
    step, then = build_step(spec, "cpu"), build_step(Spec(**{**spec.__dict__, "seed": 2}), "cpu")
    cache = step.cache.clone()
    graph = RecordingGraph()
    with recording_graph(graph):
        out = run_kernel(triton_paged_attention, step, spec, cache, num_splits=2)
    for name in ("q", "k", "v"):                                   # the next step, in the same buffers
        getattr(step, name).copy_(getattr(then, name))
    for name, value in vars(step.meta).items():
        if isinstance(value, torch.Tensor):
            value.copy_(getattr(then.meta, name))
    cache.copy_(then.cache)
    graph.replay()
    want_cache = then.cache.clone()
    want = run_kernel(triton_paged_attention, then, spec, want_cache, num_splits=2)
    assert torch.equal(out, want) and torch.equal(bytes_of(cache), bytes_of(want_cache))


def test_interpreter_suite_in_a_fresh_process() -> None:
    """Where triton was imported before this module (a full-suite run), the interpreter tests
    run in a child pytest that sets ``TRITON_INTERPRET=1`` first."""
    if os.environ.get(CHILD_ENV) or INTERPRETER_PROBLEM is None:
        pytest.skip("the interpreter tests run in this process")
    if HAS_CUDA or "imported earlier" not in INTERPRETER_PROBLEM:
        pytest.skip(f"Triton interpreter: {INTERPRETER_PROBLEM}")
    env = dict(os.environ, TRITON_INTERPRET="1", **{CHILD_ENV: "1"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "interpret and not fresh"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], done.stdout[-3000:]


# ---- choices and refusals (no kernel runs) ---------------------------------------------------

def test_refuses_what_it_cannot_run_with_a_reason() -> None:
    assert "head_dim 48" in triton_config_problem(48, torch.bfloat16, torch.bfloat16)
    assert "int8" in triton_config_problem(128, torch.bfloat16, torch.int8)
    assert triton_config_problem(128, torch.bfloat16, torch.float8_e5m2) is None
    q = torch.zeros(1, 96)
    with pytest.raises(ConfigError, match="head_dim 48|Triton"):
        triton_paged_attention(q, q[:, :48], q[:, :48], torch.zeros(2, 17, 1, 48), torch.zeros(1, dtype=torch.int64),
                               torch.tensor([0, 1], dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                               torch.ones(1, 1, dtype=torch.int32), None, 16, 1.0)


def test_kernel_choice_follows_graphrt_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(attention_mod.ATTENTION_ENV, raising=False)
    assert choose_attention_kernel("cpu", 128, torch.float32, torch.float32).kernel == "reference"
    monkeypatch.setenv(attention_mod.ATTENTION_ENV, "reference")
    assert choose_attention_kernel("cuda", 128, torch.bfloat16, torch.bfloat16).kernel == "reference"
    monkeypatch.setenv(attention_mod.ATTENTION_ENV, "flash")
    with pytest.raises(ConfigError, match="flash"):
        choose_attention_kernel("cpu", 128, torch.float32, torch.float32)
    monkeypatch.setenv(attention_mod.ATTENTION_ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="cannot run"):
        choose_attention_kernel("cpu", 128, torch.float32, torch.float32)


def test_graphrt_imports_and_the_reference_runs_without_triton() -> None:
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, graphrt\n"
            "from graphrt.layers.torch.attention import paged as attention, triton_attention\n"
            "print(triton_attention.triton_unavailable_reason('cuda'))\n"
            "q = torch.zeros(1, 32); qsl = torch.tensor([0, 1], dtype=torch.int32)\n"
            "out = attention.run_paged_attention(q, q, q, torch.zeros(2, 17, 2, 16), torch.zeros(1, dtype=torch.int64),"
            " qsl, torch.ones(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),"
            " torch.zeros(1, dtype=torch.int64), 16, 0.25)\n"
            "print(tuple(out.shape))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    env.pop(attention_mod.ATTENTION_ENV, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "triton does not import" in done.stdout and "(1, 32)" in done.stdout


def test_reference_window_and_fp8_options() -> None:
    """The reference's new options: a window as long as the context changes nothing; a window of
    1 returns each token's own V; fp8 reads back stored * scale."""
    spec = Spec(kv_heads=1, groups=2, head_dim=16, block_size=16, q_dtype=torch.float32,
                cache_dtype=torch.float32, reqs=[(10, 4), (0, 3)])
    step = build_step(spec, "cpu")
    full = run_kernel(paged_attention_kernel, step, spec, step.cache.clone())
    wide = run_kernel(paged_attention_kernel, step, Spec(**{**spec.__dict__, "window": 14}), step.cache.clone())
    torch.testing.assert_close(wide, full, rtol=0, atol=0)
    own = run_kernel(paged_attention_kernel, step, Spec(**{**spec.__dict__, "window": 1}), step.cache.clone())
    n = step.real_tokens
    torch.testing.assert_close(own[:n], step.v[:n].repeat(1, 2))
    x = torch.tensor([0.1, -3.0, 1000.0])
    stored = quantize_kv(x, torch.float8_e4m3fn, 2.0)
    assert stored.float().tolist() == [0.05078125, -1.5, 448.0]  # x / 2, rounded; 500 saturates at 448
