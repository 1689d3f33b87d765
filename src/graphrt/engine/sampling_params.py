"""``SamplingParams``: how one request's tokens are chosen (vLLM's names and defaults)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from graphrt.core import sampling as rules


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when ``temperature == 0``; otherwise temperature, top-k and top-p sampling.

    ``top_k=-1`` and ``top_p=1.0`` disable those filters. ``seed`` (an integer in
    ``[0, 2**64)``) makes the request's samples reproducible whatever else is in its batch.
    ``logprobs=k`` returns, per generated token, its logprob and the ``k`` most likely tokens'
    (``log_softmax`` of the model's logits, before temperature and filters); ``prompt_logprobs=k``
    the same for every prompt token after the first (vLLM's fields; None: none; ``k`` at most
    the engine's ``max_logprobs``, checked when the request is added).
    Every field is checked at construction by the rules a step's ``SamplingBatch`` uses
    (:mod:`graphrt.core.sampling`); a bad one raises ``InputError`` naming it. Fields are
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

    def __post_init__(self) -> None:
        rules.TEMPERATURE.check(self.temperature)
        rules.TOP_P.check(self.top_p)
        rules.TOP_K.check(self.top_k)
        normalised = {"temperature": float(self.temperature), "top_p": float(self.top_p),
                      "top_k": int(self.top_k), "max_tokens": rules.max_tokens(self.max_tokens),
                      "ignore_eos": rules.flag(self.ignore_eos, "ignore_eos"), "seed": rules.seed(self.seed),
                      "logprobs": rules.logprobs(self.logprobs),
                      "prompt_logprobs": rules.logprobs(self.prompt_logprobs, "prompt_logprobs")}
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def without_seed(params: SamplingParams) -> SamplingParams:
    """Params for a step in which a request samples nothing (a partial prefill chunk): the
    same filters, no seed, so the request's seeded generator is not advanced."""
    return params if params.seed is None else dataclasses.replace(params, seed=None)
