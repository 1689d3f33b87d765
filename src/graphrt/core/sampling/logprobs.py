"""Logprobs as graphrt returns them, and what a step returns when it was asked for them.

Every backend computes them on the device in float32 from the raw logits (vLLM's default
``raw_logprobs``: before temperature and top-k / top-p): the chosen token's logprob and rank,
and the ``max_logprobs`` largest in descending order; sampled tokens' from the sampler's
logprobs graph, prompt logprobs from the forward's hidden rows. Host numpy arrays only here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's logprob and the top logprobs, per row (a request, or a prompt position)."""

    token_ids: np.ndarray       # int64 [N]: the sampled token (or, for a prompt, the next prompt token)
    logprobs: np.ndarray        # float32 [N]: its logprob
    ranks: np.ndarray           # int64 [N]: 1 + how many tokens have a larger logprob
    top_token_ids: np.ndarray   # int64 [N, K]: the most likely tokens, K the most any row asked for
    top_logprobs: np.ndarray    # float32 [N, K]: their logprobs, descending along each row
    num_top: np.ndarray         # int64 [N]: how many of the K columns row i asked for (-1: none)

    def __len__(self) -> int:
        return len(self.token_ids)

    def top(self, i: int) -> list[tuple[int, float]]:
        """Row ``i``'s top ``(token id, logprob)`` pairs, as many as it asked for, best first."""
        k = max(int(self.num_top[i]), 0)
        return list(zip(self.top_token_ids[i, :k].tolist(), self.top_logprobs[i, :k].tolist()))

    @classmethod
    def of(cls, token_ids: np.ndarray, arrays: Sequence[np.ndarray], num_top: np.ndarray) -> "TokenLogprobs":
        """Host arrays of the first ``len(num_top)`` rows of a device result ``(logprob, rank, top
        logprobs, top ids)``, the top columns cut to the largest count asked for."""
        n, k = len(num_top), max(int(num_top.max(initial=0)), 0)
        lp, rank, top_lp, top_ids = arrays
        return cls(np.asarray(token_ids[:n], np.int64), np.asarray(lp[:n], np.float32),
                   np.asarray(rank[:n], np.int64), np.asarray(top_ids[:n, :k], np.int64),
                   np.asarray(top_lp[:n, :k], np.float32), np.asarray(num_top, np.int64))


@dataclass(frozen=True)
class StepOutput:
    """What ``ModelRunner.execute`` returns for a step whose sampling batch asks for logprobs, or
    that asks for prompt logprobs (other steps return ``token_ids`` alone, as before)."""

    token_ids: np.ndarray                               # int64 [R]: one sampled token per request
    #: Per request (row i: request i, ``num_top`` -1 where it asked none); None: no row asked.
    logprobs: TokenLogprobs | None = None
    #: Per request: the logprobs at each of its scheduled positions of the token after it (the
    #: caller's token table at position + 1), None where it asked none; None: nobody asked.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


__all__ = ["StepOutput", "TokenLogprobs"]
