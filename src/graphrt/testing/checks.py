"""The checks :mod:`graphrt.testing.properties` is written with: the scrub step every example
starts from, the state entries a step reads or writes, and comparisons that say what broke --
bit for bit at the same shape on a CPU, within the dtype's tolerance elsewhere, greedy tokens
equal except at a tie.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from graphrt.core.numerics import tolerance
from graphrt.testing import access
from graphrt.testing.runners import Outputs, Planted, plant
from graphrt.testing.step import Step


def scrub(runner: Any) -> None:
    """Run the same step on ``runner`` before every example: one token in each request slot
    (row ``i`` in block ``i + 1``), so state a backend keeps across steps is the same each time."""
    cfg = runner.config
    n = cfg.max_num_seqs
    table = np.zeros((n, cfg.max_blocks_per_req), np.int32)
    table[:, 0] = np.arange(1, n + 1)
    extras = None
    if runner.extra is not None:          # the model's declared extra inputs: zeros of each
        extras = {name: np.zeros((spec.rows(n, n), *spec.shape), spec.dtype) for name, spec in runner.extra.specs.items()}
    runner.execute(token_ids=np.zeros((n, cfg.max_model_len), np.int32), block_table=table,
                   req_rows=np.arange(n, dtype=np.int32), num_computed_tokens=np.zeros(n, np.int32),
                   num_scheduled_tokens=np.ones(n, np.int32), extra_inputs=extras)


def start(factory: Callable[..., Any], step: Step, *, nan_unused: bool = False) -> tuple[Any, Planted]:
    """A runner from ``factory`` after the scrub step, with ``step``'s KV (and state) contents planted."""
    runner = factory()
    scrub(runner)
    return runner, plant(runner, step, nan_unused=nan_unused)


def checkpoints(runner: Any) -> int:
    """Checkpoints per state slot (1 + num_speculative_tokens)."""
    return int(runner.config.decode_query_len)


def state_entries(step: Step, runner: Any, which: str) -> tuple[np.ndarray, np.ndarray]:
    """The (slots, checkpoints) the step reads or writes, as index arrays."""
    pairs = (step.state_writes if which == "writes" else step.state_reads)(checkpoints(runner))
    return (np.array([p[0] for p in pairs], dtype=np.int64), np.array([p[1] for p in pairs], dtype=np.int64))


def tolerances(runner: Any) -> tuple[float, float]:
    """``(rtol, atol)`` of the runner's KV dtype (``graphrt.core.numerics.tolerance``)."""
    tol = tolerance(access.kv_dtype(runner))
    return tol.rtol, tol.atol


def close(runner: Any, got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Within ``graphrt.tolerance`` of the model's dtype (the same step at another shape)."""
    rtol, atol = tolerances(runner)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


def same_shape(runner: Any, got: np.ndarray, want: np.ndarray, what: str) -> None:
    """The same step at the same padded shape: bit for bit on a CPU, within tolerance elsewhere."""
    if not access.on_cpu(runner):
        close(runner, got, want, what)
        return
    if got.shape != want.shape or not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        np.testing.assert_array_equal(got, want, err_msg=f"{what} (not bitwise equal)", strict=True)
        raise AssertionError(f"{what}: equal values but other bits (e.g. -0.0 against 0.0)")


def same_tokens(runner: Any, got: np.ndarray, want_logits: np.ndarray, what: str) -> None:
    """Greedy tokens equal, except where the reference's best two logits are within tolerance."""
    rtol, atol = tolerances(runner)
    top2 = np.sort(want_logits, axis=-1)[:, -2:] if want_logits.shape[-1] > 1 else None
    for i, token in enumerate(np.asarray(got)):
        best = int(want_logits[i].argmax())
        if token == best:
            continue
        tie = top2 is not None and top2[i, 1] - top2[i, 0] <= atol + rtol * abs(top2[i, 1])
        if not tie:
            raise AssertionError(f"{what}: request {i} sampled token {int(token)}, the reference's greedy "
                                 f"token is {best}")


def finite(out: Outputs, step: Step) -> None:
    """Every hidden row and logits row of ``out`` finite, padded ones included."""
    bad_rows = np.flatnonzero(~np.isfinite(out.padded_hidden).all(axis=-1))
    if bad_rows.size:
        which = "padded" if bad_rows.min() >= step.num_tokens else "real"
        raise AssertionError(f"{out.how}: hidden rows {bad_rows.tolist()} are not finite ({which} rows; "
                             f"the step has {step.num_tokens} real tokens)")
    bad_reqs = np.flatnonzero(~np.isfinite(out.padded_logits).all(axis=-1))
    if bad_reqs.size:
        raise AssertionError(f"{out.how}: logits of requests {bad_reqs.tolist()} are not finite "
                             f"(the step has {step.num_reqs} real requests)")


__all__ = ["checkpoints", "close", "finite", "same_shape", "same_tokens", "scrub", "start", "state_entries",
           "tolerances"]
