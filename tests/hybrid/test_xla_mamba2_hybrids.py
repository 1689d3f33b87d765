"""Nemotron-H, Falcon-H1 and Zamba2 as graphrt's JAX hybrid models on ``backend="xla"`` (issue 45).

Their Mamba2 mixers run on the JAX SSD scan of ``layers/jax/recurrent.py`` (the one Mamba2 and
Granite-4-H run on) over graphrt's state cache: Nemotron-H's layers are each one block (Mamba2,
attention without rotary, a relu² MLP, sigmoid-routed relu² experts with a shared expert);
Falcon-H1 attends beside the mixer in every layer, with its µP multipliers and its gated norm;
Zamba2's hybrid layers run the one shared attention + MLP block (tied weights) before their
mixer, each use with a KV cache and adapters of its own.
Here: teacher-forced parity with transformers' own forward (support/hybrid_parity.run_schedule:
4 requests of 7-18 tokens joining at steps 0, 0, 1 and 3, chunked prefill in chunks of 5, request
2 preempted and recomputed in another slot), on the zoo's tiny checkpoints the torch parity
tests use (tests/hybrid/test_transformers_mamba2_hybrids.py), and what graphrt reads of them.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

import graphrt
from graphrt.core.state_spec import StateGroup, StateTensor
from graphrt.models.hf_config import DecoderConfig
from graphrt.models.model_impl import resolve_model_impl
from support.hybrid_parity import reference_logits, run_schedule

pytest.importorskip("transformers")

from transformers_zoo import load_reference, tiny_checkpoint  # noqa: E402

LENGTHS = (13, 7, 18, 9)
#: The xla runs: one token bucket of 16 and one of 4 requests hold every step of the schedule.
XLA = dict(precompile_token_paddings=[16], precompile_bs_paddings=[4], max_num_seqs=3, max_num_batched_tokens=16,
           max_model_len=32, block_size=4, num_kv_blocks=33)
#: Falcon-H1 with every multiplier away from 1 and its norm before the gate (the torch parity test's).
FALCON_MUP = dict(mamba_rms_norm=True, mamba_norm_before_gate=True, ssm_in_multiplier=0.7, ssm_out_multiplier=1.3,
                  ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.6], attention_in_multiplier=0.8, key_multiplier=1.2,
                  attention_out_multiplier=0.9, embedding_multiplier=1.5, lm_head_multiplier=0.8,
                  mlp_multipliers=[1.1, 0.9])
#: The zoo's Nemotron-H has one layer of each kind (Mamba2, experts, attention, MLP); sigmoid routing in 2 groups.
CHECKPOINTS = {"nemotron_h": ("nemotron_h", dict(n_group=2, topk_group=1, routed_scaling_factor=1.5)),
               "falcon_h1": ("falcon_h1", FALCON_MUP)}


def _checkpoint(name: str) -> Path:
    if name == "zamba2":
        return _zamba2_checkpoint()
    arch, overrides = CHECKPOINTS[name]
    return tiny_checkpoint(arch, **overrides)


@pytest.mark.parametrize("name", ["nemotron_h", "falcon_h1", "zamba2"])
def test_teacher_forced_parity_with_transformers_on_xla(name):
    d = _checkpoint(name)
    rng = np.random.default_rng(5)
    seqs = [[int(t) for t in rng.integers(3, 128, size=n)] for n in LENGTHS]
    hf = load_reference(d)
    # Zamba2: transformers' forward in float64 (rounded to float32), its own float32 rounding (0.4
    # of the tolerance off float64 here; graphrt's 0.7) not counted against graphrt's
    refs = reference_logits(hf.double() if name == "zamba2" else hf, seqs)
    runner = graphrt.ModelRunner(str(d), backend="xla", progress=False, **XLA)
    assert runner.executor.num_state_slots == 3
    assert run_schedule(runner, seqs, refs, chunk=5, joins=[0, 0, 1, 3], preempt={2: 0}) >= 8


def test_configs_state_specs_and_refusals(tmp_path):
    """What HybridConfig reads of each checkpoint, the state and KV it declares (Nemotron-H: one
    Mamba2 layer's state, one attention layer; Falcon-H1: both in each layer); torch backends keep
    transformers' model for them; a Nemotron-H of latent experts or another MLP activation is
    refused naming the key."""
    nemo = DecoderConfig.from_dir(_checkpoint("nemotron_h"))
    assert nemo.layer_kinds == ("mamba", "moe", "attention", "mlp") and nemo.num_hidden_layers == 4
    assert (nemo.rope_theta, nemo.time_step_limit, nemo.expert_groups, nemo.routed_scaling_factor) == \
        (None, (0.001, float("inf")), 2, 1.5)
    assert nemo.state_spec().groups == (StateGroup((0,), (StateTensor("conv", (192, 3)),
                                                          StateTensor("ssm", (4, 32, 16))), "mamba"),)
    assert nemo.attention_layer_ids == (2,) and nemo.kv_cache_spec().groups[0].layers == (0,)
    falcon = DecoderConfig.from_dir(_checkpoint("falcon_h1"))
    assert falcon.attention_layer_ids == falcon.state_layer_ids == (0, 1)
    assert (falcon.mamba_gate, falcon.mamba_in_scale, falcon.mamba_proj_scales) == \
        ("gate_after_norm", 0.7, (0.9, 1.1, 0.8, 1.2, 0.6))
    assert DecoderConfig.from_dir(tiny_checkpoint("falcon_h1")).mamba_gate == "gate"
    zamba = DecoderConfig.from_dir(_checkpoint("zamba2"))          # each use of the shared block: a KV layer
    assert zamba.attention_layer_ids == zamba.state_layer_ids == (0, 1) and zamba.shared_blocks == 1
    assert zamba.kv_cache_spec().groups[0].layers == (0, 1) and zamba.head_dim == 32
    assert (zamba.attention_scale, zamba.rotary_dim, zamba.tie_word_embeddings) == (0.25, 32, True)
    for name in CHECKPOINTS:
        assert resolve_model_impl(_checkpoint(name), "auto", framework="torch") == "transformers"
        assert resolve_model_impl(_checkpoint(name), "auto", framework="jax") == "graphrt"
    raw = json.loads((_checkpoint("nemotron_h") / "config.json").read_text())
    for key, value in (("moe_latent_size", 16), ("mlp_hidden_act", "gelu")):
        (tmp_path / "config.json").write_text(json.dumps({**raw, key: value}))
        with pytest.raises(graphrt.InputError, match=key):
            DecoderConfig.from_dir(tmp_path)


#: Zamba2's logits and adapters scaled as in its torch parity test (float32 margins; there:
#: ZAMBA2_EMBEDDING_SCALE, ZAMBA2_ADAPTER_SCALE), one Mamba2 group.
ZAMBA2_SCALES = dict(embedding=0.125, adapter=0.25)


@functools.lru_cache(maxsize=None)
def _zamba2_checkpoint() -> Path:
    """The zoo's tiny Zamba2 (two hybrid layers using the one shared block, each with its own
    adapters), its tied embedding and its adapters' up-projections scaled (:data:`ZAMBA2_SCALES`)."""
    import torch

    model = load_reference(tiny_checkpoint("zamba2", mamba_ngroups=1))
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(ZAMBA2_SCALES["embedding"])
        for name, param in model.named_parameters():
            if "adapter_list" in name and name.endswith("1.weight"):
                param.mul_(ZAMBA2_SCALES["adapter"])
    out = Path(tempfile.mkdtemp(prefix="zamba2-xla-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    model.save_pretrained(out)
    return out
