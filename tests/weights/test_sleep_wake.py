"""Sleep and wake (issue 43) on ``ModelRunner`` and ``graphrt.LLM``, on ``cpu`` graphs and the
CUDA adapter over the recording graph:

* level 1 offloads the weights to host memory and drops the KV cache; level 2 drops the weights
  too; each reports the bytes released (weights + caches) and a measured figure; every request
  and step is refused while asleep;
* wake gives every buffer back in the same storage objects: the graphs reading any that came
  back at another address are recaptured (never one left stale), caches come back zeroed; after
  level 1 the tokens equal a fresh engine's, after level 2 steps wait for a refit of every
  weight, then equal a fresh engine with the new weights, with no forward key compiled anew;
* requests in flight at ``sleep`` are refused with a named error (nothing released) or drained;
* a hybrid model (Granite-4-H) through sleep(2), wake, refit keeps no recurrent state from before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import graphrt
from graphrt import EngineAsleepError, RequestsInFlightError
from support.hf_models import tiny_hf_model_dir
from support.hybrid_models import hybrid_model_dir
from support.refit_models import ENGINE, GREEDY, PROMPTS, backend, fresh_tokens, greedy_tokens, tensors

OLD, NEW = (str(tiny_hf_model_dir("qwen3", seed=s)) for s in (0, 1))


def _woke_clean(llm: graphrt.LLM, report: dict) -> None:
    """Nothing stale after a wake: the keys over moved buffers were recaptured, caches are zero
    (but the trash row and slot, which a recapture's padding steps write)."""
    assert llm.runner.executor.stale_buffers(llm.runner.weights.entries()) == {}
    assert (report["recaptured"] > 0) == bool(report["moved"])
    for kv in llm.runner.executor.kv_views():
        assert not kv[:, :, :-1].any()
    for state in llm.runner.executor.state_caches:
        assert not state[:-1].any()


@pytest.mark.parametrize("name", ["cpu", "cuda-sim"])
def test_sleep_wake_and_refit(name: str) -> None:
    want_old, want_new = fresh_tokens(OLD, name), fresh_tokens(NEW, name)
    with graphrt.LLM(OLD, backend=backend(name), **ENGINE) as llm:
        assert greedy_tokens(llm) == want_old
        weights = sum(p.numel() * p.element_size() for p in llm.runner.model.parameters())
        caches = sum(t.numel() * t.element_size() for t in llm.runner.executor.kv_views())
        compiles = llm.runner.stats.compiles
        one = llm.sleep(1)
        assert (one["level"], one["weight_bytes"], one["cache_bytes"], one["offloaded_bytes"]) == \
               (1, weights, caches, weights)
        assert one["released_bytes"] == weights + caches and one["measured_bytes"] is not None
        assert all(p.untyped_storage().nbytes() == 0 for p in llm.runner.model.parameters())
        with pytest.raises(EngineAsleepError, match="level 1"):
            llm.generate(PROMPTS, GREEDY)
        with pytest.raises(EngineAsleepError):
            llm.add_request(PROMPTS[0], GREEDY)
        with pytest.raises(EngineAsleepError, match="wake"):
            llm.update_weights(NEW)
        report = llm.wake()
        _woke_clean(llm, report)
        assert greedy_tokens(llm) == want_old          # the prefix cache forgot the dropped KV
        two = llm.sleep(2)
        assert (two["offloaded_bytes"], two["released_bytes"]) == (0, weights + caches)
        report = llm.wake()
        assert report["needs_weights"]
        _woke_clean(llm, report)
        with pytest.raises(EngineAsleepError, match="level-2 sleep"):
            llm.generate(PROMPTS, GREEDY)
        half = {n: t for n, t in tensors(NEW).items() if not n.startswith("model.layers.1.")}
        assert llm.update_weights(half)["unfilled"] > 0          # layer 1 still missing: refused
        with pytest.raises(EngineAsleepError, match="model.layers.1"):
            llm.generate(PROMPTS, GREEDY)
        assert llm.update_weights(NEW)["unfilled"] == 0
        assert greedy_tokens(llm) == want_new
        stats = llm.stats["weights"]
        assert (stats["sleeps"], stats["wakes"], stats["refits"]) == (2, 2, 2)
        # Recaptures rebuild keys already planned; no new key was compiled for the steps.
        assert llm.runner.stats.compiles == compiles + llm.runner.stats.recaptured
        assert llm.runner.stats.unplanned_builds == 0


def test_runner_sleep_and_wake() -> None:
    kw = {k: v for k, v in ENGINE.items() if k != "num_kv_blocks"}
    with graphrt.ModelRunner(OLD, backend="cpu", num_kv_blocks=16, **kw) as runner:
        with pytest.raises(graphrt.InputError, match="level"):
            runner.sleep(3)
        runner.sleep(2)
        with pytest.raises(EngineAsleepError, match="already"):
            runner.sleep(1)
        with pytest.raises(EngineAsleepError, match="sleeps"):
            runner.execute(token_ids=np.zeros((4, 64), np.int32), block_table=np.zeros((4, 16), np.int32),
                           req_rows=[0], num_computed_tokens=[0], num_scheduled_tokens=[2])
        runner.wake()
        with pytest.raises(graphrt.GraphrtError, match="not asleep"):
            runner.wake()
        assert runner.weights.unfilled == runner.executor.weight_names()
        runner.update_weights(OLD)
        assert not runner.weights.blocked


def test_requests_in_flight_are_refused_or_drained() -> None:
    with graphrt.LLM(OLD, backend="cpu", **ENGINE) as llm:
        rid = llm.add_request(PROMPTS[2], GREEDY)
        llm.step()
        with pytest.raises(RequestsInFlightError) as err:
            llm.sleep(1)
        assert err.value.request_ids == (rid,)
        assert llm.runner.weights.level is None and llm.runner.executor.kv_views()[0].any()
        llm.sleep(1, drain=True)                     # the request runs to its end first
        outs = llm.step()                            # its output waits for the step API, asleep or not
        assert [(o.request_id, o.token_ids) for o in outs] == [(rid, fresh_tokens(OLD, "cpu", [PROMPTS[2]])[0])]
        llm.wake()


def test_a_hybrid_model_keeps_no_state_across_sleep() -> None:
    """Granite-4-H: recurrent states and KV dropped by sleep(2), zero at wake; after the refit the
    tokens equal a fresh engine's (no state from before the sleep reaches a request)."""
    old, new = (str(hybrid_model_dir("granite", seed=s)) for s in (0, 1))
    kw = dict(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=32, block_size=4, num_kv_blocks=24,
              cudagraph_capture_sizes=[4, 16])
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23]]
    with graphrt.LLM(new, backend="cpu", **kw) as fresh:
        want = greedy_tokens(fresh, prompts)
    with graphrt.LLM(old, backend="cpu", **kw) as llm:
        greedy_tokens(llm, prompts)
        assert any(s.any() for s in llm.runner.executor.state_caches)        # states were written
        report = llm.sleep(2)
        states = sum(s.numel() * s.element_size() for s in llm.runner.executor.state_caches)
        assert report["cache_bytes"] >= states > 0
        report = llm.wake()
        _woke_clean(llm, report)
        llm.update_weights(new)
        assert greedy_tokens(llm, prompts) == want


def test_sleep_waits_for_background_warmup() -> None:
    """Background warm-up builds between steps over the buffers a sleep would release: refused."""
    kw = {k: v for k, v in ENGINE.items() if k != "num_kv_blocks"}
    with graphrt.ModelRunner(OLD, backend="cpu", num_kv_blocks=16, warmup="background", **kw) as runner:
        assert runner.background is not None and runner.background.active     # no step: nothing built yet
        with pytest.raises(graphrt.GraphrtError, match="background warm-up"):
            runner.sleep(1)
        assert runner.weights.level is None
