"""Mamba1's selective scan (Mamba, Falcon-Mamba, Jamba) over a step of many requests, in plain torch.

Per channel ``d`` a state ``h [N]``; per token: ``h <- exp(dt_d A_d) * h + dt_d x_d B``, output
``y_d = h . C + D_d x_d``. Unlike Mamba2 the decay differs per (channel, state) entry, so the
SSD's chunked attention-like form does not apply; :func:`selective_scan` runs a segmented
inclusive scan over the step's packed tokens instead -- ``ceil(log2 T)`` doubling steps, each
combining a token with the one ``2^i`` before it when both are the same request's (``where``:
nothing crosses a request boundary, NaN of one request never reaches another) -- or, for uniform
decode / verification steps, one recurrent update per token. Lengths come from device tensors
only and the shapes are static, so it runs inside FULL graphs of any step. Float32 throughout.
Memory: a few ``[T, D, N]`` float32 tensors (the Triton kernel is the memory-light one).
"""

from __future__ import annotations

import torch

from graphrt.layers.torch.state.mamba_kernels import request_tokens
from graphrt.layers.torch.state.metadata import StateMetadata


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None, init: torch.Tensor, meta: StateMetadata,
                   chunk_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba1's scan. ``x [T, D]``, ``dt [T, D]`` (after the bias and softplus), ``A [D, N]``
    (< 0), ``B`` / ``C [T, N]``, ``D [D]`` (or None), ``init [R + 1, D, N]`` (zeros where a
    request has no state) -> (``y [T, D]`` float32, the state after each request's last C
    positions ``[R + 1, C, D, N]``, newest first). ``chunk_size`` is unused (the reference
    kernels' signature)."""
    xf, dtf, Af, Bf, Cf = x.float(), dt.float(), A.float(), B.float(), C.float()
    if meta.uniform_query_len:
        y, states = _recurrent(xf, dtf, Af, Bf, Cf, init.float(), meta)
    else:
        y, states = _segmented(xf, dtf, Af, Bf, Cf, init.float(), meta)
    if D is not None:
        y = y + D.float() * xf
    return y, states


def _recurrent(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               init: torch.Tensor, meta: StateMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request ``q`` tokens, token ``r * q + j`` its ``j``-th: one state update per token."""
    q, c = meta.uniform_query_len, meta.checkpoints
    t, d = x.shape
    r = t // q
    xs, dts, Bs, Cs = x.view(r, q, d), dt.view(r, q, d), B.view(r, q, -1), C.view(r, q, -1)
    state = init[:r]
    states = init.new_zeros(init.shape[0], c, *init.shape[1:])
    ys = []
    for j in range(q):
        decay = torch.exp(dts[:, j, :, None] * A)                                  # [R, D, N]
        state = decay * state + (dts[:, j] * xs[:, j])[..., None] * Bs[:, j, None, :]
        ys.append(torch.einsum("rdn,rn->rd", state, Cs[:, j]))
        back = q - 1 - j
        if back < c:
            states[:r, back] = state
    return torch.stack(ys, 1).reshape(t, d), states


def _segmented(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               init: torch.Tensor, meta: StateMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan of ``h_t = a_t h_{t-1} + b_t`` per request over the packed tokens by doubling:
    after step ``i`` each token holds the composition of its last ``2^i`` same-request tokens.
    A request's first token folds its initial state into ``b``."""
    t = x.shape[0]
    a = torch.exp(dt.unsqueeze(-1) * A)                                            # [T, D, N]
    b = (dt * x).unsqueeze(-1) * B.unsqueeze(1)                                    # [T, D, N]
    first = (meta.token_index == 0).view(-1, 1, 1)
    b = torch.where(first, a * init.index_select(0, meta.token_req) + b, b)
    tokens = torch.arange(t, device=x.device)
    span = 1
    while span < t:
        back = (tokens - span).clamp(min=0)
        same = ((tokens >= span) & (meta.token_req.index_select(0, back) == meta.token_req)).view(-1, 1, 1)
        b = torch.where(same, a * b.index_select(0, back) + b, b)
        a = torch.where(same, a * a.index_select(0, back), a)
        span *= 2
    y = torch.einsum("tdn,tn->td", b, C)
    last = meta.query_lens.unsqueeze(1) - 1 - torch.arange(meta.checkpoints, device=x.device)   # [R + 1, C]
    rows, valid = request_tokens(meta, last, t)
    states = torch.where(valid[..., None, None], b[rows], torch.zeros((), device=x.device))
    return y, states


__all__ = ["selective_scan"]
