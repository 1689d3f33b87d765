"""A Mamba2 mixer over graphrt's recurrent-state cache (Mamba2, Granite-4-H, Bamba layers).

:class:`Mamba2Mixer` has transformers' parameter names (``in_proj``, ``conv1d``, ``dt_bias``,
``A_log``, ``D``, ``norm``, ``out_proj``), so checkpoints load as they are. Its state lives in
``state_cache`` -- ``(conv [slots + 1, C, conv_dim, K - 1], ssm [slots + 1, C, heads, head_dim,
d_state])``, assigned by the executor from the model's ``state_spec()`` -- and its per-step
metadata comes from :func:`graphrt.layers.torch.forward_context.get_state_context`.

The kernel entry point, for any wrapper (a Transformers modeling backend's layer, an engine's
own module) that has a layer's projections and parameters: :func:`mamba2_mixer_step`, given
the step's :class:`~graphrt.layers.torch.state.metadata.StateMetadata` and the layer's two state
tensors. It reads lengths from device tensors only, so it runs inside FULL graphs of any step
(uniform decode and mixed); the module is a PIECEWISE split point (``graphrt_attention``): its
state metadata has the step's requests, which pieces keyed by tokens alone cannot hold.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from graphrt.core.graph_modes import AttentionGraphSupport
from graphrt.layers.torch.forward_context import get_state_context
from graphrt.layers.torch.state.kernels import REFERENCE_KERNELS
from graphrt.layers.torch.state.metadata import StateMetadata, read_states, write_states


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x * silu(gate))`` over ``groups`` equal slices of the features, in
    float32 (transformers' ``MambaRMSNormGated`` with ``norm_before_gate=False``); with
    ``gate_after``, ``weight * rmsnorm(x) * silu(gate)`` (Falcon-H1's ``norm_before_gate=True``)."""

    def __init__(self, size: int, groups: int, eps: float, dtype: torch.dtype = torch.float32,
                 gate_after: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.groups, self.eps, self.gate_after = groups, eps, gate_after

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() if self.gate_after else x.float() * F.silu(gate.float())
        grouped = h.view(*h.shape[:-1], self.groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gate_after:
            return (self.weight.float() * grouped.view_as(h) * F.silu(gate.float())).to(dtype)
        return self.weight * grouped.view_as(h).to(dtype)


def mamba2_mixer_step(xbc: torch.Tensor, dt: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                      dt_bias: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor, conv_state: torch.Tensor,
                      ssm_state: torch.Tensor, meta: StateMetadata, *, heads: int, head_dim: int, groups: int,
                      d_state: int, chunk_size: int,
                      dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """One Mamba2 layer's convolution and scan over a step of many requests; reads each request's
    state from, and writes the states after its last positions to, ``conv_state`` /
    ``ssm_state`` (``[slots + 1, C, ...]``: :mod:`graphrt.core.state_spec`).

    ``xbc [T, conv_dim]`` and ``dt [T, heads]`` are the input projection's x|B|C and dt parts;
    returns the scan's output ``[T, heads * head_dim]`` (float32) for the gated norm."""
    t = xbc.shape[0]
    kernels = meta.kernels or REFERENCE_KERNELS          # chosen once by the state backend (kernels.py)
    conv, scan = kernels.causal_conv1d, kernels.ssd_scan
    conv_init = read_states(conv_state, meta, torch.float32)
    xbc, window = conv(xbc, conv_weight, conv_bias, conv_init, meta)
    intermediate = heads * head_dim
    x, B, C = torch.split(xbc, [intermediate, groups * d_state, groups * d_state], dim=-1)
    dt = F.softplus(dt.float() + dt_bias.float()).clamp(dt_limit[0], dt_limit[1])
    y, states = scan(x.reshape(t, heads, head_dim), dt, -torch.exp(A_log.float()),
                         B.reshape(t, groups, d_state), C.reshape(t, groups, d_state), D,
                         read_states(ssm_state, meta, torch.float32), meta, chunk_size)
    write_states(conv_state, meta, window)
    write_states(ssm_state, meta, states)
    return y.reshape(t, intermediate)


#: How a Mamba2 variant gates the scan's output ``y`` with ``z``: ``rmsnorm(y * silu(z))`` (Mamba2,
#: Granite-4-H, Bamba, Nemotron-H, Zamba2), ``rmsnorm(y) * silu(z)`` or ``y * silu(z)`` without a
#: norm (Falcon-H1's ``mamba_norm_before_gate`` / ``mamba_rms_norm=False``).
GATES = ("norm_gated", "gate_after_norm", "gate")


class Mamba2Mixer(nn.Module):
    """transformers' ``Mamba2Mixer`` / ``GraniteMoeHybridMambaLayer`` (and their relatives) over
    graphrt's state cache: ``hidden [T, hidden]`` -> ``[T, hidden]``. Optional config fields:
    ``mamba_gate`` (one of :data:`GATES`, default the first), ``mamba_in_scale`` (a factor on
    the input, default 1) and ``mamba_proj_scaled`` (a ``proj_scale [projection]`` buffer
    multiplying the input projection, Falcon-H1's µP vector; assigned by whoever builds it)."""

    graphrt_attention: ClassVar[bool] = True          # a PIECEWISE split point (see the module docstring)
    graph_support: ClassVar[AttentionGraphSupport] = AttentionGraphSupport.ALWAYS

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        c = config
        self.heads, self.head_dim, self.groups, self.d_state = c.mamba_heads, c.mamba_head_dim, c.mamba_groups, c.mamba_state
        self.intermediate, self.conv_dim = c.mamba_intermediate, c.conv_dim
        self.chunk_size, self.dt_limit = c.chunk_size, tuple(c.time_step_limit)
        self.in_proj = nn.Linear(c.hidden_size, self.intermediate + self.conv_dim + self.heads, bias=c.mamba_bias,
                                 dtype=dtype)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, c.conv_kernel, groups=self.conv_dim,
                                padding=c.conv_kernel - 1, bias=c.conv_bias, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.ones(self.heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(self.heads, dtype=dtype))
        self.D = nn.Parameter(torch.ones(self.heads, dtype=dtype))
        self.gate, self.in_scale = getattr(c, "mamba_gate", GATES[0]), float(getattr(c, "mamba_in_scale", 1.0))
        if self.gate not in GATES:
            raise ValueError(f"gate {self.gate!r} is none of {GATES}")
        self.norm = (GatedRMSNorm(self.intermediate, self.groups, c.mamba_norm_eps, dtype,
                                  gate_after=self.gate == "gate_after_norm") if self.gate != "gate" else None)
        self.register_buffer("proj_scale", torch.ones(self.intermediate + self.conv_dim + self.heads, dtype=dtype)
                             if getattr(c, "mamba_proj_scaled", False) else None, persistent=False)
        self.out_proj = nn.Linear(self.intermediate, c.hidden_size, bias=c.mamba_bias, dtype=dtype)
        #: (conv, ssm), assigned by the executor from the model's state_spec().
        self.state_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """What it keeps per request (the runner checks ``state_spec()`` against it): the
        convolution window ``[conv_dim, K - 1]`` and the SSM state ``[heads, head_dim, d_state]``."""
        return (self.conv_dim, self.conv1d.kernel_size[0] - 1), (self.heads, self.head_dim, self.d_state)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.state_cache is None:
            raise RuntimeError("Mamba2Mixer.state_cache is not set: the runner assigns it from state_spec()")
        projected = self.in_proj(hidden * self.in_scale if self.in_scale != 1.0 else hidden)
        if self.proj_scale is not None:
            projected = projected * self.proj_scale
        gate, xbc, dt = projected.split([self.intermediate, self.conv_dim, self.heads], dim=-1)
        conv_state, ssm_state = self.state_cache
        y = mamba2_mixer_step(xbc, dt, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.dt_bias, self.A_log,
                              self.D, conv_state, ssm_state, get_state_context(), heads=self.heads,
                              head_dim=self.head_dim, groups=self.groups, d_state=self.d_state,
                              chunk_size=self.chunk_size, dt_limit=self.dt_limit)
        gated = y * F.silu(gate.float()) if self.norm is None else self.norm(y, gate)
        return self.out_proj(gated.to(hidden.dtype))


__all__ = ["GATES", "GatedRMSNorm", "Mamba2Mixer", "mamba2_mixer_step"]
