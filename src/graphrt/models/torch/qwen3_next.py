"""Qwen3-Next in plain torch: gated delta-net and gated attention layers over graphrt's paged KV
cache and recurrent-state cache (docs/hybrid.md). Module and parameter names are transformers'.

The gated delta-net's kernel entry point, for a wrapper with its own modules:
:func:`gated_delta_net_step` (the convolution and the delta rule over a step of many requests,
reading and writing the layer's two state tensors; capturable in FULL graphs of any step).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from graphrt.core.graph_modes import AttentionGraphSupport
from graphrt.layers.torch.forward_context import get_state_context
from graphrt.models.hybrid_config import ATTENTION, HybridConfig
from graphrt.layers.torch.attention.paged import PagedAttention
from graphrt.models.torch.decoder import RotaryEmbedding, apply_rotary
from graphrt.models.torch.hybrid_base import HybridBase
from graphrt.layers.torch.state.kernels import REFERENCE_KERNELS
from graphrt.layers.torch.state.metadata import StateMetadata, read_states, write_states


class ZeroCenteredRMSNorm(nn.Module):
    """``rmsnorm(x) * (1 + weight)`` in float32, cast back (Qwen3-Next's norms)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class HeadGatedNorm(nn.Module):
    """Per head: ``weight * rmsnorm(x)`` then ``* silu(gate)`` (norm before gate)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * h.to(dtype)) * F.silu(gate.float())).to(dtype)


def gated_delta_net_step(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                         conv_state: torch.Tensor, delta_state: torch.Tensor, meta: StateMetadata, *,
                         key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                         chunk_size: int) -> torch.Tensor:
    """One gated delta-net layer's convolution and delta rule over a step: ``qkv [T, 2 Hk Dk +
    Hv Dv]`` (before the convolution), ``g`` / ``beta [T, Hv]``; the layer's ``conv_state`` /
    ``delta_state`` (``[slots + 1, C, ...]``) read and written. Returns ``[T, Hv, Dv]`` float32."""
    t = qkv.shape[0]
    kernels = meta.kernels or REFERENCE_KERNELS          # chosen once by the state backend (kernels.py)
    conv, rule = kernels.causal_conv1d, kernels.gated_delta_rule
    mixed, window = conv(qkv, conv_weight, None, read_states(conv_state, meta, torch.float32), meta)
    kd = key_heads * key_dim
    q, k, v = torch.split(mixed, [kd, kd, value_heads * value_dim], dim=-1)
    y, states = rule(q.reshape(t, key_heads, key_dim), k.reshape(t, key_heads, key_dim),
                                 v.reshape(t, value_heads, value_dim), g, beta,
                                 read_states(delta_state, meta, torch.float32), meta, chunk_size)
    write_states(conv_state, meta, window)
    write_states(delta_state, meta, states)
    return y


class GatedDeltaNet(nn.Module):
    """transformers' ``Qwen3NextGatedDeltaNet`` over graphrt's state cache (a PIECEWISE split point)."""

    graphrt_attention: ClassVar[bool] = True
    graph_support: ClassVar[AttentionGraphSupport] = AttentionGraphSupport.ALWAYS

    def __init__(self, config: HybridConfig, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.hk, self.hv, self.dk, self.dv = c.delta_key_heads, c.delta_value_heads, c.delta_key_dim, c.delta_value_dim
        self.chunk_size = c.chunk_size
        conv_dim = c.delta_conv_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, c.conv_kernel, groups=conv_dim, padding=c.conv_kernel - 1,
                                bias=False, dtype=dtype)
        self.in_proj_qkvz = nn.Linear(c.hidden_size, 2 * self.hk * self.dk + 2 * self.hv * self.dv, bias=False,
                                      dtype=dtype)
        self.in_proj_ba = nn.Linear(c.hidden_size, 2 * self.hv, bias=False, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.ones(self.hv, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(self.hv, dtype=dtype))
        self.norm = HeadGatedNorm(self.dv, c.mamba_norm_eps, dtype)
        self.out_proj = nn.Linear(self.hv * self.dv, c.hidden_size, bias=False, dtype=dtype)
        self.state_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """What it keeps per request (the runner checks ``state_spec()`` against it): the
        convolution window ``[2 Hk Dk + Hv Dv, K - 1]`` and the delta-rule state ``[Hv, Dk, Dv]``."""
        return (self.conv1d.in_channels, self.conv1d.kernel_size[0] - 1), (self.hv, self.dk, self.dv)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.state_cache is None:
            raise RuntimeError("GatedDeltaNet.state_cache is not set: the runner assigns it from state_spec()")
        t = hidden.shape[0]
        per = self.hv // self.hk                          # value heads per key head (grouped per key head)
        qkvz = self.in_proj_qkvz(hidden).view(t, self.hk, 2 * self.dk + 2 * per * self.dv)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, per * self.dv, per * self.dv], dim=-1)
        b, a = torch.split(self.in_proj_ba(hidden).view(t, self.hk, 2 * per), [per, per], dim=-1)
        qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        beta = b.reshape(t, self.hv).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(t, self.hv).float() + self.dt_bias)
        conv_state, delta_state = self.state_cache
        y = gated_delta_net_step(qkv, g, beta, self.conv1d.weight.squeeze(1), conv_state, delta_state,
                                 get_state_context(), key_heads=self.hk, value_heads=self.hv, key_dim=self.dk,
                                 value_dim=self.dv, chunk_size=self.chunk_size)
        out = self.norm(y.to(hidden.dtype).reshape(-1, self.dv), z.reshape(-1, self.dv))
        return self.out_proj(out.reshape(t, -1))


class GatedAttention(nn.Module):
    """Qwen3-Next's attention: q and a sigmoid output gate from one projection (per head), q/k
    norms, partial rotary, paged attention."""

    def __init__(self, config: HybridConfig, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, 2 * self.heads * self.head_dim, bias=c.attention_bias, dtype=dtype)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.attention_bias, dtype=dtype)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=c.attention_bias, dtype=dtype)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, c.rms_norm_eps, dtype)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, c.rms_norm_eps, dtype)
        self.rotary_dim = c.rotary_dim
        self.rotary = RotaryEmbedding(self.rotary_dim, c.rope_theta)
        self.attn = PagedAttention(self.heads, self.kv_heads, self.head_dim)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.cat((apply_rotary(x[..., :self.rotary_dim], cos, sin), x[..., self.rotary_dim:]), dim=-1)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        q, gate = self.q_proj(hidden).view(t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(hidden).view(t, self.kv_heads, self.head_dim))
        cos, sin = self.rotary(positions)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        out = self.attn(q.reshape(t, -1), k.reshape(t, -1), self.v_proj(hidden))
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (transformers' names)."""

    def __init__(self, hidden: int, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(size, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nn.Module):
    """Experts (every one computed for every token, weighted by the dense routing weights:
    softmax over all, top-k, renormalised) plus a sigmoid-gated shared expert."""

    def __init__(self, config: HybridConfig, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.k, self.normalize = c.num_experts_per_tok, c.norm_topk_prob
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False, dtype=dtype)
        self.experts = nn.ModuleList(GatedMLP(c.hidden_size, c.intermediate_size, dtype) for _ in range(c.num_experts))
        self.shared_expert = GatedMLP(c.hidden_size, c.shared_intermediate_size, dtype)
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        top, index = probs.topk(self.k, dim=-1)
        if self.normalize:
            top = top / top.sum(-1, keepdim=True)
        weights = torch.zeros_like(probs).scatter(1, index, top).to(x.dtype)        # [T, E]
        out = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        for e, expert in enumerate(self.experts):
            out = out + weights[:, e:e + 1] * expert(x)
        return out


class Qwen3NextLayer(nn.Module):
    def __init__(self, config: HybridConfig, kind: str, dtype: torch.dtype) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.kind = kind
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps, dtype)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps, dtype)
        if kind == ATTENTION:
            self.self_attn = GatedAttention(config, dtype)
        else:
            self.linear_attn = GatedDeltaNet(config, dtype)
        self.mlp = SparseMoe(config, dtype)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(hidden)
        hidden = hidden + (self.self_attn(x, positions) if self.kind == ATTENTION else self.linear_attn(x))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3NextForCausalLM(HybridBase):
    """Qwen3-Next (``Qwen3NextForCausalLM``): ``model.*`` and ``lm_head``."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {}

    def __init__(self, config: HybridConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.build_model(config, nn.ModuleList(Qwen3NextLayer(config, kind, dtype) for kind in config.layer_kinds),
                         ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, dtype), dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            hidden = layer(hidden, positions)
        return self.model.norm(hidden)


__all__ = ["GatedDeltaNet", "Qwen3NextForCausalLM", "gated_delta_net_step"]
