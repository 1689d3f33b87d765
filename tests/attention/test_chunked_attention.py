"""Chunked local attention (Llama 4's ``chunked_attention`` layers) through graphrt (issue 45).

A token at position p attends to (p // C) * C .. p only: ``KVCacheGroup.attention_chunk``, the
reference kernel's chunk mask (its property test, tests/attention/test_reference_kernel.py, draws
chunks too) and the JAX kernel's. Here:

* the spec's checks (a chunk is an int >= 0, never beside a window) and the kernels that do not
  run chunks refusing them by name;
* the JAX kernel's chunk mask against the torch reference's;
* teacher-forced parity with transformers' own forward for a tiny ``llama4_text`` (chunks of 4
  tokens; layer 0 chunked with RoPE, layer 1 full and NoPE with the query temperature at each
  token's position): 4 requests joining at different steps, prompts longer than a chunk, chunked
  prefill, a preempted request recomputed, on ``eager`` and ``cpu`` FULL graphs;
* the kit's ``kv_isolated`` and ``padding_invisible`` on it;
* graphrt's own JAX Llama 4 on ``xla`` (Llama 3's rotary scaling, experts with a shared expert
  beside a dense layer): the same parity, and the config fields it refuses by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import graphrt
from graphrt.core.errors import ConfigError
from graphrt.core.kv_spec import KVCacheGroup, KVCacheSpec, resolve_kv_spec
from graphrt.layers.torch.attention.paged import PagedAttention, TorchAttentionMetadata, paged_attention_kernel
from support.hybrid_parity import run_schedule

transformers = pytest.importorskip("transformers")

from transformers_zoo import load_reference, reference_logits, tiny_checkpoint  # noqa: E402

CHUNK = 4
#: Llama 4's pattern: RoPE layers chunked, NoPE layers full with the query temperature (a floor
#: scale of 4 tokens, so that the temperature changes within the test prompts).
LLAMA4 = dict(attention_chunk_size=CHUNK, layer_types=["chunked_attention", "full_attention"],
              no_rope_layers=[1, 0], floor_scale=4, attn_scale=0.5)
LIMITS = dict(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=32, block_size=4, num_kv_blocks=33)
SHAPES = {"eager": {}, "cpu": dict(cudagraph_capture_sizes=[4, 16])}


def _resolve(*groups: KVCacheGroup) -> KVCacheSpec:
    return resolve_kv_spec(KVCacheSpec(groups), block_size=4, model_dtype="float32", supported={"float32"},
                           backend="eager")


def test_the_spec_keeps_a_chunk_and_refuses_a_bad_one():
    spec = _resolve(KVCacheGroup((0,), 2, 16, attention_chunk=8), KVCacheGroup((1,), 2, 16))
    assert spec.attention_chunks == (8, 0) and spec.sliding_windows == (0, 0)
    with pytest.raises(ConfigError, match=r"groups\[0\]\.attention_chunk: must be an int >= 0"):
        _resolve(KVCacheGroup((0,), 2, 16, attention_chunk=-1))
    with pytest.raises(ConfigError, match=r"groups\[0\]: sliding_window 4 and attention_chunk 8"):
        _resolve(KVCacheGroup((0,), 2, 16, sliding_window=4, attention_chunk=8))


def test_kernels_without_chunks_refuse_them_by_name():
    from graphrt.layers.torch.attention.flashinfer_attention import FlashInferAttentionBackend
    from graphrt.layers.torch.attention.paged import run_paged_attention

    layer = PagedAttention(4, 2, 16, attention_chunk=CHUNK)
    with pytest.raises(ConfigError, match=r"flashinfer: attention layers \[0\] attend within chunks"):
        FlashInferAttentionBackend([layer])
    meta = TorchAttentionMetadata.build(torch.tensor([4]), torch.tensor([0, 1], dtype=torch.int32),
                                        torch.tensor([1], dtype=torch.int32), torch.tensor([[1]], dtype=torch.int32), 4)
    q = torch.zeros(1, 64)
    with pytest.raises(ConfigError, match="reference kernel only, not 'triton'"):
        run_paged_attention(q, q[:, :32], q[:, :32], torch.zeros(2, 9, 2, 16), meta.slot_mapping,
                            meta.query_start_loc, meta.seq_lens, meta.block_table, meta.token_req_idx, 4, 0.25,
                            kernel="triton", attention_chunk=CHUNK)


def test_the_jax_kernel_masks_chunks_as_the_reference_does():
    jnp = pytest.importorskip("jax.numpy")
    from graphrt.layers.jax.paged_attention import AttentionMetadata, paged_attention

    gen = torch.Generator().manual_seed(3)
    bs, width = 4, 4
    computed, scheduled = [9, 0], [3, 11]           # a continuing request and a prefill, both crossing chunks
    lens = [c + n for c, n in zip(computed, scheduled)]
    table = torch.tensor([[1, 2, 3, 0], [4, 5, 6, 0]], dtype=torch.int32)
    slots = [int(table[r, p // bs]) * bs + p % bs for r in range(2) for p in range(computed[r], lens[r])]
    qsl = torch.tensor([0, 3, 14], dtype=torch.int32)
    k_cache, v_cache = torch.randn(2, 7 * bs + 1, 2, 16, generator=gen)
    q, k, v = torch.randn(14, 64, generator=gen), torch.randn(14, 32, generator=gen), torch.randn(14, 32, generator=gen)
    meta = TorchAttentionMetadata.build(torch.tensor(slots), qsl, torch.tensor(lens, dtype=torch.int32), table, bs)
    cache = torch.stack([k_cache, v_cache])
    want = paged_attention_kernel(q, k, v, cache, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                                  meta.block_table, meta.token_req_idx, bs, 16 ** -0.5, attention_chunk=CHUNK)
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(computed, scheduled)])
    jmeta = AttentionMetadata(slot_mapping=jnp.asarray(np.array(slots)), block_table=jnp.asarray(table.numpy()),
                              seq_lens=jnp.asarray(np.array(lens, np.int32)),
                              query_start_loc=jnp.asarray(qsl.numpy()))
    got = paged_attention(jnp.asarray(q.view(14, 4, 16).numpy()), jnp.asarray(cache[0].numpy()),
                          jnp.asarray(cache[1].numpy()), jnp.asarray(positions.astype(np.int32)), jmeta, bs,
                          attention_chunk=CHUNK)
    full = paged_attention_kernel(q, k, v, cache.clone(), meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                                  meta.block_table, meta.token_req_idx, bs, 16 ** -0.5)
    tol = graphrt.reduction_tolerance("float32", magnitude=4.0, width=16)
    torch.testing.assert_close(torch.from_numpy(np.array(got)).reshape(14, 64), want, rtol=tol.rtol, atol=tol.atol)
    assert not torch.allclose(full, want), "the chunk must change what the tokens past a chunk read"


@pytest.mark.parametrize("backend,mode", [("eager", "NONE"), ("cpu", "FULL")])
def test_teacher_forced_parity_with_transformers_llama4(backend, mode):
    d = tiny_checkpoint("llama4_text", **LLAMA4)
    rng = np.random.default_rng(5)
    seqs = [[int(t) for t in rng.integers(3, 128, size=n)] for n in (13, 7, 18, 9)]
    runner = graphrt.ModelRunner(str(d), backend=backend, mode=mode, model_impl="transformers", progress=False,
                                 **SHAPES[backend], **LIMITS)
    assert runner.model.kv_cache_spec().attention_chunks == (CHUNK, 0)
    assert [layer.temperature for layer in runner.model.paged] == [None, (4.0, 0.5)]
    ref = load_reference(d)
    refs = [reference_logits(ref, s).numpy() for s in seqs]
    assert run_schedule(runner, seqs, refs, chunk=5, joins=[0, 0, 1, 3], preempt={2: 0}) >= 8
    if backend == "cpu":
        assert runner.stats.hits > 0 and runner.stats.eager_steps == 0


def test_kit_kv_isolation_and_padding_on_llama4():
    from graphrt.testing.conformance import run_conformance
    from graphrt.testing.runners import RunnerFactory

    from graphrt.models.torch.transformers_impl import load_transformers_model

    d = tiny_checkpoint("llama4_text", **LLAMA4)
    factory = RunnerFactory(lambda: load_transformers_model(d), "cpu", mode="FULL_AND_PIECEWISE",
                            cudagraph_capture_sizes=[2, 4, 8, 16])
    results = run_conformance(factory=factory, properties=["kv_isolated", "padding_invisible"], examples=6,
                              report=None)
    assert [r.status for r in results] == ["PASS"] * 2, [r.line() for r in results]


#: Llama 4 checkpoints' rotary (Llama 3's scaling), its original context short enough that the
#: test positions turn the scaled frequencies visibly.
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)


def test_teacher_forced_parity_with_transformers_llama4_on_xla():
    """graphrt's JAX Llama 4 (models/jax/llama4.py) on xla: layer 0 chunked with interleaved
    Llama-3-scaled rotary, the q / k L2 norm and experts with a shared expert, layer 1 full and
    NoPE with the query temperature and a dense MLP; the schedule's every step against
    transformers' forward (prompts longer than a chunk). The config it reads (its rotary
    frequencies transformers'), its KV spec, and the torch backends still running transformers'
    model for it."""
    from graphrt.models.hf_config import DecoderConfig
    from graphrt.models.model_impl import resolve_model_impl

    d = tiny_checkpoint("llama4_text", **LLAMA4, moe_layers=[0], intermediate_size_mlp=96, rope_parameters=LLAMA3_ROPE)
    rng = np.random.default_rng(5)
    seqs = [[int(t) for t in rng.integers(3, 128, size=n)] for n in (13, 7, 18, 9)]
    ref = load_reference(d)
    refs = [reference_logits(ref, s).numpy() for s in seqs]
    runner = graphrt.ModelRunner(str(d), backend="xla", progress=False, precompile_token_paddings=[16],
                                 precompile_bs_paddings=[4], **LIMITS)
    assert run_schedule(runner, seqs, refs, chunk=5, joins=[0, 0, 1, 3], preempt={2: 0}) >= 8
    assert runner.stats.hits > 0 and runner.stats.eager_steps == 0
    config = DecoderConfig.from_dir(d)
    assert (config.rope_layers, config.chunked_layers, config.moe_layers) == ((True, False), (0,), (0,))
    assert config.temperature == (4.0, 0.5) and config.qk_norm
    assert [(g.layers, g.attention_chunk) for g in config.kv_cache_spec().groups] == [((0,), CHUNK), ((1,), 0)]
    np.testing.assert_allclose(config.inv_freq(), ref.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)
    assert resolve_model_impl(d, "auto", framework="torch") == "transformers"
    with pytest.raises(graphrt.InputError, match="graphrt's own torch models do not implement Llama4ForCausalLM"):
        resolve_model_impl(d, "graphrt", framework="torch")


def test_the_jax_llama4_config_names_what_it_does_not_implement():
    """Llama4Config.from_dict: transformers' defaults (NoPE every 4th layer, the others chunked,
    experts everywhere) and an InputError naming the field for what graphrt's JAX model lacks."""
    from graphrt.models.llama4_config import Llama4Config

    raw = dict(architectures=["Llama4ForCausalLM"], vocab_size=128, hidden_size=64, num_hidden_layers=4,
               num_attention_heads=4)
    c = Llama4Config.from_dict(raw)
    assert (c.rope_layers, c.chunked_layers, c.attention_chunk) == ((True, True, True, False), (0, 1, 2), 8192)
    assert c.moe_layers == (0, 1, 2, 3) and c.temperature == (8192.0, 0.1) and c.rope_scaling is None
    with pytest.raises(graphrt.InputError, match=r"rope_parameters: .*'yarn'.* default or llama3 rotary"):
        Llama4Config.from_dict({**raw, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(graphrt.InputError, match="rope_parameters: .*llama3 rotary needs 'low_freq_factor'"):
        Llama4Config.from_dict({**raw, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(graphrt.InputError, match="layer_types: .*'chunked_attention' or 'full_attention'"):
        Llama4Config.from_dict({**raw, "layer_types": ["sliding_attention"] * 4})
    with pytest.raises(graphrt.InputError, match=r"attention_chunk_size: 0, but layers \[0\] are chunked"):
        Llama4Config.from_dict({**raw, "attention_chunk_size": 0,
                                "layer_types": ["chunked_attention"] + ["full_attention"] * 3})
