"""Buckets fitted from live traffic (issue 33): the runner counts the step sizes it serves; a
re-fit fits each bucket family to them under the graph budget (the exact fit of ``graphrt
plan``), builds the new keys in the background, then switches and retires the keys that no
longer pay. Tokens stay those of a runner that never re-fits."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import graphrt
from graphrt import ModelRunner
from graphrt.runner.background import BackgroundWarmup
from graphrt.config import GraphConfig
from graphrt.core.buckets import BucketPolicy
from graphrt.core.defaults import MIN_REFIT_INTERVAL
from graphrt.core.dispatch import DispatchShape
from graphrt.core.errors import ConfigError
from graphrt.runner.traffic import TRAFFIC_MAX_SIZES, binned, fit_family, padded, split_sizes
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
    with pytest.raises(AttributeError):          # runner.keys is the dispatcher's one writer
        live.dispatcher = live.dispatcher
    before = live.dispatcher.decode_buckets
    assert 44 not in before and 48 in before

    def serve(reqs: int, start: int, n: int) -> None:
        for step in decode_steps(tables, reqs, start, n):
            np.testing.assert_array_equal(step.run(live, greedy(reqs)), step.run(ref, greedy(reqs)))

    with caplog.at_level(logging.INFO, logger="graphrt.runner.traffic"):
        serve(4, 0, 40)                               # batch 4; the step loop re-fits at step 40
    first = live.traffic.history[-1]
    assert first.step == 40 and first.installed   # nothing new to build: installed at once
    assert live.dispatcher.decode_buckets.sizes == (4, 64) and first.retired > 0
    assert live.stats.retired + live.sampler_stats.retired == first.retired
    serve(4, 40, 5)                                   # still on graphs, tokens unchanged
    assert live.last_step.eager_cause is None
    serve(44, 45, 35)                                 # the shift: batch 44 pads to 64 now
    assert live.last_step.key.num_reqs == 64
    second = live.traffic.history[-1]                 # the re-fit of step 80
    assert second.step == 80 and not second.installed and second.added >= 2   # the key and its sampler
    assert live.dispatcher.decode_buckets.sizes == (4, 64)        # the old set serves while they build
    live.background.build_all()
    assert second.installed and 44 in live.dispatcher.decode_buckets
    serve(44, 80, 5)
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
                       refit_interval=32, refit_max_buckets=16, cudagraph_capture_sizes=[1, 2, 4, 64], **LIMITS)
    for step in decode_steps(tables, 3, 0, 5):
        step.run(live, greedy(3))
    assert live.traffic.refit() is None               # 5 steps: below MIN_REFIT_INTERVAL
    buckets = live.dispatcher.decode_buckets
    assert buckets.sizes[:3] == (1, 2, 4)


def test_refit_is_refused_with_data_parallel_agreement(model_dir):
    class Agreement:
        rank, size = 0, 2

    with pytest.raises(ConfigError, match="refit_interval"):
        ModelRunner(model_dir, backend="cpu", refit_interval=32, step_agreement=Agreement(), progress=False,
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
    record = live.traffic.history[-1]                 # the step loop's re-fit of step 40
    assert record.step == 40 and not record.installed
    new_samplers = {key for _, key in live.background.pending if getattr(key, "num_reqs", None) == 44
                    and not hasattr(key, "num_tokens")}
    assert any(key.penalties for key in new_samplers), new_samplers
    live.background.build_all()
    assert record.installed and 44 in live.dispatcher.decode_buckets
    built = {key for key in live.sampler_cache if key.num_reqs == 44}
    assert {k for _, k in live.warmup_plan.jobs() if getattr(k, "num_reqs", None) == 44
            and not hasattr(k, "num_tokens")} <= built


# ---- issue 46, item 7: the re-fit decides on schedule, from the step loop ---------------------

#: A recorded traffic: at step index -> requests that arrive (3-token prompts, 100 greedy tokens
#: each, so the batch never shrinks within the run): batch 4, then batch 6 from step 32.
ARRIVALS = {0: 4, 32: 2}
SCHEDULE_LIMITS = dict(backend="cpu", progress=False, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128,
                       block_size=16, cudagraph_capture_sizes=[2, 4, 8])


def replay(model_dir: str, steps: int, overlap: bool = False, settle: int = 0) -> tuple[dict, tuple[int, ...]]:
    """Serve ARRIVALS with ``llm.step()`` back to back (the builder thread running, as in
    serving) for ``steps`` steps, then up to ``settle`` more until the last re-fit is installed;
    the re-fit's report and the decode buckets served."""
    llm = graphrt.LLM(model_dir, refit_interval=MIN_REFIT_INTERVAL, **SCHEDULE_LIMITS)
    llm.overlap = overlap          # on cpu the loop is plain by default; overlapped, steps stay in flight
    params = graphrt.SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    try:
        for step in range(steps):
            for i in range(ARRIVALS.get(step, 0)):
                llm.add_request([1 + i, 2 + step % 5, 3], params)
            llm.step()
        report = llm.stats["traffic"]
        for _ in range(settle):      # the loop overlaps again at the first step after the switch
            if llm.runner.traffic.history[-1].installed and llm.overlap == overlap:
                break
            llm.step()
            llm.runner.background.wait(5)
        assert llm.overlap == overlap
        return report, llm.runner.dispatcher.decode_buckets.sizes
    finally:
        llm.close()


def decisions(report: dict) -> list[tuple[int, list[int], list[int]]]:
    return [(h["step"], h["decode_buckets"], h["token_buckets"]) for h in report["history"]]


def test_the_refit_decides_every_interval_under_continuous_stepping_the_same_both_times(model_dir):
    """The re-fit's decision runs at the end of every ``refit_interval``-th step, from that
    window alone: not when a builder thread wins the runner's lock (0, 1 or 2 re-fits of the
    same run before issue 46), so the same traffic re-fits at the same steps every time."""
    steps = 2 * MIN_REFIT_INTERVAL
    (first, _), (second, _) = replay(model_dir, steps), replay(model_dir, steps)
    made = decisions(first)
    assert [step for step, _, _ in made] == [MIN_REFIT_INTERVAL, 2 * MIN_REFIT_INTERVAL], made
    assert made[0][1] == [4, 8] and made[1][1] == [4, 6, 8]     # batch 4, then batch 6 gets a key
    assert first["next_at"] == 3 * MIN_REFIT_INTERVAL and first["refits"] == 2
    assert decisions(second) == made and second["next_at"] == first["next_at"]


def test_an_overlapped_loop_refits_at_the_same_steps_and_switches_once_nothing_is_in_flight(model_dir):
    """With a launched step in flight at the deciding step, the switch (which retires keys)
    waits for the builder's turn: graphrt.LLM runs plain until then, and overlaps again after."""
    steps = 2 * MIN_REFIT_INTERVAL
    report, served = replay(model_dir, steps, overlap=True, settle=20)
    made = decisions(report)
    assert [step for step, _, _ in made] == [MIN_REFIT_INTERVAL, 2 * MIN_REFIT_INTERVAL], made
    assert made[0][1] == [4, 8] and made[1][1] == [4, 6, 8]
    assert report["history"][0]["installed"] and served == (4, 6, 8)


@pytest.mark.parametrize("interval", [1, 8, MIN_REFIT_INTERVAL - 1])
def test_an_interval_the_refit_cannot_honour_is_refused(model_dir, interval):
    """A window shorter than MIN_REFIT_INTERVAL steps never re-fitted; now it is refused at
    construction, naming the field and the minimum."""
    with pytest.raises(ConfigError, match=f"refit_interval.*at least {MIN_REFIT_INTERVAL}"):
        graphrt.LLM(model_dir, refit_interval=interval, **SCHEDULE_LIMITS)
    with pytest.raises(ConfigError, match="refit_interval"):
        ModelRunner(model_dir, refit_interval=interval, **SCHEDULE_LIMITS)


def test_a_histogram_of_many_sizes_is_binned_before_the_exact_fit():
    """The fit runs in the step loop now: more distinct sizes than TRAFFIC_MAX_SIZES are merged
    into runs (each under its largest size) first, so a wide mixed-step histogram neither takes
    seconds (O(n^2 k)) nor exceeds BucketPolicy.fit's limit (a ConfigError out of a step)."""
    hist = {n: 1.0 + (n % 3) for n in range(1, 5001)}
    fitted = fit_family(hist, BucketPolicy([16, 8192]), 8)
    assert len(fitted.sizes) <= 8 and fitted.max_size == 8192 and max(s for s in fitted.sizes if s < 8192) == 5000
    merged = binned({n: 1 for n in range(1, 1001)}, TRAFFIC_MAX_SIZES)
    assert len(merged) <= TRAFFIC_MAX_SIZES and sum(merged.values()) == 1000 and max(merged) == 1000
