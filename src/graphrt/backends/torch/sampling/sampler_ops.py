"""The random sampler's filters without a sort of the vocabulary: thresholds on probabilities.

Each filter keeps an upper set of ``P = exp((logits - max) / T)``: one threshold per row.
top-k reads ``topk`` of ``defaults.SAMPLER_TOP_K_CANDIDATES`` (wider: the counting sampler);
top-p's threshold is :func:`radix_threshold`, a bisection over ``P``'s float32 bits with
``index_add_`` histograms: fixed device ops, no host read (docs/sampling.md). The draw is
``argmax(P * keep / E)``, ``E ~ Exp(1)``, on a :class:`Workspace` shared by every sampler graph."""

from __future__ import annotations

from typing import Any

import torch

from graphrt.backends.torch.sampling.flashinfer_sampling import flashinfer_filtered
from graphrt.core import defaults

#: The sampler's threshold search (top-p, wide top-k) over a row's probabilities: float32 bits
#: of values in [0, 1] fit in 30 bits, chosen ``SAMPLER_RADIX_BITS`` at a time (3 passes of a
#: 1024-bucket histogram on torch backends).
SAMPLER_RADIX_BITS = 10

_DIGITS = 1 << SAMPLER_RADIX_BITS
_BUCKETS = _DIGITS + 2          # below the window, its digits, above it
_TINY = float(torch.finfo(torch.float32).smallest_normal) * 2.0**-23   # the least positive float32


class Workspace:
    """The random sampler's persistent buffers for up to ``max_reqs`` rows: the probabilities,
    a scratch row (masks, histogram keys), the histograms and their row offsets."""

    def __init__(self, max_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.probs = torch.zeros(max_reqs, vocab_size, dtype=torch.float32, device=device)
        self.scratch = torch.zeros(max_reqs, vocab_size, dtype=torch.float32, device=device)
        self.hist = torch.zeros(max_reqs * _BUCKETS, dtype=torch.float32, device=device)
        self.row_base = (torch.arange(max_reqs, dtype=torch.int32, device=device) * _BUCKETS).unsqueeze(1)
        self.ones = torch.ones(1, dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes held (they are outside every graph's own memory)."""
        return sum(t.numel() * t.element_size() for t in (self.probs, self.scratch, self.hist, self.row_base))


def scaled_probs(logits: torch.Tensor, temperature: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``exp((logits - max) / T)`` per row into ``out`` (the most likely token's is exactly 1)."""
    t = temperature.clamp(min=defaults.SAMPLER_MIN_TEMPERATURE).unsqueeze(1)
    torch.sub(logits, logits.amax(dim=-1, keepdim=True), out=out)
    return out.div_(t).exp_()


def radix_threshold(probs: torch.Tensor, target: torch.Tensor, ws: Workspace, count: bool) -> torch.Tensor:
    """Per row, the largest ``t`` (a value of the row) with ``sum(w[probs >= t]) >= target``, where
    ``w`` is ``probs`` itself (``count=False``: mass) or 1 (``count=True``: the k-th largest
    value for ``target = k``). ``probs`` ``[R, V]`` in [0, 1], ``target`` ``[R, 1]``; ``[R, 1]``
    float32. Where no value reaches the target (rounding), the search ends lower: more is kept."""
    rows, vocab = probs.shape
    bits = probs.view(torch.int32)
    key = ws.scratch[:rows].view(torch.int32)
    hist = ws.hist[:rows * _BUCKETS]
    weights = ws.ones.expand(rows * vocab) if count else probs.reshape(-1)
    target = target.clamp(min=_TINY)           # some weight must reach it: never above every value
    prefix = torch.zeros(rows, 1, dtype=torch.int32, device=probs.device)
    step = SAMPLER_RADIX_BITS
    for shift in range(defaults.SAMPLER_PROB_BITS - step, -1, -step):
        low = prefix << step                                  # the window's first key
        torch.bitwise_right_shift(bits, shift, out=key)
        key.sub_(low - 1).clamp_(0, _BUCKETS - 1).add_(ws.row_base[:rows])
        hist.zero_()
        hist.index_add_(0, key.view(-1), weights)
        counts = hist.view(rows, _BUCKETS)
        suffix = counts[:, 1:_DIGITS + 1].flip(-1).cumsum(-1).flip(-1) + counts[:, _DIGITS + 1:]
        digit = (suffix >= target).sum(dim=-1, keepdim=True) - 1
        prefix = low + digit.clamp(min=0).to(torch.int32)
    return prefix.view(torch.float32)


def filter_threshold(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None,
                     min_p: torch.Tensor | None, ws: Workspace, candidates: int, wide: bool) -> torch.Tensor:
    """Per row the probability a kept token reaches (``[R, 1]``): top-k, then min-p, then top-p
    on what they keep (module doc). ``top_k`` holds the vocabulary size where disabled; above
    ``candidates`` it needs ``wide``."""
    rows, vocab = probs.shape
    c = min(candidates, vocab)
    k = top_k.clamp(1, vocab)
    tau = probs.topk(c, dim=-1, sorted=True).values.gather(1, (k.clamp(max=c) - 1).unsqueeze(1))
    tau = torch.where((k >= vocab).unsqueeze(1), 0.0, tau)
    if wide and c < vocab:
        kth = radix_threshold(probs, k.to(torch.float32).unsqueeze(1), ws, count=True)
        tau = torch.where(((k > c) & (k < vocab)).unsqueeze(1), kth, tau)
    if min_p is not None:
        tau = torch.maximum(tau, min_p.unsqueeze(1))
    if top_p is not None:
        kept = ws.scratch[:rows]
        torch.ge(probs, tau, out=kept)
        mass = kept.mul_(probs).sum(dim=-1, keepdim=True)
        nucleus = radix_threshold(probs, top_p.unsqueeze(1) * mass, ws, count=False)
        tau = torch.where((top_p < 1.0).unsqueeze(1), torch.maximum(tau, nucleus), tau)
    return tau


def race(probs: torch.Tensor, tau: torch.Tensor, noise: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """The exponential race over the kept tokens: ``argmax(probs * (probs >= tau) / noise)``
    (``noise`` is clamped in place to ``defaults.SAMPLER_MIN_NOISE``)."""
    torch.ge(probs, tau, out=scratch)
    scratch.mul_(probs).div_(noise.clamp_(min=defaults.SAMPLER_MIN_NOISE))
    return scratch.argmax(dim=-1)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None,
                min_p: torch.Tensor | None, noise: torch.Tensor, ws: Workspace, *,
                candidates: int | None = None, wide: bool = False, flashinfer: Any = None) -> torch.Tensor:
    """One token per row of ``logits`` ``[R, V]`` (int64), rows below the minimum temperature
    greedy (``argmax`` of the logits, as the greedy sampler); static shapes, nothing read on the
    host: capturable. ``ws`` holds at least ``R`` rows; ``candidates`` defaults to
    ``defaults.SAMPLER_TOP_K_CANDIDATES``. With ``flashinfer`` (its ``sampling`` module) the top-k
    and top-p filters are FlashInfer's kernels (:mod:`~graphrt.backends.torch.sampling.flashinfer_sampling`)."""
    rows = logits.shape[0]
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    probs = scaled_probs(logits, temperature, ws.probs[:rows])
    if flashinfer is not None:
        weights = flashinfer_filtered(flashinfer, probs, top_k, top_p, min_p, ws.scratch[:rows])
        scratch = ws.scratch[:rows]
        torch.div(weights, noise.clamp_(min=defaults.SAMPLER_MIN_NOISE), out=scratch)
        sampled = scratch.argmax(dim=-1)
    else:
        cands = defaults.SAMPLER_TOP_K_CANDIDATES if candidates is None else candidates
        tau = filter_threshold(probs, top_k, top_p, min_p, ws, cands, wide)
        sampled = race(probs, tau, noise, ws.scratch[:rows])
    return torch.where(temperature < defaults.SAMPLER_MIN_TEMPERATURE, greedy, sampled)


__all__ = ["Workspace", "scaled_probs", "radix_threshold", "filter_threshold", "race", "sample_rows"]
