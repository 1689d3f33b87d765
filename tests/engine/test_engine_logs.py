"""graphrt.LLM's log lines (SGLang's ``Prefill batch.`` / ``Decode batch.``), parsed back to
numbers and checked against the engine's own counters, and the eager steps they show."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

import graphrt
from graphrt import SamplingParams
from support.hf_models import tiny_hf_model_dir

LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
PREFILL = re.compile(r"Prefill batch\. #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+), "
                     r"token usage: ([\d.]+), #running-req: (\d+), #queue-req: (\d+)$")
DECODE = re.compile(r"Decode batch\. #running-req: (\d+), #token: (\d+), token usage: ([\d.]+), "
                    r"graph: (True|False) \((\w+)\), gen throughput \(token/s\): ([\d.]+), #queue-req: (\d+), "
                    r"eager since last: (\d+) steps / (\d+) tokens(?: \((.*)\))?, "
                    r"on graphs since last: ([\d.]+)% of steps(?:, warm-up: (\d+) keys to build)?$")


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(4)
    shared = rng.integers(3, 128, 12).tolist()
    return [shared + rng.integers(3, 128, n).tolist() for n in (3, 5, 2, 7, 4, 6)]


def lines(caplog: pytest.LogCaptureFixture, pattern: re.Pattern) -> list[tuple[str, ...]]:
    out = [pattern.match(r.getMessage()) for r in caplog.records if r.name == "graphrt.engine"]
    return [m.groups() for m in out if m]


def test_log_lines_parse_back_to_the_engines_numbers(caplog: pytest.LogCaptureFixture):
    llm = graphrt.LLM(str(tiny_hf_model_dir("qwen3")), backend="cpu", decode_log_interval=2,
                      cudagraph_capture_sizes=[4, 8, 16, 32], **LIMITS)
    with caplog.at_level(logging.INFO, logger="graphrt.engine"):
        llm.generate(prompts(), GREEDY)
    stats = llm.stats
    prefill, decode = lines(caplog, PREFILL), lines(caplog, DECODE)
    assert prefill and decode
    assert sum(int(p[1]) for p in prefill) == stats["prefill_tokens"]
    assert sum(int(p[2]) for p in prefill) == stats["prefix_cache_hit_tokens"] > 0
    assert sum(int(p[0]) for p in prefill) >= len(prompts())
    assert all(0.0 <= float(p[3]) <= 1.0 and int(p[4]) <= LIMITS["max_num_seqs"] for p in prefill)
    assert stats["log_lines"]["prefill_lines"] == len(prefill)
    assert stats["log_lines"]["decode_lines"] == len(decode)
    last = llm.metrics.last_decode
    running, token, usage, graph, backend, rate, queue, eager_steps, eager_tokens, _, share, pending = decode[-1]
    assert (int(running), int(token), graph, backend, int(queue)) == (
        last.running_req, last.token, str(last.graph), last.backend, last.queue_req)
    assert abs(float(usage) - last.token_usage) < 0.01 and float(rate) > 0
    assert graph == "True" and backend == "cpu" and (int(eager_steps), int(eager_tokens)) == (0, 0)
    assert float(share) == 100.0 and pending is None        # every decode step on a graph; warm-up was upfront
    assert int(token) % LIMITS["block_size"] == 0


def test_the_decode_line_shows_steps_that_ran_eagerly_and_why(caplog: pytest.LogCaptureFixture):
    """Decode graphs only up to 2 requests: the 4-request decodes run above the largest bucket,
    and FULL_DECODE_ONLY runs the mixed prefill steps eagerly by its mode."""
    llm = graphrt.LLM(str(tiny_hf_model_dir("qwen3")), backend="cpu", decode_log_interval=1,
                      mode="FULL_DECODE_ONLY", cudagraph_capture_sizes=[1, 2], **LIMITS)
    with caplog.at_level(logging.INFO, logger="graphrt.engine"):
        llm.generate(prompts()[:4], GREEDY)
    decode = lines(caplog, DECODE)
    eager = [d for d in decode if d[3] == "False"]
    assert eager, decode
    for d in eager:       # the last step ran eagerly: counted, with its cause, and the share shows it
        assert int(d[7]) >= 1 and d[9] and float(d[10]) < 100.0, d
    assert any("above_largest_bucket" in (d[9] or "") for d in eager)   # 4-request decodes
    assert any("mode" in (d[9] or "") for d in decode)                  # mixed steps, FULL_DECODE_ONLY
    total = llm.runner.stats.eager_by_cause
    assert sum(int(d[7]) for d in decode) <= sum(c.steps for c in total.values())


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_a_bad_decode_log_interval_is_refused_naming_it(bad):
    from graphrt import InputError
    from graphrt.engine.metrics import EngineMetrics

    with pytest.raises(InputError) as err:
        EngineMetrics(backend="cpu", block_size=4, capacity_blocks=8, decode_log_interval=bad)
    assert err.value.field == "decode_log_interval"
