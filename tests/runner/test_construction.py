"""Building a runner asks only what it serves with (issue 44, 'building a runner'): the kernels
of other devices are not asked, a feature not configured is made on first use, and a runner
built without warm-up warms up later into the same tokens as one warmed up at construction."""

from __future__ import annotations

import numpy as np
import pytest

from graphrt import ConfigError, ModelRunner
from graphrt.backends.torch.sampling import sampler as torch_sampler
from graphrt.layers.torch.attention import ascend_attention

from support.runner_steps import CONFIG, LIMITS, VOCAB, Tables, greedy


def _asked(name: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} asked while building a runner on cpu")
    return refuse


def test_kernels_of_other_devices_are_not_asked(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On cpu neither the Ascend attention kernel (NPUs) nor the FlashInfer sampler (CUDA) is
    asked; ``GRAPHRT_SAMPLER`` set asks the sampler's choice anywhere (a wrong one is refused)."""
    monkeypatch.setattr(ascend_attention, "ascend_backend", _asked("ascend_backend"))
    monkeypatch.setattr(torch_sampler, "flashinfer_sampling", _asked("flashinfer_sampling"))
    monkeypatch.delenv("GRAPHRT_SAMPLER", raising=False)
    monkeypatch.delenv("GRAPHRT_ATTENTION", raising=False)
    ModelRunner(model_dir, backend="cpu", warmup=False, progress=False, **LIMITS).close()
    monkeypatch.undo()
    monkeypatch.setenv("GRAPHRT_SAMPLER", "flashinfer")
    with pytest.raises(ConfigError, match="GRAPHRT_SAMPLER=flashinfer"):
        ModelRunner(model_dir, backend="cpu", warmup=False, progress=False, **LIMITS)


def test_a_runner_built_without_warmup_warms_up_later_to_the_same_tokens(model_dir: str) -> None:
    """The warm-up plan, the graph builder and the fx split are made by ``warmup()``: the graphs
    it captures serve the same tokens as a runner warmed up when built."""
    tables = Tables(CONFIG, VOCAB)
    # few keys: one token bucket and one context bucket (a PIECEWISE and a FULL decode graph), no logprobs
    kw = dict(backend="cpu", num_kv_blocks=tables.num_kv_blocks, progress=False, cudagraph_capture_sizes=[8],
              context_buckets=[64], max_logprobs=0, **LIMITS)
    later = ModelRunner(model_dir, warmup=False, **kw)
    now = ModelRunner(model_dir, warmup=True, **kw)
    try:
        assert later.warmup_report == [] and later.executor.build_count == 0
        report = later.warmup()
        assert sorted(r["key"] for r in report) == sorted(r["key"] for r in now.warmup_report) != []
        rows = [0, 1, 2]           # a mixed step of 8 tokens (PIECEWISE), then two decodes (FULL)
        for computed, scheduled in (([0, 0, 0], [2, 3, 3]), ([2, 3, 3], [1, 1, 1]), ([3, 4, 4], [1, 1, 1])):
            step = tables.step(rows, computed, scheduled)
            np.testing.assert_array_equal(step.run(later, greedy(3)), step.run(now, greedy(3)))
        assert later.cache.stats.hits == now.cache.stats.hits == 3
    finally:
        later.close()
        now.close()
