"""Length-dependent RoPE on the transformers backend: a request's tokens never depend on its batch (issue 46, item 3).

transformers' ``dynamic`` and ``longrope`` rotary modules pick their frequencies from the largest
position of the whole call; graphrt packs a step's requests into one row, so a short request
sharing a step with a long one was rotated with the long one's frequencies (other tokens than
alone). transformers_impl/rope.py replaces them with frequencies per token (its own length,
position + 1): the same tokens alone and packed, chunked or not, eagerly and in graphs, and
transformers' own tokens when it runs the sequence one token at a time.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

import graphrt
from graphrt.core.errors import ConfigError
from transformers_zoo import load_reference, tiny_checkpoint
from support.fast_subset import examples
from support.hf_greedy import argmax_problem
from support.hf_models import random_prompts

pytest.importorskip("transformers")

HALF = 8        # frequencies of the tiny llama's heads (head_dim 16)
THRESHOLD = 16  # original_max_position_embeddings (longrope), max_position_embeddings (dynamic)
#: Every RoPE type transformers' Llama takes, on a tiny model whose length-dependent ones change
#: their frequencies after THRESHOLD tokens (test prompts run to 40).
ROPES = {
    "default": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "linear": dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "dynamic": dict(max_position_embeddings=THRESHOLD,
                    rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}),
    "yarn": dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                  "original_max_position_embeddings": THRESHOLD}),
    "llama3": dict(rope_parameters={"rope_type": "llama3", "factor": 4.0, "rope_theta": 10000.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": THRESHOLD}),
    "longrope": dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                      "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
                                      "long_factor": [4.0 + 2.0 * i for i in range(HALF)],
                                      "original_max_position_embeddings": THRESHOLD}),
}
KW = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_kv_blocks=64,
          cudagraph_capture_sizes=[4, 8, 16], enable_prefix_caching=False, allow_long_max_model_len=True)
MAX_TOKENS = 4


def checkpoint(rope: str) -> str:
    overrides = {"max_position_embeddings": 64, **ROPES[rope]}
    return str(tiny_checkpoint("llama", **overrides))


_LLMS: dict[tuple[str, str], graphrt.LLM] = {}


def engine(rope: str, backend: str) -> graphrt.LLM:
    """One engine per RoPE type and backend for the whole module (cpu: every step a graph, strict)."""
    key = (rope, backend)
    if key not in _LLMS:
        extra = dict(strict=True) if backend == "cpu" else {}
        _LLMS[key] = graphrt.LLM(checkpoint(rope), backend=backend, model_impl="transformers", **KW, **extra)
    return _LLMS[key]


def tokens(llm: graphrt.LLM, prompts: list[list[int]]) -> list:
    return llm.generate(prompts, graphrt.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2))


def same_greedy_tokens(alone, packed) -> str | None:
    """None where the two runs chose the same tokens up to an exact tie (after which they may
    differ), else the first difference. The runs differ in shapes only, so logits may differ in
    their last bits: a tie is two tokens within TIE_TOLERANCE of each other in both runs."""
    from transformers_matrix import TIE_TOLERANCE

    for j, (a, p) in enumerate(zip(alone.token_ids, packed.token_ids)):
        if a == p:
            continue
        lps = alone.logprobs[j]
        if p in lps and abs(lps[a].logprob - lps[p].logprob) < TIE_TOLERANCE:
            return None
        return f"token {j}: alone {alone.token_ids}, packed {packed.token_ids}"
    return None


@pytest.mark.parametrize("rope", ["longrope", "dynamic"])
def test_a_short_request_packed_with_a_long_one_gets_its_tokens_alone(rope):
    """The issue's case: a 6-token request next to a 30-token one (past the threshold) was rotated
    with the long one's frequencies."""
    short, long = random_prompts([6, 30], seed=3)
    llm = engine(rope, "eager")
    alone = tokens(llm, [short])[0]
    packed = tokens(llm, [short, long])
    assert same_greedy_tokens(alone, packed[0]) is None
    reference = load_reference(checkpoint(rope))
    assert [argmax_problem(reference, p, o.token_ids) for p, o in zip([short, long], packed)] == [None, None]


@settings(max_examples=examples(12), deadline=None)
@given(rope=st.sampled_from(sorted(ROPES)), backend=st.sampled_from(["eager", "cpu"]),
       target=st.integers(1, 40), neighbours=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       where=st.integers(0, 3), seed=st.integers(0, 2**16))
@example(rope="longrope", backend="eager", target=6, neighbours=[30], where=0, seed=3)
@example(rope="dynamic", backend="cpu", target=6, neighbours=[30], where=1, seed=3)
@example(rope="longrope", backend="cpu", target=35, neighbours=[3, 20], where=2, seed=5)
def test_a_requests_tokens_do_not_depend_on_its_neighbours(rope, backend, target, neighbours, where, seed):
    """Check B: alone or packed with any neighbours (their lengths crossing the thresholds, the
    prompts chunked by a 16-token budget), every RoPE type the backend takes, eager and cpu graphs."""
    prompts = random_prompts([target, *neighbours], seed=seed)
    mine, others = prompts[0], prompts[1:]
    where = min(where, len(others))
    llm = engine(rope, backend)
    alone = tokens(llm, [mine])[0]
    packed = tokens(llm, others[:where] + [mine] + others[where:])[where]
    assert same_greedy_tokens(alone, packed) is None


def test_dynamic_rope_runs_in_graphs():
    """Its frequencies are a function of the positions (a device input): no host read of the step's
    largest position any more, so every step is a graph (strict), with the eager engine's tokens."""
    prompts = random_prompts([6, 30, 17], seed=4)
    graphs = engine("dynamic", "cpu")
    outs = tokens(graphs, prompts)
    assert graphs.stats["hits"] > 0 and graphs.stats["eager_steps"] == 0
    eager = tokens(engine("dynamic", "eager"), prompts)
    assert [same_greedy_tokens(e, g) for e, g in zip(eager, outs)] == [None] * len(prompts)


class _Rotary(torch.nn.Module):
    """A stand-in for a transformers rotary module with per-layer-type RoPE parameters."""

    def __init__(self, rope_type) -> None:
        super().__init__()
        self.rope_type = rope_type


def test_a_length_dependent_rope_graphrt_cannot_make_per_token_is_refused():
    from graphrt.models.torch.transformers_impl.rope import route_length_rope

    per_layer = torch.nn.Module()
    per_layer.rotary_emb = _Rotary({"full_attention": "longrope", "sliding_attention": "default"})
    with pytest.raises(ConfigError, match=r"rotary_emb .*per token"):
        route_length_rope(per_layer)

    hf = load_reference(checkpoint("longrope"))
    original = hf.model.rotary_emb
    forward = original.forward
    original.forward = lambda x, ids: tuple(t + 0.5 for t in forward(x, ids))   # computes something else
    with pytest.raises(ConfigError, match=r"model\.rotary_emb .*does not reproduce it"):
        route_length_rope(hf)
