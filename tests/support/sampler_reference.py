"""The test oracle of the sampler: the sort-based random sampler graphrt shipped before the
threshold sampler (backends/torch/sampling/sampler.py up to b48ab83), extended with min-p (vLLM's order:
min-p on the temperature-scaled probabilities, then top-k and top-p on what it keeps), and its
filtered distribution in float64 numpy; plus a chi-square goodness-of-fit test.

Not shipped: the runtime samples by thresholds (graphrt.backends.torch.sampling.sampler_ops).
"""

from __future__ import annotations

import math

import numpy as np
import torch

MIN_T = 1e-5


def sort_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                noise: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The old sampler: sort each row, keep the top-k prefix, then the smallest prefix whose mass
    reaches top_p, scatter back, race ``probs / noise``; rows below MIN_T greedy."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    scaled = logits / temperature.clamp(min=MIN_T).unsqueeze(1)
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    keep = ranks < top_k.clamp(min=1, max=vocab).unsqueeze(1)
    if min_p is not None:
        first = torch.softmax(sorted_logits, dim=-1)
        keep = keep & (first >= min_p.unsqueeze(1) * first[:, :1])
    probs = torch.softmax(torch.where(keep, sorted_logits, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs
    keep = keep & (before < top_p.unsqueeze(1))
    sorted_logits = torch.where(keep, sorted_logits, float("-inf"))
    filtered = torch.full_like(scaled, float("-inf")).scatter(1, sorted_idx, sorted_logits)
    probs = torch.softmax(filtered, dim=-1)
    sampled = (probs / noise.clamp(min=1e-10)).argmax(dim=-1)
    return torch.where(temperature < MIN_T, greedy, sampled)


def filtered_probs(logits: np.ndarray, temperature: float, top_k: int = -1, top_p: float = 1.0,
                   min_p: float = 0.0) -> np.ndarray:
    """One row's sampling distribution in float64, by sorting: temperature, min-p, top-k, then
    top-p on what those keep (the smallest sorted prefix whose mass reaches top_p)."""
    s = logits.astype(np.float64) / max(temperature, MIN_T)
    p = np.exp(s - s.max())
    order = np.argsort(-p, kind="stable")
    sp = p[order]
    keep = sp >= min_p * sp[0]
    if 0 < top_k < len(sp):
        keep &= np.arange(len(sp)) < top_k
    q = np.where(keep, sp, 0.0)
    q /= q.sum()
    before = np.cumsum(q) - q
    keep &= before < top_p
    out = np.zeros_like(p)
    out[order] = np.where(keep, sp, 0.0)
    return out / out.sum()


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of the chi-square goodness-of-fit of ``counts`` to ``probs`` over the tokens
    ``probs`` keeps (scipy's when installed, else the Wilson-Hilferty normal approximation)."""
    support = probs > 0
    n = counts.sum()
    expected = probs[support] * n
    stat = float((((counts[support] - expected) ** 2) / expected).sum())
    dof = int(support.sum()) - 1
    if dof < 1:
        return 1.0
    try:
        from scipy.stats import chi2
    except ImportError:
        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))
    return float(chi2.sf(stat, dof))


def penalised_logits(logits: np.ndarray, prompt: list[list[int]], output: list[list[int]], repetition: np.ndarray,
                     presence: np.ndarray, frequency: np.ndarray) -> np.ndarray:
    """vLLM's penalties on host logits ``[R, V]`` from each row's prompt and output token lists."""
    x = logits.astype(np.float32).copy()
    vocab = x.shape[1]
    for i in range(len(x)):
        counts = np.bincount(np.asarray(output[i], np.int64), minlength=vocab).astype(np.float32)
        seen = (counts > 0) | (np.bincount(np.asarray(prompt[i], np.int64), minlength=vocab) > 0)
        r = np.float32(repetition[i])
        x[i] = np.where(seen, np.where(x[i] > 0, x[i] / r, x[i] * r), x[i])
        x[i] -= np.float32(frequency[i]) * counts + np.float32(presence[i]) * (counts > 0)
    return x
