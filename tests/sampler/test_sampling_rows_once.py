"""A batch's sampling rows are written once while the same batch samples (issue 44, second step).

The samplers keep the temperature / top-k / top-p rows of the last (frozen) batch they wrote and
write them again only for another batch or other row counts: a step of another batch between two
steps of one batch, and one batch at fewer rows, each still sample under their own rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from graphrt import ModelRunner, SamplingParams
from graphrt.runner import sampling_batch
from support.hf_models import tiny_hf_model_dir

VOCAB = 128
LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32, block_size=4)
FIELDS = {"cpu": dict(cudagraph_capture_sizes=[16], max_logprobs=0),
          "xla": dict(precompile_token_paddings=[16], precompile_bs_paddings=[4], max_logprobs=0)}


@pytest.fixture(scope="module", params=["cpu", "xla"])
def runner(request) -> ModelRunner:
    if request.param == "xla":
        pytest.importorskip("jax")
    r = ModelRunner(str(tiny_hf_model_dir("qwen3")), backend=request.param, num_kv_blocks=33, progress=False,
                    **LIMITS, **FIELDS.get(request.param, {}))
    yield r
    r.close()


def step(runner: ModelRunner, num_reqs: int, sampling) -> np.ndarray:
    """The same prefill of ``num_reqs`` requests (3 tokens each) each time: the same logits."""
    tokens = (np.arange(4 * 32, dtype=np.int32).reshape(4, 32) * 7) % VOCAB
    blocks = (1 + np.arange(32, dtype=np.int32)).reshape(4, 8)
    return runner.execute(token_ids=tokens, block_table=blocks, req_rows=np.arange(num_reqs, dtype=np.int32),
                          num_computed_tokens=np.zeros(num_reqs, np.int32),
                          num_scheduled_tokens=np.full(num_reqs, 3, np.int32), sampling=sampling)


def test_each_batch_samples_under_its_own_rows(runner: ModelRunner) -> None:
    argmax = sampling_batch([SamplingParams(temperature=1.0, top_k=1)] * 3, [0, 1, 2], VOCAB)    # top-1: the argmax
    wide = sampling_batch([SamplingParams(temperature=5.0, seed=s) for s in range(3)], [0, 1, 2], VOCAB)
    first = step(runner, 3, argmax)
    np.testing.assert_array_equal(first, runner.outputs.logits()[:3].argmax(axis=-1))
    hot = [step(runner, 3, wide) for _ in range(4)]            # hot and wide: not the argmax every time
    assert any((h != first).any() for h in hot)
    np.testing.assert_array_equal(step(runner, 3, argmax), first)     # its rows written again
    np.testing.assert_array_equal(step(runner, 3, argmax), first)     # and kept
    fewer = sampling_batch([SamplingParams(temperature=1.0, top_k=1)] * 2, [0, 1], VOCAB)
    np.testing.assert_array_equal(step(runner, 2, fewer), first[:2])
