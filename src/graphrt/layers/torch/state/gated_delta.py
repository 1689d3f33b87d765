"""The gated delta rule (Qwen3-Next, Kimi Linear) over a step of many requests, in plain torch.

Per value head a state ``S [Dk, Dv]``; per token (``q``, ``k`` L2-normalised, ``q`` scaled by
``Dk ** -0.5``): ``S <- exp(g) S``; ``S <- S + k (beta (v - S^T k))^T``; output ``S^T q``.

:func:`gated_delta_rule` works on the packed tokens of a step with a
:class:`~graphrt.layers.torch.state.metadata.StateMetadata`, lengths from device tensors only:
chunked (within a chunk the WY / UT form -- one unit-triangular solve -- between chunks the
state, the ``k``-th chunk of every request at once), or for uniform decode / verification
steps one recurrent update per token. Both return the state after each request's last C
positions (its checkpoints). float32; masked values removed with ``where``.
"""

from __future__ import annotations

import torch

from graphrt.layers.torch.state.mamba_kernels import chunked_scan
from graphrt.layers.torch.state.metadata import StateMetadata


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (transformers' / FLA's)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     init: torch.Tensor, meta: StateMetadata, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` / ``k [T, Hk, Dk]``, ``v [T, Hv, Dv]``, ``g`` / ``beta [T, Hv]`` (log decay <= 0,
    update strength), ``init [R + 1, Hv, Dk, Dv]`` -> (``y [T, Hv, Dv]`` float32, the state after
    each request's last C positions ``[R + 1, C, Hv, Dk, Dv]``)."""
    hv = v.shape[1]
    rep = hv // k.shape[1]
    qf = l2norm(q.float()).repeat_interleave(rep, dim=1) * q.shape[-1] ** -0.5
    kf = l2norm(k.float()).repeat_interleave(rep, dim=1)
    args = (qf, kf, v.float(), g.float(), beta.float(), init.float(), meta)
    return _recurrent(*args) if meta.uniform_query_len else _chunked(*args, chunk_size)


def _recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               init: torch.Tensor, meta: StateMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request ``q`` tokens, token ``r * q + j`` its ``j``-th: one update per token."""
    n, c = meta.uniform_query_len, meta.checkpoints
    t, h, dv = v.shape
    r = t // n
    qs, ks, vs = q.view(r, n, h, -1), k.view(r, n, h, -1), v.view(r, n, h, dv)
    gs, bs = g.view(r, n, h), beta.view(r, n, h)
    state = init[:r]
    states = init.new_zeros(init.shape[0], c, *init.shape[1:])
    ys = []
    for j in range(n):
        state = state * torch.exp(gs[:, j])[..., None, None]
        memory = torch.einsum("rhkv,rhk->rhv", state, ks[:, j])
        delta = (vs[:, j] - memory) * bs[:, j, :, None]
        state = state + ks[:, j, :, :, None] * delta[:, :, None, :]
        ys.append(torch.einsum("rhkv,rhk->rhv", state, qs[:, j]))
        back = n - 1 - j
        if back < c:
            states[:r, back] = state
    return torch.stack(ys, 1).reshape(t, h, dv), states


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             init: torch.Tensor, meta: StateMetadata, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """By chunks (:func:`chunked_scan`): within a chunk the WY / UT form, between chunks the state."""
    t, h, dv = v.shape

    def step(rows: torch.Tensor, valid: torch.Tensor, lane: torch.Tensor, at: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        size, rows_total, c = lane.shape[0], at.shape[0], at.shape[1]
        m = valid[..., None, None]
        qk, kk = torch.where(m, q[rows], 0.0), torch.where(m, k[rows], 0.0)       # [R + 1, L, H, Dk]
        vk = torch.where(m, v[rows], 0.0)                                         # [R + 1, L, H, Dv]
        gk = torch.where(valid[..., None], g[rows], 0.0)                          # [R + 1, L, H]
        bk = torch.where(valid[..., None], beta[rows], 0.0)
        cum = torch.cumsum(gk, dim=1).transpose(1, 2)                             # [R + 1, H, L]
        seg = cum.unsqueeze(-1) - cum.unsqueeze(-2)                               # [R + 1, H, L(l), L(s)]
        decay = torch.exp(torch.where(lane.view(-1, 1) >= lane.view(1, -1), seg, float("-inf")))   # s <= l
        kh, qh, vh = kk.transpose(1, 2), qk.transpose(1, 2), vk.transpose(1, 2)   # [R + 1, H, L, D]
        kb = kh * bk.transpose(1, 2).unsqueeze(-1)
        eye = torch.eye(size, device=v.device)
        system = torch.where(lane.view(-1, 1) > lane.view(1, -1), (kb @ kh.transpose(-1, -2)) * decay, 0.0) + eye
        values = torch.linalg.solve_triangular(system, vh * bk.transpose(1, 2).unsqueeze(-1), upper=False,
                                               unitriangular=True)
        decayed_keys = torch.linalg.solve_triangular(system, kb * torch.exp(cum).unsqueeze(-1), upper=False,
                                                     unitriangular=True)
        fresh = values - decayed_keys @ state                                    # [R + 1, H, L, Dv]
        attn = (qh @ kh.transpose(-1, -2)) * decay
        yk = (qh * torch.exp(cum).unsqueeze(-1)) @ state + attn @ fresh           # [R + 1, H, L, Dv]
        cum_at = cum.gather(2, at.unsqueeze(1).expand(-1, h, -1))                 # [R + 1, H, C]
        weights = torch.exp(torch.where(lane.view(1, 1, 1, -1) <= at.view(rows_total, 1, c, 1),
                                        cum_at.unsqueeze(-1) - cum.unsqueeze(2), float("-inf")))   # [R+1, H, C, L]
        at_state = torch.einsum("rhcs,rhsk,rhsv->rchkv", weights, kh, fresh) + \
            torch.exp(cum_at).transpose(1, 2)[..., None, None] * state.unsqueeze(1)
        to_end = torch.exp(cum[..., -1:] - cum)                                   # [R + 1, H, L]
        end = torch.exp(cum[..., -1])[..., None, None] * state + (kh * to_end.unsqueeze(-1)).transpose(-1, -2) @ fresh
        return yk.transpose(1, 2), at_state, end

    return chunked_scan(init, meta, t, chunk_size, (h, dv), step)


__all__ = ["gated_delta_rule", "l2norm"]
