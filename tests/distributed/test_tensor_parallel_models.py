"""Sharded torch reference models (issue 12): on 2 and 4 gloo ranks the tensor-parallel
Qwen3 / Llama decoders (tied and untied embeddings, a bias and a vocabulary the ranks do not
divide) give the unsharded model's logits through a prefill and a decode over their own paged
KV caches, with 4 ranks replicating the 2 KV heads; a recording-graph replay of the sharded
forward equals its eager run; the loader reads only each rank's slices; ``tensor_parallel_size``
is a validated config field; LoRA is refused on a shard."""

from __future__ import annotations

import functools

import pytest
import torch
from safetensors import safe_open

from support.fast_subset import slow_except
from support.gloo_ranks import run_ranks
from graphrt import ConfigError, GraphConfig, add_cli_args, from_cli_args
from graphrt.layers.torch.forward_context import forward_context
from graphrt.core.kv_spec import KVCacheSpec
from graphrt.models.hf_config import DecoderConfig
from graphrt.models.torch import loader as loader_module
from graphrt.layers.torch.attention.paged import TorchAttentionMetadata
from graphrt.models.torch.decoder import DecoderForCausalLM, FusedLinear
from graphrt.models.torch.loader import load_torch_model
from graphrt.models.torch.parallel import kv_head_shard
from support.hf_models import tiny_hf_model_dir
from support.parity import assert_close_across_reductions
from support.torch_steps import BLOCK_SIZE, alloc_caches, assign_blocks, make_step, random_tokens, run

#: The models' hidden size: the width the ranks' partial sums reduce over.
HIDDEN = 64
# name -> (arch, overrides); every one has 4 query heads over 2 KV heads, hidden 64, 2 layers.
VARIANTS = {
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3-tied", {}),
    "llama": ("llama", {}),
    "llama-bias-vocab127": ("llama", {"attention_bias": True, "vocab_size": 127}),
}


def _paths() -> dict[str, str]:
    """The checkpoints, built here (the ranks only read them)."""
    return {name: str(tiny_hf_model_dir(arch, **overrides)) for name, (arch, overrides) in VARIANTS.items()}


def _steps(vocab: int) -> list:
    """A two-request prefill (7 and 5 tokens), then one decode token each."""
    seqs = [random_tokens(8, vocab, seed=11), random_tokens(6, vocab, seed=12)]
    tables = assign_blocks([len(s) for s in seqs], seed=13)
    return [make_step([(seqs[0][:7], 0), (seqs[1][:5], 0)], tables),
            make_step([(seqs[0][7:], 7), (seqs[1][5:], 5)], tables)]


def _logits(model: DecoderForCausalLM) -> list[torch.Tensor]:
    """Each step's logits, eagerly over a fresh paged KV cache."""
    alloc_caches(model)
    with torch.no_grad():
        return [model.compute_logits(run(model, step)) for step in _steps(model.config.vocab_size)]


def _replay_failures(model: DecoderForCausalLM) -> list[str]:
    """Capture a decode step of the sharded model in a recording graph (all-reduces and the
    logits all-gather recorded), replay it on the next decode step's inputs, and compare the
    logits and KV writes with that step run eagerly from the same cache."""
    from graphrt.backends.torch.recording_graph import RecordingGraph, recording_graph

    vocab = model.config.vocab_size
    seqs = [random_tokens(6, vocab, seed=21), random_tokens(4, vocab, seed=22)]
    tables = assign_blocks([len(s) for s in seqs], seed=23)
    caches = alloc_caches(model)
    decode = [make_step([(seqs[0][p:p + 1], p), (seqs[1][p - 2:p - 1], p - 2)], tables) for p in (4, 5)]
    fields = lambda s: [s.input_ids, s.positions, s.meta.slot_mapping, s.meta.query_start_loc,  # noqa: E731
                        s.meta.seq_lens, s.meta.block_table]
    static = [t.clone() for t in fields(decode[0])]

    def forward() -> torch.Tensor:
        ids, pos, slots, qsl, lens, table = static
        with forward_context(TorchAttentionMetadata.build(slots, qsl, lens, table, BLOCK_SIZE)):
            return model.compute_logits(model(ids, pos))

    with torch.no_grad():
        run(model, make_step([(seqs[0][:4], 0), (seqs[1][:2], 0)], tables))
        graph = RecordingGraph()
        with recording_graph(graph):
            out = forward()
        before = [c.clone() for c in caches]
        for dst, src in zip(static, fields(decode[1])):
            dst.copy_(src)
        graph.replay()
        replayed, replayed_kv = out.clone(), [c.clone() for c in caches]
        for cache, saved in zip(caches, before):
            cache.copy_(saved)
        eager = forward()
    failures = [] if torch.equal(replayed, eager) else [f"replayed logits differ: {(replayed - eager).abs().max()}"]
    if not all(torch.equal(a, b) for a, b in zip(replayed_kv, caches)):
        failures.append("replayed KV writes differ from eager")
    return failures


def _shard_run(name: str, path: str, tp_rank: int, tp_size: int, group, capture: bool) -> tuple[list, list[str]]:
    """One shard's logits per step (numpy: torch tensors would cross the queue as shared fds
    that die with the rank), and its failures: the KV spec and, with ``capture``, the replay."""
    shard = load_torch_model(path, tp_rank=tp_rank, tp_size=tp_size, group=group)
    c, failures = shard.config, []
    want = (c.num_hidden_layers, kv_head_shard(c.num_key_value_heads, tp_rank, tp_size)[1], c.head_dim)
    if shard.kv_cache_spec() != KVCacheSpec.uniform(*want) or shard.attention_layers()[0].num_kv_heads != want[1]:
        failures.append(f"tp {tp_size} rank {tp_rank} {name}: kv_cache_spec {shard.kv_cache_spec()}, "
                        f"expected {want}")
    logits = [t.numpy() for t in _logits(shard)]
    if capture:
        failures += [f"tp {tp_size} rank {tp_rank} {name}: {f}" for f in _replay_failures(shard)]
    return logits, failures


def _rank(rank: int, paths: dict[str, str]) -> dict[int, tuple[dict, list[str]]]:
    """On 4 gloo ranks: every model as TP=2 over the pairs {0, 1} and {2, 3} (subgroups: the
    ``group`` argument), Qwen3's forward also replayed from a recording graph; then as TP=4 over
    the world. Returns ``{tp_size: (logits by model, failures)}``; one spawn serves both sizes."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]      # every rank creates every group
    out = {}
    for tp_size, tp_rank, group in ((2, rank % 2, pairs[rank // 2]), (4, rank, None)):
        logits, failures = {}, []
        for name, path in paths.items():
            logits[name], failed = _shard_run(name, path, tp_rank, tp_size, group,
                                              capture=tp_size == 2 and name == "qwen3")
            failures += failed
        out[tp_size] = (logits, failures)
    return out


@pytest.fixture(scope="module")
def sharded() -> tuple[dict, dict]:
    """(the 4 ranks' results, the unsharded model's logits by model): the reference runs once,
    here, rather than on every rank."""
    paths = _paths()
    got = run_ranks(functools.partial(_rank, paths=paths), 4)
    return got, {name: _logits(load_torch_model(path)) for name, path in paths.items()}


def _check(sharded: tuple[dict, dict], tp_size: int) -> None:
    """Every rank's logits allclose to the unsharded model's (graphrt.reduction_tolerance: the
    ranks' partial sums add in another order), and no rank failed a check."""
    got, reference = sharded
    failures = [f for rank in sorted(got) for f in got[rank][tp_size][1]]
    for name, steps in reference.items():
        for step, ref in enumerate(steps):
            for rank in sorted(got):
                try:
                    assert_close_across_reductions(got[rank][tp_size][0][name][step], ref, width=HIDDEN)
                except AssertionError as err:
                    failures.append(f"tp {tp_size} rank {rank} {name} step {step}: {err}")
    assert not failures, "\n".join(failures)


def test_two_ranks_match_one_rank_and_replay_their_recorded_forward(sharded):
    """KV heads split 1 + 1 (two pairs of ranks, each its own subgroup); the recording-graph
    replay of the sharded forward equals eager."""
    _check(sharded, 2)


def test_four_ranks_replicate_two_kv_heads_and_match_one_rank(sharded):
    """4 ranks over 2 KV heads: each rank holds one query head and one KV head (0, 0, 1, 1)."""
    _check(sharded, 4)


# ---------------------------------------------------------------------------- loader (no ranks)


class _ReadSpy:
    """A ``safe_open`` handle that records which tensors are read whole (``get_tensor``)."""

    def __init__(self, handle, whole: list[str]) -> None:
        self.handle, self.whole = handle, whole

    def __enter__(self) -> "_ReadSpy":
        self.inner = self.handle.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.handle.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_slice(self, key: str):
        return self.inner.get_slice(key)

    def get_tensor(self, key: str) -> torch.Tensor:
        self.whole.append(key)
        return self.inner.get_tensor(key)


@pytest.mark.parametrize("variant, world", slow_except([("qwen3", 2), ("llama-bias-vocab127", 4)], ("qwen3", 2)))
def test_loader_reads_only_each_ranks_slices(monkeypatch, variant, world):
    """Every rank's parameters are its slices of the checkpoint; only replicated tensors (the
    norms) are read whole. Loading needs no process group (collectives run in the forward)."""
    arch, overrides = VARIANTS[variant]
    path = tiny_hf_model_dir(arch, **overrides)
    (file,) = path.glob("*.safetensors")
    with safe_open(file, framework="pt") as f:
        ckpt = {key: f.get_tensor(key) for key in f.keys()}
    whole: list[str] = []
    real_open = loader_module.safe_open
    monkeypatch.setattr(loader_module, "safe_open", lambda *a, **k: _ReadSpy(real_open(*a, **k), whole))
    c = DecoderConfig.from_dir(path)
    d, vocab_rows = c.head_dim, -(-c.vocab_size // world)
    heads, inter, hidden = c.num_attention_heads // world, c.intermediate_size // world, c.q_size // world
    for rank in range(world):
        whole.clear()
        p = dict(load_torch_model(path, tp_rank=rank, tp_size=world).named_parameters())
        assert whole and all(key.endswith("norm.weight") for key in whole), whole
        kv, _ = kv_head_shard(c.num_key_value_heads, rank, world)
        q_rows, kv_rows = slice(rank * heads * d, (rank + 1) * heads * d), slice(kv * d, (kv + 1) * d)
        mine = slice(rank * inter, (rank + 1) * inter)
        for i in range(c.num_hidden_layers):
            at, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            assert p[f"{at}qkv_proj.weight"].shape == ((heads + 2) * d, c.hidden_size)
            for kind in ("weight", "bias") if c.attention_bias else ("weight",):
                want = torch.cat([ckpt[f"{at}q_proj.{kind}"][q_rows], ckpt[f"{at}k_proj.{kind}"][kv_rows],
                                  ckpt[f"{at}v_proj.{kind}"][kv_rows]])
                assert torch.equal(p[f"{at}qkv_proj.{kind}"], want), (rank, i, kind)
            o = ckpt[f"{at}o_proj.weight"][:, rank * hidden:(rank + 1) * hidden]
            assert torch.equal(p[f"{at}o_proj.weight"], o)
            if c.attention_bias:
                assert torch.equal(p[f"{at}o_proj.bias"], ckpt[f"{at}o_proj.bias"])
            gate_up = torch.cat([ckpt[f"{mlp}gate_proj.weight"][mine], ckpt[f"{mlp}up_proj.weight"][mine]])
            assert torch.equal(p[f"{mlp}gate_up_proj.weight"], gate_up)
            assert torch.equal(p[f"{mlp}down_proj.weight"], ckpt[f"{mlp}down_proj.weight"][:, mine])
        start = rank * vocab_rows
        rows = max(0, min(vocab_rows, c.vocab_size - start))
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert p[name].shape == (vocab_rows, c.hidden_size)
            assert torch.equal(p[name][:rows], ckpt[name][start:start + rows]) and not p[name][rows:].any()
        assert torch.equal(p["model.norm.weight"], ckpt["model.norm.weight"])


def test_tied_shard_shares_its_vocabulary_rows():
    model = load_torch_model(tiny_hf_model_dir("qwen3-tied"), tp_rank=1, tp_size=2)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.shape == (64, 64)


# ---------------------------------------------------------------------------- structure, config, LoRA


def test_one_rank_builds_the_plain_layers():
    """tp_size 1 is the model as it was: nn.Linear / FusedLinear / nn.Embedding, no parallel layer."""
    from graphrt.models.torch import parallel

    config = DecoderConfig.from_dir(tiny_hf_model_dir("qwen3"))
    with torch.device("meta"):
        model = DecoderForCausalLM(config)
    kinds = {type(m) for m in model.modules()}
    assert not any(issubclass(k, parallel._Parallel) for k in kinds)
    attn = model.model.layers[0].self_attn
    assert type(attn.qkv_proj) is FusedLinear and type(attn.o_proj) is torch.nn.Linear
    assert type(model.model.embed_tokens) is torch.nn.Embedding and type(model.lm_head) is torch.nn.Linear
    assert model.kv_cache_spec() == KVCacheSpec.uniform(2, 2, 16)


def test_shapes_the_ranks_cannot_divide_are_refused():
    config = DecoderConfig.from_dir(tiny_hf_model_dir("qwen3"))
    with torch.device("meta"):
        with pytest.raises(ConfigError, match=r"tensor_parallel_size \(3\)"):
            DecoderForCausalLM(config, tp_rank=0, tp_size=3)
        with pytest.raises(ConfigError, match="tp_rank"):
            DecoderForCausalLM(config, tp_rank=2, tp_size=2)


def test_lora_is_refused_on_a_shard():
    from graphrt.models.torch.lora import LoraState, enable_lora

    config = DecoderConfig.from_dir(tiny_hf_model_dir("qwen3"))
    with torch.device("meta"):
        model = DecoderForCausalLM(config, tp_rank=0, tp_size=2)
    state = LoraState(torch.zeros(4, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ConfigError, match="tensor_parallel_size 2"):
        enable_lora(model, state, max_loras=1, max_rank=4)


def test_tensor_parallel_size_config_field():
    import argparse

    assert GraphConfig().tensor_parallel_size == 1
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        GraphConfig.create(tensor_parallel_size=0)
    args = add_cli_args(argparse.ArgumentParser()).parse_args(["--tensor-parallel-size", "4"])
    assert from_cli_args(args).tensor_parallel_size == 4
