"""Llama, Mistral and Qwen3 decoders in plain torch, over graphrt's paged KV cache.

Flat token batches (``input_ids [T]``, ``positions [T]``), attention metadata from the forward
context, so one captured graph serves any batch of its size. Numerics follow transformers;
q/k/v and gate/up are fused. ``tp_size > 1`` builds the rank's shard from
:mod:`graphrt.models.torch.parallel` (docs/distributed.md, "Tensor-parallel layers").
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from graphrt.core.errors import ConfigError, InputError
from graphrt.core.kv_spec import KVCacheSpec
from graphrt.models.hf_config import DecoderConfig
from graphrt.layers.torch.attention.paged import PagedAttention
from graphrt.models.torch.parallel import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                           RowParallelLinear, TPGroup, VocabParallelEmbedding,
                                           kv_head_shard)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled in the input dtype (as HF does)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(in_dtype)


class RotaryEmbedding(nn.Module):
    """Default rotary embedding; cos/sin per step from positions, inverse frequencies on the fly
    so they stay float32 whatever dtype or device the module is moved to."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` -> ``(cos, sin)``, each float32 ``[T, head_dim // 2]``."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device) / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponents)
        freqs = positions.float().unsqueeze(-1) * inv_freq
        return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by position; the two halves of D form the complex pairs."""
    cos = cos.to(x.dtype).unsqueeze(1)
    sin = sin.to(x.dtype).unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class FusedLinear(nn.Linear):
    """One linear layer whose output rows stack several checkpoint projections; ``shard_sizes``
    maps each shard id (``"q"``/``"k"``/``"v"`` or ``0``/``1``) to its row count, in order."""

    def __init__(self, in_features: int, shard_sizes: dict[str | int, int], bias: bool,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias, dtype=dtype)
        self.shard_offsets: dict[str | int, tuple[int, int]] = {}
        start = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (start, size)
            start += size
        self.bind_weight_loaders()

    def bind_weight_loaders(self) -> None:
        """Attach ``weight_loader`` to the parameters (again after ``to_empty`` replaced them)."""
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: str | int | None = None) -> None:
        """Copy one checkpoint projection (tensor or safetensors slice) into its rows."""
        if shard_id not in self.shard_offsets:
            raise InputError("shard_id", f"{shard_id!r} is not one of {list(self.shard_offsets)}")
        if not isinstance(loaded_weight, torch.Tensor):
            loaded_weight = loaded_weight[:]
        start, size = self.shard_offsets[shard_id]
        expected = (size, *param.shape[1:])
        if tuple(loaded_weight.shape) != expected:
            raise InputError("loaded_weight", f"shard {shard_id!r} has shape {tuple(loaded_weight.shape)}, "
                                              f"expected {expected}")
        with torch.no_grad():
            param.narrow(0, start, size).copy_(loaded_weight)


class DecoderAttention(nn.Module):
    """Fused QKV projection, optional per-head q/k RMSNorm (Qwen3), rotary, paged attention;
    sharded, each rank attends with its own heads and ``o_proj`` all-reduces."""

    def __init__(self, config: DecoderConfig, dtype: torch.dtype, tp: TPGroup = TPGroup(),
                 sliding_window: int = 0) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        bias = config.attention_bias
        if tp.size == 1:
            self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
            self.q_size, self.kv_size = config.q_size, config.kv_size
            self.qkv_proj = FusedLinear(config.hidden_size, {"q": config.q_size, "k": config.kv_size,
                                                             "v": config.kv_size}, bias=bias, dtype=dtype)
            self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=bias, dtype=dtype)
        else:
            self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                                              config.num_key_value_heads, bias, *tp, dtype=dtype)
            self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
            self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
            self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, bias, *tp, dtype=dtype)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, sliding_window=sliding_window)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = self.attn(q.reshape(num_tokens, self.q_size), k.reshape(num_tokens, self.kv_size), v)
        return self.o_proj(out)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul; sharded, each
    rank holds a slice of the intermediate features and ``down`` all-reduces."""

    def __init__(self, config: DecoderConfig, dtype: torch.dtype, tp: TPGroup = TPGroup()) -> None:
        super().__init__()
        size, hidden = config.intermediate_size, config.hidden_size
        if tp.size == 1:
            self.gate_up_proj = FusedLinear(hidden, {0: size, 1: size}, bias=False, dtype=dtype)
            self.down_proj = nn.Linear(size, hidden, bias=False, dtype=dtype)
        else:
            self.gate_up_proj = MergedColumnParallelLinear(hidden, [size, size], False, *tp, dtype=dtype)
            self.down_proj = RowParallelLinear(size, hidden, False, *tp, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention (over layer ``index``'s sliding window, if any) then MLP."""

    def __init__(self, config: DecoderConfig, dtype: torch.dtype, tp: TPGroup = TPGroup(), index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = DecoderAttention(config, dtype, tp, config.layer_window(index))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = GatedMLP(config, dtype, tp)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.*`` parameter names)."""

    def __init__(self, config: DecoderConfig, dtype: torch.dtype, tp: TPGroup = TPGroup()) -> None:
        super().__init__()
        if tp.size == 1:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        else:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, *tp, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, tp, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary_emb(positions)
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.norm(hidden)


class DecoderForCausalLM(nn.Module):
    """A Llama, Mistral or Qwen3 causal LM over a paged KV cache; capturable as a device graph.

    ``forward`` returns hidden states; ``compute_logits`` is separate so the runner projects only
    the rows it samples. ``tp_rank`` / ``tp_size`` / ``group`` (None: the default process group)
    build one rank's shard; every rank returns full hidden states and logits.
    """

    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    #: Linear children that take LoRA adapters when ``max_loras > 0`` (models/torch/lora.py).
    lora_target_modules: ClassVar[tuple[str, ...]] = ("o_proj",)

    def __init__(self, config: DecoderConfig, dtype: torch.dtype = torch.float32, tp_rank: int = 0,
                 tp_size: int = 1, group: Any = None) -> None:
        super().__init__()
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ConfigError(f"tensor-parallel rank {tp_rank} of {tp_size}: need tp_size >= 1 and "
                              f"0 <= tp_rank < tp_size")
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        #: KV heads this rank holds (all of them unsharded).
        self.num_kv_heads = kv_head_shard(config.num_key_value_heads, tp_rank, tp_size)[1]
        tp = TPGroup(tp_rank, tp_size, group)
        self.model = DecoderModel(config, dtype, tp)
        if tp_size == 1:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, *tp, dtype=dtype)
        self.bind_parameters()

    def bind_parameters(self) -> None:
        """Tie ``lm_head`` to ``embed_tokens`` when configured and attach weight loaders; call
        again after ``nn.Module.to_empty``, which drops ties and attributes."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for module in self.modules():
            bind = getattr(module, "bind_weight_loaders", None)
            if bind is not None:
                bind()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` -> hidden ``[T, hidden]``; metadata from the forward context."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden]`` -> float32 logits ``[N, vocab]`` (sharded: gathered on every rank)."""
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[PagedAttention]:
        """The paged-attention modules in layer order (the runner assigns their ``kv_cache``)."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def kv_cache_spec(self) -> KVCacheSpec:
        """The KV cache the runner allocates: every layer's heads, one group per sliding window;
        sharded, this rank's KV heads. dtype "auto": config's ``kv_cache_dtype``, else weights'."""
        return self.config.kv_cache_spec(self.num_kv_heads)
