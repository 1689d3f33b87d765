"""A step's optional features behind one small interface: :class:`StepFeature`.

``ModelRunner._execute`` runs every step as check, plan, write, run, sample; a feature joins it
at four points, each a public method that is a no-op unless the feature needs it:
:meth:`~StepFeature.check` (refuse its argument before anything is written),
:meth:`~StepFeature.dispatched` (the step's dispatch shape is known: agree on it, count it),
:meth:`~StepFeature.write` (the padded step is written: add its own rows) and
:meth:`~StepFeature.finish` (the step ran). A step with padding only (``execute_dummy``) calls
:meth:`~StepFeature.pad`. The features exchange what they need through the step's
:class:`Step` record, never through the runner.

Features on for every step of a runner: LoRA (``max_loras``), extra inputs (the model declares
some), data parallelism (``step_agreement``), the traffic re-fit (``refit_interval``:
:class:`~graphrt.runner.traffic.TrafficFit`). Features a step's arguments turn on: future rows,
logprobs (and prompt logprobs), penalties. :class:`StepFeatures` picks a step's features.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import numpy as np

from graphrt.backends.base import Executor
from graphrt.core.dispatch import DispatchShape
from graphrt.core.dp_agreement import DataParallelStep
from graphrt.core.errors import InputError
from graphrt.core.inputs.extra_inputs import ExtraInputs
from graphrt.core.inputs.fields import ModelInputs
from graphrt.core.future_tokens import FutureTokens
from graphrt.core.lora import RunnerLora, lora_off
from graphrt.runner.outputs import StepOutputs
from graphrt.runner.plans import SamplerChoice, StepArgs, StepPlan


class Step:
    """One step on its way through the runner: the caller's arguments, the checked step, and
    what check, plan and write decided (each field set by the phase that knows it; until then
    the class's default, so a step costs five assignments)."""

    shape: DispatchShape | None = None
    plan: StepPlan | None = None
    padded: ModelInputs | None = None
    choice: SamplerChoice | None = None
    lora_ids: np.ndarray | None = None
    num_loras: int = 0
    extras: dict[str, np.ndarray] | None = None
    future_rows: np.ndarray | None = None
    future: Any = None
    logprobs: bool = False
    prompt_logprobs: np.ndarray | None = None

    def __init__(self, args: StepArgs, wait: bool, num_tokens: int, num_reqs: int,
                 previous: tuple[Any, int] | None) -> None:
        self.args, self.wait = args, wait
        self.num_tokens, self.num_reqs = num_tokens, num_reqs
        #: The previous sampled step (sampler output, requests) future rows read; None: none.
        self.previous = previous


class StepFeature:
    """One optional part of a step; each phase a no-op unless the feature overrides it."""

    def check(self, step: Step) -> None:
        """Refuse this feature's argument (InputError) before anything is written."""

    def dispatched(self, step: Step) -> None:
        """``step.shape`` is known, before its plan is looked up (it may be replaced)."""

    def write(self, step: Step) -> None:
        """The padded step is written (``step.plan``, ``step.padded``): write this feature's rows."""

    def finish(self, step: Step) -> None:
        """The step ran and sampled."""

    def pad(self, plan: StepPlan) -> None:
        """A step of padding only (``execute_dummy``) runs ``plan``: this feature's rows as padding."""


class LoraStep(StepFeature):
    """Per-request LoRA slots: the step's adapters (their count is part of its key) and their rows."""

    def __init__(self, lora: RunnerLora) -> None:
        self.lora = lora

    def check(self, step: Step) -> None:
        step.lora_ids, step.num_loras = self.lora.check(step.args.lora_ids, step.num_reqs)

    def write(self, step: Step) -> None:
        if step.num_loras:
            self.lora.write(step.lora_ids, step.args.num_scheduled_tokens, step.num_tokens,
                            step.plan.key.num_tokens)

    def pad(self, plan: StepPlan) -> None:
        self.lora.write_padding(plan.key.num_tokens)


class ExtraInputsStep(StepFeature):
    """The model's declared per-step inputs (``model.extra_inputs``): checked, then written padded."""

    def __init__(self, extra: ExtraInputs) -> None:
        self.extra = extra

    def check(self, step: Step) -> None:
        step.extras = self.extra.check(step.args.extra_inputs, step.num_tokens, step.num_reqs)

    def write(self, step: Step) -> None:
        self.extra.write(step.extras, step.num_tokens, step.num_reqs, step.plan.key.num_tokens,
                         step.plan.padded_reqs)

    def pad(self, plan: StepPlan) -> None:
        self.extra.write_padding(plan.key.num_tokens, plan.padded_reqs)


class DataParallelAgreement(StepFeature):
    """Data-parallel ranks that step together: every step's shape agreed with the group."""

    def __init__(self, data_parallel: DataParallelStep) -> None:
        self.data_parallel = data_parallel

    def dispatched(self, step: Step) -> None:
        step.shape, step.lora_ids = self.data_parallel.agree(step.shape, step.lora_ids)


class FutureRows(StepFeature):
    """A step whose last tokens are the previous sampled step's, before the host has them."""

    def __init__(self, futures: FutureTokens) -> None:
        self.futures = futures

    def check(self, step: Step) -> None:
        step.future_rows = self.futures.check(step.args.future_rows, step.num_reqs, step.previous)

    def write(self, step: Step) -> None:
        step.future = self.futures.apply(step.future_rows, step.previous, step.padded.input_ids,
                                         step.padded.query_start_loc)


class Logprobs(StepFeature):
    """Logprobs and prompt logprobs: checked within ``max_logprobs``; the step samples through
    ``runner.outputs`` (``step.logprobs``)."""

    def __init__(self, outputs: StepOutputs) -> None:
        self.outputs = outputs

    def check(self, step: Step) -> None:
        step.prompt_logprobs = self.outputs.check(step.args.sampling, step.args.prompt_logprobs, step.num_reqs)
        step.logprobs = True


class Penalties(StepFeature):
    """Repetition, frequency and presence penalties: the token counts planned before anything runs."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    def write(self, step: Step) -> None:
        a = step.args
        if step.choice.key.penalties:
            self.executor.prepare_penalties(a.sampling, a.token_ids, a.req_rows, a.num_computed_tokens,
                                            a.num_scheduled_tokens, step.plan.padded_reqs)


class StepFeatures:
    """A runner's step features: :attr:`always` (on for every step, in the order they run) and
    those a step's arguments turn on (:meth:`for_step`)."""

    def __init__(self, *, lora: Any, extra: ExtraInputs | None, on_device: bool, outputs: StepOutputs,
                 executor: Executor, data_parallel: DataParallelStep | None = None,
                 traffic: StepFeature | None = None) -> None:
        """``on_device``: the backend resolves future rows on the device (:class:`FutureTokens`)."""
        self.lora_enabled = bool(lora.enabled)
        self.has_extra = extra is not None
        on = [ExtraInputsStep(extra) if extra is not None else None, LoraStep(lora) if self.lora_enabled else None,
              DataParallelAgreement(data_parallel) if data_parallel is not None else None, traffic]
        #: The features every step of this runner runs.
        self.always: tuple[StepFeature, ...] = tuple(f for f in on if f is not None)
        self.logprobs, self.penalties = Logprobs(outputs), Penalties(executor)
        self._on_device = on_device

    @functools.cached_property
    def future_rows(self) -> FutureRows:
        """The future-rows feature, made for the first step that gives ``future_rows``."""
        return FutureRows(FutureTokens(on_device=self._on_device))

    def for_step(self, a: StepArgs) -> Sequence[StepFeature]:
        """The features step ``a`` runs: :attr:`always`, plus future rows, logprobs and penalties
        where its arguments ask for them. An argument of a feature that is off is refused."""
        sampling = a.sampling
        logprobs = a.prompt_logprobs is not None or (sampling is not None and sampling.logprobs is not None)
        penalties = sampling is not None and sampling.penalties is not None
        # Given extra inputs: anything but None or an empty mapping (an array or a list is given, and
        # refused by name by the extra-inputs check, not by Python's truth test of an array).
        extra = a.extra_inputs is not None and not (isinstance(a.extra_inputs, Mapping) and not a.extra_inputs)
        if a.future_rows is None and not logprobs and not penalties and a.lora_ids is None and not extra:
            return self.always
        if a.lora_ids is not None and not self.lora_enabled:
            raise lora_off()
        if extra and not self.has_extra:
            raise InputError("extra_inputs", "the model declares no extra inputs (model.extra_inputs)")
        asked = ([self.logprobs] if logprobs else []) + ([self.future_rows] if a.future_rows is not None else [])
        return [*asked, *self.always, *([self.penalties] if penalties else [])]


__all__ = ["DataParallelAgreement", "ExtraInputsStep", "FutureRows", "Logprobs", "LoraStep", "Penalties", "Step",
           "StepFeature", "StepFeatures"]
