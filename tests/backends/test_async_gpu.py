"""Steps launched without waiting on CUDA (issue 25; ``gpu``-marked, skipped without a GPU).

* ``execute_async`` returns before the device has finished: its tokens and logprobs come from a
  page-locked host slot behind an event, equal to what ``execute`` returns for the same step,
  and the previous step's tokens are read on the device (``future_rows``);
* ``graphrt.LLM`` overlaps by default on cuda and gives the plain loop's tokens and logprobs;
* ``runner.outputs.device_logits()`` is the CUDA buffer itself.

The same code runs on the CPU graphs in CI (tests/engine/test_overlap.py, tests/sampler/test_logprobs.py); the
plain against overlapped step time is ``benchmarks/bench_overlap.py --backend cuda`` (``make
gpu-check``, part ``overlap``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import graphrt
from graphrt import SamplingParams
from graphrt.runner import sampling_batch
from support.hf_models import tiny_hf_model_dir
from support.loop_outputs import assert_same

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96, block_size=4)


def test_execute_async_launches_and_resolves_from_an_event():
    runner = graphrt.ModelRunner(str(tiny_hf_model_dir("qwen3")), backend="cuda", num_kv_blocks=8 * 24 + 1,
                                 progress=False, **LIMITS)
    ex = runner.executor
    assert ex.capabilities.async_execution and ex.capabilities.device_runs_ahead
    rng = np.random.default_rng(0)
    tok = rng.integers(3, 128, size=(8, 96), dtype=np.int32)
    blocks = (1 + np.arange(8 * 24, dtype=np.int32)).reshape(8, 24)
    batch = sampling_batch([SamplingParams(logprobs=3), SamplingParams(temperature=0.7, seed=4, logprobs=1)],
                           [0, 1], runner.vocab_size)

    def step(computed, scheduled, run=runner.execute, **kw):
        return run(token_ids=tok, block_table=blocks, req_rows=np.array([0, 1], np.int32),
                   num_computed_tokens=np.asarray(computed, np.int32),
                   num_scheduled_tokens=np.asarray(scheduled, np.int32), sampling=batch, **kw)

    first = step([0, 0], [9, 6])
    tok[[0, 1], [9, 6]] = first.token_ids
    second = step([9, 6], [1, 1])
    runner.free_request(1)
    pending = step([0, 0], [9, 6], run=runner.execute_async)
    assert not pending.done()
    tok[[0, 1], [9, 6]] = 0                                         # placeholders: read on the device
    later = step([9, 6], [1, 1], run=runner.execute_async, future_rows=[0, 1])
    got_first, got_second = pending.result(), later.result()
    np.testing.assert_array_equal(got_first.token_ids, first.token_ids)
    np.testing.assert_array_equal(got_second.token_ids, second.token_ids)
    np.testing.assert_allclose(got_second.logprobs.logprobs, second.logprobs.logprobs, **graphrt.tolerance()._asdict())
    logits = runner.outputs.device_logits()
    assert logits.is_cuda and logits.data_ptr() == ex.logits_out.data_ptr()


def test_the_engine_overlaps_on_cuda_with_the_plain_loops_outputs():
    llm = graphrt.LLM(str(tiny_hf_model_dir("qwen3")), backend="cuda", num_kv_blocks=160, **LIMITS)
    assert llm.overlap, "cuda runs ahead of the host: overlap is on by default"
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 128, int(n)).tolist() for n in rng.integers(2, 40, 12)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2 if i % 2 else None,
                             temperature=0.8 if i % 3 == 0 else 0.0, seed=i if i % 3 == 0 else None)
              for i in range(12)]
    results = []
    for overlap in (False, True):
        llm.overlap = overlap
        llm.reset_prefix_cache()
        results.append([(o.token_ids, o.finish_reason, o.logprobs, o.prompt_logprobs)
                        for o in llm.generate(prompts, params)])
    assert_same(results[1], results[0])
