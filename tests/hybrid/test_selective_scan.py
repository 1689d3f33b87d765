"""Mamba1's selective scan kernels (torch reference, JAX, Triton) against a per-request loop.

The oracle runs each request's recurrence token by token from its initial state, the way
transformers' ``mamba_selective_scan`` does for one sequence. The kernels run a packed step:
requests continuing a state and new ones, a padded request, padded tokens, two checkpoints; the
reference's segmented scan (mixed steps) and recurrent form (uniform steps) are both checked,
over hypothesis-drawn step layouts, and so are the states each one hands to ``write_states``
(what goes into which slot and ring entry; the trash slot for what has no position).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from support.triton_interpreter import INTERPRETER_PROBLEM  # sets TRITON_INTERPRET first

import graphrt
from graphrt.layers.torch.state import triton_recurrent
from graphrt.layers.torch.state.metadata import build_state_metadata
from graphrt.layers.torch.state.selective_scan import selective_scan

interpreted = pytest.mark.skipif(INTERPRETER_PROBLEM is not None, reason=f"Triton interpreter: {INTERPRETER_PROBLEM}")
CHANNELS, STATE = 12, 8


def _oracle(x, dt, A, B, C, D, init, meta):
    """Per request, token by token: y ``[T, D]`` (zeros on tokens of no live request) and the
    state after each of its last C positions, newest first."""
    rows, c = meta.starts.shape[0], meta.checkpoints
    y = torch.zeros_like(x)
    states = torch.zeros(rows, c, *init.shape[1:])
    for r in range(rows):
        h = init[r].clone()
        start, n = int(meta.starts[r]), int(meta.query_lens[r])
        for i in range(n):
            t = start + i
            h = torch.exp(dt[t, :, None] * A) * h + (dt[t] * x[t])[:, None] * B[t][None, :]
            y[t] = h @ C[t] + D * x[t]
            if n - 1 - i < c:
                states[r, n - 1 - i] = h
    return y, states


def _inputs(t: int, rows: int, meta, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, CHANNELS, generator=g)
    dt = torch.rand(t, CHANNELS, generator=g) * 0.5
    A = -torch.rand(CHANNELS, STATE, generator=g) * 2 - 0.1
    B, C = torch.randn(t, STATE, generator=g), torch.randn(t, STATE, generator=g)
    D = torch.randn(CHANNELS, generator=g)
    init = torch.randn(rows, CHANNELS, STATE, generator=g) * meta.has_initial.view(-1, 1, 1)
    return x, dt, A, B, C, D, init


def _close(a, b, what: str) -> None:
    tol = graphrt.reduction_tolerance("float32", magnitude=float(b.abs().amax()) + 1.0 if b.numel() else 1.0,
                                      width=64)
    torch.testing.assert_close(a, b, rtol=tol.rtol, atol=tol.atol, msg=what)


def _mixed():
    """Request 0 continues (5 computed, 3 new), 1 is new (6 tokens), 2 decodes, 3 is padded; 3
    padded tokens; 2 checkpoints."""
    qsl = torch.tensor([0, 3, 9, 10, 10], dtype=torch.int32)
    return build_state_metadata(qsl, torch.tensor([5, 0, 7, 0], dtype=torch.int32),
                                torch.tensor([2, 0, 1, -1], dtype=torch.int32), 13, num_slots=3, checkpoints=2)


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(0, 9), min_size=1, max_size=5), pad=st.integers(0, 4),
       checkpoints=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_reference_matches_a_per_request_loop(lens, pad, checkpoints, seed):
    """Drawn layouts: the live tokens' outputs and the states of each request's last C positions
    (what ``write_states`` stores) equal the loop's; nothing leaks across requests (a request's
    init is non-zero only where it continues)."""
    t = max(1, sum(lens) + pad)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    computed = torch.tensor([(i * 3) % 4 for i in range(len(lens))], dtype=torch.int32)
    slots = torch.tensor([i if n else -1 for i, n in enumerate(lens)], dtype=torch.int32)
    meta = build_state_metadata(qsl, computed, slots, t, num_slots=len(lens), checkpoints=checkpoints)
    args = _inputs(t, len(lens) + 1, meta, seed)
    got, want = selective_scan(*args, meta), _oracle(*args, meta)
    live = sum(lens)
    _close(got[0][:live], want[0][:live], "outputs")
    written = meta.write_slot < len(lens)                     # what does not go to the trash slot
    _close(got[1][written], want[1][written], "states")


@pytest.mark.parametrize("q", [1, 3])
def test_reference_uniform_steps_run_the_recurrent_form(q):
    """A uniform decode / verification step (every request q tokens) takes the recurrent form,
    which equals the loop and the segmented scan."""
    r, checkpoints = 3, 3
    qsl = torch.arange(0, (r + 1) * q, q, dtype=torch.int32)
    meta = build_state_metadata(qsl, torch.tensor([4, 0, 2], dtype=torch.int32),
                                torch.tensor([1, 0, 2], dtype=torch.int32),
                                r * q, num_slots=3, checkpoints=checkpoints, uniform_query_len=q)
    assert meta.uniform_query_len == q
    args = _inputs(r * q, r + 1, meta, 3)
    got, want = selective_scan(*args, meta), _oracle(*args, meta)
    _close(got[0], want[0], "outputs")
    written = meta.write_slot < 3
    _close(got[1][written], want[1][written], "states")
    meta.uniform_query_len = 0
    segmented = selective_scan(*args, meta)
    _close(segmented[0], got[0], "segmented outputs")


def test_nan_in_one_request_stays_in_it():
    """NaN on the padded tokens (the padding request's) reaches no live token or state."""
    meta = _mixed()
    x, dt, A, B, C, D, init = _inputs(13, 5, meta)
    x[10:] = float("nan")
    y, states = selective_scan(x, dt, A, B, C, D, init, meta)
    assert torch.isfinite(y[:10]).all() and torch.isfinite(states[:4]).all()


def test_jax_kernel_matches_the_torch_reference():
    jnp = pytest.importorskip("jax.numpy")
    from graphrt.layers.jax import recurrent

    meta = _mixed()
    args = _inputs(13, 5, meta)
    jmeta = recurrent.state_meta(jnp.asarray(np.array([0, 3, 9, 10, 10])), jnp.asarray(np.array([8, 6, 8, 0])),
                                 jnp.asarray(np.array([2, 0, 1, -1])), 13, num_slots=3, checkpoints=2)
    want = selective_scan(*args, meta)
    y, states = recurrent.selective_scan(*(jnp.asarray(a.numpy()) for a in args), jmeta, checkpoints=2, uniform=0)
    _close(torch.from_numpy(np.array(y))[:10], want[0][:10], "JAX outputs")
    _close(torch.from_numpy(np.array(states)), want[1], "JAX states")
    # uniform: 2 requests of 2 tokens
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    umeta = build_state_metadata(qsl, torch.tensor([3, 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                                 4, num_slots=2, checkpoints=2, uniform_query_len=2)
    args = _inputs(4, 3, umeta, 1)
    jmeta = recurrent.state_meta(jnp.asarray(qsl.numpy()), jnp.asarray(np.array([5, 3])), jnp.asarray(np.array([0, 1])),
                                 4, num_slots=2, checkpoints=2)
    want = selective_scan(*args, umeta)
    y, states = recurrent.selective_scan(*(jnp.asarray(a.numpy()) for a in args), jmeta, checkpoints=2, uniform=2)
    _close(torch.from_numpy(np.array(y)), want[0], "JAX uniform outputs")
    _close(torch.from_numpy(np.array(states)), want[1], "JAX uniform states")


@pytest.fixture
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRETER_PROBLEM is None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@interpreted
def test_interpret_triton_kernel_matches_the_reference(_interpret) -> None:
    meta = _mixed()
    args = _inputs(13, 5, meta)
    got, want = triton_recurrent.triton_selective_scan(*args, meta), selective_scan(*args, meta)
    _close(got[0][:10], want[0][:10], "Triton outputs")
    _close(got[1], want[1], "Triton states")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_triton_kernel_matches_the_reference_on_cuda() -> None:
    meta = _mixed()
    args = _inputs(13, 5, meta)
    cuda = [a.cuda() for a in args]
    cmeta = build_state_metadata(torch.tensor([0, 3, 9, 10, 10], dtype=torch.int32, device="cuda"),
                                 torch.tensor([5, 0, 7, 0], dtype=torch.int32, device="cuda"),
                                 torch.tensor([2, 0, 1, -1], dtype=torch.int32, device="cuda"), 13, num_slots=3,
                                 checkpoints=2)
    got, want = triton_recurrent.triton_selective_scan(*cuda, cmeta), selective_scan(*args, meta)
    _close(got[0][:10].cpu(), want[0][:10], "compiled outputs")
    _close(got[1].cpu(), want[1], "compiled states")
