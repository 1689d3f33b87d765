"""graphrt's transformers backend (models/torch/transformers_impl): its pieces, its refusals, model_impl.

The end-to-end parity of each architecture in each mode is tests/backends/test_transformers_matrix.py;
here: the extended paged kernel against a dense reference, the KV cache specs read from the
configs, the registered attention function, what keeps a model out of graphs (named, with the
module), model_impl's choice, and the kit's padding and KV-isolation properties on a sample.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import graphrt
from graphrt.core.errors import ConfigError, GraphCaptureError, InputError
from graphrt.core.numerics import tolerance
from graphrt.layers.torch.attention.paged import TorchAttentionMetadata, paged_attention_kernel
from graphrt.models.torch.transformers_impl import ATTENTION_NAME, load_transformers_model
from transformers_zoo import SLIDING_WINDOW, tiny_checkpoint

pytest.importorskip("transformers")

KW = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=4,
          cudagraph_capture_sizes=[4, 8, 16])
PROMPTS = [[5, 9, 17, 33, 65, 7, 11, 13, 19, 23, 29, 31, 37], [40, 41], [3, 4, 5, 6, 7, 8]]
GREEDY = graphrt.SamplingParams(max_tokens=4, ignore_eos=True)


# ---- the extended kernel ------------------------------------------------------------------------

def dense_attention(q, k, v, lens, scale, window=0, softcap=0.0, sinks=None):
    """Each request's causal attention over its own tokens, written out densely (float64)."""
    outs, start = [], 0
    for n in lens:
        qi, ki, vi = (x[start:start + n].double() for x in (q, k, v))
        hq, hkv = qi.shape[1], ki.shape[1]
        ki, vi = ki.repeat_interleave(hq // hkv, 1), vi.repeat_interleave(hq // hkv, 1)
        s = torch.einsum("thd,lhd->htl", qi, ki) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        pos = torch.arange(n)
        allowed = pos[None, :] <= pos[:, None]
        if window:
            allowed &= pos[None, :] > pos[:, None] - window
        s = s.masked_fill(~allowed, -math.inf)
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(hq, n, 1)], -1)
        p = torch.softmax(s, -1)[..., :n]
        outs.append(torch.einsum("htl,lhd->thd", p, vi))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("case", ["softcap+window", "sinks", "split-v", "all"])
def test_extended_kernel_matches_dense(case):
    torch.manual_seed(0)
    hq, hkv, d, dv, bs = 4, 2, 8, (4 if case in ("split-v", "all") else 8), 4
    lens = [7, 1, 12]
    t = sum(lens)
    q, k = torch.randn(t, hq, d), torch.randn(t, hkv, d)
    v = torch.randn(t, hkv, dv)
    softcap = 2.0 if case in ("softcap+window", "all") else 0.0
    window = 3 if case in ("softcap+window", "all") else 0
    sinks = torch.randn(hq) if case in ("sinks", "all") else None
    blocks_per_req = 4
    rows = (1 + len(lens) * blocks_per_req) * bs + 1
    cache = (torch.zeros(rows, hkv, d), torch.zeros(rows, hkv, dv)) if dv != d else torch.zeros(2, rows, hkv, d)
    table = torch.tensor([[1 + r * blocks_per_req + b for b in range(blocks_per_req)] for r in range(len(lens))],
                         dtype=torch.int32)
    qsl = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    slots = (table[req, pos // bs].long() * bs + pos % bs)
    out = paged_attention_kernel(q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), cache, slots, qsl, seq,
                                 table, req, bs, d ** -0.5, window, softcap=softcap, sinks=sinks)
    want = dense_attention(q, k, v, lens, d ** -0.5, window, softcap, sinks).reshape(t, -1)
    tol = tolerance("float32")
    torch.testing.assert_close(out.double(), want, rtol=tol.rtol, atol=tol.atol)


# ---- specs from the configs -----------------------------------------------------------------------

def test_gemma2_spec_windows_and_softcap_from_the_config():
    model = load_transformers_model(tiny_checkpoint("gemma2"))
    config = model.config.hf
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert [f.sliding_window for f in model.facts] == [SLIDING_WINDOW, 0]
    assert all(f.softcap == config.attn_logit_softcapping for f in model.facts)
    assert all(f.scale == config.query_pre_attn_scalar ** -0.5 for f in model.facts)
    spec = model.kv_cache_spec()
    assert sorted((g.layers, g.sliding_window) for g in spec.groups) == [((0,), SLIDING_WINDOW), ((1,), 0)]
    assert model.attention_backend.name == "graphrt-paged-transformers"     # soft-capping: the extended kernel


def test_sinks_and_split_v_heads_are_declared():
    oss = load_transformers_model(tiny_checkpoint("gpt_oss"))
    assert all(f.sinks for f in oss.facts) and all(layer.extended for layer in oss.paged)
    mla = load_transformers_model(tiny_checkpoint("deepseek_v3"))
    group = mla.kv_cache_spec().groups[0]
    assert (group.head_size, group.head_size_v) == (mla.facts[0].head_dim, mla.facts[0].head_dim_v)
    assert group.head_size_v is not None and group.head_size_v != group.head_size


def test_plain_models_use_graphrts_own_attention_backend():
    model = load_transformers_model(tiny_checkpoint("llama"))
    assert not hasattr(model, "attention_backend") and not any(layer.extended for layer in model.paged)


def test_registered_attention_refuses_calls_outside_graphrt():
    from transformers import AttentionInterface

    model = load_transformers_model(tiny_checkpoint("llama"))
    assert AttentionInterface._global_mapping[ATTENTION_NAME] is not None
    with pytest.raises(RuntimeError, match="outside graphrt"):
        model.hf(input_ids=torch.tensor([[3, 4, 5]]), use_cache=False)


def test_a_window_the_config_contradicts_is_refused():
    from graphrt.models.torch.transformers_impl.facts import _window

    with pytest.raises(ConfigError, match="sliding_window=4.*say 8"):
        _window({"window": 4, "path": "model.layers.0.self_attn"}, {0: 8}, 0)
    assert _window({"window": None, "path": "p"}, {0: 8}, 0) == 8       # the mask-only window of the config


@pytest.mark.parametrize("arch, reason", [
    ("doge", "attention mask of its own.*adding a bias"),   # a learned dynamic mask (a per-key bias)
    # compressed sparse / heavily compressed attention and ZAYA's CCA: the refusal names the kernel graphrt lacks
    ("deepseek_v4", r"graphrt lacks a kernel: .*\(DeepseekV4HCACompressor, layer_types\[0\] "
                    r"'heavily_compressed_attention'\) is heavily compressed attention, which needs a cache "
                    r"graphrt's KV spec has no kind for: compressed KV entries, one per 128 tokens.*"
                    r"\(DeepseekV4CSACompressor, layer_types\[1\] 'compressed_sparse_attention'\) is compressed "
                    r"sparse attention.* one per 4 tokens .*overlapping window of 8 tokens.*lightning indexer"),
    ("zaya", r"ZayaForCausalLM: layer_types has \['hybrid'\] layers, for which graphrt lacks a kernel: "
             r"model\.layers\.0\.self_attn\.qkv_proj \(ZayaCCAProjection.*per-request state kind graphrt's state "
             r"seam lacks: the last 2 rows of the concatenated q\|k projections.*delayed value projection"),
])
def test_what_paged_attention_cannot_run_is_refused_by_name(arch, reason):
    with pytest.raises(ConfigError, match=reason):
        load_transformers_model(tiny_checkpoint(arch))


def test_a_class_without_the_attention_backend_flag_is_refused(tmp_path):
    from transformers import BloomConfig, BloomForCausalLM

    BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="BloomForCausalLM does not declare _supports_attention_backend"):
        load_transformers_model(tmp_path)


# ---- what keeps a model out of graphs -------------------------------------------------------------

def _llm(model, **kw):
    return graphrt.LLM(model, backend="cpu", **{**KW, **kw})


def test_eager_experts_loop_is_refused_for_graphs_and_runs_eagerly(caplog):
    path = tiny_checkpoint("qwen2_moe")
    with pytest.raises(GraphCaptureError, match=r"experts_implementation='eager'.*host sync"):
        _llm(load_transformers_model(path, experts="eager"), strict=True)
    with caplog.at_level(logging.WARNING):
        llm = _llm(load_transformers_model(path, experts="eager"))
        eager = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert llm.stats["hits"] == 0 and llm.stats["eager_by_cause"]["capture_failed"]["steps"] == llm.stats["eager_steps"] > 0
    assert "model.layers.0.mlp.experts (Qwen2MoeExperts)" in caplog.text
    graphs = _llm(load_transformers_model(path))            # grouped_mm, the default: every step a graph
    assert [o.token_ids for o in graphs.generate(PROMPTS, GREEDY)] == eager
    assert graphs.stats["eager_steps"] == 0 and graphs.stats["hits"] > 0


def test_an_unknown_host_sync_names_the_op_and_the_module():
    model = load_transformers_model(tiny_checkpoint("qwen2_moe"), experts="eager")
    model.graph_blocker = None          # no declared reason: the recording graph finds it
    with pytest.raises(GraphCaptureError, match=r"_local_scalar_dense.*\[in model\.layers\.0\.mlp\.experts "
                                                r"\(Qwen2MoeExperts\) at modeling_qwen2_moe\.py:\d+\]"):
        _llm(model, strict=True)


def test_dynamic_rope_runs_in_graphs():
    """Its frequencies are per token, from the positions (transformers_impl/rope.py; issue 46,
    item 3), no longer the step's largest position read on the host: graphs hold it."""
    path = tiny_checkpoint("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    model = load_transformers_model(path)
    assert model.graph_blocker is None
    llm = _llm(model, strict=True)
    assert len(llm.generate(PROMPTS, GREEDY)) == len(PROMPTS) and llm.stats["hits"] > 0


# ---- model_impl ---------------------------------------------------------------------------------

def test_model_impl_auto_prefers_graphrts_own_decoder():
    from graphrt.models.model_impl import resolve_model_impl
    from graphrt.models.torch.decoder import DecoderForCausalLM
    from graphrt.models.torch.transformers_impl import TransformersForCausalLM

    llama, gemma = str(tiny_checkpoint("llama")), str(tiny_checkpoint("gemma2"))
    assert resolve_model_impl(llama) == "graphrt" and resolve_model_impl(gemma) == "transformers"
    assert isinstance(graphrt.LLM(llama, backend="eager", **KW).runner.model, DecoderForCausalLM)
    forced = graphrt.LLM(llama, backend="eager", model_impl="transformers", **KW)
    assert isinstance(forced.runner.model, TransformersForCausalLM)
    with pytest.raises(InputError, match="not supported"):
        graphrt.LLM(gemma, backend="eager", model_impl="graphrt", **KW)
    with pytest.raises(ConfigError, match="model_impl"):
        graphrt.LLM(llama, backend="eager", model_impl="vllm", **KW)


def test_model_impl_transformers_is_torch_only():
    from graphrt.models.model_impl import resolve_model_impl

    with pytest.raises(ConfigError, match="torch backends"):
        resolve_model_impl(str(tiny_checkpoint("llama")), "transformers", framework="jax")


def test_model_impl_is_a_cli_flag():
    import argparse

    from graphrt.config import add_cli_args, from_cli_args

    args = add_cli_args(argparse.ArgumentParser()).parse_args(["--model-impl", "transformers"])
    assert from_cli_args(args).model_impl == "transformers"


def test_transformers_and_graphrt_llama_agree():
    llama = str(tiny_checkpoint("llama"))
    own = [o.token_ids for o in graphrt.LLM(llama, backend="cpu", **KW).generate(PROMPTS, GREEDY)]
    hf = graphrt.LLM(llama, backend="cpu", model_impl="transformers", **KW)
    assert [o.token_ids for o in hf.generate(PROMPTS, GREEDY)] == own


# ---- trust_remote_code (issue 46, item 6) ----------------------------------------------------------

REMOTE_CONFIG = ("from transformers import Qwen3Config\n\n\n"
                 "class TinyRemoteConfig(Qwen3Config):\n    model_type = 'tinyremote'\n")
REMOTE_MODEL = ("from transformers import Qwen3ForCausalLM\n\nfrom .configuration_tinyremote import TinyRemoteConfig\n"
                "\n\nclass TinyRemoteForCausalLM(Qwen3ForCausalLM):\n    config_class = TinyRemoteConfig\n")


@pytest.fixture
def remote_checkpoint(tmp_path, monkeypatch):
    """A tiny Qwen3 whose config.json's auto_map names classes in .py files of its own directory
    (a Qwen3 subclass: the same weights, the same tokens); transformers' module cache in tmp_path."""
    import json
    import sys

    import transformers.dynamic_module_utils as dynamic
    from support.hf_models import make_tiny_hf_model

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    path = make_tiny_hf_model(tmp_path, "qwen3")
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="tinyremote", architectures=["TinyRemoteForCausalLM"],
                  auto_map={"AutoConfig": "configuration_tinyremote.TinyRemoteConfig",
                            "AutoModelForCausalLM": "modeling_tinyremote.TinyRemoteForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    (path / "configuration_tinyremote.py").write_text(REMOTE_CONFIG)
    (path / "modeling_tinyremote.py").write_text(REMOTE_MODEL)
    yield path
    for name in set(sys.modules) - before:
        if name.startswith("transformers_modules"):
            del sys.modules[name]


@pytest.mark.parametrize("model_impl", ["auto", "transformers"])
def test_a_checkpoints_own_code_is_refused_by_default_without_reading_stdin(remote_checkpoint, monkeypatch,
                                                                           model_impl):
    """Without trust_remote_code, a ConfigError saying how to opt in, at once: stdin (here one
    that would answer "y") is never read, no code of the checkpoint runs."""
    import io
    import sys

    stdin = io.StringIO("y\n")
    monkeypatch.setattr(sys, "stdin", stdin)
    with pytest.raises(ConfigError, match=r"^trust_remote_code: .*config\.json maps \['AutoConfig', "
                                          r"'AutoModelForCausalLM'\]") as err:
        graphrt.LLM(str(remote_checkpoint), backend="eager", model_impl=model_impl, **KW)
    assert "trust_remote_code=True" in str(err.value) and "--trust-remote-code" in str(err.value)
    assert stdin.tell() == 0
    assert not [name for name in sys.modules if "tinyremote" in name]


def test_trust_remote_code_runs_the_checkpoints_own_class(remote_checkpoint):
    llm = graphrt.LLM(str(remote_checkpoint), backend="eager", trust_remote_code=True, **KW)
    assert type(llm.runner.model.hf).__name__ == "TinyRemoteForCausalLM"
    from support.hf_models import tiny_hf_model_dir

    stock = graphrt.LLM(str(tiny_hf_model_dir("qwen3")), backend="eager", model_impl="transformers", **KW)
    assert llm.generate(PROMPTS[1:2], GREEDY)[0].token_ids == stock.generate(PROMPTS[1:2], GREEDY)[0].token_ids


def test_trust_remote_code_is_off_by_default_strict_and_a_cli_flag():
    import argparse

    from graphrt.config import GraphConfig, add_cli_args, from_cli_args

    assert GraphConfig().trust_remote_code is False
    with pytest.raises(ConfigError, match="trust_remote_code"):
        GraphConfig.create(trust_remote_code="yes")
    parser = add_cli_args(argparse.ArgumentParser())
    assert from_cli_args(parser.parse_args(["--trust-remote-code"])).trust_remote_code is True
    assert from_cli_args(parser.parse_args([])).trust_remote_code is False


# ---- the kit's properties on a sample ------------------------------------------------------------

@pytest.mark.parametrize("arch", ["gemma2", "qwen2_moe"])
def test_kit_padding_and_kv_isolation(arch):
    from graphrt.testing.conformance import run_conformance
    from graphrt.testing.runners import RunnerFactory

    path = tiny_checkpoint(arch)
    factory = RunnerFactory(lambda: load_transformers_model(path), "cpu")
    results = run_conformance(factory=factory, properties=["padding_invisible", "kv_isolated"], examples=4,
                              report=None)
    assert [r.status for r in results] == ["PASS", "PASS"], [r.line() for r in results]


# ---- the attention contract: graphrt's layers and a backend of one's own (issue 47) ---------------

@dataclass
class OwnMeta:
    """A backend's own metadata, of none of graphrt's fields."""

    slots: torch.Tensor


class OwnMetaBackend(graphrt.AttentionBackend):
    name = "own-meta"

    def build(self, step, host):
        return OwnMeta(step.slot_mapping)


@dataclass
class AttendingMeta:
    """graphrt's paged metadata kept whole inside, plus the backend's own kernel: ``attend``."""

    paged: Any
    calls: list

    def attend(self, layer, q, k, v):
        self.calls.append(type(layer).__name__)
        m = self.paged
        return paged_attention_kernel(q, k, v, layer.kv_cache, m.slot_mapping, m.query_start_loc, m.seq_lens,
                                      m.block_table, m.token_req_idx, m.block_size, layer.scale,
                                      layer.sliding_window, layer.k_scale, layer.v_scale)


class AttendingBackend(graphrt.AttentionBackend):
    name = "own-kernel"

    def __init__(self):
        self.calls = []

    def build(self, step, host):
        paged = TorchAttentionMetadata.build(step.slot_mapping, step.query_start_loc, step.seq_lens, step.block_table,
                                             step.block_size)
        return AttendingMeta(paged, self.calls)


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_a_backend_whose_metadata_the_layers_cannot_read_is_refused_at_build(arch):
    """issue 47: accepted, then ~20 "capture failed" warnings and a raw AttributeError ('OwnMeta'
    object has no attribute 'token_req_idx'); now a ConfigError naming the backend, the metadata
    type, the layer and the fields it reads, before the KV cache is allocated."""
    model = load_transformers_model(tiny_checkpoint(arch))
    model.attention_backend = OwnMetaBackend()
    with pytest.raises(ConfigError, match=r"attention backend 'own-meta' builds OwnMeta metadata, but attention layer "
                                          r"0 \(HFPagedAttention, graphrt's paged attention\) reads slot_mapping, "
                                          r"query_start_loc, seq_lens, block_table, token_req_idx, block_size of it"):
        _llm(model)
    if arch == "gpt_oss":            # sinks: graphrt's reference kernel's additions, never the backend's attend()
        model.attention_backend = type("Attending", (AttendingBackend,), {"build": lambda self, step, host: (
            AttendingMeta(None, self.calls))})()
        with pytest.raises(ConfigError, match=r"with its additions .*which this backend.s attend\(\) does not run"):
            _llm(model)


def test_graphrts_layers_call_a_backends_own_kernel_through_attend():
    """A backend's metadata with attend(layer, q, k, v) runs its own kernel in every layer, in
    graphs and eagerly, and gives graphrt's own tokens (here the kernel is graphrt's reference)."""
    path = tiny_checkpoint("llama")
    plain = [o.token_ids for o in _llm(load_transformers_model(path)).generate(PROMPTS, GREEDY)]
    model = load_transformers_model(path)
    model.attention_backend = backend = AttendingBackend()
    llm = _llm(model)
    backend.calls.clear()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
    assert set(backend.calls) == {"HFPagedAttention"} and llm.stats["hits"] > 0
