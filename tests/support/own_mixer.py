"""An engine's own recurrent layer, as issue 47's trial wrote one: an RWKV-6 / GLA-style mixer
(token shift, a width-4 causal convolution, a data-dependent-decay linear recurrence; three
state tensors per request) over graphrt's state helpers, in a tiny hybrid model with one
attention layer -- and the state bugs an author makes in such a layer, planted one at a time.

``own_hybrid(bug=None)`` builds the model (seeded random weights); ``bug`` is one of
:data:`BUGS`. Built from graphrt's public pieces only: ``read_states`` / ``write_states`` and
:class:`StateMetadata` (``layers/torch/state/metadata.py``), ``get_state_context``,
``PagedAttention``, :class:`graphrt.StateSpec`.
"""

from __future__ import annotations

import dataclasses
import types
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from graphrt import KVCacheSpec, StateGroup, StateSpec, StateTensor
from graphrt.core.graph_modes import AttentionGraphSupport
from graphrt.layers.torch.attention.paged import PagedAttention
from graphrt.layers.torch.forward_context import get_state_context
from graphrt.layers.torch.state.metadata import StateMetadata, read_states, write_states

VOCAB, HIDDEN, HEADS, WIDTH = 48, 16, 2, 4
HEAD_DIM = HIDDEN // HEADS

#: The planted bugs, each a one-line slip in :class:`OwnMixer` (docs/testing.md's table).
BUGS: dict[str, str] = {
    "slot0": "every request's states written to slot 0 (a single-sequence habit)",
    "padded_rows": "padded requests (state slot -1) write their state rows into slot 0",
    "no_trash": "writes meant for the trash slot clamped into the last live slot",
    "conv_unshifted": "a short step's conv window keeps the old columns unshifted",
    "no_reset": "a new request reads its slot's stale state instead of zeros",
    "carried": "a Python number kept from the previous forward scales the token shift",
    "ring_oldest": "the checkpoint ring written oldest first (entry 0 the oldest of the last C positions)",
}


class OwnMixer(nn.Module):
    """Token shift, a width-4 depthwise causal conv over r|k|v, ``S = diag(w) S + k v^T`` per
    head with a data-dependent decay ``w``, ``y = r S``: ``hidden [T, D] -> [T, D]``."""

    graphrt_attention: ClassVar[bool] = True          # a PIECEWISE split point: its metadata has the requests
    graph_support: ClassVar[AttentionGraphSupport] = AttentionGraphSupport.ALWAYS

    def __init__(self, bug: str | None = None) -> None:
        super().__init__()
        d = HIDDEN
        self.bug = bug
        self.mu = nn.Parameter(torch.rand(d))
        self.in_proj = nn.Linear(d, 3 * d, bias=False)
        self.conv = nn.Parameter(torch.randn(3 * d, WIDTH) / WIDTH)
        self.decay = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d, bias=False)
        self.state_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # shift, conv, wkv
        self._carried = 0                                                                  # the "carried" bug's

    def _read(self, cache: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        if self.bug == "no_reset":                   # every request reads its slot, new ones included
            return cache[meta.read_slot, meta.read_checkpoint].float()
        return read_states(cache, meta, torch.float32)

    def _write(self, cache: torch.Tensor, meta: StateMetadata, states: torch.Tensor) -> None:
        slot = meta.write_slot
        if self.bug == "slot0":
            slot = torch.where(slot < meta.num_slots, 0, slot)
        elif self.bug == "padded_rows":
            slot = torch.where((meta.read_slot == meta.num_slots).unsqueeze(1), 0, slot)
        elif self.bug == "no_trash":
            slot = slot.clamp(max=meta.num_slots - 1)
        if self.bug == "ring_oldest":
            states = states.flip(1)
        write_states(cache, dataclasses.replace(meta, write_slot=slot), states)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.state_cache is None:
            raise RuntimeError("OwnMixer.state_cache is not set: the runner assigns it from state_spec()")
        meta = get_state_context()
        shift_cache, conv_cache, wkv_cache = self.state_cache
        t, d, c = x.shape[0], HIDDEN, meta.checkpoints
        tokens = torch.arange(t, device=x.device)
        j, req = meta.token_index, meta.token_req
        xf = x.float()
        last = meta.query_lens.unsqueeze(1) - 1 - torch.arange(c, device=x.device)     # [R + 1, C]
        last_rows = (meta.starts.unsqueeze(1) + last).clamp(0, max(t - 1, 0))

        # token shift: the previous token's input, the state before a request's first token
        shift0 = self._read(shift_cache, meta)
        prev = torch.where((j > 0).unsqueeze(1), xf[(tokens - 1).clamp(min=0)], shift0[req])
        mix = self.mu
        if self.bug == "carried":
            mix = mix * (1.0 + 0.05 * self._carried)
            self._carried = t
        xx = xf + mix * (prev - xf)
        shift_states = xf[last_rows]                                                    # [R + 1, C, D]

        # width-4 causal conv over r|k|v, the window (last WIDTH - 1 inputs) in the state
        u = self.in_proj(xx)
        conv0 = self._read(conv_cache, meta)                                            # [R + 1, 3D, W - 1]
        acc = torch.zeros_like(u)
        for tap in range(WIDTH):
            back = tap - (WIDTH - 1)
            src = j + back
            col = (src + WIDTH - 1).clamp(0, WIDTH - 2)
            value = torch.where((src >= 0).unsqueeze(1), u[(tokens + back).clamp(min=0)], conv0[req, :, col])
            acc = acc + value * self.conv[:, tap]
        r, k, v = F.silu(acc).split(d, dim=-1)
        back = torch.arange(-(WIDTH - 2), 1, device=x.device)                           # [W - 1]: oldest first
        src = last.unsqueeze(-1) + back                                                 # [R + 1, C, W - 1]
        rows = (meta.starts.view(-1, 1, 1) + src).clamp(0, max(t - 1, 0))
        col = torch.arange(WIDTH - 1, device=x.device).expand_as(src) if self.bug == "conv_unshifted" \
            else (src + WIDTH - 1).clamp(0, WIDTH - 2)
        old = conv0[torch.arange(conv0.shape[0], device=x.device).view(-1, 1, 1), :, col]   # [R + 1, C, W - 1, 3D]
        conv_states = torch.where((src >= 0).unsqueeze(-1), u[rows], old).transpose(2, 3)

        # the linear recurrence, one in-request position at a time for every request at once
        w = torch.exp(-torch.exp(self.decay(xx)))                                       # (0, 1)
        heads = (t, HEADS, HEAD_DIM)
        r, k, v, w = (a.reshape(heads) for a in (r, k, v, w))
        state = self._read(wkv_cache, meta)                                             # [R + 1, H, K, V]
        states = state.new_zeros(state.shape[0], c, *state.shape[1:])
        y = xf.new_zeros(t + 1, HEADS, HEAD_DIM)
        for i in range(meta.uniform_query_len or t):
            valid = i < meta.query_lens
            at = (meta.starts + i).clamp(0, max(t - 1, 0))
            new = w[at].unsqueeze(-1) * state + k[at].unsqueeze(-1) * v[at].unsqueeze(-2)
            state = torch.where(valid.view(-1, 1, 1, 1), new, state)
            y.index_copy_(0, torch.where(valid, at, t), torch.einsum("rhk,rhkv->rhv", r[at], state))
            states = torch.where((last == i).view(*last.shape, 1, 1, 1), state.unsqueeze(1), states)
        self._write(shift_cache, meta, shift_states)
        self._write(conv_cache, meta, conv_states)
        self._write(wkv_cache, meta, states)
        return self.out_proj(y[:t].reshape(t, d).to(x.dtype))


class Attention(nn.Module):
    """Plain multi-head attention over graphrt's paged KV cache (no positions: the mixer orders)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.attn = PagedAttention(HEADS, HEADS, HEAD_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(HIDDEN, dim=-1)
        return self.out(self.attn(q, k, v))


class Block(nn.Module):
    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN)
        self.mixer = mixer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))


class OwnHybrid(nn.Module):
    """embed -> own mixer -> attention -> own mixer -> norm -> lm_head (docs/models.md's protocol
    plus ``state_layers`` / ``state_spec``, docs/hybrid.md)."""

    def __init__(self, bug: str | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Block(OwnMixer(bug)), Block(Attention()), Block(OwnMixer(bug))])
        self.norm = nn.RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.config = types.SimpleNamespace(vocab_size=VOCAB, hidden_size=HIDDEN)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[PagedAttention]:
        return [b.mixer.attn for b in self.layers if isinstance(b.mixer, Attention)]

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec.uniform(len(self.attention_layers()), HEADS, HEAD_DIM)

    def state_layers(self) -> list[OwnMixer]:
        return [b.mixer for b in self.layers if isinstance(b.mixer, OwnMixer)]

    def state_spec(self) -> StateSpec:
        return StateSpec((StateGroup(tuple(range(len(self.state_layers()))), (
            StateTensor("shift", (HIDDEN,)), StateTensor("conv", (3 * HIDDEN, WIDTH - 1)),
            StateTensor("wkv", (HEADS, HEAD_DIM, HEAD_DIM))), kind="own-rwkv"),))


def own_hybrid(bug: str | None = None, seed: int = 0) -> OwnHybrid:
    """A fresh :class:`OwnHybrid` with seeded weights (the kit builds one per runner)."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; known: {list(BUGS)}")
    torch.manual_seed(seed)
    return OwnHybrid(bug).eval()


def carried_model() -> OwnHybrid:
    """``--model support.own_mixer:carried_model``: the mixer with a value carried between forwards."""
    return own_hybrid("carried")


def clean_model() -> OwnHybrid:
    """``--model support.own_mixer:clean_model``."""
    return own_hybrid()


__all__ = ["BUGS", "OwnHybrid", "OwnMixer", "carried_model", "clean_model", "own_hybrid"]
