"""Assertions for what padding guarantees, and the same-shape eager reference they need.

* :func:`assert_bitwise` -- the same step at the same padded shape (a graph replay and an
  eager run of that padded step, or one graph replayed twice): the same kernels run on the
  same rows, so every bit agrees, on any CPU.
* :func:`assert_close_across_shapes` -- the same step at different shapes (two buckets, or
  a bucket and the unpadded step): within :func:`graphrt.tolerance` of the dtype, since
  another row count may pick another matmul kernel; :func:`assert_same_tokens` for the
  greedy tokens.
* :func:`assert_close_across_reductions` -- the same computation with its sums in another
  order (tensor parallelism's all-reduce, data-parallel ranks): within
  :func:`graphrt.reduction_tolerance`, which scales with the values' magnitude.
* :func:`pad_like` -- an eager runner that pads every step to the key a graph runner would
  use, so a replay has an eager reference of exactly its own shape.

KV slots outside a step's real slots are compared bit for bit by the tests themselves
(``runner_steps.same_bits``): no kernel choice excuses a foreign write.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

import graphrt
from graphrt.core.dispatch import Dispatch, Dispatcher
from graphrt.core.eager import EagerCause
from graphrt.core.graph_modes import RuntimeMode


def _numpy(a: Any) -> np.ndarray:
    return a.detach().float().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def assert_bitwise(got: Any, want: Any, err_msg: str = "") -> None:
    """Every bit equal (NaN equals NaN): for computations of the same shape only."""
    if isinstance(got, torch.Tensor) or isinstance(want, torch.Tensor):
        got, want = torch.as_tensor(got), torch.as_tensor(want)
        assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, err_msg)
        from support.runner_steps import same_bits

        assert same_bits(got.cpu(), want.cpu()), f"not bitwise equal: {err_msg}"
        return
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    np.testing.assert_array_equal(got, want, err_msg=err_msg, strict=True)  # says where values differ
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"equal values, other bits: {err_msg}"


def assert_close_across_shapes(got: Any, want: Any, dtype: Any = None, err_msg: str = "") -> None:
    """Within ``graphrt.tolerance(dtype)`` (the arrays' own dtype by default): for the same
    step run at two different padded shapes."""
    if dtype is None:
        dtype = got.dtype
    tol = graphrt.tolerance(dtype)
    np.testing.assert_allclose(_numpy(got), _numpy(want), rtol=tol.rtol, atol=tol.atol, err_msg=err_msg)


def assert_close_across_reductions(got: Any, want: Any, *, width: int, dtype: Any = None,
                                   err_msg: str = "") -> None:
    """Within ``graphrt.reduction_tolerance`` (scaled by the largest ``|want|`` and the reduced
    ``width``): for the same computation with its sums in another order -- tensor-parallel
    ranks, a sharded model, data-parallel ranks at other shapes."""
    got, want = _numpy(got), _numpy(want)
    tol = graphrt.reduction_tolerance(dtype if dtype is not None else got.dtype,
                                      magnitude=float(np.abs(want).max(initial=0.0)), width=width)
    np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=tol.atol, err_msg=err_msg)


def assert_same_tokens(got_logits: Any, want_logits: Any, err_msg: str = "") -> None:
    """The greedy tokens (argmax of each row's logits) are the same."""
    np.testing.assert_array_equal(_numpy(got_logits).argmax(-1), _numpy(want_logits).argmax(-1),
                                  err_msg=err_msg)


class PaddedEagerDispatcher:
    """Dispatches like ``inner`` but runs every step eagerly at the key ``inner`` returns."""

    def __init__(self, inner: Dispatcher) -> None:
        self.inner = inner
        self.context_sizes = inner.context_sizes

    def context_bucket(self, max_seq_len: int) -> int:
        return self.inner.context_bucket(max_seq_len)

    def dispatch(self, num_tokens: int, num_reqs: int, uniform_decode: bool, num_loras: int = 0,
                 context: int = 0) -> Dispatch:
        d = self.inner.dispatch(num_tokens, num_reqs, uniform_decode, num_loras, context)
        return dataclasses.replace(d, mode=RuntimeMode.NONE, reason=f"{d.reason}; eager at the padded key",
                                   cause=EagerCause.MODE)    # every step eager by design

    def keys(self) -> list:
        return []


def pad_like(eager: Any, graph_runner: Any) -> Any:
    """Make ``eager`` (a runner on the eager backend, before its first step) pad each step
    to the key ``graph_runner`` replays for it; returns ``eager``."""
    assert not eager.executor.capabilities.has_graphs and eager.last_step is None
    eager.keys.serve(PaddedEagerDispatcher(graph_runner.dispatcher))
    return eager
