"""Your own reference: the runner's steps compared with a step function you wrote.

The other properties compare the runner with itself (padded against unpadded, replay against
eager), so a bug that behaves the same at every shape -- a wrong softmax scale, a RoPE
off by one, K and V swapped -- passes them all. :func:`matches_reference` compares it with
*your* loop instead: ``reference(step) -> logits or tokens``, typically a plain eager forward
of each request's tokens (:meth:`~graphrt.testing.step.Step.sequences`) through your model or
``transformers``:

.. code-block:: python

    def reference(step):
        logits = [hf_model(torch.tensor([seq])).logits[0, -1] for seq in step.sequences()]
        return torch.stack(logits)        # [num_reqs, vocab]: the logits of each request's last token

It runs on whole request lifetimes (:func:`~graphrt.testing.strategies.traces` without prefix
hits, so every KV slot a step reads was written by an earlier step of the same lifetime), and
is called once per step, in order, with the step as the runner ran it.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from graphrt.core.errors import InputError
from graphrt.core.numerics import Tolerance, reduction_tolerance
from graphrt.testing import access
from graphrt.testing.checks import scrub
from graphrt.testing.runners import Outputs, plant_kv, run_runner
from graphrt.testing.step import Step

#: The property's name in the suite (``--property matches_reference``).
REFERENCE_PROPERTY = "matches_reference"
#: The strategy kind it draws: lifetimes without prefix hits.
REFERENCE_KIND = "fresh_trace"

Reference = Callable[[Step], Any]


def host_array(value: Any) -> np.ndarray:
    """A reference's result as numpy: torch tensors (bfloat16 as float32), jax arrays, lists."""
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        if value.is_floating_point():
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def _tolerance(runner: Any, out: Outputs, want: np.ndarray, given: Tolerance | None) -> Tolerance:
    """``given``, else ``graphrt.reduction_tolerance`` of the model's dtype, scaled by the
    reference's largest value and the hidden width (a reference sums in another order)."""
    if given is not None:
        return given
    finite = want[np.isfinite(want)]
    return reduction_tolerance(access.kv_dtype(runner), magnitude=float(np.abs(finite).max(initial=0.0)),
                               width=int(out.hidden.shape[-1]) or 1)


def _where(step: Step, r: int) -> str:
    row, c, n = int(step.req_rows[r]), int(step.num_computed_tokens[r]), int(step.num_scheduled_tokens[r])
    return f"request {r} (table row {row}, position {c + n - 1})"


def _near_best(logits: np.ndarray, token: int, tol: Tolerance) -> bool:
    """Whether ``token``'s logit is within ``tol`` of the row's best (a tie both may break)."""
    best = float(logits.max())
    return 0 <= token < logits.shape[0] and float(logits[token]) >= best - (tol.atol + tol.rtol * abs(best))


def compare(runner: Any, step: Step, out: Outputs, want: np.ndarray, what: str,
            tolerance: Tolerance | None = None) -> None:
    """The runner's run ``out`` of ``step`` against the reference's ``want``: token ids
    ``[num_reqs]`` equal to the sampled (greedy) tokens, or logits ``[num_reqs, vocab]`` with
    the same greedy tokens (barring ties within tolerance) and values within tolerance."""
    reqs, vocab = out.logits.shape
    if want.shape == (reqs,) and want.dtype.kind in "iu":
        tol = _tolerance(runner, out, out.logits, tolerance)
        for r in range(reqs):
            if int(out.tokens[r]) != int(want[r]) and not _near_best(out.logits[r], int(want[r]), tol):
                raise AssertionError(f"{what}: {_where(step, r)} sampled token {int(out.tokens[r])}, the "
                                     f"reference's token is {int(want[r])}")
        return
    if want.shape != (reqs, vocab) or want.dtype.kind != "f":
        raise InputError("reference", f"returned an array of shape {want.shape} and dtype {want.dtype}; expected "
                                      f"{reqs} token ids or [{reqs}, {vocab}] float logits (the step has {reqs} "
                                      f"requests, the model {vocab} tokens)")
    want = want.astype(np.float32)
    tol = _tolerance(runner, out, want, tolerance)
    for r in range(reqs):
        token = int(out.tokens[r])
        if token != int(want[r].argmax()) and not _near_best(want[r], token, tol):
            raise AssertionError(f"{what}: {_where(step, r)} sampled token {token}, the reference's greedy "
                                 f"token is {int(want[r].argmax())}")
    diff = np.abs(out.logits - want)
    bad = ~(diff <= tol.atol + tol.rtol * np.abs(want))           # NaN on either side is bad too
    if bad.any():
        r, t = (int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: logits differ beyond rtol={tol.rtol:.3g}, atol={tol.atol:.3g} at "
                             f"{int(bad.sum())} of {bad.size} values; first at {_where(step, r)}, token {t}: "
                             f"runner {out.logits[r, t]:.6g}, reference {want[r, t]:.6g} (largest difference "
                             f"{np.nanmax(diff):.3g})")


def matches_reference(factory: Callable[..., Any], trace: list[Step], reference: Reference,
                      tolerance: Tolerance | None = None) -> None:
    """A few requests' whole lifetimes through the runner equal ``reference`` step by step:
    its tokens exactly (or its logits' greedy tokens, barring ties within tolerance) and its
    logits within ``tolerance`` (default: ``graphrt.reduction_tolerance`` of the model's dtype,
    scaled by the reference's largest logit and the hidden width)."""
    if not trace:
        return
    runner = factory()
    scrub(runner)
    plant_kv(runner, trace[0], nan_unused=False)
    for i, step in enumerate(trace):
        out = run_runner(runner, step)
        want = host_array(reference(step))
        compare(runner, step, out, want, f"step {i} of {len(trace)} of the lifetime, {out.how}, against the "
                                         f"reference", tolerance)


__all__ = ["REFERENCE_KIND", "REFERENCE_PROPERTY", "Reference", "compare", "host_array", "matches_reference"]
