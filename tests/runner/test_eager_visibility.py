"""Eager-fallback visibility (issue 14): the statistics say how many steps and tokens ran
eagerly, grouped by cause (``EagerCause``: above the largest bucket, capture failed, the graph
mode, a miss), in ``ModelRunner.stats``, ``LLM.stats``, ``CacheStats.summary()`` and the
``graphrt demo`` output."""

from __future__ import annotations

import re

import pytest

import graphrt
from graphrt import CacheMissError, ModelRunner
from graphrt.cli import main
from graphrt.core.cache import CacheStats
from graphrt.core.dispatch import BatchDescriptor, SamplerKey
from graphrt.core.eager import EagerCause
from support.runner_steps import LIMITS, greedy


def make_runner(model_dir, tables, **kw):
    kw = {"mode": "FULL", "cudagraph_capture_sizes": [4, 8], **kw}
    return ModelRunner(model_dir, backend="cpu", num_kv_blocks=tables.num_kv_blocks, progress=False,
                       **LIMITS, **kw)


def by_cause(stats: CacheStats) -> dict[str, tuple[int, int]]:
    """Non-zero causes as (steps, tokens)."""
    return {c.value: (n.steps, n.tokens) for c, n in stats.eager_by_cause.items() if n.steps}


def test_a_step_above_the_largest_bucket(model_dir, tables):
    r = make_runner(model_dir, tables)
    tables.step([0, 1], [0, 0], [7, 5]).run(r)              # 12 tokens, largest bucket 8
    assert r.last_step.eager_cause is EagerCause.ABOVE_LARGEST_BUCKET
    tables.step([0, 1], [7, 5], [1, 1]).run(r)              # a decode step: a graph
    assert r.last_step.eager_cause is None
    s = r.stats
    assert (s.eager_steps, s.eager_tokens) == (1, 12)
    assert by_cause(s) == {"above_largest_bucket": (1, 12)}
    assert s.summary().startswith("hits 1, misses 0, eager 1 steps / 12 tokens (above_largest_bucket 1/12)")


def test_a_failed_capture(model_dir, tables, monkeypatch):
    r = make_runner(model_dir, tables, warmup=False)
    build = r.executor.build

    def fail_8_tokens_and_samplers(mode, key):
        if isinstance(key, SamplerKey) or (isinstance(key, BatchDescriptor) and key.num_tokens == 8):
            raise RuntimeError("operation not permitted when stream is capturing")
        return build(mode, key)

    monkeypatch.setattr(r.executor, "build", fail_8_tokens_and_samplers)
    r.warmup()
    tables.step([0, 1], [0, 0], [3, 3]).run(r, greedy(2))  # 6 tokens -> the failed 8-token key
    assert r.last_step.eager_cause is EagerCause.CAPTURE_FAILED
    tables.step([2], [0], [3]).run(r, greedy(1))           # 3 tokens -> the 4-token graph
    assert by_cause(r.stats) == {"capture_failed": (1, 6)}
    assert r.stats.eager_tokens == 6 and r.stats.failed_builds == 1
    # the graph step's sampler, whose capture failed too, ran eagerly (it counts no tokens)
    assert by_cause(r.sampler_stats) == {"capture_failed": (1, 0)}


def test_full_decode_only_runs_mixed_steps_eagerly_and_decode_above_its_buckets(model_dir, tables):
    r = make_runner(model_dir, tables, mode="FULL_DECODE_ONLY", cudagraph_capture_sizes=[1, 2])
    tables.step([0, 1], [0, 0], [3, 2]).run(r)              # a mixed (prefill) step
    assert r.last_step.eager_cause is EagerCause.MODE
    tables.step([0, 1], [3, 2], [1, 1]).run(r)              # decode of 2: the FULL graph
    assert r.last_step.eager_cause is None
    tables.step([0, 1, 2], [4, 3, 0], [1, 1, 1]).run(r)     # uniform decode of 3: above bucket 2
    assert r.last_step.eager_cause is EagerCause.ABOVE_LARGEST_BUCKET
    assert by_cause(r.stats) == {"mode": (1, 5), "above_largest_bucket": (1, 3)}
    assert (r.stats.eager_steps, r.stats.eager_tokens) == (2, 8)


def test_enforce_eager_counts_every_step_under_mode(model_dir, tables):
    r = make_runner(model_dir, tables, enforce_eager=True)
    tables.step([0], [0], [5]).run(r)
    tables.step([0], [5], [1]).run(r)
    assert by_cause(r.stats) == {"mode": (2, 6)}


def test_a_miss_without_warmup_and_strict_mode_raising_instead(model_dir, tables):
    r = make_runner(model_dir, tables, warmup=False)
    tables.step([0], [0], [3]).run(r)
    assert r.last_step.eager_cause is EagerCause.MISS and by_cause(r.stats) == {"miss": (1, 3)}
    strict = make_runner(model_dir, tables, warmup=False, strict=True)
    strict.cache.seal()
    with pytest.raises(CacheMissError):
        tables.step([0], [0], [3]).run(strict)
    assert strict.stats.misses == 1 and strict.stats.eager_steps == 0 and by_cause(strict.stats) == {}


def test_the_dict_and_the_summary_list_every_cause():
    s = CacheStats()
    d = s.as_dict()
    assert d["eager_tokens"] == 0
    assert d["eager_by_cause"] == {c.value: {"steps": 0, "tokens": 0} for c in EagerCause}
    assert s.summary() == (
        "hits 0, misses 0, eager 0 steps / 0 tokens, on graphs 100.0% of steps / 100.0% of tokens, padding waste 0.0%")


def test_llm_stats_and_the_demo_show_the_causes(model_dir, capsys):
    llm = graphrt.LLM(model_dir, backend="eager", progress=False, **LIMITS)
    llm.generate([[1, 2, 3], [4, 5]], graphrt.SamplingParams(temperature=0.0, max_tokens=3))
    stats = llm.stats
    assert stats["eager_by_cause"]["mode"] == {"steps": stats["eager_steps"], "tokens": stats["eager_tokens"]}
    assert stats["eager_tokens"] == stats["real_tokens"] > 0
    assert stats["graph_memory"]["estimate"] == 0 and stats["graph_memory"]["reason"]
    assert main(["demo", "--backend", "eager", "--num-prompts", "2", "--max-tokens", "2",
                 "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]) == 0
    out = capsys.readouterr().out
    steps = int(re.search(r"eager_steps\s+(\d+)", out).group(1))
    tokens = int(re.search(r"eager_tokens\s+(\d+)", out).group(1))
    assert steps > 0 and re.search(rf"^\s+mode\s+{steps} / {tokens}$", out, flags=re.M)
    assert re.search(r"^\s+above_largest_bucket\s+0 / 0$", out, flags=re.M)
    assert f"eager {steps} steps / {tokens} tokens (mode {steps}/{tokens})" in out
    assert "graph memory: not deducted" in out


def test_the_dispatcher_names_the_cause_of_each_eager_step():
    from graphrt.core.buckets import BucketPolicy
    from graphrt.core.dispatch import Dispatcher
    from graphrt.core.graph_modes import GraphMode

    decode_only = Dispatcher(GraphMode.FULL_DECODE_ONLY, token_buckets=BucketPolicy([1, 2, 4]), max_num_seqs=8)
    assert decode_only.dispatch(3, 3, True).cause is None                         # a decode graph
    assert decode_only.dispatch(6, 2, False).cause is EagerCause.MODE             # mixed: the mode's choice
    assert decode_only.dispatch(6, 6, True).cause is EagerCause.ABOVE_LARGEST_BUCKET  # no decode bucket held it
    full = Dispatcher(GraphMode.FULL, token_buckets=BucketPolicy([1, 2, 4]), max_num_seqs=8)
    assert full.dispatch(9, 2, False).cause is EagerCause.ABOVE_LARGEST_BUCKET
    assert Dispatcher(GraphMode.NONE, token_buckets=None, max_num_seqs=8).dispatch(1, 1, True).cause \
        is EagerCause.MODE
