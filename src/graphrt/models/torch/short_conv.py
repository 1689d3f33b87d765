"""LFM2's short causal convolution over graphrt's recurrent-state cache (LFM2, LFM2-MoE ``conv`` layers).

Per token: ``B, C, x = in_proj(h)``; ``y = out_proj(C * conv(B * x))`` with a depthwise causal
convolution of ``L_cache`` taps and no activation. Per request it keeps the convolution window
``[hidden, K - 1]`` in ``state_cache`` (a one-tensor state, assigned by the executor from the
model's ``state_spec()``); the convolution is the recurrent kernels' ``causal_conv1d`` (chosen
once by the state backend: the reference or Triton), so it runs inside FULL graphs of any step
and, like the other mixers, is a PIECEWISE split point. Parameter names are transformers'
(``in_proj``, ``conv``, ``out_proj``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from graphrt.core.graph_modes import AttentionGraphSupport
from graphrt.layers.torch.forward_context import get_state_context
from graphrt.layers.torch.state.kernels import REFERENCE_KERNELS
from graphrt.layers.torch.state.metadata import read_states, write_states


class ShortConvMixer(nn.Module):
    """transformers' ``Lfm2ShortConv`` / ``Lfm2MoeShortConv`` over graphrt's state cache:
    ``hidden [T, hidden]`` -> ``[T, hidden]``. ``config``: ``hidden_size``, ``conv_kernel``
    (LFM2's ``conv_L_cache``), ``bias``."""

    graphrt_attention: ClassVar[bool] = True          # a PIECEWISE split point (the step's requests)
    graph_support: ClassVar[AttentionGraphSupport] = AttentionGraphSupport.ALWAYS

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        h, k = config.hidden_size, config.conv_kernel
        self.hidden_size = h
        self.in_proj = nn.Linear(h, 3 * h, bias=config.bias, dtype=dtype)
        self.conv = nn.Conv1d(h, h, k, groups=h, padding=k - 1, bias=config.bias, dtype=dtype)
        self.out_proj = nn.Linear(h, h, bias=config.bias, dtype=dtype)
        #: (conv,), assigned by the executor from the model's state_spec().
        self.state_cache: tuple[torch.Tensor] | None = None

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """What it keeps per request: the convolution window ``[hidden, K - 1]``."""
        return ((self.hidden_size, self.conv.kernel_size[0] - 1),)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.state_cache is None:
            raise RuntimeError("ShortConvMixer.state_cache is not set: the runner assigns it from state_spec()")
        (conv_state,) = self.state_cache
        meta = get_state_context()
        kernels = meta.kernels or REFERENCE_KERNELS          # chosen once by the state backend (kernels.py)
        B, C, x = self.in_proj(hidden).chunk(3, dim=-1)
        out, window = kernels.causal_conv1d(B * x, self.conv.weight.squeeze(1), self.conv.bias,
                                            read_states(conv_state, meta, torch.float32), meta, activation=False)
        write_states(conv_state, meta, window)
        return self.out_proj(C * out)


__all__ = ["ShortConvMixer"]
