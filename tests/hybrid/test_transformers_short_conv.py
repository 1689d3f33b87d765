"""LFM2's short convolutions through graphrt's Transformers modeling backend (issue 45).

transformers' ``Lfm2ShortConv`` / ``Lfm2MoeShortConv`` (``conv`` layers: ``out_proj(C * conv(B *
x))``, a depthwise causal convolution of ``L_cache`` taps and no activation) are routed to
graphrt's ``ShortConvMixer`` (``models/torch/short_conv.py``) over the same parameters, its
window in a state slot (kind ``short_conv``). Here:

* the convolution without activation (torch reference, Triton interpreted, JAX) against a
  per-request ``F.conv1d`` over the request's window and tokens, and the windows it stores;
* teacher-forced parity with transformers' own forward for a tiny LFM2 (conv, attention, conv;
  biased): 4 requests joining at different steps, chunked prefill, a preempted request
  recomputed, on ``eager`` and ``cpu`` FULL graphs;
* the routed modules hold transformers' parameters and declare the ``short_conv`` state spec;
  the kit's ``state_isolated``, ``kv_isolated`` and ``padding_invisible`` on LFM2; a short state sweep.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from support.triton_interpreter import INTERPRETER_PROBLEM  # sets TRITON_INTERPRET first

import graphrt
from graphrt.core.state_spec import StateGroup, StateTensor
from graphrt.layers.torch.state import triton_recurrent
from graphrt.layers.torch.state.mamba_kernels import causal_conv1d
from graphrt.layers.torch.state.metadata import build_state_metadata
from support.hybrid_models import hybrid_model_dir, load_hf_hybrid
from support.hybrid_parity import reference_logits, routed_runner, run_routed_schedule

transformers = pytest.importorskip("transformers")

from graphrt.models.torch.short_conv import ShortConvMixer  # noqa: E402
from graphrt.models.torch.transformers_impl import (ATTENTION_NAME, register_attention,  # noqa: E402
                                                    wrap_transformers_model)
from graphrt.models.torch.transformers_impl.recurrent import RoutedMixer  # noqa: E402

interpreted = pytest.mark.skipif(INTERPRETER_PROBLEM is not None, reason=f"Triton interpreter: {INTERPRETER_PROBLEM}")


def _step():
    """Request 0 continues (5 computed, 3 new), 1 is new (6 tokens), 2 decodes, 3 is padded; 3
    padded tokens; 2 checkpoints."""
    qsl = torch.tensor([0, 3, 9, 10, 10], dtype=torch.int32)
    return build_state_metadata(qsl, torch.tensor([5, 0, 7, 0], dtype=torch.int32),
                                torch.tensor([2, 0, 1, -1], dtype=torch.int32), 13, num_slots=3, checkpoints=2)


def _inputs(meta):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(13, 24, generator=g), torch.randn(24, 3, generator=g), torch.randn(24, generator=g)
    init = torch.randn(5, 24, 2, generator=g) * meta.has_initial.view(-1, 1, 1)
    return x, w, b, init


def _oracle(x, w, b, init, meta):
    """Per request: ``F.conv1d`` over its window then its tokens (no activation); the window
    after each of its last C positions, newest first."""
    k = w.shape[1]
    out, windows = torch.zeros_like(x), torch.zeros(init.shape[0], meta.checkpoints, x.shape[1], k - 1)
    for r in range(init.shape[0]):
        start, n = int(meta.starts[r]), int(meta.query_lens[r])
        if n == 0:
            continue
        seq = torch.cat([init[r], x[start:start + n].T], dim=1)              # [D, K - 1 + n]
        out[start:start + n] = F.conv1d(seq[None], w[:, None], b, groups=x.shape[1])[0].T
        for c in range(min(n, meta.checkpoints)):
            windows[r, c] = seq[:, n - c:n - c + k - 1]
    return out, windows


def _close(a, b, what):
    tol = graphrt.reduction_tolerance("float32", magnitude=float(b.abs().amax()) + 1.0, width=8)
    torch.testing.assert_close(a, b, rtol=tol.rtol, atol=tol.atol, msg=what)


def test_the_convolution_without_activation_matches_a_per_request_conv1d():
    meta = _step()
    args = _inputs(meta)
    (got, windows), (want, want_windows) = causal_conv1d(*args, meta, activation=False), _oracle(*args, meta)
    _close(got[:10], want[:10], "outputs")
    written = meta.write_slot < 3
    assert torch.equal(windows[written], want_windows[written])


@interpreted
def test_interpret_triton_convolution_without_activation(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    meta = _step()
    args = _inputs(meta)
    got = triton_recurrent.triton_causal_conv1d(*args, meta, activation=False)
    want = causal_conv1d(*args, meta, activation=False)
    _close(got[0][:10], want[0][:10], "Triton outputs")
    assert torch.equal(got[1], want[1])


def test_jax_convolution_without_activation():
    jnp = pytest.importorskip("jax.numpy")
    from graphrt.layers.jax import recurrent

    meta = _step()
    args = _inputs(meta)
    jmeta = recurrent.state_meta(jnp.asarray(np.array([0, 3, 9, 10, 10])), jnp.asarray(np.array([8, 6, 8, 0])),
                                 jnp.asarray(np.array([2, 0, 1, -1])), 13, num_slots=3, checkpoints=2)
    y, windows = recurrent.causal_conv1d(*(jnp.asarray(a.numpy()) for a in args), jmeta, 2, activation=False)
    want = causal_conv1d(*args, meta, activation=False)
    _close(torch.from_numpy(np.array(y))[:10], want[0][:10], "JAX outputs")
    _close(torch.from_numpy(np.array(windows)), want[1], "JAX windows")


@pytest.mark.parametrize("backend,mode", [("eager", "NONE"), ("cpu", "FULL")])
def test_teacher_forced_parity_with_transformers(backend, mode):
    d = hybrid_model_dir("lfm2")
    rng = np.random.default_rng(5)
    seqs = [[int(t) for t in rng.integers(3, 128, size=n)] for n in (13, 7, 18, 9)]
    runner = routed_runner(d, backend, mode)
    assert [type(m) for m in runner.model.state_layers()] == [ShortConvMixer] * 2
    refs = reference_logits(load_hf_hybrid(d), seqs)
    run_routed_schedule(runner, seqs, refs, backend)


def _wrapped():
    register_attention()
    hf = transformers.AutoModelForCausalLM.from_pretrained(hybrid_model_dir("lfm2"), dtype=torch.float32,
                                                           attn_implementation=ATTENTION_NAME)
    return wrap_transformers_model(hf)


def test_routed_mixers_hold_transformers_weights_and_the_short_conv_state_spec():
    model = _wrapped()
    hf = load_hf_hybrid(hybrid_model_dir("lfm2"))
    layers = [i for i, layer in enumerate(model.body.layers) if isinstance(getattr(layer, "conv", None), RoutedMixer)]
    assert layers == [0, 2]
    assert [model.body.layers[i].conv.mixer for i in layers] == model.state_layers()
    for i in layers:
        own = dict(hf.model.layers[i].conv.named_parameters())
        ours = dict(model.body.layers[i].conv.mixer.named_parameters())
        assert sorted(own) == sorted(ours) and all(torch.equal(own[n], ours[n]) for n in own)
    assert model.state_spec().groups == (StateGroup((0, 1), (StateTensor("conv", (64, 2)),), "short_conv"),)


def test_kit_state_isolation_on_lfm2():
    from graphrt.testing.conformance import run_conformance
    from graphrt.testing.runners import RunnerFactory

    factory = RunnerFactory(_wrapped, "cpu", mode="FULL_AND_PIECEWISE", num_speculative_tokens=1,
                            cudagraph_capture_sizes=[2, 4, 8, 16])
    results = run_conformance(factory=factory, properties=["state_isolated", "kv_isolated", "padding_invisible"],
                              examples=6, report=None)
    assert [r.status for r in results] == ["PASS"] * 3, [r.line() for r in results]


def test_a_short_state_sweep_of_lfm2():
    """The state sweep's LFM2 configuration with FULL mixed and K+1 steps, 30 drawn steps: no
    live slot touched; the 10,000-step run is in docs/hybrid.md."""
    from graphrt.testing import state_sweep

    config = ("lfm2", "cpu", "FULL", 1)
    assert (*config, 2) in state_sweep.SWEEP
    line = state_sweep.sweep_config(config, 30)
    assert line.violation is None and line.steps == 30, line.line()
    assert min(line.kinds["FULL mixed"], line.kinds["K+1"], line.kinds["padded"], line.kinds["restart"]) > 0
