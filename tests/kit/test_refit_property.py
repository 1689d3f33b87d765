"""The kit's refit property (issue 43, ``graphrt.testing.refit``): random weights refit in the
middle of random greedy traffic (requests arriving at different steps, a step in flight with
overlap, tensors or a checkpoint directory) serve every request as fresh engines do -- the old
weights' tokens before the refit, the new weights' after -- on ``cpu`` graphs and on the CUDA
adapter over the recording graph. The property's own check fails on a refit that leaves the
KV of running requests (``recompute=False``)."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings

import graphrt
from graphrt.testing.refit import RefitTraffic, refit_traffic, refit_under_traffic
from support.fast_subset import examples
from support.hf_models import tiny_hf_model_dir
from support.refit_models import ENGINE, backend

MODEL = str(tiny_hf_model_dir("qwen3"))
KIT = dict(ENGINE, max_num_batched_tokens=16, cudagraph_capture_sizes=[4, 16])


def _factory(name: str):
    return lambda model_dir: graphrt.LLM(model_dir, backend=backend(name), **KIT)


@functools.lru_cache(maxsize=None)
def _reference(name: str, model_dir: str) -> graphrt.LLM:
    """One reference engine per checkpoint and backend (read only through generate)."""
    return graphrt.LLM(model_dir, backend=backend(name), **KIT)


@pytest.mark.parametrize("name", ["cpu", "cuda-sim"])
@settings(max_examples=examples(4), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(traffic=refit_traffic(128, max_requests=3, max_tokens=5))
def test_refit_under_traffic(name: str, traffic: RefitTraffic, tmp_path) -> None:
    refit_under_traffic(_factory(name), functools.partial(_reference, name), MODEL, traffic, tmp_path)


def test_the_property_sees_a_refit_that_keeps_old_kv(tmp_path, monkeypatch) -> None:
    """The check can fail: with running requests' KV kept from the old weights it does."""
    keep = graphrt.LLM.update_weights
    monkeypatch.setattr(graphrt.LLM, "update_weights",
                        lambda self, w, recompute=True: keep(self, w, recompute=False))
    traffic = RefitTraffic(prompts=((5, 6, 7, 8, 9, 10, 11, 12),), arrivals=(0,), max_tokens=(5,), refit_step=2,
                           seed=3)
    with pytest.raises(AssertionError, match="after the refit"):
        refit_under_traffic(_factory("cpu"), functools.partial(_reference, "cpu"), MODEL, traffic, tmp_path)
