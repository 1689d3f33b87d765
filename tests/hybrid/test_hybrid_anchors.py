"""Each anchor's 2026 state-corruption bug, as a regression test that fails on a planted version.

Every test runs a check on graphrt as it is (it passes), then plants the bug (monkeypatch) and
runs the same check again, which must fail -- so the check can see the bug it is named for:

* vLLM #57720, Granite-4-H garbled under full CUDA graphs: the recurrent layers' metadata must
  come from the static buffers at every replay (planted: computed once per shape and reused,
  so FULL graphs replay the capture's padding-only metadata) -- teacher-forced parity with
  transformers through FULL graphs of decode and mixed steps.
* vLLM PR #55178, 7 of 8 responses corrupted by K+1 speculative padding of a state: a padded
  request of a verification step must write the trash slot (planted: its slot -1 clamped to 0,
  a parked live request's) -- ``state_isolated`` on a 3-request verification step padded to 4.
* vllm-ascend PR #7506, a padded state index -1 writing into the adjacent cache: a negative
  slot is mapped with ``where`` (planted: wrapped to the neighbouring slot ``num_slots - 1``).
* SGLang PR #30974, padded rows' ``torch.empty`` garbage flowing into the SSM: a padded or new
  request starts from zeros, never from a slot's contents (planted: every request reads its
  slot) -- ``state_isolated`` with NaN in every unread entry.
* TensorRT-LLM PR #13151, padding dummies aliasing live requests parked by the overlap
  scheduler: the ``state_slots`` fill is negative, refused otherwise (planted: the padder's
  rule filled with 0, a parked request's slot) -- ``state_isolated``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import graphrt
from graphrt import ConfigError
from graphrt.layers.torch.state import backend as state_cache   # where the state backend builds its metadata
from graphrt.layers.torch.state import metadata as state_metadata
from graphrt.testing.properties import state_isolated
from graphrt.testing.runners import RunnerFactory
from graphrt.testing.step import Step
from support.hybrid_models import hybrid_model_dir, load_hf_hybrid
from support.hybrid_parity import reference_logits, run_schedule

LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32, block_size=4)
#: Graphs captured by the isolation checks: the steps below need no more (3 to 9 tokens of up
#: to 4 requests); fewer sizes keep the two warm-ups of each check (as is, planted) short.
CAPTURE = dict(cudagraph_capture_sizes=[4, 12])


def _fails(check, plant, monkeypatch: pytest.MonkeyPatch) -> None:
    """``check`` passes as graphrt is, and raises AssertionError with ``plant`` applied."""
    check()
    with monkeypatch.context() as m:
        plant(m)
        with pytest.raises(AssertionError):
            check()


def _verify_step(k: int, parked_slot: int = 0) -> Step:
    """Rows 0-2 verify (1 + k tokens each, after 5 computed) in slots 1-3; row 3 is parked in
    ``parked_slot``: padded to 4 requests, the padded request must not touch it."""
    q = 1 + k
    rng = np.random.default_rng(3)
    tokens = rng.integers(3, 120, size=(4, 64)).astype(np.int32)          # the kit's limits: 64 tokens,
    table = np.arange(1, 65, dtype=np.int32).reshape(4, 16)               # blocks of 4
    slots = np.array([1, 2, 3, parked_slot], np.int32)
    return Step(tokens, table, np.array([0, 1, 2], np.int32), np.array([5, 6, 7], np.int32),
                np.full(3, q, np.int32), 4, seed=5, state_slots=slots)


def _isolation_check(arch: str, step: Step, **fields):
    """``state_isolated`` of ``step`` on a runner built (warmed up, graphs captured) inside the
    check, so a plant is in every graph too."""
    def check() -> None:
        state_isolated(RunnerFactory(str(hybrid_model_dir(arch)), "cpu", **CAPTURE, **fields), step)
    return check


def _with_metadata(m: pytest.MonkeyPatch, change) -> None:
    """Plant ``change(meta) -> meta`` after the executor's state-metadata builder."""
    real = state_metadata.build_state_metadata
    m.setattr(state_cache, "build_state_metadata", lambda *args, **kw: change(real(*args, **kw)))


def _padding_writes(slot_of_trash):
    """A plant: every state write meant for the trash slot (padded requests' entries, the padding
    request's tokens, positions a request does not have) goes to ``slot_of_trash(num_slots)``."""
    def change(meta):
        trash = meta.write_slot == meta.num_slots
        meta.write_slot = torch.where(trash, slot_of_trash(meta.num_slots), meta.write_slot)
        return meta
    return change


def test_vllm_57720_full_graphs_refresh_the_state_metadata(monkeypatch):
    d = hybrid_model_dir("granite")
    rng = np.random.default_rng(7)
    seqs = [[int(t) for t in rng.integers(3, 128, size=n)] for n in (11, 6, 14)]
    refs = reference_logits(load_hf_hybrid(d), seqs)

    def check() -> None:
        runner = graphrt.ModelRunner(str(d), backend="cpu", mode="FULL", progress=False, num_kv_blocks=33,
                                     cudagraph_capture_sizes=[4, 8, 12], **LIMITS)
        run_schedule(runner, seqs, refs, chunk=4, joins=[0, 1, 2])
        assert runner.stats.hits > 0

    def plant(m: pytest.MonkeyPatch) -> None:      # computed once per shape: FULL graphs replay the capture's
        memo = {}
        real = state_metadata.build_state_metadata

        def once_per_shape(qsl, computed, slots, t, **kw):
            key = (t, slots.shape[0], kw.get("uniform_query_len", 0))
            if key not in memo:
                memo[key] = real(qsl, computed, slots, t, **kw)
            return memo[key]
        m.setattr(state_cache, "build_state_metadata", once_per_shape)

    _fails(check, plant, monkeypatch)


def test_vllm_55178_speculative_padding_writes_the_trash_slot(monkeypatch):
    """A verification step of 3 requests x (1 + 2) tokens, padded to 4 requests: the padded
    request's K+1 positions (and the other trash writes) must not reach the parked slot 0."""
    _fails(_isolation_check("granite", _verify_step(2), mode="FULL_AND_PIECEWISE", num_speculative_tokens=2),
           lambda m: _with_metadata(m, _padding_writes(lambda n: 0)), monkeypatch)


def test_vllm_ascend_7506_a_negative_slot_never_indexes_a_neighbour(monkeypatch):
    """Slot -1 is the trash slot by ``where``; planted: wrapped onto the neighbouring live slot."""
    step = _verify_step(0)
    step.state_slots = np.array([0, 1, 2, 3], np.int32)   # the parked request next to the trash slot
    _fails(_isolation_check("mamba2", step, mode="FULL"),
           lambda m: _with_metadata(m, _padding_writes(lambda n: n - 1)), monkeypatch)


def test_sglang_30974_padded_and_new_requests_start_from_zeros(monkeypatch):
    step = _verify_step(0)
    step.num_computed_tokens[1] = 0            # request 1 is new: its slot's old contents must not count

    def every_slot_read(meta):
        meta.has_initial = torch.ones_like(meta.has_initial)
        return meta
    _fails(_isolation_check("qwen3_next", step, mode="FULL_AND_PIECEWISE"),
           lambda m: _with_metadata(m, every_slot_read), monkeypatch)


def test_tensorrt_llm_13151_padding_never_aliases_a_parked_request(monkeypatch):
    """The state_slots fill is negative (a padder with another is refused), and the padded
    tokens (the padding request's) write the trash slot; planted: a parked request's slot 0."""
    with pytest.raises(ConfigError, match="state_slots fill must be negative"):
        graphrt.Padder(fill_values={"state_slots": 0})
    step = _verify_step(0)
    step.num_scheduled_tokens[:] = (3, 2, 1)        # a mixed step: padded tokens after them
    _fails(_isolation_check("granite", step, mode="FULL"),
           lambda m: _with_metadata(m, _padding_writes(lambda n: 0)), monkeypatch)
