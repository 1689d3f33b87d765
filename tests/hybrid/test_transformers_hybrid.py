"""Stock transformers hybrids through graphrt's Transformers modeling backend (issue 32).

The backend replaces each recurrent mixer of the loaded transformers model (Granite-4-H's
``GraniteMoeHybridMambaLayer``, Qwen3-Next's ``Qwen3NextGatedDeltaNet``) with graphrt's own
module over the same parameters, so graphrt's kernels and state slots run it
(``models/torch/transformers_impl/recurrent.py``). Here:

* parity, teacher-forced, with transformers' own forward (and for Bamba's ``BambaMixer``): several concurrent requests of
  different lengths, chunked prefill, a preempted request recomputed -- eagerly and on the CPU
  recording graph (FULL_AND_PIECEWISE and FULL);
* the routed modules hold transformers' parameters and declare the reference models' state spec;
* the kit's ``state_isolated`` (and KV isolation, padding) on the routed Granite-4-H;
* what is refused, with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import graphrt
from graphrt import ConfigError
from graphrt.models.hybrid_config import HybridConfig
from graphrt.models.model_impl import read_config_json
from support.hybrid_models import hybrid_hf_config, hybrid_model_dir, load_hf_hybrid
from support.hybrid_parity import reference_logits, run_schedule

transformers = pytest.importorskip("transformers")

from graphrt.models.torch.transformers_impl import (ATTENTION_NAME, TransformersForCausalLM,  # noqa: E402
                                                    register_attention, wrap_transformers_model)
from graphrt.models.torch.transformers_impl.recurrent import RoutedMixer  # noqa: E402

LIMITS = dict(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=32, block_size=4)
LENGTHS = (13, 7, 18, 9)
SHAPES = {"eager": {}, "cpu": dict(cudagraph_capture_sizes=[4, 16])}


def graphrt_hf(model_dir, **kwargs) -> TransformersForCausalLM:
    """The checkpoint loaded by transformers with graphrt's attention, wrapped (mixers routed)."""
    register_attention()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                           attn_implementation=ATTENTION_NAME, **kwargs)
    return wrap_transformers_model(hf)


@pytest.fixture(scope="module", params=["granite", "qwen3_next"])
def model(request):
    d = hybrid_model_dir(request.param)
    rng = np.random.default_rng(5)
    seqs = [[int(t) for t in rng.integers(3, 128, size=n)] for n in LENGTHS]
    return request.param, d, seqs, reference_logits(load_hf_hybrid(d), seqs)


@pytest.mark.parametrize("backend,mode", [("eager", "NONE"), ("cpu", "FULL_AND_PIECEWISE"), ("cpu", "FULL")])
def test_teacher_forced_parity_with_transformers(model, backend, mode):
    """Both load from their directories with ``model_impl="transformers"``: Qwen3-Next's class does
    not declare ``_supports_attention_backend``, but its modeling module defines a routed mixer
    class (and its attention layers are checked to call AttentionInterface)."""
    arch, d, seqs, refs = model
    runner = graphrt.ModelRunner(str(d), backend=backend, mode=mode, model_impl="transformers", progress=False,
                                 num_kv_blocks=4 * 8 + 1, **SHAPES[backend], **LIMITS)
    assert isinstance(runner.model, TransformersForCausalLM) and runner.model.state_layers()
    steps = run_schedule(runner, seqs, refs, chunk=5, joins=[0, 0, 1, 3], preempt={2: 0})
    assert steps >= 8
    if backend == "cpu":
        assert runner.stats.hits > 0 and runner.stats.eager_steps == 0


#: A tiny Bamba (Mamba2 layers 0 and 2, attention layer 1): ``BambaMixer`` routes like Granite's.
BAMBA = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
             mamba_n_groups=2, mamba_chunk_size=4, mamba_expand=2, mamba_d_conv=4, max_position_embeddings=256,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    from support.hf_models import _randomize

    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(transformers.BambaConfig(**BAMBA), dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    _randomize(ref, 0)
    d = tmp_path_factory.mktemp("bamba")
    ref.save_pretrained(d)
    rng = np.random.default_rng(5)
    seqs = [[int(t) for t in rng.integers(3, 128, size=n)] for n in LENGTHS]
    return d, seqs, reference_logits(ref, seqs)


@pytest.mark.parametrize("backend,mode", [("eager", "NONE"), ("cpu", "FULL")])
def test_bamba_mixers_route_too(bamba, backend, mode):
    d, seqs, refs = bamba
    model = graphrt_hf(d)
    assert [type(w).__name__ for w in model.state_layers()] == ["Mamba2Mixer", "Mamba2Mixer"]
    runner = graphrt.ModelRunner(model, backend=backend, mode=mode, progress=False, num_kv_blocks=4 * 8 + 1,
                                 **SHAPES[backend], **LIMITS)
    assert run_schedule(runner, seqs, refs, chunk=5, joins=[0, 0, 1, 3], preempt={2: 0}) >= 8


@pytest.mark.parametrize("arch,mixer", [("granite", "mamba"), ("qwen3_next", "linear_attn")])
def test_routed_mixers_hold_transformers_weights_and_the_reference_state_spec(arch, mixer):
    d = hybrid_model_dir(arch)
    model = graphrt_hf(d)
    layers = model.body.layers
    routed = [getattr(layer, mixer) for layer in layers if isinstance(getattr(layer, mixer, None), RoutedMixer)]
    assert [w.mixer for w in routed] == model.state_layers() and routed
    hf = load_hf_hybrid(d)
    index = [i for i, layer in enumerate(layers) if isinstance(getattr(layer, mixer, None), RoutedMixer)]
    for i, wrapper in zip(index, routed):
        own = dict(getattr(hf.model.layers[i], mixer).named_parameters())
        ours = dict(wrapper.mixer.named_parameters())
        assert sorted(own) == sorted(ours)
        assert all(torch.equal(own[n], ours[n]) for n in own)
    # the same parameters as transformers' model it wraps (shared, not copied)
    assert len({p.data_ptr() for p in model.hf.parameters()}) == len(list(model.hf.parameters()))
    reference = HybridConfig.from_dict(read_config_json(d)).state_spec()
    assert [(g.layers, g.tensors) for g in model.state_spec().groups] == \
        [(g.layers, g.tensors) for g in reference.groups]


@pytest.mark.parametrize("arch", ["granite", "qwen3_next"])
def test_kit_state_isolation_on_routed_hybrids(arch):
    """FULL decode, PIECEWISE mixed steps and K+1 padding. The experts run ``batched_mm``:
    transformers' ``grouped_mm`` (the backend's default) sorts tokens by expert, so a token's
    expert matmul has batchmate-dependent shapes and its logits move by ~1e-7 with who shares
    the step -- a MoE property the kit's bitwise "same output whoever shares" check sees, not a
    state leak (the Granite without experts passes with either)."""
    from graphrt.testing.conformance import run_conformance
    from graphrt.testing.runners import RunnerFactory

    d = hybrid_model_dir(arch)
    factory = RunnerFactory(lambda: graphrt_hf(d, experts_implementation="batched_mm"), "cpu",
                            mode="FULL_AND_PIECEWISE", num_speculative_tokens=1, cudagraph_capture_sizes=[2, 4, 8, 16])
    results = run_conformance(factory=factory, properties=["state_isolated", "kv_isolated", "padding_invisible"],
                              examples=8, report=None)
    assert [r.status for r in results] == ["PASS"] * 3, [r.line() for r in results]
    assert factory().executor.num_state_slots          # the property ran: the model keeps states


@pytest.mark.slow
def test_the_matrix_check_passes_granitemoehybrid():
    """The compatibility matrix's workload (tools/transformers_matrix.py): tokens equal
    transformers' argmax with chunked prefill and preemption; a hybrid runs without prefix
    caching (docs/hybrid.md), so the check does not ask it for prefix-cache hits."""
    from transformers_matrix import check_mode

    result = check_mode("granitemoehybrid", "eager")
    assert result.passed, result.reason


# ---- refusals ------------------------------------------------------------------------------------

def _hf_with_graphrt_attention(arch: str, **overrides):
    register_attention()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(hybrid_hf_config(arch, **overrides), dtype=torch.float32,
                                                         attn_implementation=ATTENTION_NAME)


def test_a_mixer_of_another_activation_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mamba .*activation 'gelu'.*SiLU"):
        wrap_transformers_model(_hf_with_graphrt_attention("granite", hidden_act="gelu"))


def test_recurrent_layers_of_an_unrouted_class_are_refused(monkeypatch):
    from graphrt.models.torch.transformers_impl import recurrent

    monkeypatch.setattr(recurrent, "MAMBA2_MIXERS", frozenset())
    with pytest.raises(ConfigError, match=r"layer_types marks layers \[0, 2\] recurrent.*no class graphrt routes"):
        wrap_transformers_model(_hf_with_graphrt_attention("granite"))


def test_tensor_parallel_routed_mixers_are_refused():
    with pytest.raises(ConfigError, match=r"tp_size=2.*not sharded"):
        wrap_transformers_model(_hf_with_graphrt_attention("granite"), tp_rank=0, tp_size=2)


def test_a_stock_hybrid_of_an_unrouted_mixer_class_is_refused_naming_its_layers(monkeypatch):
    """A stock mixer class that is not routed is refused naming its layers and the kernel it
    lacks (MISSING_KERNELS): RecurrentGemma's RG-LRU block with its route taken away (it is
    routed since issue 45: test_transformers_rg_lru.py)."""
    from transformers_zoo import tiny_config

    from graphrt.models.torch.transformers_impl import recurrent

    monkeypatch.setattr(recurrent, "RG_LRU_MIXERS", frozenset())
    monkeypatch.setitem(recurrent.MISSING_KERNELS, "RecurrentGemmaRecurrentBlock", "the RG-LRU scan")
    register_attention()
    hf = transformers.AutoModelForCausalLM.from_config(tiny_config("recurrent_gemma"), dtype=torch.float32,
                                                       attn_implementation=ATTENTION_NAME)
    with pytest.raises(ConfigError, match=r"RecurrentGemmaForCausalLM: layer_types marks layers \[0\] recurrent.*"
                                          r"RecurrentGemmaRecurrentBlock needs the RG-LRU scan"):
        wrap_transformers_model(hf)


def test_a_recurrent_looking_module_without_layer_types_is_refused():
    """A mixer the config does not announce (no ``layer_types``) is still found by its class."""
    from graphrt.models.torch.transformers_impl.recurrent import served_types

    class FooMambaMixer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1d = torch.nn.Conv1d(4, 4, 3, groups=4)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([FooMambaMixer()])
    with pytest.raises(ConfigError, match=r"recurrent mixers \['layers.0 \(FooMambaMixer\)'\] are of no class"):
        served_types(model, object(), [])
    assert served_types(torch.nn.Linear(2, 2), object(), []) == frozenset()
