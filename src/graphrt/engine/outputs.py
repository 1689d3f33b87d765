"""What ``graphrt.LLM`` returns for a finished request."""

from __future__ import annotations

from dataclasses import dataclass


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


__all__ = ["RequestOutput"]
