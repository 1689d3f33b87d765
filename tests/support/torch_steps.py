"""A model's forward driven by hand (no ModelRunner): a step's flat inputs and metadata over
per-request block tables, its KV caches, and a run -- the reference models' tests build steps
with these (models/test_torch_models.py, distributed/test_tensor_parallel_models.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrt.layers.torch.forward_context import forward_context
from graphrt.layers.torch.attention.paged import TorchAttentionMetadata
from graphrt.models.torch.decoder import DecoderForCausalLM

BLOCK_SIZE = 4
NUM_BLOCKS = 24
TABLE_WIDTH = 6  # blocks per request row: room for 24 tokens

@dataclass
class Step:
    """One scheduled batch: flat inputs, metadata, and each real request's token span."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: TorchAttentionMetadata
    spans: list[slice]

    @property
    def real_slots(self) -> torch.Tensor:
        return self.meta.slot_mapping[self.meta.slot_mapping >= 0]


def make_step(reqs: list[tuple[list[int], int]], tables: list[list[int]],
              pad_tokens: int = 0, pad_reqs: int = 0) -> Step:
    """``reqs`` holds (scheduled token ids, tokens already in the cache) per request."""
    ids, pos, slots, qsl, seq_lens, spans = [], [], [], [0], [], []
    for (tokens, start), blocks in zip(reqs, tables):
        for i, tok in enumerate(tokens):
            p = start + i
            ids.append(tok)
            pos.append(p)
            slots.append(blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        spans.append(slice(qsl[-1], qsl[-1] + len(tokens)))
        qsl.append(qsl[-1] + len(tokens))
        seq_lens.append(start + len(tokens))
    ids += [0] * pad_tokens
    pos += [0] * pad_tokens
    slots += [-1] * pad_tokens
    qsl += [qsl[-1]] * pad_reqs
    seq_lens += [0] * pad_reqs
    table = torch.zeros(len(reqs) + pad_reqs, TABLE_WIDTH, dtype=torch.int32)
    for r, blocks in enumerate(tables):
        table[r, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    meta = TorchAttentionMetadata.build(
        torch.tensor(slots, dtype=torch.int64), torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32), table, BLOCK_SIZE)
    return Step(torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), meta, spans)


def alloc_caches(model: DecoderForCausalLM, fill: str = "zeros", seed: int = 0) -> list[torch.Tensor]:
    """One ``[2, NUM_BLOCKS*BLOCK_SIZE + 1, Hkv, D]`` cache per layer, assigned to the model."""
    spec = model.kv_cache_spec()
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for i, attn in enumerate(model.attention_layers()):
        group = spec.group_of(i)
        shape = (2, NUM_BLOCKS * BLOCK_SIZE + 1, group.num_kv_heads, group.head_size)
        cache = torch.randn(shape, generator=gen) if fill == "randn" else torch.zeros(shape)
        attn.kv_cache = cache
        caches.append(cache)
    assert len(caches) == spec.num_layers
    return caches


def set_caches(model: DecoderForCausalLM, caches: list[torch.Tensor]) -> None:
    for attn, cache in zip(model.attention_layers(), caches):
        attn.kv_cache = cache


def run(model: DecoderForCausalLM, step: Step) -> torch.Tensor:
    with torch.no_grad(), forward_context(step.meta):
        return model(step.input_ids, step.positions)


def assign_blocks(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Non-contiguous blocks from a shuffled pool; block 0 (the null block) is never handed out."""
    pool = (torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    tables = []
    for n in lengths:
        need = -(-n // BLOCK_SIZE)
        tables.append(pool[:need])
        pool = pool[need:]
    return tables


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
