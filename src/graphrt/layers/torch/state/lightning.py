"""MiniMax's lightning attention (linear attention with a fixed decay per head) over a step of
many requests, in plain torch.

Per head a state ``S [Dk, Dv]`` (the decayed sum of ``k v^T``); per token ``S <- exp(-s) S + k
v^T`` and the output ``q S``, ``s > 0`` the head's decay rate (transformers'
``slope_rate``). No normalisation of ``q`` / ``k``, no scaling: the layer applies its
activation before and its norm and gate after (``models/torch/lightning.py``).

:func:`lightning_attention` works on a step's packed tokens with a
:class:`~graphrt.layers.torch.state.metadata.StateMetadata`, lengths from device tensors only:
by chunks (within a chunk the decay-masked ``(q k^T) v`` plus the carried state, between chunks
the state; the ``k``-th chunk of every request at once, :func:`chunked_scan`), or for uniform
decode / verification steps one update per token. Both return the state after each request's
last C positions (its checkpoints). Float32; masked rows removed with ``where``, so NaN in a
padded row reaches no request.
"""

from __future__ import annotations

import torch

from graphrt.layers.torch.state.mamba_kernels import chunked_scan
from graphrt.layers.torch.state.metadata import StateMetadata


def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, init: torch.Tensor,
                        meta: StateMetadata, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` / ``k [T, H, Dk]``, ``v [T, H, Dv]``, ``slope [H]`` (each head's decay rate, > 0),
    ``init [R + 1, H, Dk, Dv]`` -> (``y [T, H, Dv]`` float32, the state after each request's last
    C positions ``[R + 1, C, H, Dk, Dv]``, newest first)."""
    args = (q.float(), k.float(), v.float(), slope.float().reshape(-1), init.float(), meta)
    return _recurrent(*args) if meta.uniform_query_len else _chunked(*args, chunk_size)


def _recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, init: torch.Tensor,
               meta: StateMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request ``n`` tokens, token ``r * n + j`` its ``j``-th: one update per token."""
    n, c = meta.uniform_query_len, meta.checkpoints
    t, h, dv = v.shape
    r = t // n
    qs, ks, vs = q.view(r, n, h, -1), k.view(r, n, h, -1), v.view(r, n, h, dv)
    ratio = torch.exp(-slope).view(1, h, 1, 1)
    state = init[:r]
    states = init.new_zeros(init.shape[0], c, *init.shape[1:])
    ys = []
    for j in range(n):
        state = ratio * state + ks[:, j, :, :, None] * vs[:, j, :, None, :]
        ys.append(torch.einsum("rhkv,rhk->rhv", state, qs[:, j]))
        if n - 1 - j < c:
            states[:r, n - 1 - j] = state
    return torch.stack(ys, 1).reshape(t, h, dv), states


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, init: torch.Tensor,
             meta: StateMetadata, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """By chunks (:func:`chunked_scan`): within a chunk the decay-masked ``(q k^T) v`` and the
    carried state decayed to each token; a lane past the request's tokens decays nothing."""
    t, h, dv = v.shape
    log_decay = -slope.view(1, h, 1)

    def step(rows: torch.Tensor, valid: torch.Tensor, lane: torch.Tensor, at: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows_total, c = at.shape
        m = valid[..., None, None]
        qh = torch.where(m, q[rows], 0.0).transpose(1, 2)                     # [R + 1, H, L, Dk]
        kh = torch.where(m, k[rows], 0.0).transpose(1, 2)
        vh = torch.where(m, v[rows], 0.0).transpose(1, 2)                     # [R + 1, H, L, Dv]
        cum = torch.cumsum(torch.where(valid.unsqueeze(1), log_decay, 0.0), dim=-1)   # [R + 1, H, L]
        lower = lane.view(-1, 1) >= lane.view(1, -1)
        decay = torch.exp(torch.where(lower, cum.unsqueeze(-1) - cum.unsqueeze(-2), float("-inf")))
        yk = (qh * torch.exp(cum).unsqueeze(-1)) @ state + ((qh @ kh.transpose(-1, -2)) * decay) @ vh
        cum_at = cum.gather(2, at.unsqueeze(1).expand(-1, h, -1))             # [R + 1, H, C]
        weights = torch.exp(torch.where(lane.view(1, 1, 1, -1) <= at.view(rows_total, 1, c, 1),
                                        cum_at.unsqueeze(-1) - cum.unsqueeze(2), float("-inf")))   # [R+1, H, C, L]
        at_state = torch.einsum("rhcs,rhsk,rhsv->rchkv", weights, kh, vh) + \
            torch.exp(cum_at).transpose(1, 2)[..., None, None] * state.unsqueeze(1)
        to_end = torch.exp(cum[..., -1:] - cum)                               # [R + 1, H, L]
        end = torch.exp(cum[..., -1])[..., None, None] * state + (kh * to_end.unsqueeze(-1)).transpose(-1, -2) @ vh
        return yk.transpose(1, 2), at_state, end

    return chunked_scan(init, meta, t, chunk_size, (h, dv), step)


__all__ = ["lightning_attention"]
