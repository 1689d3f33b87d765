"""graphrt's own decoder runs a checkpoint only where it implements every key of its config (issue 46, item 2).

models/decoder_fields.py is an allow-list per architecture: the keys the own decoder reads with the
values it implements, and the keys that change nothing at inference. Any other key or value makes
``model_impl="auto"`` fall through to transformers' model (the reason logged), and
``model_impl="graphrt"`` / the XLA backend raise an InputError naming the key. Before, a Qwen3 with
``hidden_act="relu"`` ran graphrt's SiLU MLP: other tokens, no warning. At the end, Check A: a
hypothesis property over the config space, ``"auto"`` against transformers' argmax.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import pytest
from hypothesis import example, given, settings, strategies as st

import graphrt
from graphrt.core.errors import InputError
from graphrt.models import decoder_fields
from graphrt.models.hf_config import SUPPORTED_ARCHITECTURES, DecoderConfig
from graphrt.models.model_impl import resolve_model_impl
from transformers_zoo import load_reference, tiny_checkpoint
from support.fast_subset import examples
from support.hf_greedy import argmax_problem
from support.hf_models import SLIDING, load_hf_model, random_prompts, tiny_hf_config, tiny_hf_model_dir

pytest.importorskip("transformers")

ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen3ForCausalLM": "qwen3"}
KW = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=4)
GREEDY = graphrt.SamplingParams(max_tokens=6, ignore_eos=True)


def base_config(arch: str) -> dict:
    """The config.json transformers writes for the tiny ``arch`` model (the suite's shape)."""
    raw = tiny_hf_config(ARCH[arch]).to_dict()
    raw["architectures"] = [arch]
    return json.loads(json.dumps(raw))


#: One directory for the module's configs, removed with the interpreter (a directory per call used
#: to be left in /tmp: ~700 per suite run).
_SCRATCH = tempfile.TemporaryDirectory(prefix="decoder-fields-")


def write(raw: dict) -> str:
    """A directory holding only ``raw`` as config.json (model_impl reads nothing else)."""
    path = Path(tempfile.mkdtemp(dir=_SCRATCH.name))
    (path / "config.json").write_text(json.dumps(raw))
    return str(path)


class ReadKeys(dict):
    """A config dict that records which keys are read."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_the_table_lists_every_key_the_own_decoder_reads_and_classifies_transformers_config(arch, monkeypatch):
    """What DecoderConfig.from_dict reads is the allow-list's IMPLEMENTED table (no key read unchecked),
    and every key transformers writes for the architecture is classified (so its plain config runs
    on graphrt's own decoder)."""
    from graphrt.models import hf_config

    monkeypatch.setattr(hf_config, "unimplemented_field", lambda raw, arch: None)
    raw = ReadKeys(base_config(arch), use_sliding_window=True, sliding_window=5, rope_theta=10000.0)
    DecoderConfig.from_dict(raw)
    table = decoder_fields.IMPLEMENTED[arch]
    assert raw.read <= set(table), raw.read - set(table)
    monkeypatch.undo()
    classified = set(table) | decoder_fields.NEUTRAL | set(decoder_fields.NEUTRAL_AT)
    assert set(base_config(arch)) <= classified, set(base_config(arch)) - classified
    assert resolve_model_impl(write(base_config(arch))) == "graphrt"


# (architecture, key, value): each is a computation graphrt's own decoder does not implement.
UNIMPLEMENTED = [
    *[(arch, "hidden_act", act) for arch in SUPPORTED_ARCHITECTURES for act in ("relu", "gelu", "gelu_pytorch_tanh")],
    *[(arch, "graphrt_has_never_seen_this_key", 1) for arch in SUPPORTED_ARCHITECTURES],
    *[(arch, "quantization_config", {"quant_method": "fp8"}) for arch in SUPPORTED_ARCHITECTURES],
    *[(arch, "rope_parameters", {"rope_type": kind, "rope_theta": 10000.0, "factor": 2.0})
      for arch in SUPPORTED_ARCHITECTURES for kind in ("linear", "dynamic")],
    ("LlamaForCausalLM", "rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    ("LlamaForCausalLM", "rope_scaling", {"type": "yarn", "factor": 2.0}),
    ("LlamaForCausalLM", "mlp_bias", True),
    ("MistralForCausalLM", "attention_bias", True),
    ("Qwen3ForCausalLM", "mlp_bias", True),
    ("Qwen3ForCausalLM", "layer_types", ["full_attention", "chunked_attention"]),
    ("Qwen3ForCausalLM", "layer_types", ["full_attention", "sliding_attention"]),   # no window: use_sliding_window false
    ("Qwen3ForCausalLM", "model_type", "qwen2"),
    ("Qwen3ForCausalLM", "pruned_heads", {"0": [1]}),
    ("Qwen3ForCausalLM", "is_encoder_decoder", True),
]


@pytest.mark.parametrize("arch,key,value", UNIMPLEMENTED, ids=lambda v: str(v)[:24])
def test_an_unimplemented_key_or_value_falls_through_and_graphrt_names_it(arch, key, value, caplog):
    path = write({**base_config(arch), key: value})
    with caplog.at_level(logging.INFO, logger="graphrt.models.model_impl"):
        assert resolve_model_impl(path, "auto") == "transformers"
    assert f"{key}:" in caplog.text
    for impl, framework in (("graphrt", "torch"), ("auto", "jax"), ("graphrt", "jax")):
        with pytest.raises(InputError) as exc:
            resolve_model_impl(path, impl, framework)
        assert exc.value.field == key


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_a_missing_key_transformers_defaults_otherwise_falls_through(arch):
    """Qwen3Config defaults head_dim to 128 and 32 KV heads, MistralConfig a 4096 window and 8 KV
    heads: graphrt reading a missing key its own way would compute another model."""
    for key in decoder_fields.REQUIRED[arch]:
        raw = base_config(arch)
        del raw[key]
        assert resolve_model_impl(write(raw)) == "transformers", key
        with pytest.raises(InputError, match=key):
            resolve_model_impl(write(raw), "graphrt")


_CLASSIFIED = set().union(*decoder_fields.IMPLEMENTED.values(), decoder_fields.NEUTRAL, decoder_fields.NEUTRAL_AT)
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                     max_leaves=5)


@settings(max_examples=examples(60), deadline=None)
@given(arch=st.sampled_from(SUPPORTED_ARCHITECTURES),
       key=st.text(st.characters(min_codepoint=48, max_codepoint=122), min_size=1, max_size=20).filter(
           lambda k: k not in _CLASSIFIED), value=_JSON)
def test_any_key_graphrt_has_not_classified_falls_through(arch, key, value):
    """Unknown keys are refused conservatively, whatever their value."""
    raw = base_config(arch)
    raw[key] = value
    path = write(raw)
    assert resolve_model_impl(path) == "transformers"
    with pytest.raises(InputError) as exc:
        resolve_model_impl(path, "graphrt")
    assert exc.value.field == key


def test_the_suites_tiny_checkpoints_still_take_graphrts_own_decoder():
    from graphrt.models.random_checkpoint import write_random_checkpoint
    from transformers_zoo import tiny_checkpoint

    dirs = [tiny_hf_model_dir(a) for a in ("qwen3", "qwen3-tied", "llama", "mistral")]
    dirs += [tiny_hf_model_dir("qwen3", **SLIDING), tiny_hf_model_dir("mistral", sliding_window=5),
             tiny_hf_model_dir("llama", attention_bias=True, rope_theta=5e5),
             tiny_checkpoint("llama"), write_random_checkpoint(tempfile.mkdtemp() + "/q"),
             write_random_checkpoint(tempfile.mkdtemp() + "/l", arch="llama")]
    assert [resolve_model_impl(str(d)) for d in dirs] == ["graphrt"] * len(dirs)


@pytest.mark.parametrize("arch,overrides", [("qwen3", dict(hidden_act="relu")), ("llama", dict(mlp_bias=True))],
                         ids=["qwen3-relu", "llama-mlp_bias"])
def test_auto_gives_transformers_tokens_for_a_config_graphrt_does_not_implement(arch, overrides):
    """The issue's case: a tiny Qwen3 with hidden_act="relu" ran graphrt's SiLU MLP ([115, 117, 102, 49, ...]
    against transformers' [115, 117, 102, 34, ...]); a Llama with mlp_bias=True was an InputError. No
    max_model_len: the default is read from any architecture's config, not through graphrt's decoder's."""
    from graphrt.models.torch.transformers_impl import TransformersForCausalLM

    path = str(tiny_hf_model_dir(arch, **overrides))
    prompts = random_prompts([5, 9, 3], seed=1)
    llm = graphrt.LLM(path, backend="eager", **{k: v for k, v in KW.items() if k != "max_model_len"})
    assert llm.config.max_model_len == 256             # the checkpoint's max_position_embeddings
    assert isinstance(llm.runner.model, TransformersForCausalLM)
    outs = llm.generate(prompts, GREEDY)
    hf = load_hf_model(path)
    assert [argmax_problem(hf, p, o.token_ids) for p, o in zip(prompts, outs)] == [None] * len(prompts)


def test_the_xla_backend_names_the_key_it_cannot_run():
    """No transformers fallback on XLA: an InputError naming the key, never graphrt's SiLU."""
    pytest.importorskip("jax")
    with pytest.raises(InputError) as exc:
        graphrt.LLM(str(tiny_hf_model_dir("qwen3", hidden_act="relu")), backend="xla", **KW)
    assert exc.value.field == "hidden_act" and "relu" in str(exc.value)


# ---- Check A: model_impl="auto" gives transformers' argmax on every drawn config ------------------
#
# Over the fields of a Llama / Qwen3 / Mistral config that change the computation -- activation,
# biases, RoPE type and parameters, norm eps, head sizes (head_dim != hidden / heads), KV heads, tied
# embeddings, sliding windows -- "auto" picks graphrt's own decoder exactly where the allow-list
# implements the config and transformers' model elsewhere, and either way every greedy token is
# transformers' argmax (exact ties allowed), on eager and cpu graphs. The reference runs transformers
# one token at a time (support/hf_greedy.py), as graphrt's length-dependent RoPE follows each token's
# own length (transformers_impl/rope.py).

THRESHOLD = 16      # where dynamic / longrope RoPE change frequencies (prompts run to 30)
PROPERTY_KW = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_kv_blocks=64,
                   cudagraph_capture_sizes=[4, 8, 16, 32], allow_long_max_model_len=True)


def rope(kind: str, theta: float, factor: float, half: int) -> dict:
    """``rope_parameters`` (and the max_position_embeddings dynamic reads) of one RoPE type."""
    params = {"rope_type": kind, "rope_theta": theta}
    if kind != "default":
        params["factor"] = factor
    if kind in ("yarn", "llama3", "longrope"):
        params["original_max_position_embeddings"] = THRESHOLD
    if kind == "llama3":
        params.update(low_freq_factor=1.0, high_freq_factor=4.0)
    if kind == "longrope":
        del params["factor"]
        params.update(short_factor=[1.0 + 0.05 * i for i in range(half)], long_factor=[factor + i for i in range(half)])
    out = {"rope_parameters": params, "max_position_embeddings": 64}
    if kind == "dynamic":
        out["max_position_embeddings"] = THRESHOLD
    return out


@st.composite
def configs(draw: st.DrawFn) -> tuple[str, dict]:
    """(model type, config overrides) of a tiny decoder over the fields that change the computation."""
    arch = draw(st.sampled_from(["llama", "qwen3", "mistral"]))
    heads = draw(st.sampled_from([2, 4]))
    head_dim = draw(st.sampled_from([8, 16]))
    layers = draw(st.integers(1, 2))
    cfg = dict(hidden_size=draw(st.sampled_from([32, 64])), num_attention_heads=heads, head_dim=head_dim,
               num_key_value_heads=draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0])),
               num_hidden_layers=layers, intermediate_size=64,
               hidden_act=draw(st.sampled_from(["silu", "silu", "gelu", "relu", "gelu_pytorch_tanh"])),
               rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5, 1e-2])),
               tie_word_embeddings=draw(st.booleans()))
    cfg.update(rope(draw(st.sampled_from(["default", "default", "linear", "dynamic", "yarn", "llama3", "longrope"])),
                    draw(st.sampled_from([10000.0, 500.0])), draw(st.sampled_from([2.0, 4.0])), head_dim // 2))
    if arch in ("llama", "qwen3"):
        cfg["attention_bias"] = draw(st.booleans())
    if arch == "llama":
        cfg["mlp_bias"] = draw(st.booleans())
    if arch == "mistral":
        cfg["sliding_window"] = draw(st.sampled_from([None, 5]))
    if arch == "qwen3" and draw(st.booleans()):
        cfg.update(use_sliding_window=True, sliding_window=5, max_window_layers=layers - 1,
                   layer_types=["full_attention"] * (layers - 1) + ["sliding_attention"])
    elif arch == "qwen3":
        cfg["layer_types"] = ["full_attention"] * layers
    return arch, cfg


def graphrt_implements(cfg: dict) -> bool:
    """Whether graphrt's own decoder implements the drawn config (what auto must pick)."""
    return (cfg["hidden_act"] == "silu" and cfg["rope_parameters"]["rope_type"] == "default"
            and not cfg.get("mlp_bias"))


@settings(max_examples=examples(10), deadline=None)
@given(drawn=configs(), backend=st.sampled_from(["eager", "cpu"]), lengths=st.lists(st.integers(1, 30), min_size=1,
                                                                                  max_size=3),
       seed=st.integers(0, 2**16))
@example(drawn=("qwen3", dict(hidden_act="relu")), backend="eager", lengths=[6, 9], seed=1)      # the case
@example(drawn=("llama", dict(mlp_bias=True, **rope("longrope", 10000.0, 4.0, 8))), backend="cpu", lengths=[28, 5],
         seed=2)
@example(drawn=("mistral", dict(sliding_window=5, head_dim=8, **rope("default", 500.0, 1.0, 4))), backend="cpu",
         lengths=[20, 3], seed=3)
def test_auto_gives_transformers_argmax_on_every_drawn_config(drawn, backend, lengths, seed):
    from graphrt.models.torch.decoder import DecoderForCausalLM

    arch, cfg = drawn
    cfg = {"hidden_act": "silu", "rope_parameters": {"rope_type": "default"}, **cfg}
    path = str(tiny_checkpoint(arch, seed=seed % 4, **cfg))
    prompts = random_prompts(lengths, seed=seed)
    with graphrt.LLM(path, backend=backend, model_impl="auto", **PROPERTY_KW, **({"strict": True} if backend == "cpu" else {})
                     ) as llm:
        assert isinstance(llm.runner.model, DecoderForCausalLM) == graphrt_implements(cfg)
        outs = llm.generate(prompts, graphrt.SamplingParams(max_tokens=4, ignore_eos=True))
    reference = load_reference(path)
    assert [argmax_problem(reference, p, o.token_ids) for p, o in zip(prompts, outs)] == [None] * len(prompts)
