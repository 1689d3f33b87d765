"""graphrt's torch reference models: loading, parity with transformers, padding safety."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphrt.core.errors import InputError
from graphrt.layers.torch.forward_context import forward_context
from graphrt.models.hf_config import DecoderConfig
from graphrt.layers.torch.attention.paged import PagedAttention, TorchAttentionMetadata
from graphrt.models.torch.decoder import DecoderForCausalLM
from graphrt.models.torch.loader import load_torch_model
from support.hf_models import SLIDING, hf_logits, load_hf_model, make_tiny_hf_model, tiny_hf_model_dir
from support.parity import assert_bitwise, assert_close_across_shapes
from support.torch_steps import (BLOCK_SIZE, NUM_BLOCKS, TABLE_WIDTH, alloc_caches, assign_blocks, make_step,
                                 random_tokens, run, set_caches)

# (arch, overrides) of every model variant the tests cover.
VARIANTS = {
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3-tied", {}),
    "llama": ("llama", {}),
    "llama-bias": ("llama", {"attention_bias": True}),
    # Sliding windows of 5 tokens, shorter than the prompts: layer 1 of a hybrid Qwen3, every
    # layer of Mistral (issue 22).
    "qwen3-sliding": ("qwen3", SLIDING),
    "mistral": ("mistral", {"sliding_window": 5}),
}
PACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def model_dir(variant: str):
    arch, overrides = VARIANTS[variant]
    return tiny_hf_model_dir(arch, **overrides)


def rewrite_checkpoint(path, edit) -> None:
    """Apply ``edit(dict of tensors)`` to the single safetensors file of a private checkpoint."""
    (file,) = glob.glob(os.path.join(path, "*.safetensors"))
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


# ---------------------------------------------------------------------------- loader


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loader_matches_hf_parameters(variant):
    path = model_dir(variant)
    model = load_torch_model(path)
    hf_state = load_hf_model(path).state_dict()
    ours = dict(model.named_parameters(remove_duplicate=False))
    for i in range(model.config.num_hidden_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for kind in ("weight", "bias") if model.config.attention_bias else ("weight",):
            fused = torch.cat([hf_state[f"{attn}{p}_proj.{kind}"] for p in "qkv"])
            assert torch.equal(ours[f"{attn}qkv_proj.{kind}"], fused)
        fused = torch.cat([hf_state[f"{mlp}gate_proj.weight"], hf_state[f"{mlp}up_proj.weight"]])
        assert torch.equal(ours[f"{mlp}gate_up_proj.weight"], fused)
    plain = [k for k in hf_state if not any(f".{p}." in k for p in PACKED)]
    assert sorted(plain) == sorted(k for k in ours if not any(f".{p}." in k for p in PACKED.values()))
    for key in plain:
        assert torch.equal(ours[key], hf_state[key]), key
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == model.config.tie_word_embeddings
    assert not any(p.requires_grad for p in model.parameters())


def test_tied_checkpoint_may_carry_lm_head(tmp_path):
    path = make_tiny_hf_model(tmp_path, "qwen3-tied")
    rewrite_checkpoint(path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    with_head = load_torch_model(path)
    without = load_torch_model(model_dir("qwen3-tied"))
    assert with_head.lm_head.weight is with_head.model.embed_tokens.weight
    assert torch.equal(with_head.lm_head.weight, without.lm_head.weight)


def test_loader_dtype():
    model = load_torch_model(model_dir("llama"), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.__setitem__("model.layers.0.self_attn.rogue.weight", torch.zeros(2)), "unknown key"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.lora", torch.zeros(2)), "unknown key"),
    (lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"), r"missing.*qkv_proj\.weight\[k\]"),
    (lambda t: t.pop("model.norm.weight"), r"missing.*model\.norm\.weight"),
    (lambda t: t.pop("lm_head.weight"), r"missing.*lm_head\.weight"),
    (lambda t: t.__setitem__("model.norm.weight", torch.zeros(3)), "shape"),
    (lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 64)), "shape"),
])
def test_loader_rejects_bad_checkpoints(tmp_path, edit, match):
    path = make_tiny_hf_model(tmp_path, "llama")
    rewrite_checkpoint(path, edit)
    with pytest.raises(InputError, match=match):
        load_torch_model(path)


# ---------------------------------------------------------------------------- metadata / attention


def test_build_token_req_idx():
    qsl = torch.tensor([0, 3, 3, 5, 6, 6, 6], dtype=torch.int32)  # request 1 empty, 4 and 5 padded
    meta = TorchAttentionMetadata.build(torch.zeros(8, dtype=torch.int64), qsl,
                                        torch.tensor([3, 1, 2, 1, 0, 0], dtype=torch.int32),
                                        torch.zeros(6, 2, dtype=torch.int32), BLOCK_SIZE)
    assert meta.token_req_idx.dtype == torch.int64
    assert meta.token_req_idx.tolist() == [0, 0, 0, 2, 2, 3, 5, 5]


def test_padded_request_attention_is_exactly_zero():
    attn = PagedAttention(num_heads=4, num_kv_heads=2, head_dim=8)
    attn.kv_cache = torch.full((2, NUM_BLOCKS * BLOCK_SIZE + 1, 2, 8), float("nan"))
    step = make_step([([5, 6, 7], 0)], [[3]], pad_tokens=2, pad_reqs=1)
    q, k, v = torch.randn(5, 32), torch.randn(5, 16), torch.randn(5, 16)
    with forward_context(step.meta):
        out = attn(q, k, v)
    assert torch.isfinite(out[:3]).all()
    assert torch.equal(out[3:], torch.zeros(2, 32))


# ---------------------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_batch_matches_hf(variant):
    path = model_dir(variant)
    model, hf = load_torch_model(path), load_hf_model(path)
    vocab = model.config.vocab_size
    seqs = [random_tokens(n, vocab, seed=n) for n in (7, 13, 2)]
    tables = assign_blocks([len(s) for s in seqs])
    alloc_caches(model)
    step = make_step([(s, 0) for s in seqs], tables)
    logits = model.compute_logits(run(model, step))
    assert logits.dtype == torch.float32
    for seq, span in zip(seqs, step.spans):
        torch.testing.assert_close(logits[span], hf_logits(hf, seq), atol=1e-4, rtol=1e-4)


# Per step, per request: (first position, number of tokens); None = not scheduled.
CHUNKED_SCHEDULE = [
    [(0, 6), (0, 5)],    # both prefill, A in chunks
    [(6, 7), (5, 1)],    # A: rest of its prompt after reading 6 cached tokens; B decodes
    [(13, 1), (6, 1)],   # both decode
    [(14, 1), (7, 1)],
    [None, (8, 1)],      # A finished; B decodes alone
]


@pytest.mark.parametrize("variant", ["qwen3", "llama-bias", "qwen3-sliding", "mistral"])
def test_chunked_prefill_and_decode_match_hf(variant):
    path = model_dir(variant)
    model, hf = load_torch_model(path), load_hf_model(path)
    vocab = model.config.vocab_size
    seqs = [random_tokens(15, vocab, seed=1), random_tokens(9, vocab, seed=2)]
    tables = assign_blocks([len(s) for s in seqs], seed=3)
    alloc_caches(model)
    got = [torch.empty(len(s), vocab) for s in seqs]
    for sched in CHUNKED_SCHEDULE:
        live = [r for r, part in enumerate(sched) if part is not None]
        reqs = [(seqs[r][sched[r][0]:sched[r][0] + sched[r][1]], sched[r][0]) for r in live]
        step = make_step(reqs, [tables[r] for r in live])
        logits = model.compute_logits(run(model, step))
        for r, span in zip(live, step.spans):
            got[r][sched[r][0]:sched[r][0] + sched[r][1]] = logits[span]
    for seq, logits in zip(seqs, got):
        torch.testing.assert_close(logits, hf_logits(hf, seq), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------- padding safety


def _two_step_setup(variant: str, fill: str):
    """A model whose cache holds a first (prefill) step; returns model, caches, second-step args."""
    model = load_torch_model(model_dir(variant))
    vocab = model.config.vocab_size
    seqs = [random_tokens(13, vocab, seed=4), random_tokens(6, vocab, seed=5), random_tokens(3, vocab, seed=6)]
    tables = assign_blocks([len(s) for s in seqs], seed=7)
    caches = alloc_caches(model, fill=fill)
    run(model, make_step([(seqs[0][:6], 0), (seqs[1][:5], 0), (seqs[2][:2], 0)], tables))
    second = [(seqs[0][6:], 6), (seqs[1][5:], 5), (seqs[2][2:], 2)]
    return model, caches, second, tables


@pytest.mark.parametrize("pad_reqs", [0, 2])
def test_padding_leaves_real_outputs_and_cache_untouched(pad_reqs):
    """Real rows and KV writes of a padded step are within graphrt.tolerance of the unpadded
    step's (more rows may pick another matmul kernel), bitwise those of the same padded step
    run again; every KV row but the real slots and the trash row keeps its bytes."""
    model, caches, second, tables = _two_step_setup("qwen3", fill="randn")
    before = [c.clone() for c in caches]
    plain = make_step(second, tables)
    h_plain = run(model, plain)
    after_plain = [c.clone() for c in caches]

    set_caches(model, [c.clone() for c in before])
    padded = make_step(second, tables, pad_tokens=3, pad_reqs=pad_reqs)
    h_pad = run(model, padded)
    after_pad = [attn.kv_cache.clone() for attn in model.attention_layers()]
    num_real = plain.input_ids.shape[0]
    assert_close_across_shapes(h_pad[:num_real], h_plain)
    assert torch.isfinite(h_pad).all()
    set_caches(model, [c.clone() for c in before])
    assert_bitwise(run(model, padded), h_pad, "the same padded step again")
    for attn, first in zip(model.attention_layers(), after_pad):
        assert_bitwise(attn.kv_cache, first, "the same padded step's KV writes")

    trash = NUM_BLOCKS * BLOCK_SIZE
    untouched = torch.ones(trash + 1, dtype=torch.bool)
    untouched[plain.real_slots] = False
    untouched[trash] = False
    for attn, old, ref in zip(model.attention_layers(), before, after_plain):
        new = attn.kv_cache
        assert torch.equal(new[:, untouched].view(torch.int32), old[:, untouched].view(torch.int32))
        assert torch.equal(ref[:, untouched].view(torch.int32), old[:, untouched].view(torch.int32))
        assert_close_across_shapes(new[:, plain.real_slots], ref[:, plain.real_slots])


def test_nan_in_unused_cache_rows_does_not_leak():
    model, caches, second, tables = _two_step_setup("llama-bias", fill="zeros")
    step = make_step(second, tables, pad_tokens=2, pad_reqs=1)
    clean = [c.clone() for c in caches]
    h_clean = run(model, step)

    poisoned = [c.clone() for c in clean]
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE + 1, dtype=torch.bool)
    written[torch.tensor([t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                          for t, n in zip(tables, (6, 5, 2)) for p in range(n)])] = True
    for cache in poisoned:
        cache[:, ~written] = float("nan")
    set_caches(model, poisoned)
    h_poisoned = run(model, step)
    assert torch.isfinite(h_poisoned).all()
    assert torch.equal(h_poisoned, h_clean)


# ---------------------------------------------------------------------------- capturability


def test_forward_runs_on_meta_tensors():
    """Meta tensors have no data: any host sync, boolean-mask index or data-dependent
    shape in build/forward would raise here, so this stands in for a graph capture on CPU."""
    config = DecoderConfig.from_dir(model_dir("qwen3"))
    with torch.device("meta"):
        model = DecoderForCausalLM(config)
        for attn in model.attention_layers():
            (group,) = model.kv_cache_spec().groups
            attn.kv_cache = torch.empty(2, NUM_BLOCKS * BLOCK_SIZE + 1, group.num_kv_heads, group.head_size)
        num_tokens, num_reqs = 10, 4
        meta = TorchAttentionMetadata.build(
            torch.empty(num_tokens, dtype=torch.int64), torch.empty(num_reqs + 1, dtype=torch.int32),
            torch.empty(num_reqs, dtype=torch.int32), torch.empty(num_reqs, TABLE_WIDTH, dtype=torch.int32),
            BLOCK_SIZE)
        with torch.no_grad(), forward_context(meta):
            hidden = model(torch.empty(num_tokens, dtype=torch.int64), torch.empty(num_tokens, dtype=torch.int64))
        logits = model.compute_logits(hidden)
    assert hidden.shape == (num_tokens, config.hidden_size)
    assert logits.shape == (num_tokens, config.vocab_size) and logits.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_capture_and_replay_matches_eager():
    model = load_torch_model(model_dir("qwen3"), device="cuda")
    vocab = model.config.vocab_size
    seqs = [random_tokens(n, vocab, seed=n) for n in (5, 3)]
    tables = assign_blocks([len(s) for s in seqs], seed=8)
    size, reqs = 8, 3  # captured batch: 8 tokens, 3 request rows

    def padded(step_reqs):
        step = make_step(step_reqs, tables[:len(step_reqs)],
                         pad_tokens=size - sum(len(t) for t, _ in step_reqs), pad_reqs=reqs - len(step_reqs))
        m = step.meta
        return [t.cuda() for t in (step.input_ids, step.positions, m.slot_mapping, m.query_start_loc,
                                   m.seq_lens, m.block_table)], step

    values, step = padded([(seqs[0], 0), (seqs[1], 0)])
    static = [torch.zeros_like(t) for t in values]  # captured on an all-padding batch
    caches = [c.cuda() for c in alloc_caches(model)]
    set_caches(model, caches)

    def forward():
        ids, pos, slots, qsl, lens, table = static
        meta = TorchAttentionMetadata.build(slots, qsl, lens, table, BLOCK_SIZE)
        with forward_context(meta):
            return model(ids, pos)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = forward()

    for c in caches:
        c.zero_()
    for dst, src in zip(static, values):
        dst.copy_(src)
    graph.replay()
    replayed = out.clone()
    for c in caches:
        c.zero_()
    with torch.no_grad():
        eager = forward()
    torch.testing.assert_close(replayed, eager)
    hf = load_hf_model(model_dir("qwen3"))
    logits = model.compute_logits(replayed).cpu()
    for seq, span in zip(seqs, step.spans):
        torch.testing.assert_close(logits[span], hf_logits(hf, seq), atol=1e-4, rtol=1e-4)
