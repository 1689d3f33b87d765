"""Data-parallel graph agreement: ranks that step together replay the same bucket.

Ranks of one expert-parallel MoE model (any forward with a collective across DP ranks) must
step together with the same shapes: before each step they agree on the largest token and
request counts, uniform decode only if every rank's step is one, and the most LoRA adapters
(:class:`StepAgreement`, one small collective), and each pads to that bucket. A rank with
nothing scheduled calls ``ModelRunner.execute_dummy`` (padding only: no KV write, no sample).
Independent engines (``graphrt.DataParallelLLM``, dense models) never need this."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from graphrt.core.dispatch import DispatchShape


class StepAgreement(Protocol):
    """One collective per step over the data-parallel group (the torch one:
    ``graphrt.backends.torch.parallel.dp_agreement.TorchStepAgreement``)."""

    def agree(self, num_tokens: int, num_reqs: int, uniform_decode: bool, num_loras: int, context: int
              ) -> DispatchShape:
        """The group's shape: max tokens, max requests, every rank uniform, max adapters, largest
        context (a :class:`DispatchShape`, or a tuple of those five fields); ``context`` is the
        dispatcher's context bucket (0: none; -1, above every bucket, is the largest)."""


class DataParallelStep:
    """A runner's data-parallel feature, held as an object: every step's shape agreed with
    the group before it is dispatched."""

    def __init__(self, agreement: StepAgreement, lora: Any = None) -> None:
        self.agreement = agreement
        self.lora = lora          # the runner's RunnerLora, or None

    def agree(self, own: DispatchShape, lora_ids: np.ndarray | None) -> tuple[DispatchShape, np.ndarray | None]:
        """The group's shape for this rank's step ``own``, and this rank's adapter ids: each
        request without one where only other ranks' adapters gave the key adapter slots."""
        shape = DispatchShape(*self.agreement.agree(*own))
        if shape.num_loras and not own.num_loras:
            lora_ids = self.lora.no_adapters(own.num_reqs)
        return shape, lora_ids

    def agree_idle(self) -> DispatchShape | None:
        """The group's shape for a step in which this rank has no work; None when no rank has."""
        shape = DispatchShape(*self.agreement.agree(0, 0, True, 0, 0))
        return None if shape.num_tokens == 0 else shape


__all__ = ["DataParallelStep", "StepAgreement"]
