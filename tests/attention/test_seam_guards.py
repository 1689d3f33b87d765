"""The attention seam's guards against the bugs an author makes (issue 30), each planted in a dense
backend of the user's own (tests/support/seam_bugs.py) and run on ``cpu`` and through the CUDA adapter's
code with the recording graph standing in (``cuda-sim``), in the default mode and in strict mode:

* a backend that overrides ``before_replay`` and declares nothing: its refresh runs before
  every run, so its graphs replay right;
* one that stashes a refreshed value and hands ``build`` the Python int; one that reads the
  lengths with ``np.from_dlpack``; one that reads ``vars(host)``; one that reads the host
  staging buffers (``step.on_host``, on a device apart from the host): every capture is refused
  naming what it read, the steps run eagerly with the right tokens (strict mode: the runner is
  refused with that error).

Before issue 30 the first was never called (every token of a replayed step wrong) and the
other four were baked into the graphs silently.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

import graphrt
from graphrt import GraphCaptureError, SamplingParams
from graphrt.backends.torch.cpu import CpuGraphBackend
from graphrt.layers.torch.attention.backend import CaptureHostValues, HostValues, Refused
from support.hf_models import random_prompts, tiny_hf_model_dir
from support.seam_bugs import SimCuda, apart_executor, planted_model

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4, num_kv_blocks=40,
              enable_prefix_caching=False, mode="FULL")
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = random_prompts((5, 17, 9, 30), seed=4)
BACKENDS = {"cpu": CpuGraphBackend, "cuda-sim": SimCuda}
#: What each refused bug's capture error names.
REFUSED = {"stashed-width": r"stashed-width.*depends on what before_replay left",
           "dlpack-width": r"from_dlpack",
           "vars-width": r"vars-width.*__dict__",
           "on-host-width": r"on-host-width.*step\.on_host"}


@pytest.fixture(scope="module")
def reference_tokens() -> list[list[int]]:
    llm = graphrt.LLM(str(tiny_hf_model_dir("qwen3")), backend="eager", **ENGINE)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("strict", [False, True])
def test_a_before_replay_without_declarations_runs_before_every_run(backend, strict, reference_tokens):
    llm = graphrt.LLM(planted_model("undeclared-refresh"), backend=BACKENDS[backend](), strict=strict, **ENGINE)
    assert llm.runner.stats.failed_builds == 0
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference_tokens
    assert llm.stats["hits"] > 0


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("bug", ["stashed-width", "dlpack-width", "vars-width", "on-host-width"])
def test_a_host_read_at_capture_is_refused_and_the_steps_run_right(backend, bug, reference_tokens, caplog,
                                                                    monkeypatch):
    if bug == "on-host-width":
        if backend == "cpu":
            pytest.skip("step.on_host exists on a device apart from the host (cuda-sim keeps its buffers apart)")
        apart_executor(monkeypatch)
    with caplog.at_level("WARNING", logger="graphrt"):
        llm = graphrt.LLM(planted_model(bug), backend=BACKENDS[backend](), **ENGINE)
    runner = llm.runner
    assert runner.stats.failed_builds == len(runner.cache) > 0, caplog.text
    assert all(e["failed"] for e in runner.cache.report())
    import re
    assert re.search(REFUSED[bug], caplog.text), caplog.text
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference_tokens
    assert llm.stats["hits"] == 0 and llm.stats["misses"] == 0 and llm.stats["eager_steps"] > 0
    with pytest.raises(GraphCaptureError, match=REFUSED[bug]):
        graphrt.LLM(planted_model(bug), backend=BACKENDS[backend](), strict=True, **ENGINE)


def test_an_apart_device_refreshes_from_the_host_staging_buffers(monkeypatch, reference_tokens):
    """The staging copy is real here: what a backend refreshes from ``step.on_host`` is the step's."""
    apart_executor(monkeypatch)
    llm = graphrt.LLM(planted_model("undeclared-refresh"), backend=SimCuda(), **ENGINE)
    ex = llm.runner.executor
    assert ex.buffers.static["seq_lens"].data_ptr() != ex.buffers.host["seq_lens"].data_ptr()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference_tokens
    assert llm.stats["hits"] > 0


def test_guarded_host_values_hold_nothing_undeclared():
    """Around the guard (``__dict__`` through object, ``dataclasses.replace``, a copy) a value
    not declared is a :class:`Refused`, whose every use raises."""
    values = HostValues(8, 4, 5, 3, 2, 17, False, np.arange(5), np.arange(4))
    guarded = CaptureHostValues(values, ("max_seq_len",), "b", "key")
    assert guarded.max_seq_len == 17
    for reach in (lambda h: vars(h), lambda h: h.__dict__, lambda h: dataclasses.asdict(h), lambda h: h.seq_lens):
        with pytest.raises(GraphCaptureError):
            reach(guarded)
    state = object.__getattribute__(guarded, "__dict__")
    assert isinstance(state["real_num_tokens"], Refused) and state["max_seq_len"] == 17
    for use in (int, float, bool, lambda v: v + 1, lambda v: v[0], lambda v: np.asarray(v), lambda v: range(v)):
        with pytest.raises(GraphCaptureError):
            use(state["seq_lens"])
