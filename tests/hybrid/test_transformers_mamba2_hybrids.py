"""Nemotron-H, Falcon-H1 and Zamba2 through graphrt's Transformers modeling backend (issue 45).

Their Mamba2 mixers (``NemotronHMamba2Mixer``, ``FalconH1Mixer``, ``Zamba2MambaMixer``) are routed
to graphrt's ``Mamba2Mixer`` over the same parameters (Falcon-H1's µP multipliers and its two other
gatings carried over); none of the classes declares ``_supports_attention_backend``, and each loads
from its directory all the same. Nemotron-H has ``mlp`` / ``moe`` layers that neither attend nor
keep state; Falcon-H1 attends beside the mixer in every (``hybrid``) layer; Zamba2's shared
attention block (one block's weights in several layers, tied) is numbered by the layer using it,
so each use keeps a KV cache of its own. Here:

* teacher-forced parity with transformers' own forward: 4 requests of 7-18 tokens joining at
  different steps, chunked prefill, a preempted request recomputed, on ``eager`` and ``cpu`` FULL;
* the routed modules hold transformers' parameters; Zamba2's uses of the shared block each have
  their own KV-cache layer;
* the kit's ``state_isolated``, ``kv_isolated`` and ``padding_invisible`` on Zamba2;
* what is refused, with the reason.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

import graphrt
from graphrt import ConfigError
from support.hybrid_parity import reference_logits, routed_runner, run_routed_schedule

transformers = pytest.importorskip("transformers")

from graphrt.models.torch.mamba2 import Mamba2Mixer  # noqa: E402
from graphrt.models.torch.transformers_impl import (ATTENTION_NAME, register_attention,  # noqa: E402
                                                    wrap_transformers_model)
from graphrt.models.torch.transformers_impl.recurrent import RoutedMixer  # noqa: E402
from transformers_zoo import load_reference, tiny_checkpoint, tiny_config  # noqa: E402

LENGTHS = (13, 7, 18, 9)
#: Falcon-H1 with every multiplier away from 1 and its gated norm (``rmsnorm(y) * silu(z)``); the
#: zoo's model has the defaults (``y * silu(z)``, no norm).
FALCON_MUP = dict(mamba_rms_norm=True, mamba_norm_before_gate=True, ssm_in_multiplier=0.7, ssm_out_multiplier=1.3,
                  ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.6], attention_in_multiplier=0.8, key_multiplier=1.2,
                  attention_out_multiplier=0.9, embedding_multiplier=1.5, lm_head_multiplier=0.8,
                  mlp_multipliers=[1.1, 0.9])
#: (architecture, config overrides): the models of the parity test.
MODELS = {"nemotron_h": ("nemotron_h", {}), "falcon_h1": ("falcon_h1", {}), "falcon_h1_mup": ("falcon_h1", FALCON_MUP),
          "zamba2": ("zamba2", {})}
#: Which layers keep a Mamba2 state, and which attend, in each model.
ROUTED = {"nemotron_h": ([0], [2]), "falcon_h1": ([0, 1], [0, 1]), "zamba2": ([0, 1], [0, 1])}
#: Zamba2's head is its embedding (tied, and untying it unties the shared block too): the zoo's unit-noise
#: embeddings give logits of ~20, whose float32 rounding (transformers' own float32 forward is 2e-4 off its
#: float64 one) outgrows the tolerances; scaled by this, its logits are O(1) like the other models'.
ZAMBA2_EMBEDDING_SCALE = 0.125
#: The zoo's per-use adapters (rank 8, drawn as full matrices) double the shared block's q / k / v and
#: sharpen its softmax: transformers' own float32 forward then lands ~4 tolerances off its float64 one.
#: Scaled by this, and with one Mamba2 group, it is within 0.6 of them, as the other tiny models are.
ZAMBA2_ADAPTER_SCALE = 0.25


@functools.lru_cache(maxsize=None)
def _zamba2_checkpoint() -> Path:
    """The zoo's tiny Zamba2 (one Mamba2 group) with its (tied) embedding and its adapters'
    up-projections scaled (:data:`ZAMBA2_EMBEDDING_SCALE`, :data:`ZAMBA2_ADAPTER_SCALE`)."""
    model = load_reference(tiny_checkpoint("zamba2", mamba_ngroups=1))
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(ZAMBA2_EMBEDDING_SCALE)
        for name, param in model.named_parameters():
            if "adapter_list" in name and name.endswith("1.weight"):
                param.mul_(ZAMBA2_ADAPTER_SCALE)
    out = Path(tempfile.mkdtemp(prefix="zamba2-small-logits-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    model.save_pretrained(out)
    return out


def checkpoint(name: str) -> Path:
    arch, overrides = MODELS[name]
    return _zamba2_checkpoint() if name == "zamba2" else tiny_checkpoint(arch, **overrides)


@pytest.fixture(scope="module")
def references():
    """Per model: its checkpoint, the sequences and transformers' logits of them."""
    cache = {}

    def get(name):
        if name not in cache:
            d = checkpoint(name)
            rng = np.random.default_rng(5)
            seqs = [[int(t) for t in rng.integers(3, 128, size=n)] for n in LENGTHS]
            cache[name] = d, seqs, reference_logits(load_reference(d), seqs)
        return cache[name]
    return get


@pytest.mark.parametrize("name,backend,mode", [("nemotron_h", "eager", "NONE"), ("nemotron_h", "cpu", "FULL"),
                                               ("falcon_h1", "cpu", "FULL"), ("falcon_h1_mup", "eager", "NONE"),
                                               ("falcon_h1_mup", "cpu", "FULL"), ("zamba2", "eager", "NONE"),
                                               ("zamba2", "cpu", "FULL")])
def test_teacher_forced_parity_with_transformers(references, name, backend, mode):
    """From the checkpoint directory (``model_impl="transformers"``), though no class declares
    ``_supports_attention_backend``; FULL graphs hold the decode and the mixed steps."""
    d, seqs, refs = references(name)
    runner = routed_runner(d, backend, mode)
    states, attends = ROUTED[MODELS[name][0]]
    assert [type(m) for m in runner.model.state_layers()] == [Mamba2Mixer] * len(states)
    assert [f.layer_idx for f in runner.model.facts] == attends
    run_routed_schedule(runner, seqs, refs, backend)


def _wrapped(name: str, **kwargs):
    register_attention()
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint(name), dtype=torch.float32,
                                                           attn_implementation=ATTENTION_NAME, **kwargs)
    return wrap_transformers_model(hf)


@pytest.mark.parametrize("arch", ["nemotron_h", "falcon_h1", "zamba2"])
def test_routed_mixers_hold_transformers_weights(arch):
    name = "falcon_h1_mup" if arch == "falcon_h1" else arch
    model = _wrapped(name)
    hf = load_reference(checkpoint(name))
    routed = {name: m for name, m in model.hf.named_modules() if isinstance(m, RoutedMixer)}
    states, _ = ROUTED[arch]
    assert [w.mixer for w in routed.values()] == model.state_layers() and len(routed) == len(states)
    for name, wrapper in routed.items():
        own = dict(hf.get_submodule(name).named_parameters())
        ours = dict(wrapper.mixer.named_parameters())
        assert sorted(own) == sorted(ours) and all(torch.equal(own[n], ours[n]) for n in own)
        if arch == "falcon_h1":       # the µP vector (a buffer transformers computes from the config)
            assert torch.equal(wrapper.mixer.proj_scale, hf.get_submodule(name).mup_vector.reshape(-1))
            assert wrapper.mixer.in_scale == 0.7 and wrapper.mixer.gate == "gate_after_norm"
    group, = model.state_spec().groups
    assert group.kind == "mamba2" and group.layers == tuple(range(len(states)))


def test_zamba2_shared_block_gets_a_kv_cache_per_use():
    """Both hybrid layers use the one shared block's weights (tied); each use is numbered by its
    layer and has a paged layer (KV cache) of its own."""
    model = _wrapped("zamba2")
    first, second = (model.body.layers[i].shared_transformer.self_attn for i in (0, 1))
    assert first is not second and first.q_proj.weight is second.q_proj.weight
    assert (first.layer_idx, second.layer_idx) == (0, 1)
    assert [f.layer_idx for f in model.facts] == [0, 1] and len(model.attention_layers()) == 2
    assert model.kv_cache_spec().groups[0].layers == (0, 1)


def test_kit_state_isolation_on_zamba2():
    """FULL decode, PIECEWISE mixed steps and K+1 padding on the model with the shared block."""
    from graphrt.testing.conformance import run_conformance
    from graphrt.testing.runners import RunnerFactory

    factory = RunnerFactory(lambda: _wrapped("zamba2"), "cpu", mode="FULL_AND_PIECEWISE", num_speculative_tokens=1,
                            cudagraph_capture_sizes=[2, 4, 8, 16])
    results = run_conformance(factory=factory, properties=["state_isolated", "kv_isolated", "padding_invisible"],
                              examples=6, report=None)
    assert [r.status for r in results] == ["PASS"] * 3, [r.line() for r in results]
    assert factory().executor.num_state_slots


# ---- refusals ------------------------------------------------------------------------------------

def _from_config(arch: str, **overrides):
    register_attention()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32,
                                                         attn_implementation=ATTENTION_NAME)


def test_one_attention_object_in_two_layers_is_refused():
    """Where the shared block is truly one module in both layers, it has no one layer to be
    numbered by: refused naming both paths."""
    hf = _from_config("zamba2")
    hf.model.layers[1].shared_transformer = hf.model.layers[0].shared_transformer
    with pytest.raises(ConfigError, match=r"layers\.0\..*and model\.layers\.1\..*one Zamba2Attention object in two decoder layers"):
        wrap_transformers_model(hf)


def test_a_falcon_h1_mixer_of_another_activation_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mamba \(FalconH1Mixer\) .*activation 'gelu'.*SiLU"):
        wrap_transformers_model(_from_config("falcon_h1", hidden_act="gelu"))
