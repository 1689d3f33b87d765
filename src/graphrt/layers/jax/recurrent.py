"""Recurrent layers of hybrid models in JAX (docs/hybrid.md): the step's state metadata, the
causal conv1d with state, Mamba2's SSD scan, the gated delta rule, Mamba1's selective scan and
RecurrentGemma's RG-LRU scan -- the torch reference kernels
(:mod:`graphrt.layers.torch.state.mamba_kernels`, ``gated_delta``, ``selective_scan``,
``rg_lru``) in ``jnp``, jit-able with
static shapes: lengths come from the batch's arrays, chunks are a ``lax.fori_loop`` (the
``k``-th chunk of every request at once), uniform decode / verification steps one update per
token. Padded requests and the padding request (the tokens past the last real one) read zeros
and write the trash slot, index ``num_slots`` of every state array ``[slots + 1, C, ...]``.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from graphrt.core.errors import ConfigError

#: While the xla backend traces a forward: each state array (by id) -> (its spec field, its
#: recurrent layer), so a write of another per-request shape names them (:func:`write_states`).
_STATE_NAMES: contextvars.ContextVar[dict[int, tuple[str, int]]] = contextvars.ContextVar("graphrt_state_names",
                                                                                            default={})


class StateMeta(NamedTuple):
    """The torch :class:`~graphrt.layers.torch.state.metadata.StateMetadata`, as a pytree of
    arrays (``num_slots``, ``checkpoints`` and ``uniform`` are static: passed alongside)."""

    starts: jax.Array           # [R + 1]
    query_lens: jax.Array       # [R + 1]
    token_req: jax.Array        # [T]
    token_index: jax.Array      # [T]
    read_slot: jax.Array        # [R + 1]
    read_checkpoint: jax.Array  # [R + 1]
    has_initial: jax.Array      # [R + 1] bool
    write_slot: jax.Array       # [R + 1, C]
    write_checkpoint: jax.Array  # [R + 1, C]


def state_meta(query_start_loc: jax.Array, seq_lens: jax.Array, state_slots: jax.Array, num_tokens: int, *,
               num_slots: int, checkpoints: int) -> StateMeta:
    """The step's metadata from the batch (``num_computed = seq_lens - query lens``)."""
    qsl = query_start_loc.astype(jnp.int32)
    r = state_slots.shape[0]
    ends = jnp.concatenate([qsl[1:], jnp.full((1,), num_tokens, jnp.int32)])
    query_lens = ends - qsl
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    token_req = jnp.searchsorted(qsl[1:], tokens, side="right").astype(jnp.int32)
    token_index = tokens - qsl[token_req]
    raw = jnp.concatenate([state_slots.astype(jnp.int32), jnp.full((1,), -1, jnp.int32)])
    live = raw >= 0
    slot = jnp.where(live, raw, num_slots)
    computed = jnp.concatenate([seq_lens.astype(jnp.int32) - query_lens[:r], jnp.zeros((1,), jnp.int32)])
    has_initial = live & (computed > 0)
    read_checkpoint = jnp.where(has_initial, jnp.mod(computed - 1, checkpoints), 0)
    index = query_lens[:, None] - 1 - jnp.arange(checkpoints)[None, :]
    writes = (index >= 0) & live[:, None]
    write_slot = jnp.where(writes, slot[:, None], num_slots)
    write_checkpoint = jnp.where(writes, jnp.mod(computed[:, None] + index, checkpoints), 0)
    return StateMeta(qsl, query_lens, token_req, token_index, slot, read_checkpoint, has_initial, write_slot,
                     write_checkpoint)


def read_states(cache: jax.Array, meta: StateMeta) -> jax.Array:
    """Each request's initial state ``[R + 1, *shape]`` (float32) from ``cache [slots + 1, C,
    *shape]``: the state after its last computed token, zeros where it has none (a new or
    preempted request, a padded one, the padding request ``R``)."""
    state = cache[meta.read_slot, meta.read_checkpoint].astype(jnp.float32)
    mask = meta.has_initial.reshape((-1,) + (1,) * (state.ndim - 1))
    return jnp.where(mask, state, 0.0)


def write_states(cache: jax.Array, meta: StateMeta, states: jax.Array) -> jax.Array:
    """``cache`` with ``states [R + 1, C, *shape]`` stored: ``states[r, c]`` is request ``r``'s
    state after its position ``end - 1 - c`` (newest first: entry 0 is the state after the
    step's last token), where ``end`` is the request's tokens so far; what has no such position
    goes to the trash slot. A ``shape`` other than the array's is a ConfigError naming the spec's
    group and tensor (checked when the forward is traced: when the runner is built)."""
    want = tuple(meta.write_slot.shape) + tuple(cache.shape[2:])
    if tuple(states.shape) != want:
        raise _shape_error(cache, tuple(states.shape), want)
    return cache.at[meta.write_slot, meta.write_checkpoint].set(states.astype(cache.dtype))


@contextlib.contextmanager
def naming_states(arrays: Sequence[Any], names: Sequence[tuple[str, int]]) -> Iterator[None]:
    """While a forward is traced over ``arrays`` (the states pytree, layer-major, tensor-minor):
    name each by its spec field and layer in :func:`write_states`' errors."""
    token = _STATE_NAMES.set({id(a): name for a, name in zip(arrays, names)})
    try:
        yield
    finally:
        _STATE_NAMES.reset(token)


def _shape_error(cache: jax.Array, got: tuple[int, ...], want: tuple[int, ...]) -> ConfigError:
    named = _STATE_NAMES.get().get(id(cache))
    if named is not None and got[2:] != want[2:]:
        field, layer = named
        return ConfigError(f"{field}.shape: {tuple(cache.shape[2:])}, but recurrent layer {layer} keeps "
                           f"{got[2:]} per request (the states its forward writes through write_states); declare "
                           "what the layer keeps")
    return ConfigError(f"write_states: states of shape {got} for a state array of shape {tuple(cache.shape)} "
                       f"([slots + 1, checkpoints, *shape]); pass [R + 1, checkpoints, *shape] = {want}: each "
                       "request's state after each of its last checkpoints positions, newest first (docs/hybrid.md)")


def _rows(meta: StateMeta, index: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Token rows of in-request indices ``index [R + 1, ...]`` and whether each is the request's."""
    shape = (-1,) + (1,) * (index.ndim - 1)
    valid = (index >= 0) & (index < meta.query_lens.reshape(shape))
    return jnp.clip(meta.starts.reshape(shape) + index, 0, num_tokens - 1), valid


def causal_conv1d(x: jax.Array, weight: jax.Array, bias: jax.Array | None, init: jax.Array, meta: StateMeta,
                  checkpoints: int, activation: bool = True) -> tuple[jax.Array, jax.Array]:
    """``x [T, D]``, ``weight [D, K]``, ``init [R + 1, D, K - 1]`` -> (``silu(conv) [T, D]`` --
    ``conv`` without ``activation``: LFM2's short convolution --, the window after each
    request's last C positions ``[R + 1, C, D, K - 1]``)."""
    t, d = x.shape
    k = weight.shape[1]
    xf, w = x.astype(jnp.float32), weight.astype(jnp.float32)
    init_t = jnp.swapaxes(init, 1, 2)                                   # [R + 1, K - 1, D]
    acc = jnp.zeros((t, d), jnp.float32) if bias is None else jnp.broadcast_to(bias.astype(jnp.float32), (t, d))
    for tap in range(k):
        back = tap - (k - 1)
        src = meta.token_index + back
        rows = jnp.clip(jnp.arange(t) + back, 0, None)
        col = jnp.clip(src + (k - 1), 0, max(k - 2, 0))
        acc = acc + jnp.where((src >= 0)[:, None], xf[rows], init_t[meta.token_req, col]) * w[:, tap]
    last = meta.query_lens[:, None] - 1 - jnp.arange(checkpoints)[None, :]
    src = last[..., None] + jnp.arange(-(k - 2), 1)[None, None, :]      # [R + 1, C, K - 1]
    rows, valid = _rows(meta, src, t)
    col = jnp.clip(src + (k - 1), 0, max(k - 2, 0))
    from_init = init_t[jnp.arange(init_t.shape[0])[:, None, None], col]
    window = jnp.where(valid[..., None], xf[rows], from_init)
    return (jax.nn.silu(acc) if activation else acc).astype(x.dtype), jnp.swapaxes(window, 2, 3)


def ssd_scan(x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array, D: jax.Array, init: jax.Array,
             meta: StateMeta, *, chunk_size: int, checkpoints: int, uniform: int) -> tuple[jax.Array, jax.Array]:
    """Mamba2's scan (see the torch ``ssd_scan``): ``x [T, H, P]``, ``dt [T, H]``, ``A [H]``, ``B`` /
    ``C [T, G, N]``, ``init [R + 1, H, P, N]`` -> (y float32, states ``[R + 1, C, H, P, N]``)."""
    t, h, p = x.shape
    rep = h // B.shape[1]
    Bf = jnp.repeat(B.astype(jnp.float32), rep, axis=1)
    Cf = jnp.repeat(C.astype(jnp.float32), rep, axis=1)
    xf, dtf, Af = x.astype(jnp.float32), dt.astype(jnp.float32), A.astype(jnp.float32)
    if uniform:
        r = t // uniform
        xs, dts, Bs, Cs = (a.reshape(r, uniform, *a.shape[1:]) for a in (xf, dtf, Bf, Cf))
        state, states, ys = init[:r], jnp.zeros((init.shape[0], checkpoints, h, p, Bf.shape[-1])), []
        for j in range(uniform):
            state = jnp.exp(dts[:, j] * Af)[..., None, None] * state + \
                (dts[:, j, :, None] * xs[:, j])[..., None] * Bs[:, j, :, None, :]
            ys.append(jnp.einsum("rhpn,rhn->rhp", state, Cs[:, j]))
            if uniform - 1 - j < checkpoints:
                states = states.at[:r, uniform - 1 - j].set(state)
        y = jnp.stack(ys, 1).reshape(t, h, p)
    else:
        y, states = _ssd_chunked(xf, dtf, Af, Bf, Cf, init, meta, max(1, min(chunk_size, t)), checkpoints)
    return y + D.astype(jnp.float32)[None, :, None] * xf, states


def _decayed_states(cum: jax.Array, k: jax.Array, v: jax.Array, state: jax.Array, at: jax.Array,
                    lane: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A chunk's states of ``S <- exp(g) S + k v^T`` (gated delta rule: ``v`` its corrected
    values; lightning attention: its values): at each checkpoint position ``at [R + 1, C]`` and
    at the chunk's end, from the state before it and the cumulative log decay ``cum [R + 1, H, L]``
    (``k [R + 1, H, L, Dk]``, ``v [R + 1, H, L, Dv]``, ``state [R + 1, H, Dk, Dv]``)."""
    heads, checkpoints = cum.shape[1], at.shape[1]
    cum_at = jnp.take_along_axis(cum, jnp.broadcast_to(at[:, None, :], (at.shape[0], heads, checkpoints)), axis=2)
    weights = jnp.exp(jnp.where(lane[None, None, None, :] <= at[:, None, :, None],
                                cum_at[..., None] - cum[:, :, None, :], -jnp.inf))   # [R+1, H, C, L]
    at_state = jnp.einsum("rhcs,rhsk,rhsv->rchkv", weights, k, v) + \
        jnp.swapaxes(jnp.exp(cum_at), 1, 2)[..., None, None] * state[:, None]
    to_end = jnp.exp(cum[..., -1:] - cum)
    end = jnp.exp(cum[..., -1])[..., None, None] * state + jnp.swapaxes(k * to_end[..., None], -1, -2) @ v
    return at_state, end


def _chunked_scan(init: jax.Array, meta: StateMeta, num_tokens: int, size: int, checkpoints: int,
                  y_shape: tuple[int, ...], step: Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
                  ) -> tuple[jax.Array, jax.Array]:
    """The chunk loop of both scans (see the torch ``chunked_scan``): ``step(rows, valid, lane, at,
    state)`` -> (y ``[R + 1, L, *y_shape]``, the state at the last C positions, the chunk's end state)."""
    rows_total = meta.starts.shape[0]
    lane = jnp.arange(size)
    last = meta.query_lens[:, None] - 1 - jnp.arange(checkpoints)[None, :]

    def body(k, carry):
        y, state, states = carry
        rows, valid = _rows(meta, jnp.broadcast_to(k * size + lane[None, :], (rows_total, size)), num_tokens)
        local = last - k * size
        yk, at_state, state = step(rows, valid, lane, jnp.clip(local, 0, size - 1), state)
        y = y.at[jnp.where(valid, rows, num_tokens).reshape(-1)].set(yk.reshape(-1, *y_shape))
        states = jnp.where(((local >= 0) & (local < size))[..., None, None, None], at_state, states)
        return y, state, states

    y0 = jnp.zeros((num_tokens + 1,) + y_shape, jnp.float32)
    states0 = jnp.zeros((rows_total, checkpoints) + init.shape[1:], jnp.float32)
    y, _, states = jax.lax.fori_loop(0, -(-num_tokens // size), body, (y0, init, states0))
    return y[:num_tokens], states


def _ssd_chunked(x, dt, A, B, C, init, meta, size, checkpoints):
    t, h, p = x.shape
    causal = jnp.arange(size)[:, None] >= jnp.arange(size)[None, :]

    def step(rows, valid, lane, at, state):
        v = valid[..., None]
        dtk = jnp.where(v, dt[rows], 0.0)
        Bk, Ck = jnp.where(v[..., None], B[rows], 0.0), jnp.where(v[..., None], C[rows], 0.0)
        u = jnp.where(v[..., None], x[rows] * dtk[..., None], 0.0)
        cum = jnp.cumsum(dtk * A, axis=1)
        decay = jnp.exp(jnp.where(causal[None, :, :, None], cum[:, :, None, :] - cum[:, None, :, :], -jnp.inf))
        yk = jnp.einsum("rlsh,rshp->rlhp", jnp.einsum("rlhn,rshn->rlsh", Ck, Bk) * decay, u)
        yk = yk + jnp.einsum("rlhn,rhpn->rlhp", Ck, state) * jnp.exp(cum)[..., None]
        cum_at = jnp.take_along_axis(cum, jnp.broadcast_to(at[..., None], at.shape + (h,)), axis=1)
        weights = jnp.exp(jnp.where((lane[None, None, :] <= at[..., None])[..., None],
                                    cum_at[:, :, None, :] - cum[:, None, :, :], -jnp.inf))
        at_state = jnp.einsum("rcsh,rshn,rshp->rchpn", weights, Bk, u) + \
            jnp.exp(cum_at)[..., None, None] * state[:, None]
        to_end = jnp.exp(cum[:, -1:] - cum)
        end = jnp.exp(cum[:, -1])[..., None, None] * state + jnp.einsum("rsh,rshn,rshp->rhpn", to_end, Bk, u)
        return yk, at_state, end

    return _chunked_scan(init, meta, t, size, checkpoints, (h, p), step)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_delta_rule(q, k, v, g, beta, init, meta: StateMeta, *, chunk_size: int, checkpoints: int,
                     uniform: int) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule (see the torch ``gated_delta_rule``): ``q`` / ``k [T, Hk, Dk]``, ``v
    [T, Hv, Dv]``, ``g`` / ``beta [T, Hv]``, ``init [R + 1, Hv, Dk, Dv]`` -> (y, states)."""
    t, hv, dv = v.shape
    rep = hv // k.shape[1]
    qf = jnp.repeat(l2norm(q.astype(jnp.float32)), rep, axis=1) * q.shape[-1] ** -0.5
    kf = jnp.repeat(l2norm(k.astype(jnp.float32)), rep, axis=1)
    vf, gf, bf = v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)
    if uniform:
        r = t // uniform
        qs, ks, vs, gs, bs = (a.reshape(r, uniform, *a.shape[1:]) for a in (qf, kf, vf, gf, bf))
        state, ys = init[:r], []
        states = jnp.zeros((init.shape[0], checkpoints) + init.shape[1:], jnp.float32)
        for j in range(uniform):
            state = state * jnp.exp(gs[:, j])[..., None, None]
            delta = (vs[:, j] - jnp.einsum("rhkv,rhk->rhv", state, ks[:, j])) * bs[:, j, :, None]
            state = state + ks[:, j, :, :, None] * delta[:, :, None, :]
            ys.append(jnp.einsum("rhkv,rhk->rhv", state, qs[:, j]))
            if uniform - 1 - j < checkpoints:
                states = states.at[:r, uniform - 1 - j].set(state)
        return jnp.stack(ys, 1).reshape(t, hv, dv), states
    return _delta_chunked(qf, kf, vf, gf, bf, init, meta, max(1, min(chunk_size, t)), checkpoints)


def _delta_chunked(q, k, v, g, beta, init, meta, size, checkpoints):
    t, h, dv = v.shape
    lane = jnp.arange(size)
    lower, strict = lane[:, None] >= lane[None, :], lane[:, None] > lane[None, :]
    eye = jnp.eye(size, dtype=jnp.float32)

    def step(rows, valid, lane, at, state):
        m = valid[..., None, None]
        kh = jnp.swapaxes(jnp.where(m, k[rows], 0.0), 1, 2)               # [R + 1, H, L, Dk]
        qh = jnp.swapaxes(jnp.where(m, q[rows], 0.0), 1, 2)
        vh = jnp.swapaxes(jnp.where(m, v[rows], 0.0), 1, 2)
        gk = jnp.swapaxes(jnp.where(valid[..., None], g[rows], 0.0), 1, 2)  # [R + 1, H, L]
        bk = jnp.swapaxes(jnp.where(valid[..., None], beta[rows], 0.0), 1, 2)
        cum = jnp.cumsum(gk, axis=-1)
        decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
        kb = kh * bk[..., None]
        system = jnp.where(strict, (kb @ jnp.swapaxes(kh, -1, -2)) * decay, 0.0) + eye
        solve = lambda b: jax.lax.linalg.triangular_solve(system, b, left_side=True, lower=True,  # noqa: E731
                                                          unit_diagonal=True)
        fresh = solve(vh * bk[..., None]) - solve(kb * jnp.exp(cum)[..., None]) @ state
        yk = (qh * jnp.exp(cum)[..., None]) @ state + ((qh @ jnp.swapaxes(kh, -1, -2)) * decay) @ fresh
        at_state, end = _decayed_states(cum, kh, fresh, state, at, lane)
        return jnp.swapaxes(yk, 1, 2), at_state, end

    return _chunked_scan(init, meta, t, size, checkpoints, (h, dv), step)


def selective_scan(x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array, D: jax.Array | None,
                   init: jax.Array, meta: StateMeta, *, checkpoints: int, uniform: int) -> tuple[jax.Array, jax.Array]:
    """Mamba1's scan (see the torch ``selective_scan``): ``x`` / ``dt [T, D]`` (dt after softplus),
    ``A [D, N]``, ``B`` / ``C [T, N]``, ``init [R + 1, D, N]`` -> (y ``[T, D]`` float32, states
    ``[R + 1, C, D, N]``): a segmented scan by doubling over the packed tokens, or one update per
    token for uniform steps."""
    xf, dtf, Af = x.astype(jnp.float32), dt.astype(jnp.float32), A.astype(jnp.float32)
    Bf, Cf, init = B.astype(jnp.float32), C.astype(jnp.float32), init.astype(jnp.float32)
    t, d = xf.shape
    if uniform:
        r = t // uniform
        xs, dts, Bs, Cs = (a.reshape(r, uniform, *a.shape[1:]) for a in (xf, dtf, Bf, Cf))
        state, ys = init[:r], []
        states = jnp.zeros((init.shape[0], checkpoints) + init.shape[1:], jnp.float32)
        for j in range(uniform):
            state = jnp.exp(dts[:, j, :, None] * Af) * state + (dts[:, j] * xs[:, j])[..., None] * Bs[:, j, None, :]
            ys.append(jnp.einsum("rdn,rn->rd", state, Cs[:, j]))
            if uniform - 1 - j < checkpoints:
                states = states.at[:r, uniform - 1 - j].set(state)
        y = jnp.stack(ys, 1).reshape(t, d)
    else:
        a = jnp.exp(dtf[..., None] * Af)
        b = (dtf * xf)[..., None] * Bf[:, None, :]
        b = jnp.where((meta.token_index == 0)[:, None, None], a * init[meta.token_req] + b, b)
        tokens = jnp.arange(t)
        span = 1
        while span < t:
            back = jnp.clip(tokens - span, 0, None)
            same = ((tokens >= span) & (meta.token_req[back] == meta.token_req))[:, None, None]
            b = jnp.where(same, a * b[back] + b, b)
            a = jnp.where(same, a * a[back], a)
            span *= 2
        y = jnp.einsum("tdn,tn->td", b, Cf)
        last = meta.query_lens[:, None] - 1 - jnp.arange(checkpoints)[None, :]
        rows, valid = _rows(meta, last, t)
        states = jnp.where(valid[..., None, None], b[rows], 0.0)
    if D is not None:
        y = y + D.astype(jnp.float32) * xf
    return y, states


def rg_lru_scan(a: jax.Array, b: jax.Array, init: jax.Array, meta: StateMeta, *, checkpoints: int,
                uniform: int) -> tuple[jax.Array, jax.Array]:
    """RecurrentGemma's RG-LRU recurrence (see the torch ``rg_lru_scan``): ``h_t = a_t h_{t-1} +
    b_t`` per request, ``a`` / ``b [T, D]``, ``init [R + 1, D]`` -> (h ``[T, D]`` float32, states
    ``[R + 1, C, D]``): a segmented scan by doubling, or one update per token for uniform steps."""
    af, bf, init = a.astype(jnp.float32), b.astype(jnp.float32), init.astype(jnp.float32)
    t, d = af.shape
    if uniform:
        r = t // uniform
        a_s, b_s = af.reshape(r, uniform, d), bf.reshape(r, uniform, d)
        state, ys = init[:r], []
        states = jnp.zeros((init.shape[0], checkpoints, d), jnp.float32)
        for j in range(uniform):
            state = a_s[:, j] * state + b_s[:, j]
            ys.append(state)
            if uniform - 1 - j < checkpoints:
                states = states.at[:r, uniform - 1 - j].set(state)
        return jnp.stack(ys, 1).reshape(t, d), states
    bf = jnp.where((meta.token_index == 0)[:, None], af * init[meta.token_req] + bf, bf)
    tokens = jnp.arange(t)
    span = 1
    while span < t:
        back = jnp.clip(tokens - span, 0, None)
        same = ((tokens >= span) & (meta.token_req[back] == meta.token_req))[:, None]
        bf = jnp.where(same, af * bf[back] + bf, bf)
        af = jnp.where(same, af * af[back], af)
        span *= 2
    last = meta.query_lens[:, None] - 1 - jnp.arange(checkpoints)[None, :]
    rows, valid = _rows(meta, last, t)
    return bf, jnp.where(valid[..., None], bf[rows], 0.0)


def lightning_attention(q: jax.Array, k: jax.Array, v: jax.Array, slope: jax.Array, init: jax.Array,
                        meta: StateMeta, *, chunk_size: int, checkpoints: int,
                        uniform: int) -> tuple[jax.Array, jax.Array]:
    """MiniMax's lightning attention (see the torch ``lightning_attention``): ``S <- exp(-s) S + k
    v^T``, ``y = q S`` per request and head; ``q`` / ``k [T, H, Dk]``, ``v [T, H, Dv]``, ``slope
    [H]``, ``init [R + 1, H, Dk, Dv]`` -> (y ``[T, H, Dv]`` float32, states ``[R + 1, C, H, Dk,
    Dv]``): by chunks, or one update per token for uniform steps."""
    qf, kf, vf = q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
    sf, init = slope.astype(jnp.float32).reshape(-1), init.astype(jnp.float32)
    t, h, dv = vf.shape
    if uniform:
        r = t // uniform
        qs, ks, vs = (a.reshape(r, uniform, *a.shape[1:]) for a in (qf, kf, vf))
        ratio = jnp.exp(-sf)[None, :, None, None]
        state, ys = init[:r], []
        states = jnp.zeros((init.shape[0], checkpoints) + init.shape[1:], jnp.float32)
        for j in range(uniform):
            state = ratio * state + ks[:, j, :, :, None] * vs[:, j, :, None, :]
            ys.append(jnp.einsum("rhkv,rhk->rhv", state, qs[:, j]))
            if uniform - 1 - j < checkpoints:
                states = states.at[:r, uniform - 1 - j].set(state)
        return jnp.stack(ys, 1).reshape(t, h, dv), states
    return _lightning_chunked(qf, kf, vf, sf, init, meta, max(1, min(chunk_size, t)), checkpoints)


def _lightning_chunked(q, k, v, slope, init, meta, size, checkpoints):
    t, h, dv = v.shape
    lane = jnp.arange(size)
    lower = lane[:, None] >= lane[None, :]

    def step(rows, valid, lane, at, state):
        m = valid[..., None, None]
        qh, kh, vh = (jnp.swapaxes(jnp.where(m, a[rows], 0.0), 1, 2) for a in (q, k, v))   # [R + 1, H, L, D]
        cum = jnp.cumsum(jnp.where(valid[:, None, :], -slope[None, :, None], 0.0), axis=-1)   # [R + 1, H, L]
        decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
        yk = (qh * jnp.exp(cum)[..., None]) @ state + ((qh @ jnp.swapaxes(kh, -1, -2)) * decay) @ vh
        at_state, end = _decayed_states(cum, kh, vh, state, at, lane)
        return jnp.swapaxes(yk, 1, 2), at_state, end

    return _chunked_scan(init, meta, t, size, checkpoints, (h, dv), step)


__all__ = ["StateMeta", "causal_conv1d", "gated_delta_rule", "lightning_attention", "naming_states", "read_states",
           "rg_lru_scan", "selective_scan", "ssd_scan", "state_meta", "write_states"]
