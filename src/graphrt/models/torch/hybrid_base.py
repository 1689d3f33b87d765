"""What graphrt's hybrid torch models share: the decoder protocol of docs/models.md plus
``state_layers()`` / ``state_spec()`` (docs/hybrid.md), tied embeddings and Granite's logit
scaling."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from graphrt.core.kv_spec import KVCacheSpec
from graphrt.core.state_spec import StateSpec
from graphrt.models.hybrid_config import ATTENTION, HybridConfig
from graphrt.layers.torch.attention.paged import PagedAttention


class HybridBase(nn.Module):
    """The decoder protocol of docs/models.md plus ``state_layers()`` / ``state_spec()``."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
    lora_target_modules: ClassVar[tuple[str, ...]] = ()

    config: HybridConfig
    lm_head: nn.Linear

    def build_model(self, config: HybridConfig, layers: nn.ModuleList, norm: nn.Module,
                    dtype: torch.dtype) -> None:
        """The ``model.*`` + ``lm_head`` layout transformers' Granite-4-H and Qwen3-Next
        checkpoints use (``model.embed_tokens``, ``model.layers``, ``model.norm``), tied and bound."""
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.model.layers = layers
        self.model.norm = norm
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.bind_parameters()

    def blocks(self) -> nn.ModuleList:
        """The decoder layers (``model.layers``; Mamba2 keeps its ``backbone.layers``)."""
        return self.model.layers

    def embed(self) -> nn.Embedding:
        """The token embedding (``model.embed_tokens``; Mamba2 keeps ``backbone.embeddings``)."""
        return self.model.embed_tokens

    def bind_parameters(self) -> None:
        """Tie ``lm_head`` to the embedding when configured; attach the fused layers' loaders
        (again after ``to_empty``)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed().weight
        for module in self.modules():
            bind = getattr(module, "bind_weight_loaders", None)
            if bind is not None:
                bind()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden]`` -> float32 logits ``[N, vocab]`` (Granite divides by ``logits_scaling``)."""
        logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return logits.float()

    def attention_layers(self) -> list[PagedAttention]:
        """The paged-attention modules in layer order (empty for a pure Mamba2)."""
        return [b.self_attn.attn for b in self.blocks() if getattr(b, "kind", None) == ATTENTION]

    def state_layers(self) -> list[nn.Module]:
        """The recurrent mixers in layer order (the runner assigns their ``state_cache``)."""
        return [m for b in self.blocks() for m in b.children() if hasattr(m, "state_cache")]

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.config.kv_cache_spec()

    def state_spec(self) -> StateSpec:
        return self.config.state_spec()


__all__ = ["HybridBase"]
