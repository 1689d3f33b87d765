"""Mamba, Falcon-Mamba, LFM2, Jamba, RecurrentGemma and MiniMax as graphrt's JAX hybrid models on
``backend="xla"`` (issue 45).

Their JAX layers (``models/jax/hybrid.py``) call the JAX reference kernels of
``layers/jax/recurrent.py`` -- Mamba1's selective scan (Jamba's beside attention and experts),
LFM2's short convolution, RecurrentGemma's RG-LRU (beside local attention of a window shorter than
the prompts), MiniMax's lightning attention (beside attention and experts, residual factors) --
over graphrt's state cache (state slots, the trash slot for padded rows). Here:

* teacher-forced parity with transformers' own forward: 4 requests of 7-18 tokens joining at
  steps 0, 0, 1 and 3, chunked prefill (chunks of 5), request 2 preempted and recomputed in
  another slot (support/hybrid_parity.run_schedule, the torch parity tests' schedule);
* the kit's ``state_isolated``, ``kv_isolated`` and ``padding_invisible`` on Jamba on xla;
* the configs graphrt reads and the state specs they declare; on the torch backends the same
  checkpoints still run transformers' model (graphrt's own torch models do not implement them),
  and an architecture with no JAX model is refused on xla with a ConfigError naming it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import graphrt
from graphrt import ConfigError
from graphrt.core.state_spec import StateGroup, StateTensor
from graphrt.models.hf_config import DecoderConfig
from graphrt.models.model_impl import resolve_model_impl
from support.hybrid_models import hybrid_model_dir, load_hf_hybrid
from support.hybrid_parity import reference_logits, run_schedule

LENGTHS = (13, 7, 18, 9)
#: The xla runs: one token bucket of 16 and one of 4 requests hold every step of the schedule.
XLA = dict(precompile_token_paddings=[16], precompile_bs_paddings=[4], max_num_seqs=3, max_num_batched_tokens=16,
           max_model_len=32, block_size=4, num_kv_blocks=33)


@pytest.mark.parametrize("arch", ["mamba", "falcon_mamba", "lfm2", "jamba", "recurrent_gemma"])
def test_teacher_forced_parity_with_transformers_on_xla(arch):
    d = hybrid_model_dir(arch)
    rng = np.random.default_rng(5)
    seqs = [[int(t) for t in rng.integers(3, 128, size=n)] for n in LENGTHS]
    refs = reference_logits(load_hf_hybrid(d), seqs)
    runner = graphrt.ModelRunner(str(d), backend="xla", progress=False, **XLA)
    assert runner.executor.num_state_slots == 3
    assert run_schedule(runner, seqs, refs, chunk=5, joins=[0, 0, 1, 3], preempt={2: 0}) >= 8


def test_kit_state_isolation_on_xla():
    """Jamba (Mamba1 layers, attention, experts) on xla, with speculative decoding's K+1
    checkpoints: no request's state or KV reaches another's, padded rows write the trash slot
    and the trash block only. (With every trash-slot write planted into slot 0, 10 examples find
    it: a one-token decode step changing slot 0's other checkpoint.)"""
    from graphrt.testing import state_sweep
    from graphrt.testing.conformance import run_conformance
    from graphrt.testing.runners import RunnerFactory

    factory = RunnerFactory(str(hybrid_model_dir("jamba")), "xla", num_speculative_tokens=1,
                            **state_sweep.XLA_GRID)
    results = run_conformance(factory=factory, properties=["state_isolated", "kv_isolated", "padding_invisible"],
                              examples=10, report=None)
    assert [r.status for r in results] == ["PASS"] * 3, [r.line() for r in results]


def test_configs_state_specs_and_where_each_backend_runs_them(tmp_path):
    """What HybridConfig reads of each checkpoint and the state it declares; torch backends keep
    transformers' model for them (``model_impl="graphrt"`` refused naming the architecture);
    xla refuses an architecture it has no JAX model of with a ConfigError naming it."""
    mamba = DecoderConfig.from_dir(hybrid_model_dir("mamba"))
    assert mamba.layer_kinds == ("mamba1", "mamba1") and (mamba.dt_rank, mamba.scan_norm) == (8, "none")
    assert mamba.kv_cache_spec().groups == ()
    assert mamba.state_spec().groups == (StateGroup((0, 1), (StateTensor("conv", (128, 3)),
                                                             StateTensor("ssm", (128, 8))), "mamba1"),)
    assert DecoderConfig.from_dir(hybrid_model_dir("falcon_mamba")).scan_norm == "unweighted"
    lfm2 = DecoderConfig.from_dir(hybrid_model_dir("lfm2"))
    assert lfm2.layer_kinds == ("short_conv", "attention", "short_conv") and lfm2.intermediate_size == 256
    assert lfm2.state_spec().groups == (StateGroup((0, 1), (StateTensor("conv", (64, 2)),), "short_conv"),)
    assert len(lfm2.kv_cache_spec().groups[0].layers) == 1
    jamba = DecoderConfig.from_dir(hybrid_model_dir("jamba"))
    assert jamba.layer_kinds == ("mamba1", "attention", "mamba1") and jamba.moe_layers == (1,)
    assert (jamba.scan_norm, jamba.rope_theta) == ("weighted", None)
    gemma = DecoderConfig.from_dir(hybrid_model_dir("recurrent_gemma"))
    assert gemma.layer_kinds == ("rg_lru", "attention", "rg_lru") and gemma.sliding_window == 6
    assert (gemma.rotary_dim, gemma.embedding_multiplier, gemma.logits_soft_cap) == (8, 8.0, 30.0)
    assert gemma.state_spec().groups == (StateGroup((0, 1), (StateTensor("conv", (48, 3)),
                                                             StateTensor("lru", (48,))), "rg_lru"),)
    for arch in ("mamba", "falcon_mamba", "lfm2", "jamba", "recurrent_gemma"):
        d = hybrid_model_dir(arch)
        assert resolve_model_impl(d, "auto", framework="torch") == "transformers"
        assert resolve_model_impl(d, "auto", framework="jax") == "graphrt"
        with pytest.raises(graphrt.InputError, match="graphrt's own torch models do not implement .*ForCausalLM"):
            resolve_model_impl(d, "graphrt", framework="torch")
    raw = json.loads((hybrid_model_dir("lfm2") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "architectures": ["Lfm2MoeForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"architectures: \['Lfm2MoeForCausalLM'\] has no jax model in "
                                          r"graphrt \(its jax models: .*'RecurrentGemmaForCausalLM'.*\]"):
        graphrt.ModelRunner(str(tmp_path), backend="xla", progress=False, **XLA)


#: MiniMax with residual factors other than 1 (each part's own alpha and beta).
MINIMAX = dict(full_attn_alpha_factor=1.25, full_attn_beta_factor=0.75, linear_attn_alpha_factor=0.8,
               linear_attn_beta_factor=1.5, mlp_alpha_factor=1.1, mlp_beta_factor=0.9)


def test_minimax_teacher_forced_parity_with_transformers_on_xla():
    """MiniMax (lightning attention at layers 0 and 2, full attention at 1, experts in every
    layer, transformers' blocks of 4 tokens, residual factors other than 1) on xla: the
    schedule's every step against transformers' forward; the state it declares; the decay rates
    graphrt derives for a checkpoint without them are the ones transformers stores."""
    d = hybrid_model_dir("minimax", **MINIMAX)
    rng = np.random.default_rng(5)
    seqs = [[int(t) for t in rng.integers(3, 128, size=n)] for n in LENGTHS]
    hf = load_hf_hybrid(d)
    refs = reference_logits(hf, seqs)
    runner = graphrt.ModelRunner(str(d), backend="xla", progress=False, **XLA)
    assert run_schedule(runner, seqs, refs, chunk=5, joins=[0, 0, 1, 3], preempt={2: 0}) >= 8
    assert runner.stats.hits > 0 and runner.stats.eager_steps == 0
    config = DecoderConfig.from_dir(d)
    assert config.layer_kinds == ("lightning_attention", "attention", "lightning_attention")
    assert config.state_spec().groups == (StateGroup((0, 1), (StateTensor("kv", (4, 16, 16)),),
                                                     "lightning_attention"),)
    assert resolve_model_impl(d, "auto", framework="torch") == "transformers"
    from graphrt.models.jax.hybrid import _lightning_slopes
    for i in (0, 2):
        np.testing.assert_allclose(_lightning_slopes(config)[f"model.layers.{i}.self_attn.slope_rate"],
                                   hf.model.layers[i].self_attn.slope_rate.reshape(-1).numpy(), rtol=1e-6)
