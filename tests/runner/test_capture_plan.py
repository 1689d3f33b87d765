"""The saved capture plan (issue 33): keys, order and observed demand beside the compilation
cache, keyed by model, config and device; a restart builds in demand order, with the re-fitted
buckets, and on xla with a warm persistent cache compiles nothing."""

from __future__ import annotations

import json

import pytest

from graphrt import ModelRunner
from graphrt.background import BackgroundWarmup
from graphrt.capture_plan import PLAN_DIR, CapturePlanStore, describe_device
from graphrt.config import GraphConfig
from graphrt.core.buckets import BucketPolicy
from graphrt.core.graph_modes import RuntimeMode
from graphrt.warmup import warmup_keys
from support.runner_steps import LIMITS, greedy


@pytest.fixture
def manual(monkeypatch):
    monkeypatch.setattr(BackgroundWarmup, "start", lambda self: None)


def make(model_dir, tables, cache_dir, **kw):
    return ModelRunner(model_dir, backend="cpu", num_kv_blocks=tables.num_kv_blocks, progress=False,
                       warmup="background", compilation_cache_dir=str(cache_dir),
                       **{**LIMITS, "cudagraph_capture_sizes": [2, 4, 8], **kw})


def test_a_restart_builds_in_the_saved_demand_order(model_dir, tables, tmp_path, manual):
    first = make(model_dir, tables, tmp_path)
    assert first.warmup_plan.store is not None and first.warmup_plan.store.load() is None
    default_first = first.background.pending[0]
    first.background.build_all()                      # completion saves the plan (no demand yet)
    assert first.warmup_plan.store.path.is_file() and first.warmup_plan.store.path.parent.name == PLAN_DIR
    for _ in range(5):                                # demand: decode steps of 2 requests
        tables.step([0, 1], [3, 3], [1, 1]).run(first, greedy(2))
    key = first.last_step.key
    first.close()                                     # saves the demand
    data = json.loads(first.warmup_plan.store.path.read_text())
    assert data["jobs"][0]["key"]["num_reqs"] == 2 and data["jobs"][0]["demand"] == 5
    assert data["backend"] == "cpu" and data["device"] == describe_device(first.executor)

    again = make(model_dir, tables, tmp_path)
    assert again.background.pending[0] == (RuntimeMode.FULL, key) != default_first
    again.background.build_next(0)
    assert (RuntimeMode.FULL, key) in again.cache and len(again.cache) == 1


def test_the_plan_is_keyed_by_config_and_model(model_dir, tables, tmp_path, manual):
    a = make(model_dir, tables, tmp_path)
    a.background.build_all()
    other_config = make(model_dir, tables, tmp_path, max_num_seqs=4)
    assert other_config.warmup_plan.store.fingerprint != a.warmup_plan.store.fingerprint
    assert other_config.warmup_plan.store.load() is None
    cfg = GraphConfig.create(**LIMITS)
    store = CapturePlanStore(tmp_path, backend="cpu", device="cpu", model=a.model, config=cfg)
    changed = GraphConfig.create(**{**LIMITS, "max_model_len": 32})
    assert CapturePlanStore(tmp_path, backend="cpu", device="cpu", model=a.model, config=changed).fingerprint \
        != store.fingerprint
    assert CapturePlanStore(tmp_path, backend="cpu", device="cuda:0", model=a.model, config=cfg).fingerprint \
        != store.fingerprint
    # switches that do not change the keys share the plan
    strict = GraphConfig.create(**{**LIMITS, "strict": True, "refit_interval": 32})
    assert CapturePlanStore(tmp_path, backend="cpu", device="cpu", model=a.model, config=strict).fingerprint \
        == store.fingerprint


def test_a_refitted_bucket_set_survives_a_restart(model_dir, tables, tmp_path, manual):
    r = make(model_dir, tables, tmp_path)
    r.background.build_all()
    new = r.dispatcher.with_buckets(decode_buckets=BucketPolicy([2, r.dispatcher.decode_buckets.max_size]))
    keep = set(warmup_keys(new))
    with r._lock:
        r.warmup_plan.replace_dispatcher(new, [j for j in warmup_keys(r.dispatcher) if j not in keep])
    again = make(model_dir, tables, tmp_path)
    assert again.dispatcher.decode_buckets == new.decode_buckets
    assert set(again.background.pending) == set(warmup_keys(new, again.config.max_logprobs > 0))


def test_an_unreadable_plan_is_ignored(model_dir, tables, tmp_path, manual, caplog):
    r = make(model_dir, tables, tmp_path)
    r.background.build_all()
    r.warmup_plan.store.path.write_text("{not json")
    again = make(model_dir, tables, tmp_path)
    assert again.background.pending[0] == warmup_keys(again.dispatcher)[0]
    assert any("ignoring the capture plan" in rec.getMessage() for rec in caplog.records)


def test_disable_capture_plan(model_dir, tables, tmp_path, manual):
    r = make(model_dir, tables, tmp_path, disable_capture_plan=True)
    assert r.warmup_plan.store is None and r.warmup_plan.save() is None


@pytest.mark.slow
def test_xla_restart_with_the_plan_and_a_warm_cache_compiles_nothing(tmp_path):
    """Run in a fresh process each time (JAX's in-memory caches would hide compiles): the first
    start compiles and saves the plan; the second loads every executable from disk."""
    import subprocess
    import sys

    script = f"""
import sys, json
sys.path.insert(0, 'tests')
import graphrt
from graphrt.backends.xla.compile import CompileCounter
from support.hf_models import tiny_hf_model_dir
d = str(tiny_hf_model_dir('qwen3'))
with CompileCounter() as c:
    llm = graphrt.LLM(d, backend='xla', warmup='background', compilation_cache_dir={str(tmp_path)!r},
                      precompile_token_paddings=[16, 32], precompile_bs_paddings=[1, 2, 4],
                      max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4)
    out = llm.generate([[1, 2, 3], [4, 5]], graphrt.SamplingParams(temperature=0.0, max_tokens=4))
    assert llm.runner.background.wait(300)
    llm.close()
print(json.dumps({{'compiles': c.compiles, 'hits': c.persistent_cache_hits,
                  'tokens': [o.token_ids for o in out], 'unplanned': llm.runner.executor.compiles.stats.unplanned_builds}}))
"""
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                              env={**__import__("os").environ, "PYTHONPATH": "src"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["compiles"] > 0 and cold["unplanned"] == 0
    assert warm["compiles"] - warm["hits"] == 0, warm          # nothing compiled from scratch
    assert warm["tokens"] == cold["tokens"] and warm["unplanned"] == 0
    assert list((tmp_path / PLAN_DIR).glob("xla-*.json"))
