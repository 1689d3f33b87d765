"""Data-parallel graph agreement (issue 12): two DP ranks with different token counts replay the
same bucket; a rank with no work runs a padded dummy step of that bucket, which writes no KV
slot; and a rank's results are those of a runner that steps alone (two gloo ranks)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import graphrt
from support.gloo_ranks import run_ranks
from graphrt.core.errors import ConfigError
from graphrt.core.sampling.batch import sampling_batch
from support.hf_models import tiny_hf_model_dir
from support.parity import assert_close_across_reductions

MODEL = dict(arch="qwen3", vocab_size=128)
RUNNER = dict(backend="cpu", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              num_kv_blocks=16, cudagraph_capture_sizes=[4, 8, 16, 32], progress=False)
#: Per rank, per step: the requests' (prompt, tokens scheduled) or None (nothing scheduled).
PROMPTS = {0: [[5, 6, 7]], 1: [list(range(10, 21)), [30, 31, 32, 33, 34, 35]]}


class Steps:
    """One rank's tables and its requests' prefill, then one decode step."""

    def __init__(self, runner: graphrt.ModelRunner, prompts: list[list[int]]) -> None:
        self.runner, self.prompts = runner, prompts
        self.tok = np.zeros((4, 64), np.int32)
        self.blocks = np.zeros((4, runner.config.max_blocks_per_req), np.int32)
        for i, p in enumerate(prompts):
            self.tok[i, :len(p)] = p
            self.blocks[i, :4] = np.arange(1 + 4 * i, 5 + 4 * i)
        self.lens = np.array([len(p) for p in prompts], np.int32)

    def run(self, computed: np.ndarray, scheduled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.prompts)
        tokens = self.runner.execute(
            token_ids=self.tok, block_table=self.blocks, req_rows=np.arange(n, dtype=np.int32),
            num_computed_tokens=computed, num_scheduled_tokens=scheduled,
            sampling=sampling_batch([graphrt.SamplingParams()] * n, list(range(n)), self.runner.vocab_size))
        return tokens, self.runner.outputs.logits()

    def prefill_then_decode(self) -> list[np.ndarray]:
        first, logits1 = self.run(np.zeros(len(self.prompts), np.int32), self.lens)
        self.tok[np.arange(len(self.prompts)), self.lens] = first
        _, logits2 = self.run(self.lens, np.ones(len(self.prompts), np.int32))
        return [logits1, logits2]


def _rank(model_dir: str, rank: int) -> dict:
    from graphrt.backends.torch.parallel.dp_agreement import TorchStepAgreement

    runner = graphrt.ModelRunner(model_dir, step_agreement=TorchStepAgreement(), **RUNNER)
    kv = runner.executor.kv_cache.clone()
    steps = Steps(runner, PROMPTS[rank])
    keys, logits = [], []
    first, l1 = steps.run(np.zeros(len(steps.prompts), np.int32), steps.lens)      # both: prefill
    keys.append((runner.last_step.mode.value, runner.last_step.key))
    logits.append(l1)
    if rank == 0:                                                                   # rank 0 decodes
        steps.tok[0, steps.lens[0]] = first[0]
        _, l2 = steps.run(steps.lens, np.ones(1, np.int32))
        logits.append(l2)
        untouched = None
    else:                                                                           # rank 1 idles
        before = runner.executor.kv_cache.clone()
        runner.execute_dummy()
        # Padding writes only the trash row, the last row of each layer's [2, rows, heads, dim].
        untouched = bool((runner.executor.kv_cache[:, :, :-1] == before[:, :, :-1]).all())
    keys.append((runner.last_step.mode.value, runner.last_step.key))
    runner.execute_dummy()          # nobody has work: nothing runs
    keys.append(runner.last_step.key)
    return {"keys": keys, "logits": logits, "dummy_kv_untouched": untouched,
            "wrote_kv": bool((runner.executor.kv_cache != kv).any()), "hits": runner.stats.hits}


def test_two_dp_ranks_replay_the_same_bucket_and_match_a_lone_runner():
    model_dir = str(tiny_hf_model_dir(**MODEL))
    got = run_ranks(functools.partial(_rank, model_dir), world_size=2)
    k0, k1 = got[0]["keys"], got[1]["keys"]
    assert k0[0] == k1[0] and k0[0][0] != "NONE", (k0, k1)          # 3 vs 17 tokens: one graph
    assert k0[0][1].num_tokens >= 17 and k0[0][1].num_reqs in (None, 2, 4)
    assert k0[1] == k1[1] and k0[1][0] == "FULL", (k0, k1)           # a decode and a dummy
    assert k0[1][1].uniform_decode and k0[1][1].num_reqs >= 1
    assert k0[2] == k0[1][1] and k1[2] == k1[1][1], "an all-idle step ran something"
    assert got[1]["dummy_kv_untouched"], "the dummy step wrote a KV slot"
    assert got[0]["hits"] == 2 and got[1]["hits"] == 2

    alone = Steps(graphrt.ModelRunner(model_dir, **RUNNER), PROMPTS[0]).prefill_then_decode()
    for dp, ref in zip(got[0]["logits"], alone):      # other shapes, another gloo order: allclose
        assert_close_across_reductions(dp, ref, width=64)
    assert np.array_equal(got[0]["logits"][1].argmax(-1), alone[1].argmax(-1))


def test_execute_dummy_needs_an_agreement():
    runner = graphrt.ModelRunner(str(tiny_hf_model_dir(**MODEL)), **{**RUNNER, "backend": "eager"})
    with pytest.raises(ConfigError, match="step_agreement"):
        runner.execute_dummy()


def test_the_torch_agreement_needs_a_process_group():
    from graphrt.backends.torch.parallel.dp_agreement import TorchStepAgreement

    with pytest.raises(ConfigError, match="init_process_group"):
        TorchStepAgreement()
