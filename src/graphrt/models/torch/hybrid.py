"""Hybrid decoders in plain torch: Mamba2 and Granite-4-H (Mamba2 + attention) over graphrt's
paged KV cache and recurrent-state cache (docs/hybrid.md).

Module and parameter names are transformers' (``backbone.*`` for Mamba2, ``model.*`` for
Granite), q/k/v fused into one matmul as in graphrt's decoders, so the torch loader fills them
from a checkpoint as it is. Besides the decoder protocol (docs/models.md) a hybrid model has
``state_layers()`` (its recurrent mixers in layer order; each gets ``state_cache``) and
``state_spec()`` (a :class:`graphrt.StateSpec`); ``attention_layers()`` may be empty (a pure
Mamba2 keeps no KV cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphrt.models.hybrid_config import ATTENTION, HybridConfig
from graphrt.layers.torch.attention.paged import PagedAttention
from graphrt.models.torch.decoder import FusedLinear, RMSNorm, RotaryEmbedding, apply_rotary
from graphrt.models.torch.hybrid_base import HybridBase
from graphrt.models.torch.mamba2 import Mamba2Mixer


class HybridAttention(nn.Module):
    """Attention of a hybrid layer: fused q/k/v, rotary on the first ``rotary_dim`` features of
    each head (none without a ``rope_theta``), the config's softmax scale, paged attention."""

    def __init__(self, config: HybridConfig, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(c.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
                                    bias=c.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=c.attention_bias, dtype=dtype)
        self.rotary_dim = c.rotary_dim if c.rope_theta is not None else 0
        self.rotary = RotaryEmbedding(self.rotary_dim, c.rope_theta) if self.rotary_dim else None
        self.attn = PagedAttention(self.heads, self.kv_heads, self.head_dim, scale=c.attention_scale)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.rotary is None:
            return x
        cos, sin = self.rotary(positions)
        if self.rotary_dim == self.head_dim:
            return apply_rotary(x, cos, sin)
        return torch.cat((apply_rotary(x[..., :self.rotary_dim], cos, sin), x[..., self.rotary_dim:]), dim=-1)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.rotate(q.reshape(t, self.heads, self.head_dim), positions)
        k = self.rotate(k.reshape(t, self.kv_heads, self.head_dim), positions)
        return self.o_proj(self.attn(q.reshape(t, self.q_size), k.reshape(t, self.kv_size), v))


def route_top_k(hidden: torch.Tensor, router: torch.Tensor, k: int, normalize: bool = True) -> torch.Tensor:
    """Dense routing weights ``[T, E]``: each token's top-``k`` experts by router logit, their
    weights the softmax over those ``k`` logits (``normalize``) or over all experts (then
    gathered), zero elsewhere."""
    logits = F.linear(hidden, router).float()
    if normalize:
        top, index = logits.topk(k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    else:
        probs = torch.softmax(logits, dim=-1)
        weights, index = probs.topk(k, dim=-1)
    return torch.zeros_like(logits).scatter(1, index, weights).to(hidden.dtype)


class GraniteExperts(nn.Module):
    """Granite's experts and router as its checkpoints store them (``input_linear.weight
    [E, 2I, H]``: gate then up; ``output_linear.weight [E, H, I]``; ``router.layer.weight
    [E, H]``), every expert computed for every token and weighted by the dense routing weights
    (static shapes: no token sorting, capturable)."""

    def __init__(self, config: HybridConfig, dtype: torch.dtype) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        self.k = config.num_experts_per_tok
        self.router = nn.Module()
        self.router.layer = _weight(e, h, dtype=dtype)
        self.input_linear = _weight(e, 2 * i, h, dtype=dtype)
        self.output_linear = _weight(e, h, i, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = route_top_k(x, self.router.layer.weight, self.k)                    # [T, E]
        gate, up = torch.einsum("th,eih->tei", x, self.input_linear.weight).chunk(2, dim=-1)
        out = torch.einsum("tei,ehi->teh", F.silu(gate) * up, self.output_linear.weight)
        return torch.einsum("te,teh->th", weights, out)


def _weight(*shape: int, dtype: torch.dtype) -> nn.Module:
    """A module holding one parameter ``weight`` of ``shape`` (a checkpoint's ``<name>.weight``)."""
    module = nn.Module()
    module.weight = nn.Parameter(torch.zeros(*shape, dtype=dtype))
    return module


class GraniteSharedMLP(nn.Module):
    """``output_linear(silu(gate) * up)``, gate and up stacked in ``input_linear``."""

    def __init__(self, config: HybridConfig, dtype: torch.dtype) -> None:
        super().__init__()
        size = config.shared_intermediate_size
        self.input_linear = nn.Linear(config.hidden_size, 2 * size, bias=False, dtype=dtype)
        self.output_linear = nn.Linear(size, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)


class GraniteLayer(nn.Module):
    """Granite-4-H's block: norm, a Mamba2 mixer or attention, residual (scaled), norm, shared
    MLP plus experts, residual (scaled)."""

    def __init__(self, config: HybridConfig, kind: str, dtype: torch.dtype) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        if kind == ATTENTION:
            self.self_attn = HybridAttention(config, dtype)
        else:
            self.mamba = Mamba2Mixer(config, dtype)
        self.kind = kind
        self.shared_mlp = GraniteSharedMLP(config, dtype)
        self.block_sparse_moe = GraniteExperts(config, dtype) if config.num_experts else None
        self.scale = config.residual_multiplier

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(hidden)
        x = self.self_attn(x, positions) if self.kind == ATTENTION else self.mamba(x)
        hidden = hidden + x * self.scale
        x = self.post_attention_layernorm(hidden)
        mlp = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            mlp = self.block_sparse_moe(x) + mlp
        return hidden + mlp * self.scale


class Mamba2Block(nn.Module):
    """Mamba2's block: norm, mixer, residual."""

    def __init__(self, config: HybridConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mixer = Mamba2Mixer(config, dtype)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return hidden + self.mixer(self.norm(hidden))


class GraniteHybridForCausalLM(HybridBase):
    """Granite-4-H (``GraniteMoeHybridForCausalLM``): ``model.*`` and ``lm_head``."""

    def __init__(self, config: HybridConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.build_model(config, nn.ModuleList(GraniteLayer(config, kind, dtype) for kind in config.layer_kinds),
                         RMSNorm(config.hidden_size, config.rms_norm_eps, dtype), dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids) * self.config.embedding_multiplier
        for layer in self.model.layers:
            hidden = layer(hidden, positions)
        return self.model.norm(hidden)


class Mamba2ForCausalLM(HybridBase):
    """Mamba2 (``Mamba2ForCausalLM``): ``backbone.*`` and ``lm_head``; no attention, no KV cache."""

    def __init__(self, config: HybridConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.backbone = nn.Module()
        self.backbone.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.backbone.layers = nn.ModuleList(Mamba2Block(config, dtype) for _ in range(config.num_hidden_layers))
        self.backbone.norm_f = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.bind_parameters()

    def blocks(self) -> nn.ModuleList:
        return self.backbone.layers

    def embed(self) -> nn.Embedding:
        return self.backbone.embeddings

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone.embeddings(input_ids)
        for layer in self.backbone.layers:
            hidden = layer(hidden, positions)
        return self.backbone.norm_f(hidden)


def hybrid_model_class(config: HybridConfig) -> type[HybridBase]:
    """graphrt's torch class for a hybrid checkpoint's architecture."""
    if config.architecture == "Mamba2ForCausalLM":
        return Mamba2ForCausalLM
    if config.architecture == "GraniteMoeHybridForCausalLM":
        return GraniteHybridForCausalLM
    from graphrt.models.torch.qwen3_next import Qwen3NextForCausalLM
    return Qwen3NextForCausalLM


__all__ = ["GraniteHybridForCausalLM", "HybridAttention", "HybridBase", "Mamba2ForCausalLM", "hybrid_model_class",
           "route_top_k"]
