"""ModelRunner under faults and threads: a failed sampler capture is visible, strict mode
raises ``GraphCaptureError`` with the reason, and concurrent ``execute`` calls are serialized.

Repros from issue 15: a failed sampler capture counted hits on the failed key with
``eager_steps`` 0; strict warm-up raised the raw ``RuntimeError``; two threads calling
``execute`` on disjoint rows returned wrong tokens and wrote wrong KV rows.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch

from graphrt import GraphCaptureError, ModelRunner, RuntimeMode
from graphrt.core.cache import FailedBuild
from graphrt.core.eager import EagerCause
from graphrt.core.dispatch import SamplerKey
from support.runner_steps import LIMITS, Tables, VOCAB, greedy, random_steps


def make_runner(model_dir, tables, **kw):
    kw.setdefault("cudagraph_capture_sizes", [4, 8, 16, 32])
    return ModelRunner(model_dir, backend="cpu", mode="FULL", num_kv_blocks=tables.num_kv_blocks,
                       progress=False, **LIMITS, **kw)


def failing_sampler_build(runner, monkeypatch):
    """Make every sampler capture of ``runner`` fail the way a real one can (an error out of
    the capture), leaving forward captures alone."""
    build = runner.executor.build

    def build_or_fail(mode, key):
        if isinstance(key, SamplerKey):
            raise RuntimeError("operation not permitted when stream is capturing")
        return build(mode, key)

    monkeypatch.setattr(runner.executor, "build", build_or_fail)


def test_failed_sampler_capture_is_counted_and_reported(model_dir, tables, monkeypatch, caplog):
    runner = make_runner(model_dir, tables, warmup=False)
    failing_sampler_build(runner, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="graphrt"):
        report = runner.warmup()
    failed = [r for r in report if r["failed"]]
    assert failed and all(r["key"].startswith("sampler") for r in failed)
    assert all("stream is capturing" in r["failed"] for r in failed)
    assert runner.sampler_stats.failed_builds == len(failed) and runner.stats.failed_builds == 0
    assert all(isinstance(runner.sampler_cache.lookup(k), FailedBuild) for k in runner.sampler_cache.keys())
    before = runner.sampler_stats.hits
    step = tables.step([0, 1], [0, 0], [3, 2])
    tokens = step.run(runner, greedy(2))
    assert runner.last_step.mode is RuntimeMode.FULL                  # the forward replayed
    assert runner.sampler_stats.hits == before                          # no hit on a failed key
    assert runner.sampler_stats.eager_steps == 1 and runner.sampler_stats.real_reqs == 2
    [reason] = runner.sampler_stats.eager_reasons
    assert "sampler capture failed" in reason and "stream is capturing" in reason
    np.testing.assert_array_equal(tokens, runner.outputs.logits().argmax(-1))   # and the tokens are right


def test_strict_warmup_raises_graph_capture_error_with_the_reason(model_dir, tables, monkeypatch):
    runner = make_runner(model_dir, tables, warmup=False, strict=True)
    failing_sampler_build(runner, monkeypatch)
    with pytest.raises(GraphCaptureError, match=r"sampler \(reqs=\d+, greedy\).*stream is capturing") as err:
        runner.warmup()
    assert isinstance(err.value.__cause__, RuntimeError)


def test_failed_forward_capture_is_no_hit_and_counts_under_its_cause(model_dir, tables, monkeypatch):
    """Not a hit (issue 15), and not a miss either (issue 30): the key has an entry, a failed
    one, and the step counts under ``capture_failed``."""
    runner = make_runner(model_dir, tables, warmup=False, cudagraph_capture_sizes=[8])
    build = runner.executor.build

    def fail_forward(mode, key):
        if not isinstance(key, SamplerKey):
            raise RuntimeError("out of graph memory")
        return build(mode, key)

    monkeypatch.setattr(runner.executor, "build", fail_forward)
    runner.warmup()
    assert runner.stats.failed_builds == 1
    tables.step([0], [0], [5]).run(runner, greedy(1))
    assert runner.last_step.mode is RuntimeMode.NONE and "out of graph memory" in runner.last_step.eager_reason
    assert (runner.stats.hits, runner.stats.misses, runner.stats.eager_steps) == (0, 0, 1)
    assert runner.stats.eager_by_cause[EagerCause.CAPTURE_FAILED].steps == 1
    assert runner.sampler_stats.hits + runner.sampler_stats.misses == 0   # no graph sampler on an eager step


def test_sampler_statistics_count_every_graph_step(model_dir, tables):
    """A replayed sampler counts its step's requests, as one whose capture failed does."""
    runner = make_runner(model_dir, tables)
    tables.step([0, 1], [0, 0], [2, 1]).run(runner, greedy(2))
    s = runner.sampler_stats
    assert runner.last_step.mode is RuntimeMode.FULL
    assert (s.hits, s.misses, s.eager_steps, s.real_reqs) == (1, 0, 0, 2)
    assert s.padded_reqs == runner.last_step.key.num_reqs


def _disjoint_workloads(config, tables, steps: int):
    """Two workloads over disjoint rows (0-3 and 4-7), each a valid request history."""
    half = config.max_num_seqs // 2
    out = []
    for part, seed in ((0, 11), (1, 12)):
        work = []
        for step in random_steps(tables, config.model_copy(update={"max_num_seqs": half}), steps, seed):
            step.req_rows = step.req_rows + part * half
            work.append(step)
        out.append(work)
    return out


def test_two_threads_on_disjoint_rows_get_their_own_results(model_dir):
    from support.runner_steps import CONFIG
    tables = Tables(CONFIG, VOCAB, seed=3)
    works = _disjoint_workloads(CONFIG, tables, steps=60)
    ref = make_runner(model_dir, tables)
    ref.executor.kv_cache.zero_()
    want = [[step.run(ref, greedy(step.num_reqs)) for step in work] for work in works]
    want_kv = ref.executor.kv_cache.clone()

    runner = make_runner(model_dir, tables)
    runner.executor.kv_cache.zero_()
    got: list[list[np.ndarray]] = [[], []]
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def drive(i: int) -> None:
        try:
            start.wait()
            for step in works[i]:
                got[i].append(step.run(runner, greedy(step.num_reqs)))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # Each step ran alone at the same shape as in the sequential run: same kernels, same bits.
    for i in range(2):
        wrong = [j for j, (a, b) in enumerate(zip(got[i], want[i])) if not np.array_equal(a, b)]
        assert not wrong, f"thread {i}: steps {wrong[:10]} returned other tokens"
    # Every slot bit for bit; not the trash row, which padded tokens of both threads write into
    # in whatever order the steps interleaved (nothing reads it).
    assert torch.equal(runner.executor.kv_cache[:, :, :-1], want_kv[:, :, :-1])
