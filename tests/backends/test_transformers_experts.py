"""Experts modules outside transformers' experts interface (transformers_impl/experts.py; issue 45).

DBRX, JetMoE and LongCat-Flash read their routing on the host in their own forwards; graphrt
routes them onto its grouped path over views of their weights:

* each routed module gives what its own forward gives on the same inputs (grouped and batched),
  holding no weight of its own;
* through ``graphrt.LLM``: 5 concurrent requests (one joining later, chunked prefills) in eager and
  every ``cpu`` graph mode, strict (every graphed step replayed), each prompt and generated
  token's logprob teacher-forced against transformers' own forward;
* what is not routed is refused for graphs with its host sync named: ``experts="eager"``, a known
  class whose weights are of another layout, an experts class graphrt does not know.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import graphrt
from graphrt.core.errors import GraphCaptureError

pytest.importorskip("transformers")

from graphrt.models.torch.transformers_impl import (ATTENTION_NAME, load_transformers_model,  # noqa: E402
                                                    register_attention, wrap_transformers_model)
from graphrt.models.torch.transformers_impl.experts import LAYOUTS, route_experts  # noqa: E402
from transformers_zoo import load_reference, tiny_checkpoint  # noqa: E402
from support.teacher_forced import assert_teacher_forced  # noqa: E402

#: The tiny checkpoints: LongCat-Flash with 2 identity experts beside its 4 (so both kinds are hit).
CHECKPOINTS = {"dbrx": {}, "jetmoe": {}, "longcat_flash": {"zero_expert_num": 2}}
KW = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=4, num_kv_blocks=40,
          cudagraph_capture_sizes=[4, 8, 16])
PROMPTS = [[5, 9, 17, 33, 65, 7, 11, 13, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61], [40, 41],
           [3, 4, 5, 6, 7, 8], [90, 12, 77], [100, 101, 102, 103, 104, 105, 106, 107, 108]]
PARAMS = graphrt.SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1)


def _path(arch):
    return tiny_checkpoint(arch, **CHECKPOINTS[arch])


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = load_reference(str(_path(arch)))
        return cache[arch]
    return get


# ---- each routed module against its own forward ------------------------------------------------

def _calls(arch, module, gen):
    """The inputs the module's own forward takes, drawn: one call per routed method."""
    h = module.input_size if arch == "jetmoe" else module.hidden_size
    x = torch.randn(1, 7, h, generator=gen)
    if arch == "jetmoe":
        return x, None, None
    experts = module.num_experts if arch == "dbrx" else module.total_experts
    index = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(7)])
    weights = torch.rand(7, 2, generator=gen)
    return (x, index, weights) if arch == "dbrx" else (x[0], index, weights)


def _outputs(arch, module, inputs):
    x, index, weights = inputs
    if arch != "jetmoe":
        return [module(x, index, weights)]
    if type(module).__name__ == "JetMoeMoE":
        return [module(x)]
    queries, logits, topo = module.map(x)
    return [queries, logits, module.reduce(queries * 0.5 + 1.0, topo)]


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("arch", list(CHECKPOINTS))
def test_a_routed_experts_module_computes_what_its_own_forward_does(arch, impl, references):
    model = load_reference(str(_path(arch)))
    known = [(p, m) for p, m in model.named_modules() if type(m).__name__ in LAYOUTS]
    assert known
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        inputs = [_calls(arch, m, gen) for _, m in known]
        want = [_outputs(arch, m, x) for (_, m), x in zip(known, inputs)]
        params = {n: p.data_ptr() for n, p in model.named_parameters()}
        assert route_experts(model, impl) == [p for p, _ in known]
        got = [_outputs(arch, m, x) for (_, m), x in zip(known, inputs)]
    for (path, module), g, w in zip(known, got, want):
        for a, b in zip(g, w):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5, err_msg=path)
        views = LAYOUTS[type(module).__name__].weights(module)         # the weights re-viewed, not copied
        stores = {p.untyped_storage().data_ptr() for p in module.parameters()}
        assert {v.untyped_storage().data_ptr() for v in (views.gate, views.up, views.down) if v is not None} <= stores
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == params


# ---- through graphrt.LLM, every mode -----------------------------------------------------------

def _llm(arch, mode, **kw):
    backend = dict(backend="eager") if mode == "eager" else dict(backend="cpu", mode=mode, strict=True)
    return graphrt.LLM(str(_path(arch)), model_impl="transformers", **backend, **KW, **kw)


@pytest.mark.parametrize("mode", ["eager", "FULL_DECODE_ONLY", "PIECEWISE", "FULL_AND_PIECEWISE"])
@pytest.mark.parametrize("arch", list(CHECKPOINTS))
def test_host_sync_experts_run_in_every_graph_mode(arch, mode, references):
    with _llm(arch, mode) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        stats = llm.stats
    assert stats["eager_by_cause"].get("capture_failed", {}).get("steps", 0) == 0
    if mode != "eager":
        assert stats["hits"] > 0 and {k for k, v in stats["eager_by_cause"].items() if v["steps"]} <= {"mode"}
    for out in outs:
        assert len(out.token_ids) == 4
        assert_teacher_forced(references(arch), out)


# ---- what is not routed is refused with its host sync named -------------------------------------

def test_eager_experts_keep_their_loop_and_are_refused_for_graphs_naming_the_host_sync():
    model = load_transformers_model(_path("dbrx"), experts="eager")
    with pytest.raises(GraphCaptureError, match=r"transformer\.blocks\.0\.ffn\.experts \(DbrxExperts\): "
                                                r"experts='eager'.*nonzero\(\).*host sync"):
        graphrt.LLM(model, backend="cpu", strict=True, **KW)


def test_a_known_class_with_weights_of_another_layout_is_refused_naming_the_host_sync():
    hf = load_reference(str(_path("longcat_flash")))
    hf.config._attn_implementation = ATTENTION_NAME
    register_attention()
    for module in hf.modules():
        if type(module).__name__ == "LongcatFlashExperts":      # [E + 1, H, I]: not the [E, H, I] graphrt re-views
            extra = torch.cat([module.down_proj.data, module.down_proj.data[:1]])
            module.down_proj = torch.nn.Parameter(extra)
    model = wrap_transformers_model(hf)
    with pytest.raises(GraphCaptureError, match=r"\(LongcatFlashExperts\): its weights are not in the layout.*"
                                                r"\.item\(\) per expert hit\) -- a host sync"):
        graphrt.LLM(model, backend="cpu", strict=True, **KW)


def test_an_experts_class_graphrt_does_not_know_is_refused_at_capture_naming_the_host_sync():
    from transformers.models.dbrx.modeling_dbrx import DbrxExperts

    class OwnExperts(DbrxExperts):        # a checkpoint's own experts class: same loop, a layout graphrt cannot know
        pass

    hf = load_reference(str(_path("dbrx")))
    hf.config._attn_implementation = ATTENTION_NAME
    register_attention()
    for block in hf.transformer.blocks:
        block.ffn.experts.__class__ = OwnExperts
    model = wrap_transformers_model(hf)
    assert model.graph_blocker is None
    with pytest.raises(GraphCaptureError, match=r"_local_scalar_dense.*\[in transformer\.blocks\.0\.ffn\.experts "
                                                r"\(OwnExperts\) at modeling_dbrx\.py:\d+\]; OwnExperts is an experts "
                                                r"module graphrt does not route"):
        graphrt.LLM(model, backend="cpu", strict=True, **KW)
