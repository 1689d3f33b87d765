"""What ``graphrt.LLM`` returns for a finished request, and the logprobs it collects on the way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from graphrt.core.sampling.logprobs import StepOutput, TokenLogprobs


@dataclass(frozen=True)
class Logprob:
    """One token's logprob (``log_softmax`` of the model's logits) and its rank (1: the most likely)."""

    logprob: float
    rank: int


#: Per token: the chosen token's :class:`Logprob` and those of the top tokens asked for (vLLM's form).
TokenLogprobDict = dict[int, Logprob]


@dataclass
class RequestOutput:
    """A finished request: its prompt, the generated ids only, and why it stopped."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    #: "stop" (EOS), "length" (max_tokens or max_model_len), "error" (a step it ran in failed)
    #: or "abort" (aborted: ``abort_request``, or its ``generate`` call failed).
    finish_reason: str
    #: Why, for "error" and "abort" (the exception's type and message); None otherwise.
    error: str | None = None
    #: Tokens whose KV came from the prefix cache instead of being computed (all admissions).
    num_cached_tokens: int = 0
    #: With ``SamplingParams.logprobs``: one dict per generated token (that token and the top ones).
    logprobs: list[TokenLogprobDict] | None = None
    #: With ``SamplingParams.prompt_logprobs``: one per prompt token, None for the first (nothing
    #: precedes it), else that token and the top ones at the position before it.
    prompt_logprobs: list[TokenLogprobDict | None] | None = None


def logprob_dict(rows: TokenLogprobs, i: int) -> TokenLogprobDict:
    """Row ``i`` as vLLM's dict: the top tokens asked for (ranks 1, 2, ...) and the row's token."""
    out = {tok: Logprob(lp, rank) for rank, (tok, lp) in enumerate(rows.top(i), 1)}
    out[int(rows.token_ids[i])] = Logprob(float(rows.logprobs[i]), int(rows.ranks[i]))
    return out


def collect_logprobs(requests: Sequence[Any], samples: Sequence[bool], prompt_starts: Sequence[int] | None,
                     out: StepOutput, finished: Any) -> None:
    """File a resolved step's logprobs with its requests (``finished``: the status they are
    skipped in): each sampled token's, for a request that asked, and prompt logprobs at the
    positions the step computed from ``prompt_starts`` (the requests' computed tokens at launch);
    a position whose next token is not a prompt token is not one."""
    if out.logprobs is not None:
        for i, (req, sampled) in enumerate(zip(requests, samples)):
            if sampled and req.status is not finished and req.sample_logprobs is not None:
                req.sample_logprobs.append(logprob_dict(out.logprobs, i))
    if out.prompt_logprobs is None or prompt_starts is None:
        return
    for req, start, rows in zip(requests, prompt_starts, out.prompt_logprobs):
        if rows is None or req.prompt_logprobs is None:
            continue
        for j in range(min(len(rows), len(req.prompt_token_ids) - 1 - start)):
            req.prompt_logprobs[start + j + 1] = logprob_dict(rows, j)


__all__ = ["Logprob", "RequestOutput", "TokenLogprobDict", "collect_logprobs", "logprob_dict"]
