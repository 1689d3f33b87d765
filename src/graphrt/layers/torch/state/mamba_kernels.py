"""Reference kernels of Mamba2 layers over a step of many requests, in plain torch.

Each works on a step's packed tokens (``[T, ...]``, padding last) with a :class:`StateMetadata`,
reads lengths from device tensors only and has static shapes, so it runs inside a captured graph.
:func:`causal_conv1d` is the depthwise causal convolution; :func:`ssd_scan` the selective scan,
chunked or, for uniform decode / verification, one recurrent step per token. Both return the
states after each request's last C positions. Float32 throughout (as transformers' torch path);
masked values are removed with ``where``, so NaN in an unused row cannot leak.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from graphrt.layers.torch.state.metadata import StateMetadata


def request_tokens(meta: StateMetadata, index: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of in-request indices ``index [R + 1, ...]`` (clamped into [0, T)) and whether
    each is one of the request's tokens of this step."""
    shape = (-1,) + (1,) * (index.dim() - 1)
    valid = (index >= 0) & (index < meta.query_lens.view(shape))
    rows = (meta.starts.view(shape) + index).clamp(0, max(num_tokens - 1, 0))
    return rows, valid


ChunkStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                     tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def chunked_scan(init: torch.Tensor, meta: StateMetadata, num_tokens: int, chunk_size: int,
                 y_shape: tuple[int, ...], step: ChunkStep) -> tuple[torch.Tensor, torch.Tensor]:
    """A scan by chunks of ``chunk_size`` tokens, the ``k``-th chunk of every request at once.
    ``step(rows, valid, lane, at, state)`` gets the chunk's rows and validity ``[R + 1, L]``, the
    lane index ``[L]``, the chunk positions of the last C positions ``[R + 1, C]`` and the state
    before the chunk; returns (``y [R + 1, L, *y_shape]``, the states at those positions, the
    state at the chunk's end). Returns (``y [T, *y_shape]``, states ``[R + 1, C, *state]``)."""
    size = max(1, min(int(chunk_size), num_tokens))
    rows_total, device = meta.starts.shape[0], init.device
    lane = torch.arange(size, device=device)
    last = meta.query_lens.unsqueeze(1) - 1 - torch.arange(meta.checkpoints, device=device)   # [R + 1, C]
    y = init.new_zeros(num_tokens + 1, *y_shape)                                 # row T: unused positions
    state, states = init, init.new_zeros(rows_total, meta.checkpoints, *init.shape[1:])
    for chunk in range(-(-num_tokens // size)):
        rows, valid = request_tokens(meta, (chunk * size + lane.view(1, -1)).expand(rows_total, -1), num_tokens)
        local = last - chunk * size             # the last C positions that fall in this chunk
        yk, at_state, state = step(rows, valid, lane, local.clamp(0, size - 1), state)
        y.index_copy_(0, torch.where(valid, rows, num_tokens).reshape(-1), yk.reshape(-1, *y_shape))
        states = torch.where(((local >= 0) & (local < size))[..., None, None, None], at_state, states)
    return y[:num_tokens], states


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, init: torch.Tensor,
                  meta: StateMetadata, activation: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, D]``, ``weight [D, K]``, ``init [R + 1, D, K - 1]`` (each request's window before
    its first token; zeros without one) -> (``silu(conv(x)) [T, D]`` in x's dtype, the window
    after each request's last C positions ``[R + 1, C, D, K - 1]``)."""
    t, d = x.shape
    k = weight.shape[1]
    xf = x.float()
    w = weight.float()
    init_t = init.float().transpose(1, 2)                   # [R + 1, K - 1, D]
    req, j = meta.token_req, meta.token_index
    acc = torch.zeros(t, d, dtype=torch.float32, device=x.device) if bias is None else \
        bias.float().expand(t, d).clone()
    for tap in range(k):
        back = tap - (k - 1)                                # <= 0: the source's offset from the token
        src = j + back
        from_tokens = src >= 0
        rows = (torch.arange(t, device=x.device) + back).clamp(min=0)
        col = (src + (k - 1)).clamp(0, max(k - 2, 0))
        value = torch.where(from_tokens.unsqueeze(1), xf.index_select(0, rows), init_t[req, col])
        acc = acc + value * w[:, tap]
    out = F.silu(acc) if activation else acc
    return out.to(x.dtype), conv_windows(xf, init, meta, k)


def conv_windows(x: torch.Tensor, init: torch.Tensor, meta: StateMetadata, k: int) -> torch.Tensor:
    """The convolution window (the last K - 1 inputs) after each request's last C positions,
    ``[R + 1, C, D, K - 1]`` float32: from the step's ``x [T, D]`` and, before a request's first
    token, its ``init [R + 1, D, K - 1]``."""
    t = x.shape[0]
    xf, init_t = x.float(), init.float().transpose(1, 2)
    last = meta.query_lens.unsqueeze(1) - 1 - torch.arange(meta.checkpoints, device=x.device)   # [R + 1, C]
    offsets = torch.arange(-(k - 2), 1, device=x.device) if k > 1 else torch.zeros(0, dtype=torch.long,
                                                                                    device=x.device)
    src = last.unsqueeze(-1) + offsets                      # [R + 1, C, K - 1]: in-request indices
    rows, valid = request_tokens(meta, src, t)
    col = (src + (k - 1)).clamp(0, max(k - 2, 0))
    from_init = init_t[torch.arange(init_t.shape[0], device=x.device).view(-1, 1, 1), col]   # [R+1, C, K-1, D]
    window = torch.where(valid.unsqueeze(-1), xf[rows], from_init)
    return window.transpose(2, 3)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor | None, init: torch.Tensor, meta: StateMetadata,
             chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's scan. ``x [T, H, P]``, ``dt [T, H]`` (after softplus and limits), ``A [H]`` (< 0),
    ``B`` / ``C [T, G, N]``, ``D [H]``, ``init [R + 1, H, P, N]`` -> (``y [T, H, P]`` float32,
    the state after each request's last C positions ``[R + 1, C, H, P, N]``)."""
    heads, groups = x.shape[1], B.shape[1]
    xf, dtf = x.float(), dt.float()
    Bf = B.float().repeat_interleave(heads // groups, dim=1)     # [T, H, N]
    Cf = C.float().repeat_interleave(heads // groups, dim=1)
    Af = A.float()
    if meta.uniform_query_len:
        y, states = _recurrent(xf, dtf, Af, Bf, Cf, init.float(), meta)
    else:
        y, states = _chunked(xf, dtf, Af, Bf, Cf, init.float(), meta, chunk_size)
    if D is not None:
        y = y + D.float().view(1, -1, 1) * xf
    return y, states


def _recurrent(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               init: torch.Tensor, meta: StateMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request ``q`` tokens, token ``r * q + j`` its ``j``-th: one state update per token."""
    q, c = meta.uniform_query_len, meta.checkpoints
    t, h, p = x.shape
    r = t // q
    n = B.shape[-1]
    xs, dts, Bs, Cs = x.view(r, q, h, p), dt.view(r, q, h), B.view(r, q, h, n), C.view(r, q, h, n)
    state = init[:r]
    states = init.new_zeros(init.shape[0], c, h, p, n)
    ys = []
    for j in range(q):
        decay = torch.exp(dts[:, j] * A)                                      # [R, H]
        state = decay[..., None, None] * state + (dts[:, j, :, None] * xs[:, j])[..., None] * Bs[:, j, :, None, :]
        ys.append(torch.einsum("rhpn,rhn->rhp", state, Cs[:, j]))
        back = q - 1 - j
        if back < c:
            states[:r, back] = state
    return torch.stack(ys, 1).reshape(t, h, p), states


def _chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             init: torch.Tensor, meta: StateMetadata, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD by chunks (:func:`chunked_scan`): within a chunk the quadratic (attention-like) form,
    between chunks the state."""
    t, h, p = x.shape

    def step(rows: torch.Tensor, valid: torch.Tensor, lane: torch.Tensor, at: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        v = valid.unsqueeze(-1)
        dtk = torch.where(v, dt[rows], 0.0)                                     # [R + 1, L, H]
        Bk = torch.where(v.unsqueeze(-1), B[rows], 0.0)
        Ck = torch.where(v.unsqueeze(-1), C[rows], 0.0)
        u = torch.where(v.unsqueeze(-1), x[rows] * dtk.unsqueeze(-1), 0.0)      # [R + 1, L, H, P]
        cum = torch.cumsum(dtk * A, dim=1)                                      # [R + 1, L, H]
        seg = cum.unsqueeze(2) - cum.unsqueeze(1)                               # [R + 1, L(l), L(s), H]
        causal = lane.view(-1, 1) >= lane.view(1, -1)                           # [L, L]: s <= l
        decay = torch.exp(torch.where(causal[None, :, :, None], seg, float("-inf")))
        scores = torch.einsum("rlhn,rshn->rlsh", Ck, Bk) * decay
        yk = torch.einsum("rlsh,rshp->rlhp", scores, u)
        yk = yk + torch.einsum("rlhn,rhpn->rlhp", Ck, state) * torch.exp(cum).unsqueeze(-1)
        cum_at = cum.gather(1, at.unsqueeze(-1).expand(-1, -1, h))              # [R + 1, C, H]
        weights = torch.exp(torch.where((lane.view(1, 1, -1) <= at.unsqueeze(-1)).unsqueeze(-1),
                                        cum_at.unsqueeze(2) - cum.unsqueeze(1), float("-inf")))
        inner = torch.einsum("rcsh,rshn,rshp->rchpn", weights, Bk, u)
        at_state = inner + torch.exp(cum_at)[..., None, None] * state.unsqueeze(1)
        # the state at the chunk's end (positions past the request: dt 0, nothing changes)
        to_end = torch.exp(cum[:, -1:] - cum)                                   # [R + 1, L, H]
        end = torch.exp(cum[:, -1])[..., None, None] * state + torch.einsum("rsh,rshn,rshp->rhpn", to_end, Bk, u)
        return yk, at_state, end

    return chunked_scan(init, meta, t, chunk_size, (h, p), step)


__all__ = ["causal_conv1d", "chunked_scan", "conv_windows", "request_tokens", "ssd_scan"]
