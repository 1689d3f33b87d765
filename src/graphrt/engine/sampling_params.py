"""``SamplingParams``: how one request's tokens are chosen (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from graphrt.core.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when ``temperature == 0``; otherwise temperature, top-k and top-p sampling.

    ``top_k=-1`` and ``top_p=1.0`` disable those filters. ``seed`` makes the request's
    samples reproducible whatever else is in its batch.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise InputError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise InputError("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise InputError("max_tokens", f"must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
