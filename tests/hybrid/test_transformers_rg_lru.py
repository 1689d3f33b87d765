"""RecurrentGemma's RG-LRU blocks through graphrt's Transformers modeling backend (issue 45).

transformers' ``RecurrentGemmaRecurrentBlock`` (a biased depthwise convolution without activation,
then the RG-LRU: ``h <- a h + sqrt(1 - a^2) (x * input_gate)``, reset at position 0, gated by
``act(linear_y(h))``) is routed to graphrt's ``RGLRUMixer`` (``models/torch/rg_lru.py``) over the
same parameters, its convolution window and recurrent state in a state slot (kind ``rg_lru``). Here:

* the scan (torch reference, Triton interpreted, JAX) against a per-request loop over drawn step layouts (hypothesis),
  and the states it stores (only written slots' rows compared);
* teacher-forced parity with transformers' own forward for a tiny RecurrentGemma (RG-LRU, local
  attention of a window shorter than the prompts, RG-LRU; soft-capped logits): 4 requests joining
  at different steps, chunked prefill, a preempted request recomputed, on ``eager`` and ``cpu`` FULL;
* the routed modules hold transformers' parameters and declare the ``rg_lru`` state spec; the kit's
  ``state_isolated`` on RecurrentGemma; a short state sweep.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from support.triton_interpreter import INTERPRETER_PROBLEM  # sets TRITON_INTERPRET first

import graphrt
from graphrt.core.state_spec import StateGroup, StateTensor
from graphrt.layers.torch.state import triton_recurrent
from graphrt.layers.torch.state.rg_lru import rg_lru_scan
from support.hybrid_models import hybrid_model_dir, load_hf_hybrid
from support.hybrid_parity import reference_logits, routed_runner, run_routed_schedule
from support.state_steps import state_layouts, state_meta

transformers = pytest.importorskip("transformers")

from graphrt.models.torch.rg_lru import RGLRUMixer  # noqa: E402
from graphrt.models.torch.transformers_impl import (ATTENTION_NAME, register_attention,  # noqa: E402
                                                    wrap_transformers_model)
from graphrt.models.torch.transformers_impl.recurrent import RoutedMixer  # noqa: E402

SLOTS, CHECKPOINTS, WIDTH = 4, 2, 6
interpreted = pytest.mark.skipif(INTERPRETER_PROBLEM is not None, reason=f"Triton interpreter: {INTERPRETER_PROBLEM}")


def _layouts():
    return state_layouts(SLOTS, 5)


def _meta(reqs, pad, uniform=0):
    return state_meta(reqs, pad, slots=SLOTS, checkpoints=CHECKPOINTS, uniform=uniform)


def _loop(a, b, init, meta):
    """Per request, token by token: ``h = a h + b`` from its initial state; its last C states."""
    h_all = torch.zeros_like(a)
    states = torch.zeros(init.shape[0], CHECKPOINTS, a.shape[1])
    for r in range(init.shape[0] - 1):
        start, n = int(meta.starts[r]), int(meta.query_lens[r])
        h, seen = init[r].clone(), []
        for t in range(start, start + n):
            h = a[t] * h + b[t]
            h_all[t] = h
            seen.append(h)
        for c in range(min(n, CHECKPOINTS)):
            states[r, c] = seen[-1 - c]
    return h_all, states


def _inputs(meta, total, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.rand(total, WIDTH, generator=g), torch.randn(total, WIDTH, generator=g)
    init = torch.randn(meta.read_slot.shape[0], WIDTH, generator=g) * meta.has_initial.view(-1, 1)
    return a, b, init


@settings(max_examples=25, deadline=None)
@given(_layouts())
def test_the_rg_lru_scan_matches_a_per_request_loop(layout):
    reqs, pad, seed = layout
    meta, total = _meta(reqs, pad)
    a, b, init = _inputs(meta, total, seed)
    if pad:                                   # padded tokens: NaN must reach no real request
        a[total - pad:], b[total - pad:] = float("nan"), float("nan")
    (h, states), (want_h, want_states) = rg_lru_scan(a, b, init, meta), _loop(a, b, init, meta)
    real = int(meta.starts[-1])
    torch.testing.assert_close(h[:real], want_h[:real], rtol=1e-5, atol=1e-5)
    written = meta.write_slot < SLOTS
    torch.testing.assert_close(states[written], want_states[written], rtol=1e-5, atol=1e-5)
    assert not states[written].isnan().any()


@interpreted
@settings(max_examples=8, deadline=None)
@given(_layouts())
def test_interpret_triton_rg_lru_scan_matches_the_reference(layout):
    reqs, pad, seed = layout
    meta, total = _meta(reqs, pad)
    a, b, init = _inputs(meta, total, seed)
    with pytest.MonkeyPatch.context() as patch:       # the interpreter reads it at each launch
        patch.setenv("TRITON_INTERPRET", "1")
        h, states = triton_recurrent.triton_rg_lru_scan(a, b, init, meta)
    want_h, want_states = rg_lru_scan(a, b, init, meta)
    real = int(meta.starts[-1])
    torch.testing.assert_close(h[:real], want_h[:real], rtol=1e-5, atol=1e-5)
    written = meta.write_slot < SLOTS
    torch.testing.assert_close(states[written], want_states[written], rtol=1e-5, atol=1e-5)


def test_uniform_steps_match_the_segmented_scan_and_the_jax_kernel():
    jnp = pytest.importorskip("jax.numpy")
    from graphrt.layers.jax import recurrent

    reqs = [(2, 3, 1), (2, 0, 0), (2, 7, 3)]
    meta, total = _meta(reqs, 0, uniform=2)
    assert meta.uniform_query_len == 2
    a, b, init = _inputs(meta, total, 3)
    got, want = rg_lru_scan(a, b, init, meta), rg_lru_scan(a, b, init, _meta(reqs, 0)[0])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1][:3], want[1][:3], rtol=1e-5, atol=1e-6)
    qsl = np.array([0, 2, 4, 6])
    jmeta = recurrent.state_meta(jnp.asarray(qsl), jnp.asarray(np.array([5, 2, 9])), jnp.asarray(np.array([1, 0, 3])),
                                 total, num_slots=SLOTS, checkpoints=CHECKPOINTS)
    for uniform in (0, 2):
        h, states = recurrent.rg_lru_scan(*(jnp.asarray(t.numpy()) for t in (a, b, init)), jmeta,
                                          checkpoints=CHECKPOINTS, uniform=uniform)
        torch.testing.assert_close(torch.from_numpy(np.array(h)), want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.from_numpy(np.array(states))[:3], want[1][:3], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend,mode", [("eager", "NONE"), ("cpu", "FULL")])
def test_teacher_forced_parity_with_transformers(backend, mode):
    d = hybrid_model_dir("recurrent_gemma")
    rng = np.random.default_rng(5)
    seqs = [[int(t) for t in rng.integers(3, 128, size=n)] for n in (13, 7, 18, 9)]
    runner = routed_runner(d, backend, mode)
    assert [type(m) for m in runner.model.state_layers()] == [RGLRUMixer] * 2
    refs = reference_logits(load_hf_hybrid(d), seqs)
    run_routed_schedule(runner, seqs, refs, backend)


def _wrapped():
    register_attention()
    hf = transformers.AutoModelForCausalLM.from_pretrained(hybrid_model_dir("recurrent_gemma"), dtype=torch.float32,
                                                           attn_implementation=ATTENTION_NAME)
    return wrap_transformers_model(hf)


def test_routed_blocks_hold_transformers_weights_and_the_rg_lru_state_spec():
    model = _wrapped()
    hf = load_hf_hybrid(hybrid_model_dir("recurrent_gemma"))
    layers = [i for i, layer in enumerate(model.body.layers) if isinstance(layer.temporal_block, RoutedMixer)]
    assert layers == [0, 2]
    assert [model.body.layers[i].temporal_block.mixer for i in layers] == model.state_layers()
    for i in layers:
        own = dict(hf.model.layers[i].temporal_block.named_parameters())
        ours = dict(model.body.layers[i].temporal_block.mixer.named_parameters())
        assert sorted(own) == sorted(ours) and all(torch.equal(own[n], ours[n]) for n in own)
    assert model.state_spec().groups == (StateGroup((0, 1), (StateTensor("conv", (48, 3)),
                                                              StateTensor("lru", (48,))), "rg_lru"),)


def test_kit_state_isolation_on_recurrent_gemma():
    from graphrt.testing.conformance import run_conformance
    from graphrt.testing.runners import RunnerFactory

    factory = RunnerFactory(_wrapped, "cpu", mode="FULL_AND_PIECEWISE", num_speculative_tokens=1,
                            cudagraph_capture_sizes=[2, 4, 8, 16])
    results = run_conformance(factory=factory, properties=["state_isolated"], examples=6, report=None)
    assert [r.status for r in results] == ["PASS"], [r.line() for r in results]


def test_a_short_state_sweep_of_recurrent_gemma():
    """The state sweep's RecurrentGemma configuration with FULL mixed and K+1 steps, 30 drawn
    steps: no live slot touched."""
    from graphrt.testing import state_sweep

    config = ("recurrent_gemma", "cpu", "FULL", 1)
    assert (*config, 2) in state_sweep.SWEEP
    line = state_sweep.sweep_config(config, 30)
    assert line.violation is None and line.steps == 30, line.line()
    assert min(line.kinds["FULL mixed"], line.kinds["K+1"], line.kinds["padded"], line.kinds["restart"]) > 0
