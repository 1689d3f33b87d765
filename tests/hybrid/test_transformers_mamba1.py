"""Mamba1 models (Mamba, Falcon-Mamba, Jamba) through graphrt's Transformers modeling backend (issue 45).

transformers' ``MambaMixer``, ``FalconMambaMixer`` and ``JambaMambaMixer`` are routed to graphrt's
``Mamba1Mixer`` (``models/torch/mamba1.py``) over the same parameters: the selective scan of
``layers/torch/state/selective_scan.py`` with graphrt's state slots. None of the three classes
declares ``_supports_attention_backend``; they load from their directories all the same (their
modeling module defines a routed mixer) and Jamba's attention layer is checked to call
transformers' AttentionInterface in the layer probe. Here:

* teacher-forced parity with transformers' own forward: 4 requests of 7-18 tokens joining at
  different steps, chunked prefill, a preempted request recomputed, on ``eager`` and on ``cpu``
  FULL graphs (PIECEWISE graphs split at the mixers: the kit's test on Jamba);
* the routed modules hold transformers' parameters and declare the ``mamba1`` state spec;
* the kit's ``state_isolated``, ``kv_isolated`` and ``padding_invisible`` on Jamba;
* a short state sweep of the new kind, and what is refused, with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import graphrt
from graphrt import ConfigError
from support.hybrid_models import load_hf_hybrid, hybrid_model_dir
from support.hybrid_parity import reference_logits, routed_runner, run_routed_schedule

transformers = pytest.importorskip("transformers")

from graphrt.core.state_spec import StateGroup, StateTensor  # noqa: E402
from graphrt.models.torch.mamba1 import Mamba1Mixer  # noqa: E402
from graphrt.models.torch.transformers_impl import (ATTENTION_NAME, register_attention,  # noqa: E402
                                                    wrap_transformers_model)
from graphrt.models.torch.transformers_impl.recurrent import RoutedMixer  # noqa: E402

LENGTHS = (13, 7, 18, 9)
#: Each architecture's mixer attribute in its decoder layers.
MIXER = {"mamba": "mixer", "falcon_mamba": "mixer", "jamba": "mamba"}


@pytest.fixture(scope="module")
def references():
    """Per architecture: its checkpoint, the sequences and transformers' logits of them."""
    cache = {}

    def get(arch):
        if arch not in cache:
            d = hybrid_model_dir(arch)
            rng = np.random.default_rng(5)
            seqs = [[int(t) for t in rng.integers(3, 128, size=n)] for n in LENGTHS]
            cache[arch] = d, seqs, reference_logits(load_hf_hybrid(d), seqs)
        return cache[arch]
    return get


#: Falcon-Mamba differs from Mamba in its mixer's numerics only (its dt / B / C norms): eager.
@pytest.mark.parametrize("arch,backend,mode", [("mamba", "eager", "NONE"), ("falcon_mamba", "eager", "NONE"),
                                               ("jamba", "eager", "NONE"), ("mamba", "cpu", "FULL"),
                                               ("jamba", "cpu", "FULL")])
def test_teacher_forced_parity_with_transformers(references, arch, backend, mode):
    """From the checkpoint directory (``model_impl="transformers"``), though the class does not
    declare ``_supports_attention_backend``; FULL graphs hold the decode and the mixed steps."""
    d, seqs, refs = references(arch)
    runner = routed_runner(d, backend, mode)
    assert [type(m) for m in runner.model.state_layers()] == [Mamba1Mixer] * 2
    run_routed_schedule(runner, seqs, refs, backend)


def _wrapped(arch: str, **kwargs):
    register_attention()
    hf = transformers.AutoModelForCausalLM.from_pretrained(hybrid_model_dir(arch), dtype=torch.float32,
                                                           attn_implementation=ATTENTION_NAME, **kwargs)
    return wrap_transformers_model(hf)


@pytest.mark.parametrize("arch", ["falcon_mamba", "jamba"])
def test_routed_mixers_hold_transformers_weights_and_the_mamba1_state_spec(arch):
    model = _wrapped(arch)
    hf = load_hf_hybrid(hybrid_model_dir(arch))
    layers = [i for i, layer in enumerate(model.body.layers)
              if isinstance(getattr(layer, MIXER[arch], None), RoutedMixer)]
    assert [getattr(model.body.layers[i], MIXER[arch]).mixer for i in layers] == model.state_layers()
    for i in layers:
        own = dict(getattr(hf.get_submodule(model._body_name).layers[i], MIXER[arch]).named_parameters())
        ours = dict(getattr(model.body.layers[i], MIXER[arch]).mixer.named_parameters())
        assert sorted(own) == sorted(ours) and all(torch.equal(own[n], ours[n]) for n in own)
    assert len({p.data_ptr() for p in model.hf.parameters()}) == len(list(model.hf.parameters()))
    config = hf.config
    inner = config.intermediate_size if arch == "falcon_mamba" else config.mamba_expand * config.hidden_size
    d_state = config.state_size if arch == "falcon_mamba" else config.mamba_d_state
    kernel = config.conv_kernel if arch == "falcon_mamba" else config.mamba_d_conv
    assert model.state_spec().groups == (StateGroup((0, 1), (StateTensor("conv", (inner, kernel - 1)),
                                                             StateTensor("ssm", (inner, d_state))), "mamba1"),)
    assert layers == ([0, 1] if arch == "falcon_mamba" else [0, 2])


def test_kit_state_isolation_on_jamba():
    """FULL decode, PIECEWISE mixed steps and K+1 padding; experts on ``batched_mm`` (see
    test_transformers_hybrid.py: ``grouped_mm``'s batchmate-dependent shapes are no state leak)."""
    from graphrt.testing.conformance import run_conformance
    from graphrt.testing.runners import RunnerFactory

    factory = RunnerFactory(lambda: _wrapped("jamba", experts_implementation="batched_mm"), "cpu",
                            mode="FULL_AND_PIECEWISE", num_speculative_tokens=1, cudagraph_capture_sizes=[2, 4, 8, 16])
    results = run_conformance(factory=factory, properties=["state_isolated", "kv_isolated", "padding_invisible"],
                              examples=6, report=None)
    assert [r.status for r in results] == ["PASS"] * 3, [r.line() for r in results]
    assert factory().executor.num_state_slots


def test_a_short_state_sweep_of_mamba1():
    """The state sweep's Mamba configuration with FULL decode, PIECEWISE and K+1 steps
    (``state_sweep.SWEEP``), 30 drawn steps: no live slot touched; the 10,000-step run of the
    Mamba1 configurations is in docs/hybrid.md."""
    from graphrt.testing import state_sweep

    config = ("mamba", "cpu", "FULL_AND_PIECEWISE", 2)
    assert (*config, 2) in state_sweep.SWEEP
    line = state_sweep.sweep_config(config, 30)
    assert line.violation is None and line.steps == 30, line.line()
    assert min(line.kinds["FULL decode"], line.kinds["PIECEWISE"], line.kinds["padded"], line.kinds["restart"]) > 0


# ---- refusals ------------------------------------------------------------------------------------

def test_an_unflagged_class_whose_attention_bypasses_the_interface_is_refused(monkeypatch):
    """Jamba loads without ``_supports_attention_backend`` because its attention calls
    AttentionInterface; if it did not (planted: its attention takes its eager function), the
    probe names the layer."""
    from transformers.models.jamba import modeling_jamba

    monkeypatch.setattr(modeling_jamba.ALL_ATTENTION_FUNCTIONS, "get_interface", lambda name, default: default)
    with pytest.raises(ConfigError, match=r"JambaForCausalLM does not declare _supports_attention_backend, and its "
                                          r"layers \[1\] .*never called AttentionInterface"):
        _wrapped("jamba")


def test_a_mixer_of_another_activation_is_refused_naming_it():
    hf = transformers.AutoModelForCausalLM.from_pretrained(hybrid_model_dir("mamba"), dtype=torch.float32)
    hf.backbone.layers[0].mixer.activation = "gelu"
    hf.config._attn_implementation = ATTENTION_NAME
    with pytest.raises(ConfigError, match=r"backbone\.layers\.0\.mixer \(MambaMixer\) .*activation 'gelu'.*SiLU"):
        wrap_transformers_model(hf)


def test_an_unflagged_class_without_routed_mixers_is_still_refused_from_its_directory():
    from graphrt.models.torch.transformers_impl.loader import causal_lm_class

    config = transformers.AutoConfig.for_model("mamba")
    assert causal_lm_class(config).__name__ == "MambaForCausalLM"
    config = transformers.AutoConfig.for_model("bloom")
    with pytest.raises(ConfigError, match="BloomForCausalLM does not declare _supports_attention_backend"):
        causal_lm_class(config)
