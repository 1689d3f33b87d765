"""Whether a step's outputs depend on what ran before it.

A layer that keeps a value from one forward to the next (a Python number, a tensor attribute)
computes each step from the step *and* the one before. The kit's other properties then see
outputs that change from run to run and blame what they compare (padding, NaN in unused
entries, a batchmate), and hypothesis, replaying an example, finds it passing the second time.
:func:`check_reproducible` runs one step twice on the same KV and states, a step of another
shape before each run, and says so when the two differ; :func:`history_cause` is the same
question asked after another property failed, so its FAIL line names the cause first.
"""

from __future__ import annotations

from typing import Any, Callable

from graphrt.testing.checks import other_shapes, same_outputs, start
from graphrt.testing.runners import Outputs, Planted, can_run_unpadded, restore, run_at, run_runner
from graphrt.testing.step import BadStep, Split, Step

#: What a step that differs from itself has, and what to do: the sentence a FAIL line leads with.
CAUSE = ("its outputs depend on what ran before it: a value carried between forwards (a Python number or "
         "tensor a layer keeps from the previous step, e.g. `self.n = x.shape[0]`) or other state kept outside "
         "the KV and state caches; take every per-step value from the step's inputs (the forward context, the "
         "state metadata)")

Run = Callable[[Any, Step], Outputs]


def eager_or_runner(runner: Any) -> tuple[str, Run]:
    """The path that runs a layer's Python code each step: eagerly at the step's own shape, or
    (no eager path) the runner's."""
    if can_run_unpadded(runner):
        return "eagerly", lambda r, s: run_at(r, s, None)
    return "by the runner", run_runner


def check_reproducible(runner: Any, step: Step, planted: Planted, run: Run, how: str) -> None:
    """``step`` run by ``run`` after each of :func:`~graphrt.testing.checks.other_shapes` (run by
    ``run`` too), on the ``planted`` KV and states each time: the same outputs (bit for bit on a CPU), else an
    ``AssertionError`` that leads with :data:`CAUSE`."""
    outs = []
    for other in other_shapes(runner):
        run(runner, other)                # the same path: a layer's Python code runs as it would for step
        restore(runner, planted)
        outs.append(run(runner, step))
    if len(outs) < 2:
        return
    what = (f"the same step run {how} twice on the same KV and states, after steps of other shapes, gave other "
            f"results ({outs[0].how}); {CAUSE}")
    same_outputs(runner, outs[1], outs[0], what)


def _step_of(example: Any) -> Step | None:
    if isinstance(example, Step):
        return example
    if isinstance(example, Split):
        return example.step
    if isinstance(example, list) and example and isinstance(example[0], Step):
        return example[0]
    return None                                 # a BadStep runs nothing: no history to blame


def history_cause(factory: Callable[..., Any], example: Any) -> str | None:
    """After a property failed on ``example``: :func:`check_reproducible`'s message when the
    example's (first) step differs from itself, else None."""
    if isinstance(example, BadStep):
        return None
    step = _step_of(example)
    if step is None:
        return None
    runner, planted = start(factory, step)
    how, run = eager_or_runner(runner)
    try:
        check_reproducible(runner, step, planted, run, how)
    except AssertionError as exc:
        return str(exc)
    return None


__all__ = ["CAUSE", "check_reproducible", "eager_or_runner", "history_cause"]
