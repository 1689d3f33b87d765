"""MiniMax's lightning attention through graphrt's Transformers modeling backend (issue 45).

transformers' ``MiniMaxLightningAttention`` (``q, k, v = silu(qkv_proj(h))``; per head the linear
attention ``S <- exp(-s) S + k v^T``, ``y = q S`` with the layer's fixed decay rates; an RMS norm
over the heads, ``sigmoid(output_gate(h))``, ``out_proj``) is routed to graphrt's
``LightningAttentionMixer`` (``models/torch/lightning.py``) over the same parameters, its state
``[heads, head_dim, head_dim]`` in a state slot (kind ``lightning_attention``). Here:

* the kernel (torch reference by chunks and token by token, Triton interpreted, JAX) against a
  per-request loop over drawn step layouts (hypothesis), NaN in padded rows reaching no request,
  and the states it stores (only written slots' rows compared);
* teacher-forced parity with transformers' own forward for a tiny MiniMax (lightning, full
  attention, lightning; experts in every layer; transformers' blocks of 4 tokens): 4 requests
  joining at different steps, chunked prefill, a preempted request recomputed, on ``eager`` and
  ``cpu`` FULL;
* the routed modules hold transformers' parameters and decay rates and declare the
  ``lightning_attention`` state spec; the kit's ``state_isolated`` on MiniMax; a short state sweep.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from support.triton_interpreter import INTERPRETER_PROBLEM  # sets TRITON_INTERPRET first

from graphrt.core.state_spec import StateGroup, StateTensor
from graphrt.layers.torch.state import triton_recurrent
from graphrt.layers.torch.state.lightning import lightning_attention
from graphrt.layers.torch.state.metadata import build_state_metadata
from support.hybrid_models import hybrid_model_dir, load_hf_hybrid
from support.hybrid_parity import reference_logits, routed_runner, run_routed_schedule
from support.state_steps import state_layouts, state_meta

transformers = pytest.importorskip("transformers")

from graphrt.models.torch.lightning import LightningAttentionMixer  # noqa: E402
from graphrt.models.torch.transformers_impl import (ATTENTION_NAME, register_attention,  # noqa: E402
                                                    wrap_transformers_model)
from graphrt.models.torch.transformers_impl.recurrent import RoutedMixer  # noqa: E402

SLOTS, CHECKPOINTS, HEADS, DK, DV, CHUNK = 4, 2, 2, 4, 3, 3
interpreted = pytest.mark.skipif(INTERPRETER_PROBLEM is not None, reason=f"Triton interpreter: {INTERPRETER_PROBLEM}")


def _layouts():
    return state_layouts(SLOTS, 7)


def _meta(reqs, pad, uniform=0):
    return state_meta(reqs, pad, slots=SLOTS, checkpoints=CHECKPOINTS, uniform=uniform)


def _inputs(meta, total, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(total, HEADS, DK, generator=g), torch.randn(total, HEADS, DK, generator=g)
    v = torch.randn(total, HEADS, DV, generator=g)
    slope = torch.rand(HEADS, generator=g) + 0.05
    init = torch.randn(meta.read_slot.shape[0], HEADS, DK, DV, generator=g) * meta.has_initial.view(-1, 1, 1, 1)
    return q, k, v, slope, init


def _loop(q, k, v, slope, init, meta):
    """Per request, token by token: ``S = exp(-s) S + k v^T``, ``y = q S``; its last C states."""
    y = torch.zeros(q.shape[0], HEADS, DV)
    states = torch.zeros(init.shape[0], CHECKPOINTS, HEADS, DK, DV)
    for r in range(init.shape[0] - 1):
        start, n = int(meta.starts[r]), int(meta.query_lens[r])
        s, seen = init[r].clone(), []
        for t in range(start, start + n):
            s = torch.exp(-slope)[:, None, None] * s + k[t][:, :, None] * v[t][:, None, :]
            y[t] = torch.einsum("hkv,hk->hv", s, q[t])
            seen.append(s)
        for c in range(min(n, CHECKPOINTS)):
            states[r, c] = seen[-1 - c]
    return y, states


def _check(got, want, meta, total):
    (y, states), (want_y, want_states) = got, want
    real = int(meta.starts[-1])
    torch.testing.assert_close(y[:real], want_y[:real], rtol=1e-4, atol=1e-4)
    written = meta.write_slot < SLOTS
    torch.testing.assert_close(states[written], want_states[written], rtol=1e-4, atol=1e-4)
    assert not states[written].isnan().any()


@settings(max_examples=15, deadline=None)
@given(_layouts())
def test_the_lightning_kernel_matches_a_per_request_loop(layout):
    reqs, pad, seed = layout
    meta, total = _meta(reqs, pad)
    q, k, v, slope, init = _inputs(meta, total, seed)
    want = _loop(q, k, v, slope, init, meta)
    if pad:                                   # padded tokens: NaN must reach no real request
        q[total - pad:], k[total - pad:], v[total - pad:] = float("nan"), float("nan"), float("nan")
    _check(lightning_attention(q, k, v, slope, init, meta, CHUNK), want, meta, total)


@interpreted
@settings(max_examples=8, deadline=None)
@given(_layouts())
def test_interpret_triton_lightning_kernel_matches_the_reference(layout):
    reqs, pad, seed = layout
    meta, total = _meta(reqs, pad)
    q, k, v, slope, init = _inputs(meta, total, seed)
    with pytest.MonkeyPatch.context() as patch:       # the interpreter reads it at each launch
        patch.setenv("TRITON_INTERPRET", "1")
        got = triton_recurrent.triton_lightning_attention(q, k, v, slope, init, meta)
    _check(got, lightning_attention(q, k, v, slope, init, meta, CHUNK), meta, total)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_triton_lightning_kernel_matches_the_reference_on_cuda():
    """Compiled with ``triton.jit``: a long prefill, a decode, a padded request and padded tokens."""
    reqs = [(40, 0, 2), (1, 9, 0), (0, 0, -1), (6, 3, 1)]
    meta, total = _meta(reqs, 3)
    q, k, v, slope, init = _inputs(meta, total, 11)
    lens = torch.tensor(np.concatenate([[0], np.cumsum([n for n, _, _ in reqs])]), dtype=torch.int32, device="cuda")
    cuda_meta = build_state_metadata(lens, torch.tensor([c for _, c, _ in reqs], dtype=torch.int32, device="cuda"),
                                     torch.tensor([s for _, _, s in reqs], dtype=torch.int32, device="cuda"), total,
                                     num_slots=SLOTS, checkpoints=CHECKPOINTS)
    y, states = triton_recurrent.triton_lightning_attention(*(t.cuda() for t in (q, k, v, slope, init)), cuda_meta)
    _check((y.cpu(), states.cpu()), lightning_attention(q, k, v, slope, init, meta, CHUNK), meta, total)


def test_uniform_steps_match_the_chunked_kernel_and_the_jax_kernel():
    jnp = pytest.importorskip("jax.numpy")
    from graphrt.layers.jax import recurrent

    reqs = [(2, 3, 1), (2, 0, 0), (2, 7, 3)]
    meta, total = _meta(reqs, 0, uniform=2)
    assert meta.uniform_query_len == 2
    q, k, v, slope, init = _inputs(meta, total, 3)
    got, want = (lightning_attention(q, k, v, slope, init, meta, CHUNK),
                 lightning_attention(q, k, v, slope, init, _meta(reqs, 0)[0], CHUNK))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1][:3], want[1][:3], rtol=1e-5, atol=1e-5)
    qsl = np.array([0, 2, 4, 6])
    jmeta = recurrent.state_meta(jnp.asarray(qsl), jnp.asarray(np.array([5, 2, 9])), jnp.asarray(np.array([1, 0, 3])),
                                 total, num_slots=SLOTS, checkpoints=CHECKPOINTS)
    for uniform in (0, 2):
        y, states = recurrent.lightning_attention(*(jnp.asarray(t.numpy()) for t in (q, k, v, slope, init)), jmeta,
                                                  chunk_size=CHUNK, checkpoints=CHECKPOINTS, uniform=uniform)
        torch.testing.assert_close(torch.from_numpy(np.array(y)), want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(np.array(states))[:3], want[1][:3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend,mode", [("eager", "NONE"), ("cpu", "FULL")])
def test_teacher_forced_parity_with_transformers(backend, mode):
    d = hybrid_model_dir("minimax")
    rng = np.random.default_rng(5)
    seqs = [[int(t) for t in rng.integers(3, 128, size=n)] for n in (13, 7, 18, 9)]
    runner = routed_runner(d, backend, mode)
    assert [type(m) for m in runner.model.state_layers()] == [LightningAttentionMixer] * 2
    refs = reference_logits(load_hf_hybrid(d), seqs)
    run_routed_schedule(runner, seqs, refs, backend)


def _wrapped(**kwargs):
    register_attention()
    hf = transformers.AutoModelForCausalLM.from_pretrained(hybrid_model_dir("minimax"), dtype=torch.float32,
                                                           attn_implementation=ATTENTION_NAME, **kwargs)
    return wrap_transformers_model(hf)


def test_routed_layers_hold_transformers_weights_decay_rates_and_the_lightning_state_spec():
    model = _wrapped()
    hf = load_hf_hybrid(hybrid_model_dir("minimax"))
    layers = [i for i, layer in enumerate(model.body.layers) if isinstance(layer.self_attn, RoutedMixer)]
    assert layers == [0, 2]
    assert [model.body.layers[i].self_attn.mixer for i in layers] == model.state_layers()
    for i in layers:
        own = dict(hf.model.layers[i].self_attn.named_parameters())
        mixer = model.body.layers[i].self_attn.mixer
        ours = dict(mixer.named_parameters())
        assert sorted(own) == sorted(ours) and all(torch.equal(own[n], ours[n]) for n in own)
        torch.testing.assert_close(mixer.slope_rate, hf.model.layers[i].self_attn.slope_rate.reshape(-1))
    slopes = [model.body.layers[i].self_attn.mixer.slope_rate for i in layers]
    assert not torch.equal(slopes[0], slopes[1])            # the rate depends on the layer
    assert model.state_spec().groups == (StateGroup((0, 1), (StateTensor("kv", (4, 16, 16)),), "lightning_attention"),)


def test_kit_state_isolation_on_minimax():
    """FULL decode, PIECEWISE mixed steps and K+1 padding; experts on ``batched_mm`` (as Jamba's:
    ``grouped_mm``'s batchmate-dependent group sizes round differently, which is no state leak)."""
    from graphrt.testing.conformance import run_conformance
    from graphrt.testing.runners import RunnerFactory

    factory = RunnerFactory(lambda: _wrapped(experts_implementation="batched_mm"), "cpu", mode="FULL_AND_PIECEWISE",
                            num_speculative_tokens=1, cudagraph_capture_sizes=[2, 4, 8, 16])
    results = run_conformance(factory=factory, properties=["state_isolated"], examples=6, report=None)
    assert [r.status for r in results] == ["PASS"], [r.line() for r in results]


def test_a_short_state_sweep_of_minimax():
    """The state sweep's MiniMax configuration with FULL mixed and K+1 steps, 30 drawn steps: no
    live slot touched."""
    from graphrt.testing import state_sweep

    config = ("minimax", "cpu", "FULL", 1)
    assert (*config, 2) in state_sweep.SWEEP
    line = state_sweep.sweep_config(config, 30)
    assert line.violation is None and line.steps == 30, line.line()
    assert min(line.kinds["FULL mixed"], line.kinds["K+1"], line.kinds["padded"], line.kinds["restart"]) > 0
