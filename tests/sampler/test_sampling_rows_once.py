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


class _Tripwire(list):
    """A batch's ``seeds`` swapped for one no step may read (the seeded rows were found once)."""

    def __iter__(self):
        raise AssertionError("a step walked the batch's seeds")

    def __getitem__(self, i):
        raise AssertionError("a step read the batch's seeds")


def test_a_step_walks_only_the_seeded_rows(runner: ModelRunner) -> None:
    """The seeded rows are found once per batch (``SamplingBatch.seeded``): a random step's
    sampler loops over them, never over every row's seed; seeded draws stay reproducible."""
    plain = sampling_batch([SamplingParams(temperature=1.0)] * 3, [0, 1, 2], VOCAB)
    seeded = sampling_batch([SamplingParams(temperature=5.0, seed=s) for s in (None, 7, None)], [0, 1, 2], VOCAB)
    assert plain.seeded == () and seeded.seeded == ((1, 7, 1),)
    runner.free_request(1)
    first = [step(runner, 3, seeded)[1] for _ in range(2)]
    object.__setattr__(plain, "seeds", _Tripwire(plain.seeds))
    step(runner, 3, plain)
    runner.free_request(1)                      # request 1 again from its first draw
    again = sampling_batch([SamplingParams(temperature=5.0, seed=s) for s in (None, 7, None)], [0, 1, 2], VOCAB)
    object.__setattr__(again, "seeds", _Tripwire(again.seeds))
    assert [step(runner, 3, again)[1] for _ in range(2)] == first


def test_xla_hands_each_step_arrays_no_later_step_writes() -> None:
    """The XLA sampler's host metadata: a batch's parameter rows are copied once, not per step
    (two steps of the batch share them), and no array a step was handed changes when later
    steps (of this batch, of another, at other row counts) are prepared: an asynchronous
    transfer of it reads what that step wrote."""
    pytest.importorskip("jax")
    from graphrt.backends.xla.sampling_rows import SamplingRows

    rows = SamplingRows(4, VOCAB, seed=0)
    hot = sampling_batch([SamplingParams(temperature=2.0, top_k=5, top_p=0.5, min_p=0.1, seed=3),
                          SamplingParams(temperature=0.5)], [0, 1], VOCAB)
    cold = sampling_batch([SamplingParams(temperature=1.0)] * 3, [0, 1, 2], VOCAB)
    first = rows.metadata(2, 4, hot)
    kept = [np.array(a, copy=True) for a in vars(first).values()]
    second = rows.metadata(2, 4, hot)
    assert second.temperature is first.temperature and second.top_k is first.top_k      # copied once a batch
    assert (first.steps[0], second.steps[0]) == (0, 1) and second.seeds is not first.seeds
    for later in (rows.metadata(3, 4, cold), rows.metadata(3, 3, cold), rows.metadata(2, 4, hot)):
        assert later.steps is not first.steps
    for before, now in zip(kept, vars(first).values()):
        np.testing.assert_array_equal(before, now)
    np.testing.assert_array_equal(first.temperature, [2.0, 0.5, 0.0, 0.0])
    np.testing.assert_array_equal(first.seeds[0], [3, 0])
