"""A broken checkpoint through ``graphrt.LLM`` on every loader: graphrt's torch loader
(``model_impl="auto"``), the Transformers backend (``model_impl="transformers"``) and the JAX
loader (``backend="xla"``) each refuse it with an InputError naming the file and the key, never
serve transformers' random initialisation nor raise a raw safetensors / json / numpy error; NaN
or inf weights are named in a warning at load (issue 46, items 5, 10, 14).

Each case is a private copy of a tiny random Qwen3 (tests/support/hf_models.py) edited in
``tmp_path``; every load fails (or, for the NaN case, is not warmed up) before anything compiles.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

import graphrt
from graphrt.core.errors import InputError
from support.hf_models import make_tiny_hf_model

pytest.importorskip("transformers")

LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=4, warmup=False)
#: How ``graphrt.LLM`` reaches each loader.
LOADERS = {
    "graphrt": dict(backend="eager", model_impl="auto"),
    "transformers": dict(backend="eager", model_impl="transformers"),
    "xla": dict(backend="xla"),
}


def _loaders():
    reason = graphrt.available_backends().get("xla")
    return [pytest.param(name, marks=pytest.mark.skipif(name == "xla" and reason is not None, reason=str(reason)))
            for name in LOADERS]


def _llm(path, loader: str, **kw) -> graphrt.LLM:
    return graphrt.LLM(str(path), **LOADERS[loader], **LIMITS, **kw)


def _edit_tensors(path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _edit_config(path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


# ---- item 5: missing and unexpected tensors --------------------------------------------------------

@pytest.mark.parametrize("loader", _loaders())
def test_a_missing_tensor_is_named_not_initialised_at_random(tmp_path, loader):
    path = make_tiny_hf_model(tmp_path, "qwen3")
    _edit_tensors(path, lambda t: (t.pop("model.layers.1.mlp.up_proj.weight"), t.pop("model.norm.weight")))
    with pytest.raises(InputError, match=r"missing") as err:
        _llm(path, loader)
    assert "model.norm.weight" in str(err.value)
    assert "layers.1.mlp" in str(err.value)          # graphrt's own loader names the fused gate_up_proj shard


@pytest.mark.parametrize("loader", _loaders())
def test_an_unexpected_tensor_is_named_with_its_file(tmp_path, loader):
    path = make_tiny_hf_model(tmp_path, "qwen3")
    _edit_tensors(path, lambda t: t.__setitem__("model.layers.0.mlp.extra_proj.weight", torch.zeros(4, 4)))
    with pytest.raises(InputError, match=r"model\.layers\.0\.mlp\.extra_proj\.weight \(model\.safetensors\)"):
        _llm(path, loader)


@pytest.mark.parametrize("loader", _loaders())
def test_what_transformers_skips_by_design_is_accepted(tmp_path, loader):
    """A tied model without ``lm_head.weight`` and an old checkpoint's rotary ``inv_freq`` buffer
    (transformers' own ignore rules) load, to the clean checkpoint's weights."""
    clean = make_tiny_hf_model(tmp_path, "qwen3-tied")
    path = make_tiny_hf_model(tmp_path, "qwen3-tied")
    _edit_tensors(path, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)))
    want, got = _llm(clean, loader).runner.model, _llm(path, loader).runner.model
    if loader == "xla":
        import jax

        pairs = zip(jax.tree_util.tree_leaves(want.params), jax.tree_util.tree_leaves(got.params))
    else:
        pairs = zip(want.state_dict().values(), got.state_dict().values())
    assert all(bool((a == b).all()) for a, b in pairs)


# ---- item 10: raw errors on load ---------------------------------------------------------------------

@pytest.mark.parametrize("cut", ["data", "header"])
@pytest.mark.parametrize("loader", _loaders())
def test_a_truncated_safetensors_file_is_named(tmp_path, loader, cut):
    path = make_tiny_hf_model(tmp_path, "qwen3")
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2] if cut == "data" else data[:100])
    with pytest.raises(InputError, match=r"model\.safetensors.*truncated") as err:
        _llm(path, loader)
    if cut == "data":        # the first tensor whose bytes are cut off
        assert err.value.field.startswith("model.") and err.value.field.endswith(".weight")


@pytest.mark.parametrize("loader", _loaders())
def test_a_tensor_of_another_shape_is_named_with_its_file(tmp_path, loader):
    path = make_tiny_hf_model(tmp_path, "qwen3")
    _edit_tensors(path, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight",
                                                t["model.layers.0.mlp.up_proj.weight"][:-1].clone()))
    with pytest.raises(InputError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*model\.safetensors.*shape"):
        _llm(path, loader)


@pytest.mark.parametrize("loader", _loaders())
def test_a_vocabulary_size_the_weights_do_not_have_is_named(tmp_path, loader):
    path = make_tiny_hf_model(tmp_path, "qwen3")
    _edit_config(path, lambda c: c.__setitem__("vocab_size", 100))
    with pytest.raises(InputError, match=r"(embed_tokens|lm_head)\.weight.*model\.safetensors.*\(100, 64\)"):
        _llm(path, loader)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\xff\xfe"])
@pytest.mark.parametrize("loader", _loaders())
def test_a_config_json_that_is_not_a_json_object_is_named(tmp_path, loader, text):
    path = make_tiny_hf_model(tmp_path, "qwen3")
    (path / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(InputError, match=r"config\.json") as err:
        _llm(path, loader)
    assert err.value.field == "config.json" and str(path / "config.json") in str(err.value)


@pytest.mark.parametrize("model_type, match", [(None, "has none"), ("qwen99", "'qwen99'.*no model type")])
def test_a_missing_or_unknown_model_type_is_named(tmp_path, model_type, match):
    """transformers picks its classes by model_type (graphrt's own loaders read ``architectures``)."""
    path = make_tiny_hf_model(tmp_path, "qwen3")
    _edit_config(path, lambda c: c.pop("model_type") if model_type is None else c.__setitem__("model_type",
                                                                                                  model_type))
    with pytest.raises(InputError, match=match) as err:
        _llm(path, "transformers")
    assert err.value.field == "model_type" and "config.json" in str(err.value)


# ---- item 14: NaN weights -----------------------------------------------------------------------------

@pytest.mark.parametrize("loader", _loaders())
def test_nan_and_inf_weights_are_named_in_a_warning_at_load(tmp_path, loader, caplog):
    path = make_tiny_hf_model(tmp_path, "qwen3")

    def poison(t):
        t["model.norm.weight"][3] = float("nan")
        t["lm_head.weight"][5, :2] = float("inf")
    _edit_tensors(path, poison)
    with caplog.at_level(logging.WARNING, logger="graphrt"):
        _llm(path, loader)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "NaN" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "model.norm.weight (1 NaN, 0 inf of 64)" in warned[0] and "lm_head.weight (0 NaN, 2 inf" in warned[0]


@pytest.mark.parametrize("loader", _loaders())
def test_finite_weights_load_without_the_warning(tmp_path, loader, caplog):
    with caplog.at_level(logging.WARNING, logger="graphrt"):
        _llm(make_tiny_hf_model(tmp_path, "qwen3"), loader)
    assert not [r for r in caplog.records if "NaN or inf" in r.getMessage()]
