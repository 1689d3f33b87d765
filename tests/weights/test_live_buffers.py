"""The live-buffer check (issue 43): a buffer captured graphs read that is re-bound, converted
or reallocated is a :class:`StaleBufferError` naming the buffer, its module and the graph keys
before any replay reads the old memory -- on ``cpu`` graphs and the CUDA adapter over the
recording graph, in the default and in strict mode:

* a parameter re-bound by its module (``lm_head.weight = nn.Parameter(...)``, and
  ``load_state_dict(assign=True)``): found before the next step (module registration is counted);
* a submodule moved by ``.to()``: found at the next refit, sleep or LoRA load by default, before
  the next step in strict mode (addresses compared every step) and in debug mode (every replay);
* the KV cache allocated again under the graphs: found before the next step.

Steps stay refused until ``runner.recapture()`` captures the named keys again; then the tokens
are the same as a fresh engine's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphrt
from graphrt import StaleBufferError
from support.hf_models import tiny_hf_model_dir
from support.refit_models import ENGINE, GREEDY, PROMPTS, backend, fresh_tokens, greedy_tokens, tensors

OLD, NEW = (str(tiny_hf_model_dir("qwen3", seed=s)) for s in (0, 1))
MODES = [("cpu", False), ("cpu", True), ("cuda-sim", False), ("cuda-sim", True)]


#: One capture size: decodes replay a FULL graph (and a PIECEWISE one), prefills run eagerly.
SMALL = dict(ENGINE, cudagraph_capture_sizes=[4])


def _engine(name: str, strict: bool, **kw) -> graphrt.LLM:
    return graphrt.LLM(OLD, backend=backend(name), strict=strict, **{**SMALL, **kw})


def _replays(llm: graphrt.LLM) -> int:
    return llm.runner.stats.hits + llm.runner.sampler_stats.hits


def _refused_until_recapture(llm: graphrt.LLM, buffer: str, module: str) -> None:
    """Every step refused naming ``buffer`` and ``module``, no graph replayed; then recaptured."""
    replays = _replays(llm)
    with pytest.raises(StaleBufferError) as err:
        llm.generate(PROMPTS, GREEDY)
    assert any(b.startswith(buffer) and f"module {module}" in b for b in err.value.buffers), err.value.buffers
    assert err.value.keys and "FULL" in str(err.value) and buffer in str(err.value)
    with pytest.raises(StaleBufferError):        # still refused: nothing replays the old memory
        llm.runner.execute(token_ids=llm.loop.token_table, block_table=llm.loop.block_table,
                           req_rows=[0], num_computed_tokens=[0], num_scheduled_tokens=[2])
    assert _replays(llm) == replays
    assert llm.runner.recapture() >= len(err.value.keys)
    assert llm.runner.stats.recaptured >= len(err.value.keys)


@pytest.mark.parametrize("name,strict", MODES)
def test_a_re_bound_parameter_is_named_before_any_replay(name: str, strict: bool) -> None:
    with _engine(name, strict) as llm:
        before = greedy_tokens(llm)
        head = llm.runner.model.lm_head
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        _refused_until_recapture(llm, "lm_head.weight", "lm_head")
        assert greedy_tokens(llm) == before          # the graphs read the new parameter now
        with torch.no_grad():
            head.weight.copy_(tensors(NEW)["lm_head.weight"])      # ... in place: no check needed
        assert llm.runner.stats.recaptured > 0


def test_load_state_dict_with_assign_is_named() -> None:
    with _engine("cpu", False) as llm:
        greedy_tokens(llm)
        norm = llm.runner.model.model.norm
        norm.load_state_dict({"weight": norm.weight.detach().clone()}, assign=True)
        _refused_until_recapture(llm, "model.norm.weight", "model.norm")


@pytest.mark.parametrize("name,strict", MODES)
def test_to_of_a_submodule_is_named(name: str, strict: bool) -> None:
    with _engine(name, strict) as llm:
        greedy_tokens(llm)
        mlp = llm.runner.model.model.layers[1].mlp
        mlp.to(torch.float64)
        if not strict:                     # found at the next refit, which writes nothing
            with pytest.raises(StaleBufferError, match="model.layers.1.mlp"):
                llm.update_weights(NEW)
            assert torch.equal(llm.runner.model.lm_head.weight, tensors(OLD)["lm_head.weight"])
        _refused_until_recapture(llm, "model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj")
        mlp.to(torch.float32)             # back, for the comparison: recaptured again
        llm.runner.recapture()
        llm.update_weights(NEW)
        assert greedy_tokens(llm) == fresh_tokens(NEW, name, cudagraph_capture_sizes=(4,))


def test_debug_mode_checks_every_replay() -> None:
    """``debug_check_addresses``: the replay itself checks (no runner check in between)."""
    with _engine("cpu", False, debug_check_addresses=True) as llm:
        greedy_tokens(llm)
        llm.runner.model.model.layers[0].self_attn.to(torch.float64)
        entries = dict(llm.runner.weights.entries())
        key, entry = next((k, e) for k, e in entries.items() if isinstance(k, tuple))
        with pytest.raises(StaleBufferError, match="model.layers.0.self_attn.qkv_proj.weight"):
            llm.runner.executor.run(key[0], key[1], entry, llm.runner.preparer.padder.pad_empty(
                key[1].num_tokens, key[1].num_reqs or 1, llm.runner.executor.host_buffers))


@pytest.mark.parametrize("name,strict", MODES)
def test_a_reallocated_kv_cache_is_named(name: str, strict: bool) -> None:
    with _engine(name, strict) as llm:
        before = greedy_tokens(llm)
        llm.runner.executor.allocate_kv_cache(llm.runner.num_kv_blocks, ENGINE["block_size"])
        _refused_until_recapture(llm, "kv_cache", "executor")
        llm.reset_prefix_cache()                      # the new cache holds none of the cached KV
        assert greedy_tokens(llm) == before


def test_a_lora_load_checks_first() -> None:
    with graphrt.LLM(OLD, backend="cpu", max_loras=1, max_lora_rank=4, **SMALL) as llm:
        greedy_tokens(llm)
        llm.runner.model.model.layers[0].self_attn.o_proj.to(torch.float64)
        targets = llm.runner.lora.targets()
        name, (n_in, n_out) = next(iter(targets.items()))
        with pytest.raises(StaleBufferError, match="o_proj"):
            llm.runner.lora.load(0, {name: (torch.zeros(2, n_in), torch.zeros(n_out, 2))})
        assert not llm.runner.lora.slots.loaded[0]
