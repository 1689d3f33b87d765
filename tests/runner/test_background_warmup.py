"""Background warm-up (issue 33): serve from the first step while the keys are built between
steps, most demanded first; the same tokens as an upfront warm-up across the transition; every
step that runs without a graph has a cause from the fixed list; strict mode once complete."""

from __future__ import annotations

import numpy as np
import pytest

import graphrt
from graphrt import CacheMissError, GraphCaptureError, ModelRunner
from graphrt.runner.background import BackgroundWarmup
from graphrt.core.buckets import BucketPolicy
from graphrt.core.dispatch import BatchDescriptor, SamplerKey
from graphrt.core.eager import EagerCause
from graphrt.core.errors import ConfigError
from graphrt.core.graph_modes import RuntimeMode
from graphrt.testing.conformance import check_property
from graphrt.testing.runners import RunnerFactory
from graphrt.runner.keys import warmup_keys
from support.fast_subset import examples
from support.runner_steps import CONFIG, LIMITS, greedy, random_steps

KIT = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4)


@pytest.fixture
def manual(monkeypatch):
    """Background warm-up without its thread: the test builds keys itself, between steps."""
    monkeypatch.setattr(BackgroundWarmup, "start", lambda self: None)


def runner(model_dir, tables, warmup, **kw) -> ModelRunner:
    return ModelRunner(model_dir, backend="cpu", num_kv_blocks=tables.num_kv_blocks, progress=False,
                       warmup=warmup, **{**LIMITS, **kw})


def causes(stats) -> dict[str, int]:
    return {c.value: n.steps for c, n in stats.eager_by_cause.items() if n.steps}


def test_same_tokens_as_upfront_across_the_transition(model_dir, tables, manual):
    """Steps before, during and after the keys are built: eager first (miss_during_warmup), then
    under a larger built key that covers them, then their own key; greedy tokens equal the
    upfront runner's at every step, and the logits stay within tolerance."""
    bg, up = runner(model_dir, tables, "background"), runner(model_dir, tables, True)
    assert bg.background.active and not bg.cache.sealed and len(bg.cache) == 0
    seen_stand_in = seen_eager = False
    for i, step in enumerate(random_steps(tables, CONFIG, 48, seed=3)):
        n = len(step.num_scheduled_tokens)
        a, b = step.run(bg, greedy(n)), step.run(up, greedy(n))
        np.testing.assert_array_equal(a, b)
        tol = graphrt.tolerance(np.float32)
        np.testing.assert_allclose(bg.outputs.logits(), up.outputs.logits(), rtol=tol.rtol, atol=tol.atol)
        info = bg.last_step
        if info.wanted is not None:              # its key is still being built
            seen_eager |= info.mode is RuntimeMode.NONE and info.eager_cause is EagerCause.WARMING_UP
            seen_stand_in |= info.mode is not RuntimeMode.NONE and info.key != info.wanted[1]
        if i % 4 == 3:
            bg.background.build_next(0)          # one key between these steps
        if i == 30:                              # the rest: warm-up completes and seals the caches
            bg.background.build_all()
    assert seen_eager and seen_stand_in
    assert bg.background.complete and not bg.background.active and bg.cache.sealed and bg.sampler_cache.sealed
    assert set(bg.cache) == set(up.cache) and set(bg.sampler_cache) == set(up.sampler_cache)
    assert bg.stats.unplanned_builds == 0 and bg.stats.eager_by_cause[EagerCause.WARMING_UP].steps > 0
    # after warm-up, the same steps run the same graphs as the upfront runner's
    assert causes(bg.stats).keys() <= {"miss_during_warmup", "above_largest_bucket"}


def test_the_most_demanded_key_is_built_first(model_dir, tables, manual):
    r = runner(model_dir, tables, "background")
    first = r.background.pending[0]              # before any demand: warm-up's order, largest first
    assert first == warmup_keys(r.dispatcher)[0]
    for _ in range(3):                           # three decode steps of 3 requests want (decode, 4)
        tables.step([0, 1, 2], [5, 5, 5], [1, 1, 1]).run(r, greedy(3))
    want = r.last_step.wanted
    assert want is not None and want[1].uniform_decode and want[1].num_reqs == 4
    assert r.background.demand[want] == 3 and r.background.pending[0] == want
    r.background.build_next(0)
    assert want in r.cache and r.background.pending[0] == (RuntimeMode.FULL, SamplerKey(4, True))
    tables.step([0, 1, 2], [6, 6, 6], [1, 1, 1]).run(r, greedy(3))
    assert r.last_step.key == want[1] and r.last_step.eager_cause is None and r.last_step.wanted is None
    # the sampler of that key was missing: its demand is counted and it is eager with the cause
    assert r.sampler_stats.eager_by_cause[EagerCause.WARMING_UP].steps == 1


def test_strict_applies_once_warm_up_is_complete(model_dir, tables, manual):
    r = runner(model_dir, tables, "background", strict=True)
    tables.step([0], [0], [3]).run(r, greedy(1))                 # a miss while warming up: eager
    assert r.last_step.eager_cause is EagerCause.WARMING_UP and r.stats.misses == 1
    r.background.build_all()
    assert r.cache.sealed
    tables.step([0], [3], [1]).run(r, greedy(1))
    assert r.last_step.eager_cause is None
    key = r.last_step.key
    r.cache.retire((RuntimeMode.FULL, key))                      # a covered key gone after warm-up
    with pytest.raises(CacheMissError):
        tables.step([0], [4], [1]).run(r, greedy(1))


def test_a_failed_background_build_is_raised_from_the_next_step_in_strict_mode(model_dir, tables, manual,
                                                                                monkeypatch):
    r = runner(model_dir, tables, "background", strict=True)

    def fail(mode, key):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(r.executor, "build", fail)
    r.background.build_next(0)
    with pytest.raises(GraphCaptureError, match="operation not permitted"):
        tables.step([0], [0], [3]).run(r, greedy(1))
    tables.step([0], [0], [3]).run(r, greedy(1))                 # raised once; serving goes on


def test_a_failed_background_build_runs_eagerly_with_its_error(model_dir, tables, manual, monkeypatch):
    r = runner(model_dir, tables, "background")
    build = r.executor.build

    def fail_decode_4(mode, key):
        if isinstance(key, BatchDescriptor) and key.uniform_decode and key.num_reqs == 4:
            raise RuntimeError("out of memory while capturing")
        return build(mode, key)

    monkeypatch.setattr(r.executor, "build", fail_decode_4)
    r.background.build_all()
    tables.step([0, 1, 2], [5, 5, 5], [1, 1, 1]).run(r, greedy(3))
    info = r.last_step
    assert info.eager_cause is EagerCause.CAPTURE_FAILED and "out of memory" in info.eager_reason
    assert r.stats.failed_builds == 1 and r.background.report()["failed"] >= 1


def test_keys_left_out_for_graph_memory_run_eagerly_with_that_cause(model_dir, tables, manual):
    r = runner(model_dir, tables, "background")
    r.background.memory_cap = 0                  # the KV budget admits no graph memory
    r.background.build_next(0)
    assert r.background.complete and r.background.report()["over_memory"] == len(warmup_keys(r.dispatcher, r.config.max_logprobs > 0))
    assert len(r.cache) == 0 and r.cache.sealed
    tables.step([0, 1, 2], [5, 5, 5], [1, 1, 1]).run(r, greedy(3))
    assert r.last_step.eager_cause is EagerCause.GRAPH_MEMORY


def test_the_builder_thread_completes_and_llm_tokens_match_upfront(model_dir):
    """The real thread: an LLM that serves at once gives the same tokens as one warmed up
    first, its stats account every eager step under a cause, and warm-up completes."""
    params = graphrt.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[1 + i, 2, 3 + i, 4][: 2 + i % 3] for i in range(6)]
    outs = {}
    for mode in ("upfront", "background"):
        with graphrt.LLM(model_dir, backend="cpu", warmup=mode, **LIMITS) as llm:
            outs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
            if mode == "background":
                assert llm.runner.background.wait(60)
                outs["after"] = [o.token_ids for o in llm.generate(prompts, params)]
                stats = llm.stats
                assert stats["warmup"]["complete"] and stats["warmup"]["built"] > 0
                assert sum(c["steps"] for c in stats["eager_by_cause"].values()) == stats["eager_steps"]
                assert stats["steps"] > stats["eager_steps"] and 0 < stats["graph_step_share"] <= 1
                text = llm.metrics_text()
                assert 'graphrt_warmup_complete{backend="cpu"} 1' in text
                assert 'graphrt_eager_steps_total{backend="cpu",cause="miss_during_warmup"}' in text
    assert outs["upfront"] == outs["background"] == outs["after"]


def test_bad_warmup_values_are_refused_naming_the_field(model_dir):
    with pytest.raises(ConfigError, match="warmup"):
        graphrt.LLM(model_dir, backend="cpu", warmup="lazy", **LIMITS)
    with pytest.raises(ConfigError, match="warmup"):
        ModelRunner(model_dir, backend="cpu", warmup="sometimes", **LIMITS)



def test_the_documented_warmup_default_is_the_codes():
    """docs/api.md and docs/architecture.md name the default ``warmup=`` and say why; the LLM's
    signature takes it from ``defaults.DEFAULT_LLM_WARMUP``."""
    import inspect
    from pathlib import Path

    from graphrt.core import defaults

    docs = Path(__file__).resolve().parents[2] / "docs"
    default = defaults.DEFAULT_LLM_WARMUP
    assert inspect.signature(graphrt.LLM).parameters["warmup"].default == default
    assert f'`warmup="{default}"` (the default' in (docs / "api.md").read_text()
    assert f'**Why {default} is the default**' in (docs / "api.md").read_text()
    assert f'`warmup="{default}"`, `defaults.DEFAULT_LLM_WARMUP`, is the default' in \
        " ".join((docs / "architecture.md").read_text().split())

# ---- the kit's properties while keys are added and retired ---------------------------------

class Transitioning(RunnerFactory):
    """A background runner whose keys change between the kit's examples: each call builds one
    more key; the sixth swaps in a dispatcher with fewer decode buckets (their keys retired)."""

    calls = 0

    def __call__(self, **overrides):
        runner = self._runners.get(())
        if runner is None:
            runner = ModelRunner(self.model, self.config, backend="cpu", num_kv_blocks=self.num_kv_blocks,
                                 progress=False, warmup="background")
            self._runners[()] = runner
        self.calls += 1
        runner.background.build_next(0)
        if self.calls == 6:
            old = runner.dispatcher
            new = old.with_buckets(decode_buckets=BucketPolicy([2, old.decode_buckets.max_size]))
            keep = set(warmup_keys(new))
            runner.warmup_plan.replace_dispatcher(new, [job for job in warmup_keys(old) if job not in keep])
            runner.background.plan(warmup_keys(new))
        return runner


@pytest.mark.parametrize("prop", ["padding_invisible", "kv_isolated"])
def test_kit_properties_hold_while_keys_are_added_and_retired(model_dir, manual, prop):
    factory = Transitioning(model_dir, "cpu", **KIT)
    n = examples(14)
    result = check_property(prop, factory, examples=n, seed=5)
    assert result.passed and result.examples >= n, result.error
    runner = factory()
    assert runner.stats.retired > 0 and runner.background.built > 1


def test_background_warmup_is_refused_with_data_parallel_agreement(model_dir):
    class Agreement:
        rank, size = 0, 2

    with pytest.raises(ConfigError, match="warmup='background'"):
        ModelRunner(model_dir, backend="cpu", warmup="background", step_agreement=Agreement(), progress=False,
                    **KIT)
