"""Buckets fitted from live traffic (issue 33): the runner counts the step sizes it serves; a
re-fit fits each bucket family to them under the graph budget (the exact fit of ``graphrt
plan``), builds the new keys in the background, then switches and retires the keys that no
longer pay. Tokens stay those of a runner that never re-fits."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from graphrt import ModelRunner
from graphrt.background import BackgroundWarmup
from graphrt.config import GraphConfig
from graphrt.core.buckets import BucketPolicy
from graphrt.core.dp_agreement import DispatchShape
from graphrt.core.errors import ConfigError
from graphrt.traffic import fit_family, padded, split_sizes
from support.runner_steps import Tables, greedy

LIMITS = dict(max_num_seqs=64, max_num_batched_tokens=64, max_model_len=128, block_size=16)


@pytest.fixture
def manual(monkeypatch):
    monkeypatch.setattr(BackgroundWarmup, "start", lambda self: None)


def test_split_sizes_and_fit_family():
    counts = {DispatchShape(4, 4, True, 0, 0): 10, DispatchShape(6, 2, False, 0, 0): 3,
              DispatchShape(8, 4, True, 0, 0): 2}             # q = 2: 8 tokens of 4 requests is a decode step
    decode, mixed = split_sizes(counts, 1)
    assert decode == {4: 10} and mixed == {6: 3, 8: 2}
    decode, mixed = split_sizes(counts, 2)
    assert decode == {4: 2, 2: 0} or decode == {4: 2}
    current = BucketPolicy([1, 2, 4, 8, 16, 32, 64])
    fitted = fit_family({4: 60.0, 44: 30.0, 45: 1.0}, current, 3)
    assert fitted.sizes == (4, 45, 64)                         # the largest stays: every old step covered
    assert fit_family({}, current, 3).sizes == (64,)
    assert padded({4: 2.0, 70: 1.0}, BucketPolicy([8, 64])) == 8 * 2 + 70


def decode_steps(tables: Tables, reqs: int, start: int, n: int):
    rows = list(range(reqs))
    for i in range(n):
        yield tables.step(rows, [start + i] * reqs, [1] * reqs)


def test_a_traffic_shift_refits_adds_new_keys_and_retires_old_ones(model_dir, manual, caplog):
    config = GraphConfig.create(**LIMITS)
    tables = Tables(config, 128, seed=1)
    kw = dict(backend="cpu", num_kv_blocks=tables.num_kv_blocks, progress=False, **LIMITS)
    live = ModelRunner(model_dir, refit_interval=40, **kw)
    ref = ModelRunner(model_dir, enforce_eager=True, **kw)       # the tokens without graphs
    assert live.traffic is not None and live.background.complete
    before = live.dispatcher.decode_buckets
    assert 44 not in before and 48 in before

    def serve(reqs: int, start: int, n: int) -> None:
        for step in decode_steps(tables, reqs, start, n):
            np.testing.assert_array_equal(step.run(live, greedy(reqs)), step.run(ref, greedy(reqs)))

    serve(4, 0, 40)                                   # batch 4
    with caplog.at_level(logging.INFO, logger="graphrt.traffic"):
        first = live.traffic.refit()
    assert first is not None and first["installed"]   # nothing new to build: installed at once
    assert live.dispatcher.decode_buckets.sizes == (4, 64) and first["retired"] > 0
    assert live.stats.retired + live.sampler_stats.retired == first["retired"]
    serve(4, 40, 5)                                   # still on graphs, tokens unchanged
    assert live.last_step.eager_cause is None
    serve(44, 45, 40)                                 # the shift: batch 44 pads to 64 now
    assert live.last_step.key.num_reqs == 64
    second = live.traffic.refit()
    assert second is not None and not second["installed"] and second["added"] >= 2   # the key and its sampler
    assert live.dispatcher.decode_buckets.sizes == (4, 64)        # the old set serves while they build
    live.background.build_all()
    assert second["installed"] and 44 in live.dispatcher.decode_buckets
    serve(44, 85, 5)
    assert live.last_step.key.num_reqs == 44 and live.last_step.eager_cause is None
    # padding waste of the new traffic within 2x of the offline exact fit with the same budget
    new = {44: 40}
    exact = BucketPolicy.fit(new, len(before))
    real = 44 * 40
    live_waste = 1 - real / padded(new, live.dispatcher.decode_buckets)
    exact_waste = 1 - real / padded(new, exact)
    assert live_waste <= 2 * exact_waste + 1e-9
    assert any("traffic re-fit" in r.getMessage() for r in caplog.records)
    report = live.traffic.report()
    assert report["refits"] == 2 and report["history"][-1]["decode_buckets"] == list(live.dispatcher.decode_buckets)
    assert live.stats.unplanned_builds == 0           # the re-fit's builds were planned


def test_no_refit_on_a_window_too_small_or_without_gain(model_dir, manual):
    config = GraphConfig.create(**LIMITS)
    tables = Tables(config, 128, seed=2)
    live = ModelRunner(model_dir, backend="cpu", num_kv_blocks=tables.num_kv_blocks, progress=False,
                       refit_interval=10, refit_max_buckets=16, cudagraph_capture_sizes=[1, 2, 4, 64], **LIMITS)
    for step in decode_steps(tables, 3, 0, 5):
        step.run(live, greedy(3))
    assert live.traffic.refit() is None               # 5 steps: below TRAFFIC_MIN_STEPS
    buckets = live.dispatcher.decode_buckets
    assert buckets.sizes[:3] == (1, 2, 4)


def test_refit_is_refused_with_data_parallel_agreement(model_dir):
    class Agreement:
        rank, size = 0, 2

    with pytest.raises(ConfigError, match="refit_interval"):
        ModelRunner(model_dir, backend="cpu", refit_interval=10, step_agreement=Agreement(), progress=False,
                    max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4)


def test_a_refit_plans_every_sampler_kind_warm_up_builds(model_dir, manual):
    """A re-fit takes its jobs where warm-up does (``runner.warmup_plan.jobs``): with
    ``enable_penalties`` the new bucket's penalised sampler is planned beside its other samplers."""
    config = GraphConfig.create(**LIMITS)
    tables = Tables(config, 128, seed=1)
    live = ModelRunner(model_dir, backend="cpu", num_kv_blocks=tables.num_kv_blocks, progress=False,
                       refit_interval=40, enable_penalties=True, **LIMITS)
    for step in decode_steps(tables, 44, 0, 40):
        step.run(live, greedy(44))
    record = live.traffic.refit()
    assert record is not None and not record["installed"]
    new_samplers = {key for _, key in live.background.pending if getattr(key, "num_reqs", None) == 44
                    and not hasattr(key, "num_tokens")}
    assert any(key.penalties for key in new_samplers), new_samplers
    live.background.build_all()
    assert record["installed"] and 44 in live.dispatcher.decode_buckets
    built = {key for key in live.sampler_cache if key.num_reqs == 44}
    assert {k for _, k in live.warmup_plan.jobs() if getattr(k, "num_reqs", None) == 44
            and not hasattr(k, "num_tokens")} <= built
