"""The checks :mod:`graphrt.testing.properties` is written with: the scrub step every example
starts from, the state entries a step reads or writes, and comparisons that say what broke --
bit for bit at the same shape on a CPU, within the dtype's tolerance elsewhere, greedy tokens
equal except at a tie.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from graphrt.core.numerics import Tolerance, reduction_tolerance, tolerance
from graphrt.testing import access
from graphrt.testing.runners import Outputs, Planted, plant
from graphrt.testing.step import Step


def shape_step(runner: Any, num_reqs: int, tokens_each: int = 1) -> Step:
    """A step of a known shape: ``num_reqs`` requests (table rows ``0 .. num_reqs - 1``, each in
    blocks of its own from block 1 on) of ``tokens_each`` tokens at position 0, token id 0."""
    cfg = runner.config
    n = cfg.max_num_seqs
    need = -(-tokens_each // cfg.block_size)
    table = np.zeros((n, cfg.max_blocks_per_req), np.int32)
    table[:num_reqs, :need] = 1 + np.arange(num_reqs * need).reshape(num_reqs, need)
    extras = None
    if runner.extra is not None:          # the model's declared extra inputs: zeros of each
        t = num_reqs * tokens_each
        extras = {name: np.zeros((spec.rows(t, num_reqs), *spec.shape), spec.dtype)
                  for name, spec in runner.extra.specs.items()}
    return Step(np.zeros((n, cfg.max_model_len), np.int32), table, np.arange(num_reqs, dtype=np.int32),
                np.zeros(num_reqs, np.int32), np.full(num_reqs, tokens_each, np.int32), cfg.block_size,
                extra_inputs=extras)


def scrub(runner: Any) -> None:
    """Run the same step on ``runner`` before every example: one token in each request slot
    (row ``i`` in block ``i + 1``), so state a backend keeps across steps is the same each time."""
    runner.execute(**shape_step(runner, runner.config.max_num_seqs).kwargs())


def other_shapes(runner: Any) -> list[Step]:
    """Two steps of different shapes (one request of one token; two requests of two tokens each
    where the config allows), for checking that a step does not depend on what ran before it."""
    cfg = runner.config
    reqs = min(2, cfg.max_num_seqs)
    each = 2 if reqs * 2 <= cfg.max_num_batched_tokens and cfg.max_model_len >= 2 else 1
    shapes = [(1, 1)] + ([(reqs, each)] if (reqs, each) != (1, 1) else [])
    return [shape_step(runner, r, e) for r, e in shapes]


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


#: Where numpy's assertion text starts dumping the two arrays whole (numpy 2, numpy 1).
_ARRAY_DUMPS = ("ACTUAL:", "DESIRED:", "x:", "y:")


def numpy_detail(exc: AssertionError) -> str:
    """numpy's assertion text (tolerance, mismatch counts, first mismatches) without its blank
    first line and the arrays' dumps, indented under graphrt's sentence."""
    lines = []
    for line in str(exc).splitlines():
        if line.strip().startswith(_ARRAY_DUMPS):
            break
        if line.strip():
            lines.append("  " + line)
    return "\n".join(lines)


def close(runner: Any, got: np.ndarray, want: np.ndarray, what: str, tol: Tolerance | None = None) -> None:
    """Within ``tol`` (default ``graphrt.tolerance`` of the model's dtype: the same step at another
    shape); the error leads with ``what``, numpy's tolerance text second."""
    rtol, atol = (tol.rtol, tol.atol) if tol is not None else tolerances(runner)
    try:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    except AssertionError as exc:
        raise AssertionError(f"{what}: beyond rtol={rtol:.3g}, atol={atol:.3g}\n{numpy_detail(exc)}") from None


def close_rows(runner: Any, got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Row by row within ``graphrt.reduction_tolerance`` of each reference row's magnitude: a
    recurrent state (or what a model with one computes) sums its tokens' products, so at another
    shape, or split at another token, the sum runs in another order and rounding carries."""
    dtype = access.kv_dtype(runner)
    for i, (got_row, want_row) in enumerate(zip(got, want)):
        finite_part = np.abs(want_row[np.isfinite(want_row)])
        tol = reduction_tolerance(dtype, magnitude=float(finite_part.max(initial=0.0)))
        close(runner, got_row, want_row, f"{what} (row {i})", tol)


def same_shape(runner: Any, got: np.ndarray, want: np.ndarray, what: str) -> None:
    """The same step at the same padded shape: bit for bit on a CPU, within tolerance elsewhere."""
    if not access.on_cpu(runner):
        close(runner, got, want, what)
        return
    if got.shape != want.shape or not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        try:
            np.testing.assert_array_equal(got, want, strict=True)
        except AssertionError as exc:
            raise AssertionError(f"{what}: not bit for bit equal at the same shape\n{numpy_detail(exc)}") from None
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


def same_outputs(runner: Any, got: Outputs, want: Outputs, what: str) -> None:
    """Two runs of one step at one padded shape (:func:`same_shape` on each): logits, real hidden
    rows, the whole KV cache and the state cache but its trash slot (padding's alone)."""
    same_shape(runner, got.logits, want.logits, f"{what}: logits")
    same_shape(runner, got.hidden, want.hidden, f"{what}: hidden rows")
    same_shape(runner, got.kv, want.kv, f"{what}: KV cache")
    if got.state is not None:
        same_shape(runner, got.state[:-1], want.state[:-1], f"{what}: recurrent states")


__all__ = ["checkpoints", "close", "close_rows", "finite", "numpy_detail", "other_shapes", "same_outputs",
           "same_shape", "same_tokens", "scrub", "shape_step", "start", "state_entries", "tolerances"]
