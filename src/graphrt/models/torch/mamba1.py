"""A Mamba1 mixer over graphrt's recurrent-state cache (Mamba, Falcon-Mamba, Jamba layers).

:class:`Mamba1Mixer` has transformers' parameter names (``in_proj``, ``conv1d``, ``x_proj``,
``dt_proj``, ``A_log``, ``D``, ``out_proj``; Jamba's ``dt_layernorm`` / ``b_layernorm`` /
``c_layernorm``), so transformers' parameters are shared as they are. Per request it keeps the
convolution window ``[intermediate, K - 1]`` and the SSM state ``[intermediate, d_state]`` in
``state_cache`` (assigned by the executor from the model's ``state_spec()``); the step's metadata
comes from :func:`graphrt.layers.torch.forward_context.get_state_context`.

:func:`mamba1_mixer_step` is the kernel entry point for any wrapper that has a layer's
projections: the causal convolution and the selective scan of the step's requests, their states
read from and written to the layer's two state tensors. Device lengths only (FULL graphs of any
step); the module is a PIECEWISE split point (``graphrt_attention``), as Mamba2's is.
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

#: How a Mamba1 variant normalises dt, B and C before the scan: not at all (Mamba), an RMS
#: norm without weight (Falcon-Mamba), an RMS norm with a weight each (Jamba).
NORMS = ("none", "unweighted", "weighted")


class ScanNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps)`` in float32, times ``weight`` where it has one, in x's dtype
    (transformers' ``JambaRMSNorm`` / ``FalconMambaWeightlessRMSNorm``)."""

    def __init__(self, size: int, eps: float, weighted: bool, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype)) if weighted else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return out if self.weight is None else self.weight * out


def mamba1_mixer_step(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, A_log: torch.Tensor,
                      D: torch.Tensor, dt_bias: torch.Tensor | None, ssm_state: torch.Tensor,
                      meta: StateMetadata) -> torch.Tensor:
    """One Mamba1 layer's selective scan over a step of many requests: ``x [T, I]`` (after the
    convolution), ``dt [T, I]`` (``dt_proj``'s output before its bias), ``B`` / ``C [T, N]``;
    reads each request's state from, and writes the states after its last positions to,
    ``ssm_state [slots + 1, C, I, N]``. Returns ``y + D x`` ``[T, I]`` float32 (before the gate)."""
    kernels = meta.kernels or REFERENCE_KERNELS          # chosen once by the state backend (kernels.py)
    dt = dt.float() if dt_bias is None else dt.float() + dt_bias.float()
    y, states = kernels.selective_scan(x, F.softplus(dt), -torch.exp(A_log.float()), B, C, D,
                                       read_states(ssm_state, meta, torch.float32), meta)
    write_states(ssm_state, meta, states)
    return y


def causal_conv_step(x: torch.Tensor, conv: nn.Conv1d, conv_state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
    """The depthwise causal convolution (SiLU) of ``x [T, I]`` over each request's window in
    ``conv_state [slots + 1, C, I, K - 1]``, the windows after its last positions written back."""
    kernels = meta.kernels or REFERENCE_KERNELS
    out, window = kernels.causal_conv1d(x, conv.weight.squeeze(1), conv.bias,
                                        read_states(conv_state, meta, torch.float32), meta)
    write_states(conv_state, meta, window)
    return out


class Mamba1Mixer(nn.Module):
    """transformers' ``MambaMixer`` / ``FalconMambaMixer`` / ``JambaMambaMixer`` over graphrt's
    state cache: ``hidden [T, hidden]`` -> ``[T, hidden]``. ``config``: ``hidden_size``,
    ``intermediate``, ``d_state``, ``dt_rank``, ``conv_kernel``, ``use_bias``, ``conv_bias``,
    ``norm`` (one of :data:`NORMS`), ``norm_eps``."""

    graphrt_attention: ClassVar[bool] = True          # a PIECEWISE split point (see the module docstring)
    graph_support: ClassVar[AttentionGraphSupport] = AttentionGraphSupport.ALWAYS

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        c = config
        i, n, rank = c.intermediate, c.d_state, c.dt_rank
        self.intermediate, self.d_state, self.dt_rank = i, n, rank
        self.in_proj = nn.Linear(c.hidden_size, 2 * i, bias=c.use_bias, dtype=dtype)
        self.conv1d = nn.Conv1d(i, i, c.conv_kernel, groups=i, padding=c.conv_kernel - 1, bias=c.conv_bias,
                                dtype=dtype)
        self.x_proj = nn.Linear(i, rank + 2 * n, bias=False, dtype=dtype)
        self.dt_proj = nn.Linear(rank, i, bias=True, dtype=dtype)
        self.A_log = nn.Parameter(torch.zeros(i, n, dtype=dtype))
        self.D = nn.Parameter(torch.ones(i, dtype=dtype))
        self.out_proj = nn.Linear(i, c.hidden_size, bias=c.use_bias, dtype=dtype)
        self.norm = c.norm
        if c.norm != "none":
            weighted = c.norm == "weighted"
            self.dt_layernorm = ScanNorm(rank, c.norm_eps, weighted, dtype)
            self.b_layernorm = ScanNorm(n, c.norm_eps, weighted, dtype)
            self.c_layernorm = ScanNorm(n, c.norm_eps, weighted, dtype)
        #: (conv, ssm), assigned by the executor from the model's state_spec().
        self.state_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """What it keeps per request (the runner checks ``state_spec()`` against it): the
        convolution window ``[intermediate, K - 1]`` and the SSM state ``[intermediate, d_state]``."""
        return (self.intermediate, self.conv1d.kernel_size[0] - 1), (self.intermediate, self.d_state)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.state_cache is None:
            raise RuntimeError("Mamba1Mixer.state_cache is not set: the runner assigns it from state_spec()")
        conv_state, ssm_state = self.state_cache
        meta = get_state_context()
        x, gate = self.in_proj(hidden).chunk(2, dim=-1)
        x = causal_conv_step(x, self.conv1d, conv_state, meta)
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.norm != "none":
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        y = mamba1_mixer_step(x, F.linear(dt, self.dt_proj.weight), B, C, self.A_log, self.D, self.dt_proj.bias,
                              ssm_state, meta)
        return self.out_proj((y * F.silu(gate.float())).to(hidden.dtype))


__all__ = ["Mamba1Mixer", "NORMS", "ScanNorm", "causal_conv_step", "mamba1_mixer_step"]
