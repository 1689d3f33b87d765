"""The torch sampler: greedy, temperature, top-k and top-p, with static shapes.

It runs as its own graph, separate from the forward (as sglang-jax jits its sampler): its inputs
are rows of the forward's logits buffer plus per-request temperature / top-k / top-p and a noise
buffer the runner fills (exponential noise from the device RNG, or from a request's own
seeded generator), so the captured graph holds no RNG state and seeding is exact.
Sampling draws ``argmax(probs / noise)`` with ``noise ~ Exp(1)``: the exponential race,
equivalent to drawing from ``probs``.
"""

from __future__ import annotations

import torch

from graphrt.core import defaults


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """Argmax per row (int64)."""
    return logits.argmax(dim=-1)


def random_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One token per row; rows with temperature 0 are greedy.

    ``top_k`` holds the vocabulary size where disabled; ``top_p`` holds 1.0 where disabled.
    Shapes are static and nothing reads a value on the host, so it can be captured.
    """
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    scaled = logits / temperature.clamp(min=defaults.SAMPLER_MIN_TEMPERATURE).unsqueeze(1)
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    keep = ranks < top_k.clamp(min=1, max=vocab).unsqueeze(1)
    probs = torch.softmax(torch.where(keep, sorted_logits, float("-inf")), dim=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (always the first token).
    before = probs.cumsum(dim=-1) - probs
    keep = keep & (before < top_p.unsqueeze(1))
    sorted_logits = torch.where(keep, sorted_logits, float("-inf"))
    filtered = torch.full_like(scaled, float("-inf")).scatter(1, sorted_idx, sorted_logits)
    probs = torch.softmax(filtered, dim=-1)
    sampled = (probs / noise.clamp(min=1e-10)).argmax(dim=-1)
    return torch.where(temperature < defaults.SAMPLER_MIN_TEMPERATURE, greedy, sampled)
