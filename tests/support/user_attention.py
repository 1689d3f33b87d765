"""A user's own attention, plugged in through the seam (docs/attention.md): its metadata, its
kernel, and a host value its kernel reads as a Python integer.

``DenseBackend.build`` gathers, for every token, the KV rows of the first ``max_seq_len``
positions of its request -- the gather's width is ``host.max_seq_len``, a host integer, as a
varlen kernel's ``max_seqlen_k`` would be. Declared keyed (``declare=True``), a graph fixes
the key's context bucket, which holds every request of a step under it: correct in every
mode. Undeclared, the capture that reads it fails, naming the value.

``ScaledInput`` declares a per-token extra input added to the embeddings (what multimodal
embeddings or an engine's own tensors look like to graphrt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from graphrt.backends.torch.cpu import CpuGraphBackend
from graphrt.core.inputs.extra_inputs import ExtraInput
from graphrt.layers.torch.forward_context import get_forward_context
from graphrt.layers.torch.attention.backend import AttentionBackend, HostValues, StepTensors
from support.hf_models import tiny_hf_model_dir


@dataclass
class DenseMeta:
    """The user's metadata: each token's KV rows and which of them it may attend to."""

    slot_mapping: torch.Tensor    # int64 [T]
    key_rows: torch.Tensor        # int64 [T, L]
    valid: torch.Tensor           # bool [T, L]
    trash_row: torch.Tensor       # int64 [T] (a constant, sized per token)


class DenseBackend(AttentionBackend):
    """Builds :class:`DenseMeta` from the step's tensors, reading ``max_seq_len`` on the host."""

    name = "user-dense"

    def __init__(self, declare: bool = True, wrong_shapes: bool = False) -> None:
        self.declare, self.wrong_shapes = declare, wrong_shapes

    def keyed_host_values(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        return ("max_seq_len",) if self.declare else ()

    def build(self, step: StepTensors, host: HostValues) -> DenseMeta:
        return self.gather(step, max(int(host.max_seq_len), 1), step.seq_lens)  # a host integer: the width

    def gather(self, step: StepTensors, width: int, seq_lens: torch.Tensor) -> DenseMeta:
        """Each token's first ``width`` KV rows of its request, valid up to its own position."""
        t = step.slot_mapping.shape[0]
        qsl, table, bs = step.query_start_loc, step.block_table, step.block_size
        tokens = torch.arange(t, dtype=qsl.dtype)
        req = (torch.searchsorted(qsl, tokens, right=True) - 1).clamp(0, max(seq_lens.shape[0] - 1, 0)).long()
        pos = torch.arange(width, dtype=torch.int64)
        blocks = table.index_select(0, req).long().gather(1, (pos // bs).clamp(max=table.shape[1] - 1)
                                                          .unsqueeze(0).expand(t, width))
        key_rows = blocks * bs + pos % bs
        seq = seq_lens.index_select(0, req).long()
        token_pos = seq - (qsl.index_select(0, req + 1).long() - tokens.long())
        valid = (pos < seq.unsqueeze(1)) & (pos <= token_pos.unsqueeze(1))
        trash = torch.zeros(t if not self.wrong_shapes else t + 3, dtype=torch.int64)
        return DenseMeta(step.slot_mapping, key_rows, valid, trash)


class DenseAttention(nn.Module):
    """The user's kernel over graphrt's KV layout ([2, rows, kv_heads, head_dim] per layer)."""

    graphrt_attention = True       # a PIECEWISE split point, as graphrt's own

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.kv_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta: DenseMeta = get_forward_context()
        cache, t, d, hkv = self.kv_cache, q.shape[0], self.head_dim, self.num_kv_heads
        rows = torch.where(meta.slot_mapping < 0, cache.shape[1] - 1 + meta.trash_row, meta.slot_mapping)
        cache[0].index_copy_(0, rows, k.reshape(t, hkv, d))
        cache[1].index_copy_(0, rows, v.reshape(t, hkv, d))
        keys, values = cache[0][meta.key_rows], cache[1][meta.key_rows]          # [T, L, Hkv, D]
        groups = self.num_heads // hkv
        scores = torch.einsum("tkgd,tlkd->tkgl", q.reshape(t, hkv, groups, d), keys) * d ** -0.5
        mask = meta.valid[:, None, None, :]
        probs = torch.where(mask, torch.softmax(torch.where(mask, scores, float("-inf")), -1), 0.0)
        values = torch.where(meta.valid[:, :, None, None], values, 0)
        return torch.einsum("tkgl,tlkd->tkgd", probs, values).reshape(t, self.num_heads * d)


def dense_model(declare: bool = True, wrong_shapes: bool = False) -> nn.Module:
    """graphrt's tiny reference Qwen3 with every attention layer the user's, and its backend."""
    model = CpuGraphBackend().load_model(str(tiny_hf_model_dir("qwen3")))
    for layer in model.model.layers:
        own = layer.self_attn.attn
        layer.self_attn.attn = DenseAttention(own.num_heads, own.num_kv_heads, own.head_dim)
    model.attention_backend = DenseBackend(declare, wrong_shapes)
    return model


class AddedEmbeddings(nn.Module):
    """Wraps an embedding: adds the step's per-token extra input ``extra_embeds``."""

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed

    @property
    def weight(self) -> torch.Tensor:
        return self.embed.weight            # a tied LM head reads it

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        extra = get_forward_context().extra_embeds
        return self.embed(ids) + extra.to(self.embed.weight.dtype)


class ExtraBackend(AttentionBackend):
    """graphrt's paged attention metadata, plus the step's extra input for the embeddings."""

    name = "paged-with-extra"

    def __init__(self, head_dim: int) -> None:
        from graphrt.layers.torch.attention.backend import PagedAttentionBackend
        self.paged = PagedAttentionBackend(head_dim)

    def setup(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        return self.paged.setup(device, dtype)          # the composed backend's kernel, chosen once

    def build(self, step: StepTensors, host: HostValues):
        meta = self.paged.build(step, host)
        meta.extra_embeds = step.extra["embeds"]
        return meta


def extra_input_model() -> nn.Module:
    """The tiny reference Qwen3 reading a declared per-token input added to its embeddings."""
    model = CpuGraphBackend().load_model(str(tiny_hf_model_dir("qwen3")))
    hidden = model.config.hidden_size
    model.extra_inputs = {"embeds": ExtraInput("token", (hidden,), "float32", 0.0)}
    model.model.embed_tokens = AddedEmbeddings(model.model.embed_tokens)
    model.attention_backend = ExtraBackend(model.config.head_dim)
    return model
