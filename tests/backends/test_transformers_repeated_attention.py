"""Attention called more than once per module in a forward, and masks a model builds itself
(transformers_impl/facts.py and model.py; issue 45).

* DiffLlama (differential attention: two calls per layer), Dory (a stack of layers run in loops)
  and HRM-Text (two stacks run in nested cycles) get one KV cache per attention call, keyed by
  its order within the forward: through ``graphrt.LLM`` with 5 concurrent requests (one joining
  later, chunked prefills), eager and every ``cpu`` graph mode (strict), each prompt and generated
  token's logprob teacher-forced against transformers' own forward.
* Dory's ``last_loop`` cache mode (earlier loops read the last loop's past) is refused by name.
* A mask the model builds itself runs when it is causal with or without a sliding window (a
  model made to materialize transformers' own masks), and is refused naming what it does
  otherwise: Doge's learned per-key bias; chunks, later keys, per-head masks (the classifier).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphrt
from graphrt.core.errors import ConfigError

pytest.importorskip("transformers")

from graphrt.models.torch.transformers_impl import load_transformers_model  # noqa: E402
from graphrt.models.torch.transformers_impl.facts import mask_window_of  # noqa: E402
from transformers_zoo import load_reference, tiny_checkpoint  # noqa: E402
from support.teacher_forced import assert_teacher_forced  # noqa: E402

KW = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=4, num_kv_blocks=64,
          cudagraph_capture_sizes=[4, 8, 16])
PROMPTS = [[5, 9, 17, 33, 65, 7, 11, 13, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61], [40, 41],
           [3, 4, 5, 6, 7, 8], [90, 12, 77], [100, 101, 102, 103, 104, 105, 106, 107, 108]]
PARAMS = graphrt.SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1)
#: Attention calls per forward of each tiny model: 2 layers x 2 (DiffLlama); Dory's 2 layers, the
#: recurrent ones twice (its default loops); HRM's 2-layer stacks x 2 H-cycles x (3 L-cycles + 1).
CALLS = {"diffllama": 4, "dory": None, "hrm_text": 16}
MODES = ["eager", "FULL_DECODE_ONLY", "PIECEWISE", "FULL_AND_PIECEWISE"]


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = load_reference(str(tiny_checkpoint(arch)))
        return cache[arch]
    return get


def _generate(path, mode):
    backend = dict(backend="eager") if mode == "eager" else dict(backend="cpu", mode=mode, strict=True)
    with graphrt.LLM(str(path), model_impl="transformers", **backend, **KW) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        stats = llm.stats
    if mode != "eager":
        assert stats["hits"] > 0 and {k for k, v in stats["eager_by_cause"].items() if v["steps"]} <= {"mode"}
    return outs


@pytest.mark.parametrize("arch", list(CALLS))
def test_each_attention_call_gets_a_kv_cache_of_its_own(arch):
    model = load_transformers_model(tiny_checkpoint(arch))
    paths = [f.path for f in model.facts]
    assert len(set(paths)) < len(paths)                     # some module attends more than once
    if CALLS[arch] is not None:
        assert len(paths) == CALLS[arch]
    assert [f.call for f in model.facts] == list(range(len(paths)))
    assert len(model.attention_layers()) == len(paths)
    assert sorted(i for g in model.kv_cache_spec().groups for i in g.layers) == list(range(len(paths)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", list(CALLS))
def test_repeated_attention_matches_transformers_in_every_mode(arch, mode, references):
    for out in _generate(tiny_checkpoint(arch), mode):
        assert len(out.token_ids) == 4
        assert_teacher_forced(references(arch), out)


def test_a_cache_mode_where_loops_read_another_calls_past_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"recurrent_kv_cache_mode='last_loop'.*last loop's cached keys"):
        load_transformers_model(tiny_checkpoint("dory", recurrent_kv_cache_mode="last_loop"))


# ---- masks the model builds itself ---------------------------------------------------------------

def test_a_learned_bias_in_place_of_a_mask_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn builds an attention mask of its own "
                                          r"\(Tensor \(1, 4, 5, 5\)\), adding a bias to the scores"):
        load_transformers_model(tiny_checkpoint("doge"))


@pytest.fixture
def materialized_masks(monkeypatch):
    """transformers builds its own float masks (-inf where hidden) for graphrt's attention, as
    for eager attention, instead of none."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "graphrt", eager_mask)


def test_a_causal_and_sliding_mask_the_model_builds_runs(materialized_masks):
    path = tiny_checkpoint("qwen3", sliding_window=3, layer_types=["sliding_attention", "full_attention"],
                           use_sliding_window=True)
    model = load_transformers_model(path)
    assert [f.sliding_window for f in model.facts] == [3, 0]
    # eager: transformers' mask preparation reads on the host whether the row packs several
    # sequences (masking_utils' packed-sequence check), which keeps this model out of graphs
    with graphrt.LLM(model, backend="eager", **KW) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    reference = load_reference(str(path))
    for out in outs:
        assert_teacher_forced(reference, out)


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(2, 9), window=st.integers(1, 12), heads=st.integers(1, 3), as_bool=st.booleans())
def test_a_causal_mask_shows_its_window(tokens, window, heads, as_bool):
    pos = torch.arange(tokens)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
    mask = allowed if as_bool else torch.zeros(tokens, tokens).masked_fill(~allowed, float("-inf"))
    got = mask_window_of("m", mask.expand(1, heads, tokens, tokens), tokens)
    assert got == (window if window < tokens else None)


@pytest.mark.parametrize("case, reason", [
    ("later", "not causal"), ("chunk", "chunked attention, chunks of 2 tokens"),
    ("heads", "differing between heads"), ("holes", "in no sliding-window pattern")])
def test_what_a_mask_does_that_paged_attention_cannot_is_named(case, reason):
    pos = torch.arange(6)
    causal = pos[None, :] <= pos[:, None]
    allowed = {"later": torch.ones(6, 6, dtype=torch.bool),
               "chunk": causal & (pos[:, None] // 2 == pos[None, :] // 2),
               "heads": torch.stack([causal, causal & (pos[:, None] - pos[None, :] < 2)]),
               "holes": causal & (pos[None, :] != 1) | torch.eye(6, dtype=torch.bool)}[case]
    with pytest.raises(ConfigError, match=reason):
        mask_window_of("model.layers.0.self_attn", allowed.reshape(1, -1, 6, 6), 6)
