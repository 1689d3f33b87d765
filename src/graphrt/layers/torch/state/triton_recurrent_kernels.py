"""The Triton kernels behind :mod:`graphrt.layers.torch.state.triton_recurrent` (read that first).

Plain functions, not decorated: the wrapper compiles them with ``triton.jit`` for CUDA tensors
or wraps them in Triton's interpreter for CPU tensors. Every length is loaded from device
memory (token -> request maps, request starts and lengths), so one launch serves any step and
a captured graph replays it for any step of its shape. Each kernel reads a request's initial
state from a gathered copy (``init [R + 1, ...]``, zeros where it has none) and writes the
state after each of its last C positions into ``states [R + 1, C, ...]`` -- the caller stores
those at their slots, as the reference kernels' callers do.
"""

from __future__ import annotations

import triton.language as tl


def conv1d_kernel(x, weight, bias, init, out, token_req, token_index, num_channels,
                  K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, ACTIVATION: tl.constexpr):
    """Token ``program_id(0)``, channels ``program_id(1) * BLOCK ..``: the depthwise causal
    convolution over its request's inputs and, before its first token, the request's window
    (``init [R + 1, D, K - 1]``), then SiLU where ``ACTIVATION`` (LFM2's short convolution has
    none). ``x`` / ``out`` ``[T, D]``, ``weight [D, K]``."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = d < num_channels
    req = tl.load(token_req + t).to(tl.int64)
    j = tl.load(token_index + t).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + d, mask=inside, other=0.0).to(tl.float32)
    zero = tl.zeros((BLOCK,), dtype=tl.int64)
    for tap in tl.static_range(K):
        src = zero + (j - (K - 1) + tap)                 # a vector: masks of one dtype everywhere
        from_tokens = src >= 0
        xv = tl.load(x + (t - (K - 1) + tap) * num_channels + d, mask=inside & from_tokens, other=0.0)
        col = (K - 1) + src
        sv = tl.load(init + (req * num_channels + d) * (K - 1) + col, mask=inside & (src < 0) & (col >= 0),
                     other=0.0)
        value = tl.where(from_tokens, xv.to(tl.float32), sv.to(tl.float32))
        acc += value * tl.load(weight + d * K + tap, mask=inside, other=0.0).to(tl.float32)
    if ACTIVATION:
        acc = acc * tl.sigmoid(acc)
    tl.store(out + t * num_channels + d, acc, mask=inside)


def ssd_kernel(x, dt, A, B, C, D, init, y, states, starts, query_lens, heads, groups, head_dim, d_state,
               CHECKPOINTS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Request ``program_id(0)``, head ``program_id(1)``, head features ``program_id(2) * BLOCK_P
    ..``: Mamba2's recurrence over the request's tokens in order (``h <- exp(dt A) h + dt x B^T``,
    ``y = h C + D x``), the state after each of its last ``CHECKPOINTS`` positions into
    ``states [R + 1, C, H, P, N]``. ``x [T, H, P]``, ``dt [T, H]`` (after softplus), ``B`` / ``C
    [T, G, N]``, ``init [R + 1, H, P, N]``; everything float32."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm, nm = p < head_dim, n < d_state
    g = h // (heads // groups)
    plane = ((r * heads + h) * head_dim + p[:, None]) * d_state + n[None, :]
    state = tl.load(init + plane, mask=pm[:, None] & nm[None, :], other=0.0)
    a = tl.load(A + h)
    skip = tl.load(D + h)
    start = tl.load(starts + r).to(tl.int64)
    count = tl.load(query_lens + r).to(tl.int64)
    for i in range(0, count):
        tok = start + i
        step = tl.load(dt + tok * heads + h)
        xv = tl.load(x + (tok * heads + h) * head_dim + p, mask=pm, other=0.0)
        bv = tl.load(B + (tok * groups + g) * d_state + n, mask=nm, other=0.0)
        cv = tl.load(C + (tok * groups + g) * d_state + n, mask=nm, other=0.0)
        state = state * tl.exp(step * a) + (step * xv)[:, None] * bv[None, :]
        out = tl.sum(state * cv[None, :], axis=1) + skip * xv
        tl.store(y + (tok * heads + h) * head_dim + p, out, mask=pm)
        back = count - 1 - i
        if back < CHECKPOINTS:
            where = (((r * CHECKPOINTS + back) * heads + h) * head_dim + p[:, None]) * d_state + n[None, :]
            tl.store(states + where, state, mask=pm[:, None] & nm[None, :])


def delta_kernel(q, k, v, g, beta, init, y, states, starts, query_lens, value_heads, rep, key_dim, value_dim,
                 CHECKPOINTS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Request ``program_id(0)``, value head ``program_id(1)``, value features ``program_id(2) *
    BLOCK_V ..``: the gated delta rule over the request's tokens in order (``S <- exp(g) S``;
    ``S <- S + k (beta (v - S^T k))^T``; ``y = S^T q``). ``q`` / ``k [T, Hv, Dk]`` (normalised,
    q scaled, already repeated per value head), ``v [T, Hv, Dv]``, ``g`` / ``beta [T, Hv]``,
    ``init [R + 1, Hv, Dk, Dv]``; the state after each of the last ``CHECKPOINTS`` positions into
    ``states [R + 1, C, Hv, Dk, Dv]``."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kk = tl.arange(0, BLOCK_K)
    km, vm = kk < key_dim, vv < value_dim
    both = km[:, None] & vm[None, :]
    plane = ((r * value_heads + h) * key_dim + kk[:, None]) * value_dim + vv[None, :]
    state = tl.load(init + plane, mask=both, other=0.0)
    start = tl.load(starts + r).to(tl.int64)
    count = tl.load(query_lens + r).to(tl.int64)
    for i in range(0, count):
        tok = start + i
        row = tok * value_heads + h
        qv = tl.load(q + row * key_dim + kk, mask=km, other=0.0)
        kv = tl.load(k + row * key_dim + kk, mask=km, other=0.0)
        vx = tl.load(v + row * value_dim + vv, mask=vm, other=0.0)
        state = state * tl.exp(tl.load(g + row))
        memory = tl.sum(state * kv[:, None], axis=0)
        delta = (vx - memory) * tl.load(beta + row)
        state = state + kv[:, None] * delta[None, :]
        tl.store(y + row * value_dim + vv, tl.sum(state * qv[:, None], axis=0), mask=vm)
        back = count - 1 - i
        if back < CHECKPOINTS:
            where = (((r * CHECKPOINTS + back) * value_heads + h) * key_dim + kk[:, None]) * value_dim + vv[None, :]
            tl.store(states + where, state, mask=both)


def selective_kernel(x, dt, A, B, C, D, init, y, states, starts, query_lens, channels, d_state,
                     CHECKPOINTS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Request ``program_id(0)``, channels ``program_id(1) * BLOCK_D ..``: Mamba1's selective scan
    over the request's tokens in order (``h <- exp(dt A) * h + dt x B``, ``y = h . C + D x``), the
    state after each of its last ``CHECKPOINTS`` positions into ``states [R + 1, C, D, N]``.
    ``x`` / ``dt [T, D]`` (dt after softplus), ``A [D, N]``, ``B`` / ``C [T, N]``, ``init [R + 1,
    D, N]``; everything float32."""
    r = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    dm, nm = d < channels, n < d_state
    both = dm[:, None] & nm[None, :]
    plane = d[:, None] * d_state + n[None, :]
    state = tl.load(init + r * channels * d_state + plane, mask=both, other=0.0)
    a = tl.load(A + plane, mask=both, other=0.0)
    skip = tl.load(D + d, mask=dm, other=0.0)
    start = tl.load(starts + r).to(tl.int64)
    count = tl.load(query_lens + r).to(tl.int64)
    for i in range(0, count):
        tok = start + i
        step = tl.load(dt + tok * channels + d, mask=dm, other=0.0)
        xv = tl.load(x + tok * channels + d, mask=dm, other=0.0)
        bv = tl.load(B + tok * d_state + n, mask=nm, other=0.0)
        cv = tl.load(C + tok * d_state + n, mask=nm, other=0.0)
        state = state * tl.exp(step[:, None] * a) + (step * xv)[:, None] * bv[None, :]
        out = tl.sum(state * cv[None, :], axis=1) + skip * xv
        tl.store(y + tok * channels + d, out, mask=dm)
        back = count - 1 - i
        if back < CHECKPOINTS:
            tl.store(states + (r * CHECKPOINTS + back) * channels * d_state + plane, state, mask=both)


def rg_lru_kernel(a, b, init, h, states, starts, query_lens, channels,
                  CHECKPOINTS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Request ``program_id(0)``, channels ``program_id(1) * BLOCK_D ..``: RecurrentGemma's RG-LRU
    recurrence over the request's tokens in order (``h <- a h + b``, each token's ``h`` stored),
    the state after each of its last ``CHECKPOINTS`` positions into ``states [R + 1, C, D]``.
    ``a`` / ``b [T, D]``, ``init [R + 1, D]``; everything float32."""
    r = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < channels
    state = tl.load(init + r * channels + d, mask=dm, other=0.0)
    start = tl.load(starts + r).to(tl.int64)
    count = tl.load(query_lens + r).to(tl.int64)
    for i in range(0, count):
        tok = start + i
        state = tl.load(a + tok * channels + d, mask=dm, other=0.0) * state + \
            tl.load(b + tok * channels + d, mask=dm, other=0.0)
        tl.store(h + tok * channels + d, state, mask=dm)
        back = count - 1 - i
        if back < CHECKPOINTS:
            tl.store(states + (r * CHECKPOINTS + back) * channels + d, state, mask=dm)


def lightning_kernel(q, k, v, slope, init, y, states, starts, query_lens, heads, key_dim, value_dim,
                     CHECKPOINTS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Request ``program_id(0)``, head ``program_id(1)``, value features ``program_id(2) * BLOCK_V
    ..``: MiniMax's lightning attention over the request's tokens in order (``S <- exp(-s) S + k
    v^T``, ``y = S^T q``, ``s`` the head's decay rate). ``q`` / ``k [T, H, Dk]``, ``v [T, H,
    Dv]``, ``slope [H]``, ``init [R + 1, H, Dk, Dv]``; the state after each of the last
    ``CHECKPOINTS`` positions into ``states [R + 1, C, H, Dk, Dv]``; everything float32."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kk = tl.arange(0, BLOCK_K)
    km, vm = kk < key_dim, vv < value_dim
    both = km[:, None] & vm[None, :]
    plane = ((r * heads + h) * key_dim + kk[:, None]) * value_dim + vv[None, :]
    state = tl.load(init + plane, mask=both, other=0.0)
    ratio = tl.exp(-tl.load(slope + h))
    start = tl.load(starts + r).to(tl.int64)
    count = tl.load(query_lens + r).to(tl.int64)
    for i in range(0, count):
        row = (start + i) * heads + h
        qv = tl.load(q + row * key_dim + kk, mask=km, other=0.0)
        kv = tl.load(k + row * key_dim + kk, mask=km, other=0.0)
        vx = tl.load(v + row * value_dim + vv, mask=vm, other=0.0)
        state = state * ratio + kv[:, None] * vx[None, :]
        tl.store(y + row * value_dim + vv, tl.sum(state * qv[:, None], axis=0), mask=vm)
        back = count - 1 - i
        if back < CHECKPOINTS:
            where = (((r * CHECKPOINTS + back) * heads + h) * key_dim + kk[:, None]) * value_dim + vv[None, :]
            tl.store(states + where, state, mask=both)
