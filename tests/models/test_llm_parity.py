"""graphrt.LLM end to end against Hugging Face transformers (tiny float32 checkpoints).

Every generated token of a greedy run must be an argmax of transformers' logits for the
same sequence (exact ties allowed), on the ``eager`` and ``cpu`` backends, with prompts
from 1 token to longer than ``max_num_batched_tokens`` (chunked prefill), more prompts
than ``max_num_seqs`` (continuous batching) and, in a second configuration, so few KV
blocks that requests are preempted and recomputed. Also: stop reasons, output order,
and ``cpu`` == ``eager`` token for token.
"""

from __future__ import annotations

import pytest

import graphrt
from graphrt import SamplingParams
from support.fast_subset import slow_except
from support.hf_models import hf_logits, load_hf_model, random_prompts, tiny_hf_model_dir

ARCHS = ("qwen3", "qwen3-tied", "llama")
BACKENDS = ("eager", "cpu")
MAX_NUM_SEQS = 4
MAX_NUM_BATCHED_TOKENS = 32
MAX_MODEL_LEN = 64
BLOCK_SIZE = 4
CAPTURE_SIZES = [4, 8, 32]
MAX_TOKENS = 6
#: 1 token up to well past max_num_batched_tokens (57 > 32: prefilled in two chunks);
#: ten prompts for four request slots.
PROMPT_LENGTHS = (1, 2, 3, 5, 8, 13, 21, 34, 45, 57)
TIE_TOLERANCE = 1e-4
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


PROMPTS = random_prompts(PROMPT_LENGTHS, seed=0)


def make_llm(model_dir, backend: str, **overrides) -> graphrt.LLM:
    kwargs = dict(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                  max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                  cudagraph_capture_sizes=CAPTURE_SIZES)
    kwargs.update(overrides)
    return graphrt.LLM(str(model_dir), backend=backend, **kwargs)


def assert_greedy_parity(hf_model, outputs, prompts) -> int:
    """Every generated token is an argmax (within TIE_TOLERANCE) of the HF logits; returns #checked."""
    checked = 0
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        assert out.prompt_token_ids == prompt
        seq = prompt + out.token_ids
        ref = hf_logits(hf_model, seq[:-1]).numpy()           # one forward per request
        for j, tok in enumerate(out.token_ids):
            row = ref[len(prompt) - 1 + j]
            assert row[tok] >= row.max() - TIE_TOLERANCE, (
                f"prompt {i} (len {len(prompt)}), generated token {j}: graphrt chose {tok} "
                f"(logit {row[tok]:.6f}) but transformers' argmax is {int(row.argmax())} "
                f"(logit {row.max():.6f}); tokens so far {out.token_ids[:j + 1]}")
            checked += 1
    return checked


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def hf_model(arch):
    return load_hf_model(tiny_hf_model_dir(arch))


@pytest.fixture(scope="module")
def greedy_runs(arch):
    """One greedy generate of PROMPTS per backend: (llm, outputs)."""
    runs = {}
    for backend in BACKENDS:
        llm = make_llm(tiny_hf_model_dir(arch), backend)
        runs[backend] = (llm, llm.generate(PROMPTS, GREEDY))
    return runs


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_match_transformers(greedy_runs, hf_model, backend):
    llm, outputs = greedy_runs[backend]
    checked = assert_greedy_parity(hf_model, outputs, PROMPTS)
    assert checked == len(PROMPTS) * MAX_TOKENS
    assert all(o.finish_reason == "length" and len(o.token_ids) == MAX_TOKENS for o in outputs)
    stats = llm.stats
    # The workload exercised what it claims to: chunked prefill of the 57-token prompt
    # (a step can hold at most 32 tokens) and more prompts than request slots.
    assert stats["real_tokens"] >= sum(PROMPT_LENGTHS) + len(PROMPTS) * (MAX_TOKENS - 1)
    if backend == "cpu":
        # Every step fits the largest capture size, so every step replayed a graph.
        assert stats["eager_steps"] == 0 and stats["hits"] > 0 and stats["unplanned_builds"] == 0
        assert stats["padded_tokens"] > stats["real_tokens"]
    else:
        assert stats["entries"] == 0


def test_cpu_and_eager_produce_identical_tokens(greedy_runs):
    eager = [o.token_ids for o in greedy_runs["eager"][1]]
    cpu = [o.token_ids for o in greedy_runs["cpu"][1]]
    assert cpu == eager


def test_outputs_in_prompt_order(greedy_runs):
    # Short prompts finish long before the 57-token one; the result is still in prompt order.
    for _, outputs in greedy_runs.values():
        assert [o.prompt_token_ids for o in outputs] == PROMPTS
        ids = [o.request_id for o in outputs]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)


# ---- preemption --------------------------------------------------------------------------

#: 8 requests of 18..30 tokens (+6 generated): each needs at most 9 blocks of 4 tokens, four
#: running at once need far more than the 13 usable blocks, so decodes preempt.
PREEMPT_LENGTHS = (18, 22, 26, 30, 20, 24, 28, 19)
PREEMPT_KV_BLOCKS = 14


@pytest.fixture(scope="module")
def qwen3_hf():
    return load_hf_model(tiny_hf_model_dir("qwen3"))


@pytest.mark.parametrize("backend", slow_except(BACKENDS, "cpu"))
def test_preemption_keeps_tokens_exact(backend, qwen3_hf):
    prompts = random_prompts(PREEMPT_LENGTHS, seed=1)
    # Admission without the KV estimate (schedule_conservativeness 0), so that running
    # requests outgrow the cache and preempt; the default estimate avoids exactly that.
    llm = make_llm(tiny_hf_model_dir("qwen3"), backend, num_kv_blocks=PREEMPT_KV_BLOCKS,
                   schedule_conservativeness=0.0)
    outputs = llm.generate(prompts, GREEDY)
    assert llm.stats["preemptions"] > 0
    assert llm.stats["kv_blocks"] == PREEMPT_KV_BLOCKS
    assert_greedy_parity(qwen3_hf, outputs, prompts)
    # The same prompts with room for everything: identical tokens, no preemption.
    roomy = make_llm(tiny_hf_model_dir("qwen3"), "eager")
    reference = roomy.generate(prompts, GREEDY)
    assert roomy.stats["preemptions"] == 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    # Every block came back.
    assert llm.allocator.num_free == llm.allocator.capacity
    assert not llm.has_unfinished()


# ---- stop reasons --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def eos_case():
    """A checkpoint whose EOS is a token greedy decoding of PROMPT produces at step k > 0.

    Same weights as the default qwen3 checkpoint (the seed and shapes are the same; only
    ``eos_token_id`` in config.json differs).
    """
    prompt = PROMPTS[4]
    base = make_llm(tiny_hf_model_dir("qwen3"), "eager")
    tokens = base.generate([prompt], GREEDY)[0].token_ids
    k = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    eos = tokens[k]
    model_dir = tiny_hf_model_dir("qwen3", eos_token_id=eos)
    return prompt, tokens, k, eos, model_dir


@pytest.mark.parametrize("backend", slow_except(BACKENDS, "cpu"))
def test_eos_stops_unless_ignored(eos_case, backend):
    prompt, tokens, k, eos, model_dir = eos_case
    llm = make_llm(model_dir, backend)
    assert llm.eos_token_ids == frozenset({eos})
    stop, ignored = llm.generate([prompt, prompt], [SamplingParams(max_tokens=MAX_TOKENS),
                                                    GREEDY])
    assert stop.finish_reason == "stop"
    assert stop.token_ids == tokens[:k + 1] and stop.token_ids[-1] == eos
    assert ignored.finish_reason == "length"
    assert ignored.token_ids == tokens


def test_max_tokens_and_max_model_len_give_length():
    llm = make_llm(tiny_hf_model_dir("qwen3"), "eager")
    long_prompt = random_prompts([MAX_MODEL_LEN - 4], seed=3)[0]
    outs = llm.generate([PROMPTS[2], PROMPTS[5], long_prompt],
                        [SamplingParams(max_tokens=1, ignore_eos=True),
                         SamplingParams(max_tokens=3, ignore_eos=True),
                         SamplingParams(max_tokens=16, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [1, 3, 4]   # the last stops at max_model_len
    assert all(o.finish_reason == "length" for o in outs)
    assert len(outs[2].prompt_token_ids) + len(outs[2].token_ids) == MAX_MODEL_LEN
