"""A toy set of recurrent kernels added the way docs/hybrid.md says: this one file and one
registration (``register_recurrent_kernels("toy", make_toy_kernels)``); nothing else in graphrt
changes. Its causal convolution is its own algorithm (each token's whole window gathered at once,
one einsum over the taps); the scans are graphrt's reference ones."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphrt.layers.torch.state.gated_delta import gated_delta_rule
from graphrt.layers.torch.state.kernels import RecurrentKernels
from graphrt.layers.torch.state.mamba_kernels import conv_windows, ssd_scan
from graphrt.layers.torch.state.metadata import StateMetadata

CALLS = {"conv": 0}


def toy_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, init: torch.Tensor,
                      meta: StateMetadata, activation: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference ``causal_conv1d``'s contract: ``x [T, D]``, ``weight [D, K]``, ``init [R + 1,
    D, K - 1]`` -> (``silu(conv(x)) [T, D]``, the windows after each request's last C positions)."""
    CALLS["conv"] += 1
    t, k = x.shape[0], weight.shape[1]
    taps = torch.arange(k, device=x.device) - (k - 1)                       # [K], the last tap is the token
    src = meta.token_index.unsqueeze(1) + taps                              # [T, K]: index within the request
    rows = (torch.arange(t, device=x.device).unsqueeze(1) + taps).clamp(min=0)
    col = (src + (k - 1)).clamp(0, max(k - 2, 0))
    before = init.float().transpose(1, 2)[meta.token_req.unsqueeze(1), col]  # [T, K, D]: the request's window
    window = torch.where((src >= 0).unsqueeze(-1), x.float()[rows], before)
    acc = torch.einsum("tkd,dk->td", window, weight.float())
    if bias is not None:
        acc = acc + bias.float()
    out = F.silu(acc) if activation else acc
    return out.to(x.dtype), conv_windows(x.float(), init, meta, k)


def make_toy_kernels(device: torch.device) -> RecurrentKernels:
    """The toy set's maker: it runs wherever torch does."""
    return RecurrentKernels("toy", toy_causal_conv1d, ssd_scan, gated_delta_rule)
