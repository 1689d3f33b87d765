"""Parity and safety tests of the JAX reference decoder (paged KV cache) against transformers."""

from __future__ import annotations

import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from graphrt.core.errors import InputError  # noqa: E402
from graphrt.layers.jax.paged_attention import AttentionMetadata, paged_attention  # noqa: E402
from graphrt.models.jax.decoder import compute_logits, forward, init_kv_cache  # noqa: E402
from graphrt.models.jax.loader import load_jax_params  # noqa: E402
from support.hf_models import SLIDING, hf_logits, load_hf_model, make_tiny_hf_model, tiny_hf_model_dir  # noqa: E402

# One batch shape for every forward in this file, so each config compiles once.
T, R, B, BS, NB = 16, 4, 4, 4, 16
TRASH = NB * BS

_FWD = jax.jit(forward, static_argnames=("config", "block_size"), donate_argnames=("kv_cache",))

VARIANTS = {
    "qwen3": dict(arch="qwen3", rope_theta=1e6),
    "qwen3_tied": dict(arch="qwen3-tied"),
    "llama_bias": dict(arch="llama", attention_bias=True, rope_theta=5e5),
    # Sliding windows of 5 tokens (layer 1 of a hybrid Qwen3; every Mistral layer), shorter than
    # the chunked test's sequences (issue 22).
    "qwen3_sliding": dict(arch="qwen3", **SLIDING),
    "mistral": dict(arch="mistral", sliding_window=5),
}


@pytest.fixture(scope="module")
def models():
    """variant name -> (shared read-only model dir, HF eager float32 model, graphrt config, params)."""
    out = {}
    for name, spec in VARIANTS.items():
        d = tiny_hf_model_dir(**spec)
        cfg, params = load_jax_params(d)
        out[name] = (str(d), load_hf_model(d), cfg, params)
    return out


def ref_logits(hf, tokens: list[int]) -> np.ndarray:
    return hf_logits(hf, tokens).numpy()


def make_step(chunks: list[tuple[list[int], int, list[int]]], pad_ids=None, pad_pos=None):
    """Flatten (tokens, start position, blocks) chunks into padded inputs for one forward step.

    Returns (input_ids, positions, meta, spans) where spans[i] is the token slice of chunk i.
    """
    ids, pos, slots, qsl, lens, spans = [], [], [], [0], [], []
    table = np.zeros((R, B), np.int32)
    for r, (tokens, start, blocks) in enumerate(chunks):
        first = len(ids)
        for i, tok in enumerate(tokens):
            p = start + i
            ids.append(tok)
            pos.append(p)
            slots.append(blocks[p // BS] * BS + p % BS)
        spans.append(slice(first, len(ids)))
        qsl.append(len(ids))
        lens.append(start + len(tokens))
        table[r, :len(blocks)] = blocks
    n_pad = T - len(ids)
    ids += list(pad_ids if pad_ids is not None else [0] * n_pad)
    pos += list(pad_pos if pad_pos is not None else [0] * n_pad)
    slots += [-1] * n_pad
    qsl += [qsl[-1]] * (R - len(chunks))
    lens += [0] * (R - len(chunks))
    meta = AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32), query_start_loc=jnp.asarray(qsl, jnp.int32),
        seq_lens=jnp.asarray(lens, jnp.int32), block_table=jnp.asarray(table))
    return jnp.asarray(ids, jnp.int32), jnp.asarray(pos, jnp.int32), meta, spans


def real_slots(meta: AttentionMetadata) -> np.ndarray:
    slots = np.asarray(meta.slot_mapping)
    return slots[slots >= 0]


SEQS = [[5, 17, 99, 3, 42], [7, 8, 120], [1, 64, 33, 2, 90, 11]]
BLOCKS = [[7, 2], [5], [3, 11]]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loader_matches_hf_weights(models, variant):
    _, hf, cfg, params = models[variant]
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    np.testing.assert_array_equal(params["embed"], sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params["norm"], sd["model.norm.weight"])
    if cfg.tie_word_embeddings:
        assert "lm_head" not in params
    else:
        np.testing.assert_array_equal(params["lm_head"], sd["lm_head.weight"].T)
    names = {"wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
             "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
             "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
             "w_down": "mlp.down_proj.weight"}
    vectors = {"input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight"}
    if cfg.qk_norm:
        vectors.update(q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight")
    if cfg.attention_bias:
        vectors.update(bq="self_attn.q_proj.bias", bk="self_attn.k_proj.bias",
                       bv="self_attn.v_proj.bias", bo="self_attn.o_proj.bias")
    assert set(params["layers"]) == set(names) | set(vectors)
    for layer in range(cfg.num_hidden_layers):
        for ours, theirs in names.items():
            np.testing.assert_array_equal(params["layers"][ours][layer],
                                          sd[f"model.layers.{layer}.{theirs}"].T)
        for ours, theirs in vectors.items():
            np.testing.assert_array_equal(params["layers"][ours][layer],
                                          sd[f"model.layers.{layer}.{theirs}"])
    assert cfg.rope_theta == hf.config.rope_parameters["rope_theta"]


def test_loader_bf16_checkpoint(models, tmp_path):
    d = str(tmp_path / "bf16")
    load_hf_model(models["qwen3"][0]).to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    hf_sd = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).state_dict()
    want = hf_sd["model.layers.1.self_attn.q_proj.weight"].float().numpy().T
    _, p16 = load_jax_params(d, dtype=jnp.bfloat16)
    _, p32 = load_jax_params(d)
    assert p16["layers"]["wq"].dtype == jnp.bfloat16 and p32["layers"]["wq"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(p16["layers"]["wq"][1], np.float32), want)
    np.testing.assert_array_equal(p32["layers"]["wq"][1], want)


def _rewrite_checkpoint(src: str, tmp_dir: str, edit) -> str:
    dst = str(make_tiny_hf_model(tmp_dir, **VARIANTS[src]))
    path = os.path.join(dst, "model.safetensors")
    tensors = safetensors_numpy.load_file(path)
    edit(tensors)
    safetensors_numpy.save_file(tensors, path)
    return dst


def test_loader_rejects_unknown_and_missing_keys(models, tmp_path):
    src = "qwen3"
    extra = "model.layers.0.mlp.gate_proj.bias"
    d = _rewrite_checkpoint(src, str(tmp_path / "extra"),
                            lambda t: t.__setitem__(extra, np.zeros(128, np.float32)))
    with pytest.raises(InputError) as err:
        load_jax_params(d)
    assert err.value.field == extra
    gone = "model.layers.1.self_attn.k_norm.weight"
    d = _rewrite_checkpoint(src, str(tmp_path / "missing"), lambda t: t.pop(gone))
    with pytest.raises(InputError) as err:
        load_jax_params(d)
    assert err.value.field == gone
    d = _rewrite_checkpoint(src, str(tmp_path / "nohead"), lambda t: t.pop("lm_head.weight"))
    with pytest.raises(InputError, match="lm_head.weight"):
        load_jax_params(d)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batched_prefill_matches_hf_and_ignores_nan_cache(models, variant):
    _, hf, cfg, params = models[variant]
    ids, pos, meta, spans = make_step([(s, 0, b) for s, b in zip(SEQS, BLOCKS)])
    cache = jnp.full(init_kv_cache(cfg, NB, BS, jnp.float32).shape, jnp.nan, jnp.float32)
    before = np.asarray(cache)
    hidden, new_cache = _FWD(params, cache, ids, pos, meta, config=cfg, block_size=BS)
    logits = np.asarray(compute_logits(params, hidden, config=cfg))
    assert logits.dtype == np.float32 and logits.shape == (T, cfg.vocab_size)
    for seq, span in zip(SEQS, spans):
        np.testing.assert_allclose(logits[span], ref_logits(hf, seq), rtol=1e-4, atol=1e-4)
    assert np.isfinite(np.asarray(hidden)).all()
    after = np.asarray(new_cache)
    written = real_slots(meta)
    assert np.isfinite(after[:, :, written]).all()
    untouched = np.setdiff1d(np.arange(TRASH), written)
    np.testing.assert_array_equal(after[:, :, untouched], before[:, :, untouched])


def test_padding_content_does_not_change_real_outputs(models):
    _, _, cfg, params = models["qwen3"]
    chunks = [(s, 0, b) for s, b in zip(SEQS[:2], BLOCKS[:2])]
    n_pad = T - sum(len(s) for s in SEQS[:2])
    runs = []
    for pad_ids, pad_pos in [(None, None), (list(range(3, 3 + n_pad)), list(range(20, 20 + n_pad)))]:
        ids, pos, meta, spans = make_step(chunks, pad_ids, pad_pos)
        cache = init_kv_cache(cfg, NB, BS, jnp.float32)
        hidden, new_cache = _FWD(params, cache, ids, pos, meta, config=cfg, block_size=BS)
        runs.append((np.asarray(hidden), np.asarray(new_cache)))
        assert np.isfinite(runs[-1][0]).all()
        untouched = np.setdiff1d(np.arange(TRASH), real_slots(meta))
        assert not runs[-1][1][:, :, untouched].any()
    real = slice(0, spans[-1].stop)
    np.testing.assert_array_equal(runs[0][0][real], runs[1][0][real])
    np.testing.assert_array_equal(runs[0][1][:, :, :TRASH], runs[1][1][:, :, :TRASH])


def test_paged_attention_zero_for_empty_requests_with_nan_cache():
    rng = np.random.default_rng(0)
    rows, heads, kv_heads, d = NB * BS + 1, 4, 2, 8
    k = np.full((rows, kv_heads, d), np.nan, np.float32)
    v = np.full((rows, kv_heads, d), np.nan, np.float32)
    k[8:11], v[8:11] = rng.normal(size=(2, 3, kv_heads, d))
    q = jnp.asarray(rng.normal(size=(T, heads, d)), jnp.float32)
    qsl = jnp.asarray([0, 3, 3, 3, 3], jnp.int32)  # one real request with 3 tokens, three empty
    meta = AttentionMetadata(slot_mapping=jnp.full((T,), -1, jnp.int32), query_start_loc=qsl,
                             seq_lens=jnp.asarray([3, 0, 0, 0], jnp.int32),
                             block_table=jnp.asarray([[2, 0, 0, 0]] + [[0] * B] * 3, jnp.int32))
    positions = jnp.asarray([0, 1, 2] + [0] * (T - 3), jnp.int32)
    out = np.asarray(paged_attention(q, jnp.asarray(k), jnp.asarray(v), positions, meta, BS))
    assert np.isfinite(out[:3]).all() and out[:3].any()
    np.testing.assert_array_equal(out[3:], 0.0)
    # Token 0 sees only key 0, so its output is v[8] repeated over the query heads of each kv head.
    np.testing.assert_allclose(out[0], np.repeat(v[8], heads // kv_heads, axis=0), rtol=1e-6)
    # No padded request: four real decode tokens; the padded tokens after them still see nothing.
    decode = meta._replace(query_start_loc=jnp.arange(R + 1, dtype=jnp.int32),
                           seq_lens=jnp.full((R,), 3, jnp.int32),
                           block_table=jnp.asarray([[2, 0, 0, 0]] * R, jnp.int32))
    positions = jnp.asarray([2] * R + [0] * (T - R), jnp.int32)
    out = np.asarray(paged_attention(q, jnp.asarray(k), jnp.asarray(v), positions, decode, BS))
    assert np.isfinite(out[:R]).all() and out[:R].any()
    np.testing.assert_array_equal(out[R:], 0.0)


@pytest.mark.parametrize("variant", ["qwen3", "llama_bias", "qwen3_sliding", "mistral"])
def test_chunked_prefill_then_decode_matches_hf(models, variant):
    _, hf, cfg, params = models[variant]
    seq_a = [9, 100, 31, 4, 77, 5, 60, 12, 88, 45, 23]  # 9 prompt + 2 decoded
    seq_b = [14, 2, 101, 56, 70, 19, 3]  # 4 prompt + 3 decoded
    blocks_a, blocks_b = [9, 4, 13], [6, 1]
    ref_a, ref_b = ref_logits(hf, seq_a), ref_logits(hf, seq_b)
    steps = [  # (a_start, a_end, b_start, b_end, b_first)
        (0, 5, 0, 4, False), (5, 9, 4, 5, True), (9, 10, 5, 6, False), (10, 11, 6, 7, True),
    ]
    cache = init_kv_cache(cfg, NB, BS, jnp.float32)
    for a0, a1, b0, b1, b_first in steps:
        chunk_a = (seq_a[a0:a1], a0, blocks_a)
        chunk_b = (seq_b[b0:b1], b0, blocks_b)
        chunks = [chunk_b, chunk_a] if b_first else [chunk_a, chunk_b]
        ids, pos, meta, spans = make_step(chunks)
        old = cache
        hidden, cache = _FWD(params, cache, ids, pos, meta, config=cfg, block_size=BS)
        assert old.is_deleted()
        logits = np.asarray(compute_logits(params, hidden, config=cfg))
        span_a, span_b = (spans[1], spans[0]) if b_first else (spans[0], spans[1])
        np.testing.assert_allclose(logits[span_a], ref_a[a0:a1], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(logits[span_b], ref_b[b0:b1], rtol=1e-4, atol=1e-4)


def test_nnx_split_merge_matches_forward(models):
    nnx = pytest.importorskip("flax.nnx")
    from graphrt.models.jax.nnx import NnxDecoder, nnx_forward

    _, _, cfg, params = models["qwen3"]
    ids, pos, meta, _ = make_step([(s, 0, b) for s, b in zip(SEQS, BLOCKS)])
    want_hidden, want_cache = _FWD(params, init_kv_cache(cfg, NB, BS, jnp.float32), ids, pos, meta,
                                   config=cfg, block_size=BS)
    module = NnxDecoder(cfg, params, block_size=BS)
    graphdef, state = nnx.split(module)
    run = jax.jit(nnx_forward, static_argnums=0, donate_argnames=("kv_cache",))
    hidden, cache = run(graphdef, state, init_kv_cache(cfg, NB, BS, jnp.float32), ids, pos, meta)
    np.testing.assert_allclose(hidden, want_hidden, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(cache, want_cache, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(module.compute_logits(hidden), compute_logits(params, hidden, config=cfg),
                               rtol=1e-6, atol=1e-6)
