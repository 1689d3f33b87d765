"""Tensor-parallel building blocks (graphrt.models.torch.parallel, issue 12): on two gloo
ranks every sharded layer returns what its unsharded twin returns, eagerly and replayed from
a CPU recording graph with new inputs; with one rank the layers are the plain ``nn`` layers
bit for bit; the KV-head rule splits or replicates; weight loaders read only the rank's slice
(from a tensor or a safetensors slice)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from support.gloo_ranks import run_ranks
from graphrt.core.errors import ConfigError, InputError
from graphrt.models.torch.parallel import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead,
                                           QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                           kv_head_replicas, kv_head_shard)

HIDDEN, INTER, VOCAB, TOKENS = 16, 24, 37, 5        # VOCAB odd: the last rank holds padding rows
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 4


def _load(layer: nn.Module, name: str, full: torch.Tensor, shard_id=None) -> None:
    param = getattr(layer, name)
    if shard_id is None:
        param.weight_loader(param, full)
    else:
        param.weight_loader(param, full, shard_id)


def _build(rank: int, size: int, group) -> dict:
    """Full reference layers and their rank-``rank`` shards, all filled through weight_loader."""
    torch.manual_seed(0)                                       # the same full weights on every rank
    ref = {"col": nn.Linear(HIDDEN, INTER), "row": nn.Linear(INTER, HIDDEN),
           "gate": nn.Linear(HIDDEN, INTER, bias=False), "up": nn.Linear(HIDDEN, INTER, bias=False),
           "down": nn.Linear(INTER, HIDDEN, bias=False),
           "q": nn.Linear(HIDDEN, HEADS * HEAD_DIM), "k": nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM),
           "v": nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM), "embed": nn.Embedding(VOCAB, HIDDEN)}
    tp = {"col": ColumnParallelLinear(HIDDEN, INTER, True, rank, size, group),
          "col_gather": ColumnParallelLinear(HIDDEN, INTER, True, rank, size, group, gather_output=True),
          "row": RowParallelLinear(INTER, HIDDEN, True, rank, size, group),
          "row_full_input": RowParallelLinear(INTER, HIDDEN, True, rank, size, group, input_is_parallel=False),
          "gate_up": MergedColumnParallelLinear(HIDDEN, [INTER, INTER], False, rank, size, group),
          "down": RowParallelLinear(INTER, HIDDEN, False, rank, size, group),
          "qkv": QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, True, rank, size, group),
          "embed": VocabParallelEmbedding(VOCAB, HIDDEN, rank, size, group),
          "head": ParallelLMHead(VOCAB, HIDDEN, rank, size, group)}
    for name in ("col", "col_gather"):
        _load(tp[name], "weight", ref["col"].weight)
        _load(tp[name], "bias", ref["col"].bias)
    for name in ("row", "row_full_input"):
        _load(tp[name], "weight", ref["row"].weight)
        _load(tp[name], "bias", ref["row"].bias)
    _load(tp["gate_up"], "weight", ref["gate"].weight, 0)
    _load(tp["gate_up"], "weight", ref["up"].weight, 1)
    _load(tp["down"], "weight", ref["down"].weight)
    for shard in "qkv":
        _load(tp["qkv"], "weight", ref[shard].weight, shard)
        _load(tp["qkv"], "bias", ref[shard].bias, shard)
    _load(tp["embed"], "weight", ref["embed"].weight)
    _load(tp["head"], "weight", ref["embed"].weight)           # a tied head
    return {"ref": ref, "tp": tp}


def _outputs(layers: dict, x: torch.Tensor, inter: torch.Tensor, ids: torch.Tensor, rank: int,
             size: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (sharded layer's output, the unsharded reference's output) for these inputs."""
    ref, tp = layers["ref"], layers["tp"]
    cols = INTER // size
    mine = slice(rank * cols, (rank + 1) * cols)
    gate, up = tp["gate_up"](x).chunk(2, dim=-1)
    q, k, v = tp["qkv"](x).split([tp["qkv"].q_size, tp["qkv"].kv_size, tp["qkv"].kv_size], dim=-1)
    first_kv, num_kv = kv_head_shard(KV_HEADS, rank, size)
    q_rows = slice(rank * HEADS // size * HEAD_DIM, (rank + 1) * HEADS // size * HEAD_DIM)
    kv_rows = slice(first_kv * HEAD_DIM, (first_kv + num_kv) * HEAD_DIM)
    # the decoder's fused references (FusedLinear): one matmul over the stacked checkpoint weights
    ref_gate, ref_up = F.linear(x, torch.cat([ref["gate"].weight, ref["up"].weight])).chunk(2, dim=-1)
    ref_q, ref_k, ref_v = F.linear(x, torch.cat([ref[n].weight for n in "qkv"]),
                                   torch.cat([ref[n].bias for n in "qkv"])).split([HEADS * HEAD_DIM,
                                                                                   KV_HEADS * HEAD_DIM,
                                                                                   KV_HEADS * HEAD_DIM], -1)
    return {
        "column (split output)": (tp["col"](x), ref["col"](x)[:, mine]),
        "column (gathered)": (tp["col_gather"](x), ref["col"](x)),
        "row + all-reduce": (tp["row"](inter[:, mine]), ref["row"](inter)),
        "row (full input)": (tp["row_full_input"](inter), ref["row"](inter)),
        "gate/up": (torch.cat([gate, up], -1), torch.cat([ref_gate[:, mine], ref_up[:, mine]], -1)),
        "mlp": (tp["down"](F.silu(gate) * up), ref["down"](F.silu(ref_gate) * ref_up)),
        "qkv": (torch.cat([q, k, v], -1), torch.cat([ref_q[:, q_rows], ref_k[:, kv_rows], ref_v[:, kv_rows]], -1)),
        "vocab embedding": (tp["embed"](ids), ref["embed"](ids)),
        "lm head": (tp["head"](x), F.linear(x, ref["embed"].weight).float()),
    }


def _compare(got: dict, tag: str) -> list[str]:
    from support.parity import assert_close_across_reductions
    failures = []
    for name, (out, want) in got.items():
        try:
            assert_close_across_reductions(out, want, width=max(HIDDEN, INTER))
        except AssertionError as err:
            failures.append(f"{tag} {name}: {err}")
    return failures


def _rank(rank: int) -> list[str]:
    """This rank's mismatches against the unsharded layers: eagerly, then replayed twice."""
    import torch.distributed as dist

    from graphrt.backends.torch.recording_graph import RecordingGraph, recording_graph

    layers = _build(rank, 2, dist.group.WORLD)
    gen = torch.Generator().manual_seed(1)                 # the same inputs on both ranks
    x, inter = torch.randn(TOKENS, HIDDEN, generator=gen), torch.randn(TOKENS, INTER, generator=gen)
    ids = torch.tensor([0, VOCAB - 1, 18, 19, 7], dtype=torch.int64)   # both halves and the last id
    with torch.no_grad():
        failures = _compare(_outputs(layers, x, inter, ids, rank, 2), "eager")
        graph = RecordingGraph()
        with recording_graph(graph):
            captured = _outputs(layers, x, inter, ids, rank, 2)
            outs = {name: out.clone() for name, (out, _) in captured.items()}
        for step in range(2):
            x.copy_(torch.randn(TOKENS, HIDDEN, generator=gen))
            inter.copy_(torch.randn(TOKENS, INTER, generator=gen))
            ids.copy_(torch.randint(0, VOCAB, (TOKENS,), generator=gen))
            graph.replay()
            want = _outputs(layers, x, inter, ids, rank, 2)
            failures += _compare({name: (outs[name], want[name][1]) for name in outs}, f"replay {step}")
    return failures


def test_two_gloo_ranks_match_the_unsharded_layers_eagerly_and_replayed():
    got = run_ranks(_rank)
    assert got[0] == [] and got[1] == [], "\n".join(got[0] + got[1])


def test_one_rank_is_the_plain_layers_bit_for_bit():
    layers = _build(0, 1, None)
    gen = torch.Generator().manual_seed(2)
    x, inter = torch.randn(TOKENS, HIDDEN, generator=gen), torch.randn(TOKENS, INTER, generator=gen)
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    with torch.no_grad():
        for name, (out, want) in _outputs(layers, x, inter, ids, 0, 1).items():
            assert torch.equal(out, want), name


def test_kv_heads_are_split_or_replicated():
    assert [kv_head_shard(8, r, 4) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [kv_head_shard(2, r, 2) for r in range(2)] == [(0, 1), (1, 1)]
    # 4 ranks, 2 KV heads: replicated, each head on two consecutive ranks
    assert [kv_head_shard(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert kv_head_replicas(2, 4) == 2 and kv_head_replicas(8, 4) == 1
    assert [kv_head_shard(1, r, 4) for r in range(4)] == [(0, 1)] * 4
    with pytest.raises(ConfigError, match="divisible"):
        kv_head_shard(6, 0, 4)
    with pytest.raises(ConfigError, match="neither a divisor nor a multiple"):
        kv_head_shard(3, 0, 4)
    with pytest.raises(ConfigError, match="tp_rank"):
        kv_head_shard(2, 2, 2)


def test_qkv_with_replicated_kv_heads_loads_each_ranks_head():
    """4 ranks, 4 query heads, 2 KV heads: rank r holds query head r and KV head r // 2."""
    q, k = torch.randn(4 * HEAD_DIM, HIDDEN), torch.randn(2 * HEAD_DIM, HIDDEN)
    for rank in range(4):
        layer = QKVParallelLinear(HIDDEN, HEAD_DIM, 4, 2, False, rank, 4)
        layer.weight.weight_loader(layer.weight, q, "q")
        layer.weight.weight_loader(layer.weight, k, "k")
        assert (layer.num_heads, layer.num_kv_heads) == (1, 1)
        assert torch.equal(layer.weight[:HEAD_DIM], q[rank * HEAD_DIM:(rank + 1) * HEAD_DIM])
        head = rank // 2
        assert torch.equal(layer.weight[HEAD_DIM:2 * HEAD_DIM], k[head * HEAD_DIM:(head + 1) * HEAD_DIM])


def test_weight_loaders_read_a_safetensors_slice_and_check_shapes(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    full = {"embed": torch.randn(VOCAB, HIDDEN), "row": torch.randn(HIDDEN, INTER)}
    save_file(full, tmp_path / "w.safetensors")
    with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
        last = VocabParallelEmbedding(VOCAB, HIDDEN, 1, 2)
        last.weight.weight_loader(last.weight, f.get_slice("embed"))
        row = RowParallelLinear(INTER, HIDDEN, False, 1, 2)
        row.weight.weight_loader(row.weight, f.get_slice("row"))
    assert torch.equal(last.weight[:VOCAB - 19], full["embed"][19:]) and not last.weight[VOCAB - 19:].any()
    assert torch.equal(row.weight, full["row"][:, INTER // 2:])
    col = ColumnParallelLinear(HIDDEN, INTER, False, 0, 2)
    with pytest.raises(InputError, match="rows"):
        col.weight.weight_loader(col.weight, torch.zeros(INTER + 2, HIDDEN))
    with pytest.raises(ConfigError, match="not divisible"):
        ColumnParallelLinear(HIDDEN, 25, False, 0, 2)
