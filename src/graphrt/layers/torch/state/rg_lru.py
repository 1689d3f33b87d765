"""RecurrentGemma's RG-LRU recurrence over a step of many requests, in plain torch.

Per channel a state ``h``; per token ``h <- a_t * h + b_t`` with ``a_t``, ``b_t`` computed by the
layer (the gates, ``sqrt(1 - a^2)`` normalisation and the reset at position 0 are elementwise,
``models/torch/rg_lru.py``). :func:`rg_lru_scan` runs a segmented inclusive scan over the step's
packed tokens -- ``ceil(log2 T)`` doubling steps, each combining a token with the one ``2^i``
before it only when both are the same request's (``where``: nothing crosses a request boundary,
NaN of one request never reaches another) -- or, for uniform decode / verification steps, one
update per token. Lengths come from device tensors only and the shapes are static, so it runs
inside FULL graphs of any step. Float32 throughout; memory a few ``[T, D]`` tensors.
"""

from __future__ import annotations

import torch

from graphrt.layers.torch.state.mamba_kernels import request_tokens
from graphrt.layers.torch.state.metadata import StateMetadata


def rg_lru_scan(a: torch.Tensor, b: torch.Tensor, init: torch.Tensor,
                meta: StateMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The diagonal recurrence ``h_t = a_t h_{t-1} + b_t`` per request: ``a`` / ``b [T, D]``,
    ``init [R + 1, D]`` (zeros where a request has no state) -> (``h [T, D]`` float32, the
    state after each request's last C positions ``[R + 1, C, D]``, newest first)."""
    af, bf, init = a.float(), b.float(), init.float()
    if meta.uniform_query_len:
        return _recurrent(af, bf, init, meta)
    return _segmented(af, bf, init, meta)


def _recurrent(a: torch.Tensor, b: torch.Tensor, init: torch.Tensor,
               meta: StateMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request ``q`` tokens, token ``r * q + j`` its ``j``-th: one update per token."""
    q, c = meta.uniform_query_len, meta.checkpoints
    t, d = a.shape
    r = t // q
    a_s, b_s = a.view(r, q, d), b.view(r, q, d)
    state = init[:r]
    states = init.new_zeros(init.shape[0], c, d)
    ys = []
    for j in range(q):
        state = a_s[:, j] * state + b_s[:, j]
        ys.append(state)
        if q - 1 - j < c:
            states[:r, q - 1 - j] = state
    return torch.stack(ys, 1).reshape(t, d), states


def _segmented(a: torch.Tensor, b: torch.Tensor, init: torch.Tensor,
               meta: StateMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan by doubling: after step ``i`` each token holds the composition of its last
    ``2^i`` same-request tokens; a request's first token folds its initial state into ``b``."""
    t = a.shape[0]
    first = (meta.token_index == 0).view(-1, 1)
    b = torch.where(first, a * init.index_select(0, meta.token_req) + b, b)
    tokens = torch.arange(t, device=a.device)
    span = 1
    while span < t:
        back = (tokens - span).clamp(min=0)
        same = ((tokens >= span) & (meta.token_req.index_select(0, back) == meta.token_req)).view(-1, 1)
        b = torch.where(same, a * b.index_select(0, back) + b, b)
        a = torch.where(same, a * a.index_select(0, back), a)
        span *= 2
    last = meta.query_lens.unsqueeze(1) - 1 - torch.arange(meta.checkpoints, device=a.device)   # [R + 1, C]
    rows, valid = request_tokens(meta, last, t)
    states = torch.where(valid[..., None], b[rows], torch.zeros((), device=a.device))
    return b, states


__all__ = ["rg_lru_scan"]
