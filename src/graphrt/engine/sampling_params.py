"""``SamplingParams``: how one request's tokens are chosen (vLLM's names and defaults)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from graphrt.core.sampling import batch as rules


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when ``temperature == 0``; otherwise temperature (at most 1e6; rows below 1e-5 are
    greedy too), top-k, top-p and min-p sampling.

    ``top_k=-1``, ``top_p=1.0`` and ``min_p=0.0`` disable those filters (``min_p``: keep tokens at
    least ``min_p`` times as likely as the most likely one, after temperature). Penalties (vLLM's):
    ``repetition_penalty`` (in [0.01, 100], 1: none) divides the logit of every token already in the prompt
    or the output (multiplies it where it is not positive); ``frequency_penalty`` and
    ``presence_penalty`` (in [-2, 2], 0: none) subtract, from each generated token's logit, the
    penalty times its count and the penalty once. They apply to greedy requests too. ``seed`` (an integer in
    ``[0, 2**64)``) makes the request's samples reproducible whatever else is in its batch.
    ``logprobs=k`` returns, per generated token, its logprob and the ``k`` most likely tokens'
    (``log_softmax`` of the model's logits, before temperature and filters); ``prompt_logprobs=k``
    the same for every prompt token after the first (vLLM's fields; None: none; ``k`` at most
    the engine's ``max_logprobs``, checked when the request is added).
    Every field is checked at construction by the rules a step's ``SamplingBatch`` uses
    (:mod:`graphrt.core.sampling.batch`); a bad one raises ``InputError`` naming it. Fields are
    stored as Python ``float`` / ``int`` / ``bool``.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        rules.TEMPERATURE.check(self.temperature)
        rules.TOP_P.check(self.top_p)
        rules.TOP_K.check(self.top_k)
        for rule in (rules.MIN_P, rules.REPETITION_PENALTY, rules.PRESENCE_PENALTY, rules.FREQUENCY_PENALTY):
            rule.check(getattr(self, rule.field))
            object.__setattr__(self, rule.field, float(getattr(self, rule.field)))
        normalised = {"temperature": float(self.temperature), "top_p": float(self.top_p),
                      "top_k": int(self.top_k), "max_tokens": rules.max_tokens(self.max_tokens),
                      "ignore_eos": rules.flag(self.ignore_eos, "ignore_eos"), "seed": rules.seed(self.seed),
                      "logprobs": rules.logprobs(self.logprobs),
                      "prompt_logprobs": rules.logprobs(self.prompt_logprobs, "prompt_logprobs")}
        for name, value in normalised.items():
            object.__setattr__(self, name, value)
        #: Whether min-p or a penalty is set (not a field: a step's batch checks it in one pass).
        object.__setattr__(self, "has_extras", self.min_p != 0.0 or self.penalized)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a repetition, presence or frequency penalty is set."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def without_seed(params: SamplingParams) -> SamplingParams:
    """Params for a step in which a request samples nothing (a partial prefill chunk): the
    same filters, no seed, so the request's seeded generator is not advanced."""
    return params if params.seed is None else dataclasses.replace(params, seed=None)
