"""RecurrentGemma's recurrent block (Griffin's RG-LRU) over graphrt's recurrent-state cache.

Per token: ``y = act(linear_y(h))``; ``x = conv_1d(linear_x(h))`` (a depthwise causal
convolution with bias and no activation); the RG-LRU gates ``i = sigmoid(x W_i + b_i)``, ``r =
sigmoid(x W_a + b_a)`` (block-diagonal, one ``[w, w]`` block per head), ``log a = -8 r
softplus(recurrent_param)``, the input ``b = x i sqrt(1 - a^2)``; the recurrence ``h <- a h +
b`` per channel; the output ``linear_out(h * y)``. At a request's position 0 the state is reset
(``a = 0``) and the input not normalised (``b = x i``), as transformers does for
``position_ids == 0``; graphrt tells position 0 from the step's metadata (the request's first
token of a step without a stored state: a new or recomputed request).

Per request it keeps the convolution window ``[lru_width, K - 1]`` and the recurrent state
``[lru_width]`` in ``state_cache`` (assigned by the executor from the model's ``state_spec()``);
the convolution and the scan are the recurrent kernels' ``causal_conv1d`` and ``rg_lru_scan``
(chosen once by the state backend), so it runs inside FULL graphs of any step and is a PIECEWISE
split point. Parameter names are transformers' (``linear_y``, ``linear_x``, ``linear_out``,
``conv_1d``, ``rg_lru.recurrent_param`` / ``input_gate_*`` / ``recurrent_gate_*``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from graphrt.core.errors import ConfigError
from graphrt.core.graph_modes import AttentionGraphSupport
from graphrt.layers.torch.forward_context import get_state_context
from graphrt.layers.torch.state.kernels import REFERENCE_KERNELS
from graphrt.layers.torch.state.metadata import StateMetadata, read_states, write_states

#: The branch activations graphrt applies (transformers' ``hidden_activation`` names).
ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu,
               "relu": F.relu}


class RGLRUGates(nn.Module):
    """The RG-LRU's parameters (transformers' ``RecurrentGemmaRglru`` names): ``[heads, w, w]``
    gate blocks, their biases and the per-channel ``recurrent_param``."""

    def __init__(self, width: int, heads: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        w = width // heads
        self.heads = heads
        self.recurrent_param = nn.Parameter(torch.zeros(width, dtype=dtype))
        self.input_gate_weight = nn.Parameter(torch.zeros(heads, w, w, dtype=dtype))
        self.input_gate_bias = nn.Parameter(torch.zeros(heads, w, dtype=dtype))
        self.recurrent_gate_weight = nn.Parameter(torch.zeros(heads, w, w, dtype=dtype))
        self.recurrent_gate_bias = nn.Parameter(torch.zeros(heads, w, dtype=dtype))

    def coefficients(self, x: torch.Tensor, meta: StateMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``a``, ``b [T, width]`` (float32) of the recurrence ``h <- a h + b`` for the
        convolved ``x [T, width]``, reset at each request's position 0."""
        t, width = x.shape
        blocks = x.view(t, self.heads, -1)
        gate_i = torch.sigmoid(torch.einsum("thi,hij->thj", blocks, self.input_gate_weight) + self.input_gate_bias)
        gate_a = torch.sigmoid(torch.einsum("thi,hij->thj", blocks, self.recurrent_gate_weight)
                               + self.recurrent_gate_bias)
        log_a = -8.0 * gate_a.reshape(t, width).float() * F.softplus(self.recurrent_param.float())
        reset = ((meta.token_index == 0) & ~meta.has_initial.index_select(0, meta.token_req)).view(-1, 1)
        a = torch.where(reset, torch.zeros((), device=x.device), torch.exp(log_a))
        scale = torch.where(reset, torch.ones((), device=x.device), torch.sqrt(1 - torch.exp(2 * log_a)))
        b = (x * gate_i.reshape(t, width)) * scale.to(x.dtype)
        return a, b


class RGLRUMixer(nn.Module):
    """transformers' ``RecurrentGemmaRecurrentBlock`` over graphrt's state cache: ``hidden [T,
    hidden]`` -> ``[T, hidden]``. ``config``: ``hidden_size``, ``lru_width``, ``heads`` (the
    gate blocks), ``conv_kernel``, ``activation`` (a key of :data:`ACTIVATIONS`)."""

    graphrt_attention: ClassVar[bool] = True          # a PIECEWISE split point (the step's requests)
    graph_support: ClassVar[AttentionGraphSupport] = AttentionGraphSupport.ALWAYS

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        h, w, k = config.hidden_size, config.lru_width, config.conv_kernel
        if config.activation not in ACTIVATIONS:
            raise ConfigError(f"RG-LRU block: hidden_activation {config.activation!r} is not one of "
                              f"{sorted(ACTIVATIONS)}")
        if w % config.heads:
            raise ConfigError(f"RG-LRU block: lru_width {w} is not a multiple of its {config.heads} gate blocks "
                              "(num_attention_heads)")
        self.lru_width = w
        self.activation = config.activation
        self.linear_y = nn.Linear(h, w, dtype=dtype)
        self.linear_x = nn.Linear(h, w, dtype=dtype)
        self.linear_out = nn.Linear(w, h, dtype=dtype)
        self.conv_1d = nn.Conv1d(w, w, k, groups=w, padding=k - 1, dtype=dtype)
        self.rg_lru = RGLRUGates(w, config.heads, dtype)
        #: (conv, lru), assigned by the executor from the model's state_spec().
        self.state_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """What it keeps per request: the convolution window ``[lru_width, K - 1]`` and the
        recurrent state ``[lru_width]``."""
        return (self.lru_width, self.conv_1d.kernel_size[0] - 1), (self.lru_width,)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.state_cache is None:
            raise RuntimeError("RGLRUMixer.state_cache is not set: the runner assigns it from state_spec()")
        conv_state, lru_state = self.state_cache
        meta = get_state_context()
        kernels = meta.kernels or REFERENCE_KERNELS          # chosen once by the state backend (kernels.py)
        y = ACTIVATIONS[self.activation](self.linear_y(hidden))
        x, window = kernels.causal_conv1d(self.linear_x(hidden), self.conv_1d.weight.squeeze(1), self.conv_1d.bias,
                                          read_states(conv_state, meta, torch.float32), meta, activation=False)
        write_states(conv_state, meta, window)
        a, b = self.rg_lru.coefficients(x.to(hidden.dtype), meta)
        h, states = kernels.rg_lru_scan(a, b, read_states(lru_state, meta, torch.float32), meta)
        write_states(lru_state, meta, states)
        return self.linear_out(h.to(hidden.dtype) * y)


__all__ = ["ACTIVATIONS", "RGLRUGates", "RGLRUMixer"]
