"""Logprobs (issue 25): the sampled tokens' and the prompt's, computed on the device on every backend.

* The logprobs of a step's sampled tokens equal ``log_softmax`` of the step's logits (within
  ``graphrt.tolerance``) on eager, cpu graphs and xla, greedy and seeded random, padded rows
  included; the top logprobs are the largest, sorted descending, as many as each row asked for;
  a row that asked none gets none.
* Prompt logprobs, over two prefill chunks, equal ``log_softmax`` of the unpadded eager forward's
  logits at every prompt position (the chunk's last position: the next chunk's first token).
* Counts above ``max_logprobs`` are refused with an ``InputError`` naming the field before the
  step runs (no KV byte written, nothing counted); ``max_logprobs=0`` builds no logprobs graph.
* ``runner.outputs.device_logits()`` is the device buffer itself (torch) or the executable's array (xla).
* ``graphrt.LLM`` returns vLLM-shaped logprobs and prompt logprobs, the same from the plain and the
  overlapped loop; a request asking for prompt logprobs does not take a cached prefix.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import graphrt
from graphrt import InputError, ModelRunner, SamplingParams
from graphrt.core.dispatch import SamplerKey
from graphrt.core.sampling.logprobs import StepOutput
from graphrt.runner import sampling_batch
from support.hf_models import tiny_hf_model_dir
from support.loop_outputs import assert_same

VOCAB = 128
#: Five request slots and a 24-token bucket: shapes no other module compiles on xla.
LIMITS = dict(max_num_seqs=5, max_num_batched_tokens=24, max_model_len=40, block_size=4)
NUM_BLOCKS = LIMITS["max_num_seqs"] * LIMITS["max_model_len"] // LIMITS["block_size"] + 1
BACKEND_FIELDS = {"eager": {}, "cpu": dict(cudagraph_capture_sizes=[2, 4, 8, 24]),
                  "xla": dict(precompile_token_paddings=[8, 24], precompile_bs_paddings=[4, 5], strict=True)}
PROMPTS = [7, 5, 9]              # prompt lengths of the three requests
TOL = graphrt.tolerance("float32")


def make_runner(backend: str, **fields) -> ModelRunner:
    if backend == "xla":
        pytest.importorskip("jax")
    return ModelRunner(str(tiny_hf_model_dir("qwen3")), backend=backend, num_kv_blocks=NUM_BLOCKS, progress=False,
                       **{**LIMITS, **BACKEND_FIELDS[backend], **fields})


@pytest.fixture(scope="module", params=["eager", "cpu", "xla"])
def runner(request) -> ModelRunner:
    return make_runner(request.param)


@pytest.fixture(scope="module")
def reference() -> ModelRunner:
    """The unpadded eager forward whose logits every backend's logprobs are compared with."""
    return make_runner("eager", max_logprobs=0)


def tables() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    tokens = rng.integers(3, VOCAB, size=(LIMITS["max_num_seqs"], LIMITS["max_model_len"]), dtype=np.int32)
    width = LIMITS["max_model_len"] // LIMITS["block_size"]
    blocks = (1 + np.arange(LIMITS["max_num_seqs"] * width, dtype=np.int32)).reshape(-1, width)
    return tokens, blocks


def run(runner: ModelRunner, computed, scheduled, sampling=None, *, run_async: bool = False, rows=None, **kw):
    tokens, blocks = tables()
    n = len(computed)
    call = runner.execute_async if run_async else runner.execute
    out = call(token_ids=tokens, block_table=blocks, req_rows=np.asarray(rows or range(n), dtype=np.int32),
               num_computed_tokens=np.asarray(computed, np.int32),
               num_scheduled_tokens=np.asarray(scheduled, np.int32), sampling=sampling, **kw)
    return out.result() if run_async else out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def check_rows(lp, ref: np.ndarray, tokens: np.ndarray, asked: list[int | None]) -> None:
    """``lp`` (TokenLogprobs) against ``ref`` (float64 logprobs ``[N, V]``) for the tokens ``tokens``."""
    n = len(tokens)
    np.testing.assert_array_equal(lp.token_ids, tokens)
    np.testing.assert_allclose(lp.logprobs, ref[np.arange(n), tokens], **TOL._asdict())
    for i in range(n):
        chosen = ref[i, tokens[i]]
        slack = TOL.atol + TOL.rtol * abs(chosen)
        assert 1 + (ref[i] > chosen + slack).sum() <= lp.ranks[i] <= 1 + (ref[i] > chosen - slack).sum()
        top = lp.top(i)
        if asked[i] is None:
            assert top == [] and lp.num_top[i] == -1
            continue
        assert len(top) == asked[i], "as many top logprobs as the row asked for"
        values = np.array([v for _, v in top])
        assert (np.diff(values) <= 0).all(), "sorted descending"
        np.testing.assert_allclose(values, np.sort(ref[i])[::-1][:asked[i]], **TOL._asdict())
        np.testing.assert_allclose(values, ref[i, [t for t, _ in top]], **TOL._asdict())


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_sampled_logprobs_equal_log_softmax_of_the_logits(runner, kind):
    asked = [3, None, 5]
    params = [SamplingParams(temperature=0.0 if kind == "greedy" else 0.8, seed=None if kind == "greedy" else 11 + i,
                             logprobs=k) for i, k in enumerate(asked)]
    batch = sampling_batch(params, [100 + i for i in range(3)], VOCAB)
    computed = [0, 0, 0]
    for step, scheduled in enumerate((PROMPTS, [1, 1, 1], [1, 1, 1])):   # a prefill, then padded decodes
        out = run(runner, computed, scheduled, batch, run_async=step == 2)
        assert isinstance(out, StepOutput)
        ref = log_softmax(runner.outputs.logits())
        check_rows(out.logprobs, ref, out.token_ids, asked)
        if kind == "greedy":
            np.testing.assert_array_equal(out.token_ids, ref.argmax(axis=-1))
            assert (out.logprobs.ranks == 1).all()
        computed = [c + s for c, s in zip(computed, scheduled)]
    for i in range(3):
        runner.free_request(100 + i)


def test_a_step_that_asks_nothing_returns_its_tokens_as_before(runner):
    out = run(runner, [0, 0], PROMPTS[:2], sampling_batch([SamplingParams()] * 2, [0, 1], VOCAB))
    assert type(out) is np.ndarray and out.shape == (2,)


def test_prompt_logprobs_equal_the_unpadded_eager_logits(runner, reference):
    tokens, _ = tables()
    length = 13                                                  # request 1's prompt, in two chunks
    run(reference, [0], [length], rows=[1])
    hidden = torch.from_numpy(reference.outputs.hidden_states(length))
    with torch.no_grad():
        ref = log_softmax(reference.model.compute_logits(hidden).numpy())   # position j predicts j + 1
    batch = sampling_batch([SamplingParams()] * 2, [0, 1], VOCAB)
    got = []
    for computed, scheduled in (([0, 0], [4, 8]), ([4, 8], [1, 5])):
        out = run(runner, computed, scheduled, batch, prompt_logprobs=[None, 4])
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs[1]) == scheduled[1]
        got.append(out.prompt_logprobs[1])
    rows = length - 1                                            # positions whose next token is known
    token_lps = np.concatenate([g.logprobs for g in got])[:rows]
    np.testing.assert_array_equal(np.concatenate([g.token_ids for g in got])[:rows], tokens[1, 1:length])
    np.testing.assert_allclose(token_lps, ref[np.arange(rows), tokens[1, 1:length]], **TOL._asdict())
    tops = [g.top(j) for g in got for j in range(len(g))][:rows]
    assert all(len(t) == 4 for t in tops)
    np.testing.assert_allclose([[v for _, v in t] for t in tops], np.sort(ref[:rows], axis=-1)[:, ::-1][:, :4],
                               **TOL._asdict())


def _kv(runner) -> bytes:
    kv = runner.executor.kv_cache
    return kv.detach().cpu().numpy().tobytes() if hasattr(kv, "detach") else np.asarray(kv).tobytes()


@pytest.mark.parametrize("change, field", [
    (dict(logprobs=[None, 21]), "logprobs"),
    (dict(prompt_logprobs=[None, 99]), "prompt_logprobs[1]"),
    (dict(prompt_logprobs=[1]), "prompt_logprobs"),
    (dict(prompt_logprobs=[None, -1]), "prompt_logprobs[1]"),
    (dict(prompt_logprobs=[None, 2.0]), "prompt_logprobs[1]"),
])
def test_counts_above_max_logprobs_are_refused_before_the_step(runner, change, field):
    run(runner, [0, 0], PROMPTS[:2], sampling_batch([SamplingParams()] * 2, [0, 1], VOCAB))
    before, steps = _kv(runner), runner.stats.hits + runner.stats.misses + runner.stats.eager_steps
    params = [SamplingParams(logprobs=k) for k in change.get("logprobs", [None, None])]
    with pytest.raises(InputError) as err:
        run(runner, PROMPTS[:2], [1, 1], sampling_batch(params, [0, 1], VOCAB),
            prompt_logprobs=change.get("prompt_logprobs"))
    assert err.value.field == field, str(err.value)
    assert _kv(runner) == before and runner.stats.hits + runner.stats.misses + runner.stats.eager_steps == steps


def test_device_logits_need_no_host_copy(runner):
    run(runner, [0, 0, 0], PROMPTS, sampling_batch([SamplingParams()] * 3, [0, 1, 2], VOCAB))
    run(runner, PROMPTS, [1, 1, 1], sampling_batch([SamplingParams()] * 3, [0, 1, 2], VOCAB))
    logits = runner.outputs.device_logits()
    assert logits.shape[0] >= 3 == runner.last_step.num_reqs
    if isinstance(logits, torch.Tensor):
        assert logits.data_ptr() == runner.executor.logits_out.data_ptr(), "a view of the static buffer"
    else:
        import jax
        assert isinstance(logits, jax.Array)
    np.testing.assert_array_equal(np.asarray(logits)[:3], runner.outputs.logits())


def test_warm_up_builds_logprobs_graphs_only_when_they_are_on(runner):
    keys = [k for k in runner.sampler_cache if isinstance(k, SamplerKey) and k.logprobs]
    counts = {k.num_reqs for k in runner.sampler_cache if isinstance(k, SamplerKey) and not k.logprobs}
    if runner.backend.name == "eager":
        assert keys == []
        return
    assert {k.num_reqs for k in keys} == counts, "one logprobs graph per sampler request count"
    if runner.backend.name == "xla":
        assert runner.executor.compiles.stats.unplanned_builds == 0


def test_max_logprobs_0_builds_no_logprobs_graph_and_refuses_them():
    runner = make_runner("cpu", max_logprobs=0, cudagraph_capture_sizes=[2, 24])
    assert not any(k.logprobs for k in runner.sampler_cache)
    with pytest.raises(InputError, match="max_logprobs is 0") as err:
        run(runner, [0, 0], PROMPTS[:2], sampling_batch([SamplingParams(logprobs=0)] * 2, [0, 1], VOCAB))
    assert err.value.field == "logprobs"


# ---- graphrt.LLM --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm() -> graphrt.LLM:
    return graphrt.LLM(str(tiny_hf_model_dir("qwen3")), backend="cpu", max_num_seqs=4, max_num_batched_tokens=16,
                       max_model_len=48, block_size=4, num_kv_blocks=48, max_logprobs=5,
                       cudagraph_capture_sizes=[1, 2, 4, 8, 16])


def test_llm_returns_logprobs_and_prompt_logprobs_from_both_loops(llm, reference):
    prompt = list(range(10, 30))                                  # 20 tokens: two prefill chunks
    params = [SamplingParams(max_tokens=5, logprobs=2, prompt_logprobs=3), SamplingParams(max_tokens=4),
              SamplingParams(max_tokens=3, temperature=0.9, seed=5, logprobs=0)]
    results = []
    for overlap in (False, True):
        llm.overlap = overlap
        llm.reset_prefix_cache()
        results.append(llm.generate([prompt, [40, 41, 42], [50, 51]], params))
    plain, overlapped = results
    assert_same([(o.token_ids, o.finish_reason, o.logprobs, o.prompt_logprobs) for o in overlapped],
                [(o.token_ids, o.finish_reason, o.logprobs, o.prompt_logprobs) for o in plain])
    first, second, third = plain
    assert second.logprobs is None and second.prompt_logprobs is None
    for out, k in ((first, 2), (third, 0)):
        assert len(out.logprobs) == len(out.token_ids)
        for token, entry in zip(out.token_ids, out.logprobs):
            assert token in entry and len(entry) in (k, k + 1)
            ranked = sorted((lp.rank, lp.logprob) for t, lp in entry.items())
            assert [lp for _, lp in ranked] == sorted((lp for _, lp in ranked), reverse=True)
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(prompt)
    tokens, blocks = tables()
    tokens = tokens.copy()
    tokens[0, :len(prompt)] = prompt
    reference.execute(token_ids=tokens, block_table=blocks, req_rows=np.zeros(1, np.int32),
                      num_computed_tokens=np.zeros(1, np.int32), num_scheduled_tokens=np.array([len(prompt)], np.int32))
    with torch.no_grad():
        ref = log_softmax(reference.model.compute_logits(torch.from_numpy(reference.outputs.hidden_states(len(prompt)))).numpy())
    for j in range(1, len(prompt)):
        entry = first.prompt_logprobs[j]
        assert prompt[j] in entry and len(entry) in (3, 4)
        np.testing.assert_allclose(entry[prompt[j]].logprob, ref[j - 1, prompt[j]], **TOL._asdict())


def test_prompt_logprobs_requests_take_no_cached_prefix(llm):
    llm.overlap = False
    llm.reset_prefix_cache()
    prompt = list(range(60, 81))
    llm.generate([prompt], SamplingParams(max_tokens=1))          # its blocks are cached now
    cached = llm.generate([prompt], SamplingParams(max_tokens=1))[0]
    assert cached.num_cached_tokens > 0
    full = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert full.num_cached_tokens == 0 and None not in full.prompt_logprobs[1:]


@pytest.mark.parametrize("params, field", [
    (SamplingParams(logprobs=6), "logprobs"), (SamplingParams(prompt_logprobs=6), "prompt_logprobs")])
def test_llm_refuses_counts_above_max_logprobs_before_queueing(llm, params, field):
    before = llm.stats["hits"] + llm.stats["misses"]
    with pytest.raises(InputError) as err:
        llm.generate([[5, 6, 7]], params)
    assert err.value.field == field and "max_logprobs=5" in str(err.value)
    assert llm.stats["hits"] + llm.stats["misses"] == before and not llm.has_unfinished()
