"""MiniMax's lightning attention layers over graphrt's recurrent-state cache.

Per token: ``q, k, v = act(qkv_proj(h))`` split per head (``[heads, 3 * head_dim]``, q | k | v
in each head's slice); per head the linear attention ``S <- exp(-s) S + k v^T``, ``y = q S`` with
the head's decay rate ``s`` (transformers' ``slope_rate``, fixed per layer); then an RMS norm over
all heads' ``y``, the output gate ``sigmoid(output_gate(h))`` and ``out_proj``. transformers
computes the same recurrence by blocks of ``block_size`` tokens for a prompt and token by token
from its cache; graphrt's kernel does both over packed steps.

Per request it keeps the state ``[heads, head_dim, head_dim]`` in ``state_cache`` (assigned by
the executor from the model's ``state_spec()``); the recurrence is the recurrent kernels'
``lightning_attention`` (chosen once by the state backend: the reference or Triton), so it runs
inside FULL graphs of any step and is a PIECEWISE split point. Parameter names are
transformers' (``qkv_proj``, ``output_gate``, ``out_proj``, ``norm.weight``; ``slope_rate`` a
buffer).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from graphrt.core.graph_modes import AttentionGraphSupport
from graphrt.layers.torch.forward_context import get_state_context
from graphrt.layers.torch.state.kernels import REFERENCE_KERNELS
from graphrt.layers.torch.state.metadata import read_states, write_states
from graphrt.models.torch.decoder import RMSNorm
from graphrt.models.torch.rg_lru import ACTIVATIONS


class LightningAttentionMixer(nn.Module):
    """transformers' ``MiniMaxLightningAttention`` over graphrt's state cache: ``hidden [T,
    hidden]`` -> ``[T, hidden]``. ``config``: ``hidden_size``, ``heads``, ``head_dim``,
    ``activation`` (a key of :data:`~graphrt.models.torch.rg_lru.ACTIVATIONS`), ``norm_eps``,
    ``chunk_size`` (the prefill kernel's chunk; transformers' ``block_size``)."""

    graphrt_attention: ClassVar[bool] = True          # a PIECEWISE split point (the step's requests)
    graph_support: ClassVar[AttentionGraphSupport] = AttentionGraphSupport.ALWAYS

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        h, heads, d = config.hidden_size, config.heads, config.head_dim
        self.heads, self.head_dim = heads, d
        self.activation, self.chunk_size = config.activation, int(config.chunk_size)
        self.qkv_proj = nn.Linear(h, 3 * heads * d, bias=False, dtype=dtype)
        self.output_gate = nn.Linear(h, heads * d, bias=False, dtype=dtype)
        self.out_proj = nn.Linear(heads * d, h, bias=False, dtype=dtype)
        self.norm = RMSNorm(heads * d, config.norm_eps, dtype)      # over every head's output at once
        #: Each head's decay rate (transformers' ``slope_rate`` buffer, flattened).
        self.register_buffer("slope_rate", torch.zeros(heads, dtype=torch.float32))
        #: (kv,), assigned by the executor from the model's state_spec().
        self.state_cache: tuple[torch.Tensor] | None = None

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """What it keeps per request: the decayed ``k v^T`` sum ``[heads, head_dim, head_dim]``."""
        return ((self.heads, self.head_dim, self.head_dim),)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.state_cache is None:
            raise RuntimeError("LightningAttentionMixer.state_cache is not set: the runner assigns it from "
                               "state_spec()")
        (kv_state,) = self.state_cache
        meta = get_state_context()
        kernels = meta.kernels or REFERENCE_KERNELS          # chosen once by the state backend (kernels.py)
        t = hidden.shape[0]
        qkv = ACTIVATIONS[self.activation](self.qkv_proj(hidden)).view(t, self.heads, 3 * self.head_dim)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        y, states = kernels.lightning_attention(q, k, v, self.slope_rate, read_states(kv_state, meta, torch.float32),
                                                meta, self.chunk_size)
        write_states(kv_state, meta, states)
        out = self.norm(y.to(hidden.dtype).reshape(t, -1))
        return self.out_proj(torch.sigmoid(self.output_gate(hidden)) * out)


__all__ = ["LightningAttentionMixer"]
