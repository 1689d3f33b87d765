"""The saved capture plan (issue 33): keys, order and observed demand beside the compilation
cache, keyed by model, config and device; a restart builds in demand order, with the re-fitted
buckets, and on xla with a warm persistent cache compiles nothing."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphrt
from graphrt import ModelRunner
from graphrt.runner.background import BackgroundWarmup
from graphrt.runner.capture_plan import PLAN_DIR, CapturePlanStore, describe_device
from graphrt.config import GraphConfig
from graphrt.core.buckets import BucketPolicy
from graphrt.core.errors import ConfigError
from graphrt.core.graph_modes import RuntimeMode
from graphrt.runner.keys import warmup_keys
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
                      precompile_token_paddings=[16], precompile_bs_paddings=[1, 2],
                      max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, block_size=4)
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


# ---- issue 46, item 8: a plan file that is not a plan is ignored, with the file and the field ----

class Warnings(logging.Handler):
    """The capture plan module's warnings (hypothesis runs many examples in one test: no caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> "Warnings":
        logging.getLogger("graphrt.runner.capture_plan").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("graphrt.runner.capture_plan").removeHandler(self)


PLAN_LIMITS = dict(backend="cpu", progress=False, warmup=False, **LIMITS, cudagraph_capture_sizes=[2, 4, 8])


@pytest.fixture(scope="module")
def saved_plan(model_dir, tmp_path_factory):
    """(cache dir, plan path, the plan's JSON): a valid plan whose decode buckets (4, 8) differ
    from the config's (2, 4, 8), so a runner that reads it serves (4, 8)."""
    cache = tmp_path_factory.mktemp("plans")
    r = ModelRunner(model_dir, compilation_cache_dir=str(cache), **PLAN_LIMITS)
    assert r.dispatcher.decode_buckets.sizes == (2, 4, 8)
    with r._lock:
        r.warmup_plan.replace_dispatcher(r.dispatcher.with_buckets(decode_buckets=BucketPolicy([4, 8])))
    path = r.warmup_plan.store.path
    plan = json.loads(path.read_text())
    r.close()
    return cache, path, plan


def start_with(model_dir, cache, path, text: str):
    """A runner started over a plan file holding ``text``, and the warnings it logged."""
    path.write_text(text)
    with Warnings() as seen:
        runner = ModelRunner(model_dir, compilation_cache_dir=str(cache), **PLAN_LIMITS)
    return runner, seen.messages


def test_a_valid_plan_is_read(model_dir, saved_plan):
    """The control of the tests below: the unchanged plan's buckets are served, nothing warned."""
    cache, path, plan = saved_plan
    runner, warned = start_with(model_dir, cache, path, json.dumps(plan))
    assert runner.dispatcher.decode_buckets.sizes == (4, 8) and not warned


def _set(plan: dict, where: tuple, value) -> dict:
    plan = json.loads(json.dumps(plan))
    *parents, last = where
    node = plan
    for step in parents:
        node = node[step]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return plan


_DELETE = object()


@pytest.mark.parametrize("text, field", [
    ("[]", "top level"), ("null", "top level"), ("42", "top level"), ('"a plan"', "top level"),
    ("{not json", "top level"),
    ({("decode_buckets",): "4, 8"}, "decode_buckets"), ({("decode_buckets",): [4, "8"]}, "decode_buckets.1"),
    ({("decode_buckets",): [4.5, 8]}, "decode_buckets.0"), ({("jobs",): {"a": 1}}, "jobs"),
    ({("jobs", 0, "demand"): 2.5}, "jobs.0.demand"), ({("jobs", 0, "demand"): "3"}, "jobs.0.demand"),
    ({("jobs", 0, "mode"): "FAST"}, "jobs.0.mode"), ({("jobs", 0, "key"): [8, 8]}, "jobs.0.key"),
    ({("jobs", 0, "key", "num_tokens"): True}, "jobs.0.key"), ({("jobs", 0, "key", "kind"): 7}, "jobs.0.key"),
    ({("format",): True}, "format"), ({("jobs",): _DELETE}, "jobs"),
])
def test_a_plan_of_the_wrong_shape_is_ignored_and_the_engine_starts(model_dir, saved_plan, text, field):
    """Valid JSON of the wrong shape, or a field of the wrong type, crashed the constructor with
    a raw AttributeError / ValueError / TypeError (or was read, 2.5 demand as 2); the docs say
    such a file is logged and ignored: now the warning names the file and the field."""
    cache, path, plan = saved_plan
    if isinstance(text, dict):
        (where, value), = text.items()
        text = json.dumps(_set(plan, where, value))
    runner, warned = start_with(model_dir, cache, path, text)
    assert runner.dispatcher.decode_buckets.sizes == (2, 4, 8)          # the config's: the plan ignored
    assert len(warned) == 1 and str(path) in warned[0] and field in warned[0], warned


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=8)
#: A plan's fields by type: where a drawn value of another JSON type makes the file no plan.
_FIELDS = {("format",): "int", ("fingerprint",): "str", ("backend",): "str", ("device",): "str",
           ("decode_buckets",): "list?", ("decode_buckets", 0): "int", ("token_buckets",): "list?",
           ("jobs",): "list", ("jobs", 0): "dict", ("jobs", 0, "mode"): "mode", ("jobs", 0, "key"): "dict",
           ("jobs", 0, "demand"): "int", ("jobs", 0, "bytes"): "int", ("jobs", 0, "seconds"): "number",
           ("jobs", 0, "key", "kind"): "kind", ("jobs", 0, "key", "num_tokens"): "int",
           ("jobs", 0, "key", "uniform_decode"): "bool", ("jobs", 0, "key", "num_loras"): "int"}
_OF_TYPE = {"int": lambda v: type(v) is int, "str": lambda v: isinstance(v, str),
            "bool": lambda v: isinstance(v, bool), "list": lambda v: isinstance(v, list),
            "list?": lambda v: v is None or isinstance(v, list), "dict": lambda v: isinstance(v, dict),
            "number": lambda v: type(v) in (int, float), "mode": lambda v: v in ("NONE", "PIECEWISE", "FULL"),
            "kind": lambda v: v in ("forward", "sampler")}


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_json_that_is_not_a_plan_is_ignored_and_the_engine_starts(model_dir, saved_plan, data):
    """Property: a plan file holding any JSON value that is not a plan -- a drawn value, or the
    saved plan with one field given a value of another JSON type -- leaves the engine starting,
    one warning naming the file, and the plan unread."""
    cache, path, plan = saved_plan
    if data.draw(st.booleans(), label="whole file"):
        value = data.draw(JSON.filter(lambda v: not isinstance(v, dict) or "jobs" not in v), label="file")
    else:
        where = data.draw(st.sampled_from(sorted(_FIELDS)), label="field")
        wrong = data.draw(JSON.filter(lambda v: not _OF_TYPE[_FIELDS[where]](v)), label="value")
        value = _set(plan, where, wrong)
    runner, warned = start_with(model_dir, cache, path, json.dumps(value))
    assert runner.dispatcher.decode_buckets.sizes == (2, 4, 8)
    assert len(warned) == 1 and str(path) in warned[0] and "not a capture plan" in warned[0], warned


# ---- issue 46, item 9: a cache directory that cannot hold the caches is refused at construction ----

def _unwritable_dir() -> str:
    """/proc: a directory even root cannot create a file in (chmod does not stop root)."""
    try:
        with tempfile.NamedTemporaryFile(dir="/proc"):
            pass
    except OSError:
        return "/proc"
    pytest.skip("/proc is writable here")


@pytest.mark.parametrize("kind", ["regular file", "under a regular file", "unwritable"])
def test_a_cache_dir_that_cannot_hold_the_caches_is_a_config_error(model_dir, tmp_path, kind):
    """Before issue 46 the runner started and its background builder died on the first save
    (a traceback on its thread), and close() raised the raw OSError."""
    afile = tmp_path / "afile"
    afile.write_text("")
    where = {"regular file": str(afile), "under a regular file": str(afile / "cache"),
             "unwritable": _unwritable_dir() if kind == "unwritable" else ""}[kind]
    with pytest.raises(ConfigError, match=f"compilation_cache_dir: {where}"):
        ModelRunner(model_dir, compilation_cache_dir=where, **{**PLAN_LIMITS, "warmup": "background"})
    if kind == "regular file":
        with pytest.raises(ConfigError, match="compilation_cache_dir.*not a directory"):
            graphrt.LLM(model_dir, compilation_cache_dir=where, **{**PLAN_LIMITS, "warmup": "background"})


@pytest.fixture
def thread_errors(monkeypatch):
    """Exceptions that ended a thread (the background builder's)."""
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    return errors


def test_a_plan_path_taken_by_a_directory_turns_the_plan_off(model_dir, tables, tmp_path, thread_errors, caplog):
    """The plan's own path is a directory: the plan is off for this runner (a warning says
    why); background warm-up completes, steps run, close() returns."""
    first = ModelRunner(model_dir, compilation_cache_dir=str(tmp_path), **PLAN_LIMITS)
    path = first.warmup_plan.store.path
    first.close()
    path.mkdir(parents=True)
    r = make(model_dir, tables, tmp_path)
    assert r.warmup_plan.store is None
    assert any("capture plan is off" in m and str(path) in m for m in caplog.messages), caplog.messages
    for _ in range(3):
        tables.step([0, 1], [3, 3], [1, 1]).run(r, greedy(2))
    assert r.background.wait(120) and not thread_errors
    r.close()
    assert path.is_dir() and not thread_errors


def test_a_plan_that_cannot_be_saved_later_is_turned_off_not_raised(model_dir, tables, tmp_path, thread_errors,
                                                                    caplog):
    """The plans' directory turns into a file after the start: the builder's save and close()
    log it and turn the plan off instead of raising the OSError."""
    r = make(model_dir, tables, tmp_path)
    plans = r.warmup_plan.store.path.parent
    shutil.rmtree(plans, ignore_errors=True)
    plans.write_text("in the way")
    for _ in range(3):
        tables.step([0, 1], [3, 3], [1, 1]).run(r, greedy(2))
    assert r.background.wait(120) and not thread_errors
    r.close()
    assert r.warmup_plan.store.off is not None and "cannot write" in r.warmup_plan.store.off
    assert any("capture plan is off" in m for m in caplog.messages) and not thread_errors
