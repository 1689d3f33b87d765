"""graphrt.testing, the conformance kit engines run on their own models.

* It passes on graphrt's reference Qwen3 on ``cpu``, ``eager`` and ``xla`` (few examples here;
  ``graphrt conformance`` runs as many as asked).
* It catches padding and KV bugs planted in the reference model's attention, each with a
  shrunk counterexample of at most 3 requests: a -1 slot used as a Python index (writes the
  last real KV slot), padded rows that come out NaN, and stale block-table rows read by
  attention (a plan buffer that re-plans a row only for a new request, not as it grows); and
  attention that reads a token's own slot before storing its K/V.
* A user's own reference (transformers) sees a bug no other property can: a doubled
  softmax scale.

Its entry points (CLI, pytest plugin) are tested in test_kit_entry_points.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import find, settings

from graphrt.layers.torch.forward_context import get_forward_context
from graphrt.layers.torch.attention.paged import PagedAttention, paged_attention_kernel
from graphrt.models.torch.loader import load_torch_model
from graphrt.testing.conformance import Result, check_property, run_conformance, summary
from graphrt.testing.runners import KIT_LIMITS, RunnerFactory
from graphrt.testing.strategies import steps
from support.fast_subset import slow_except
from support.kit_models import hf_reference, model_dir

EXAMPLES = 6
#: A small XLA grid: every compile costs about a second here.
XLA_GRID = dict(precompile_token_paddings=[16, 32], precompile_bs_paddings=[4])
#: Properties with nothing to check on a backend: XLA has no eager path and no static buffers.
#: (the reference model keeps no recurrent state: state_isolated is N/A everywhere; tests/hybrid/test_hybrid_kit.py
#: runs it on hybrid models)
NOT_APPLICABLE = {"cpu": {"state_isolated"}, "eager": {"state_isolated"},
                  "xla": {"replay_matches_eager", "addresses_stable", "state_isolated"}}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: the tiny model's matmuls gain nothing from more, and on a shared
    machine a second thread mostly waits for a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("backend", slow_except(["cpu", "eager", "xla"], "cpu"))
def test_the_kit_passes_on_the_reference_model(backend: str) -> None:
    """Every property holds, the user's reference (transformers) included."""
    if backend == "xla":
        pytest.importorskip("jax")
    lines: list[str] = []
    results = run_conformance(model_dir(), backend, examples=EXAMPLES, report=lines.append, reference=hf_reference,
                              **(XLA_GRID if backend == "xla" else {}))
    assert "matches_reference" in [r.name for r in results]
    assert [r.name for r in results if not r.passed] == [], "\n".join(lines)
    assert all(r.examples >= 1 for r in results if r.applicable)
    assert lines[0].startswith("warm-up: ") and len(lines) == len(results) + 1
    na = NOT_APPLICABLE.get(backend, set())
    statuses = {line.split()[1]: line.split()[0] for line in lines[1:]}
    assert statuses == {r.name: "N/A" if r.name in na else "PASS" for r in results}, "\n".join(lines)
    assert all(r.examples == 0 and "not applicable" in r.note for r in results if r.name in na)


def test_the_summary_counts_not_applicable_properties_apart() -> None:
    held, na = Result("kv_isolated", 6, 1.0), Result("addresses_stable", 0, 0.1, note="not applicable: no buffers")
    failed = Result("padding_invisible", 2, 1.0, error="padding is visible", counterexample="Step: ...")
    assert (held.status, na.status, failed.status) == ("PASS", "N/A", "FAIL")
    assert na.line().startswith("N/A  addresses_stable") and "(not applicable: no buffers)" in na.line()
    assert summary([held, na]) == "1 of 1 properties hold, 1 not applicable"
    assert summary([held, na, failed]) == "1 of 2 properties hold, 1 not applicable; failed: padding_invisible"
    assert summary([held]) == "1 of 1 properties hold"


# ---- planted bugs ---------------------------------------------------------------------------

class NegativeSlotAsIndex(PagedAttention):
    """Stores K/V by indexing the cache's real slots with the slot mapping: a padded token's
    slot -1 wraps around to the last real slot (the trash row is not part of its view)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        cache, t = self.kv_cache, q.shape[0]
        slots = cache[:, :-1]
        slots[0][meta.slot_mapping] = k.reshape(t, cache.shape[2], cache.shape[3]).to(cache.dtype)
        slots[1][meta.slot_mapping] = v.reshape(t, cache.shape[2], cache.shape[3]).to(cache.dtype)
        nowhere = torch.full_like(meta.slot_mapping, -1)         # the kernel's own store: trash row
        return paged_attention_kernel(q, k, v, cache, nowhere, meta.query_start_loc, meta.seq_lens,
                                      meta.block_table, meta.token_req_idx, meta.block_size, self.scale)


class UnguardedSoftmax(PagedAttention):
    """Softmax over every masked score without the guard for rows that have no key at all: a
    padded request's tokens (seq_len 0) come out NaN."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        out = paged_attention_kernel(q, k, v, self.kv_cache, meta.slot_mapping, meta.query_start_loc,
                                     meta.seq_lens, meta.block_table, meta.token_req_idx, meta.block_size,
                                     self.scale)
        has_key = meta.seq_lens.index_select(0, meta.token_req_idx) > 0
        return torch.where(has_key[:, None], out, out * float("nan"))   # softmax(all -inf) = NaN


class StalePlan(PagedAttention):
    """Keeps its own block table (a FlashInfer-style plan) and re-plans a request's row only when
    a new request takes the row (a length no longer than the plan's), not as its request grows:
    a request that reaches a new block reads whatever block the plan held there before.
    (Stale rows of padded requests alone are harmless: the kernel reads nothing for them.)"""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        r, width = meta.block_table.shape
        if getattr(self, "plan_table", None) is None:
            self.plan_table = torch.zeros(KIT_LIMITS["max_num_batched_tokens"], width, dtype=meta.block_table.dtype)
            self.plan_lens = torch.zeros(KIT_LIMITS["max_num_batched_tokens"], dtype=meta.seq_lens.dtype)
        fresh = (meta.seq_lens > 0) & (meta.seq_lens <= self.plan_lens[:r])
        self.plan_table[:r].copy_(torch.where(fresh[:, None], meta.block_table, self.plan_table[:r]))
        self.plan_lens[:r].copy_(meta.seq_lens)
        return paged_attention_kernel(q, k, v, self.kv_cache, meta.slot_mapping, meta.query_start_loc,
                                      meta.seq_lens, self.plan_table[:r], meta.token_req_idx,
                                      meta.block_size, self.scale)


class ReadBeforeStore(PagedAttention):
    """Attends first and stores the step's K/V afterwards: a token reads whatever its own
    slot held before the step (the kit plants NaN there)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        cache, t = self.kv_cache, q.shape[0]
        nowhere = torch.full_like(meta.slot_mapping, -1)
        out = paged_attention_kernel(q, k, v, cache, nowhere, meta.query_start_loc, meta.seq_lens,
                                     meta.block_table, meta.token_req_idx, meta.block_size, self.scale)
        real = meta.slot_mapping >= 0
        cache[0, meta.slot_mapping[real]] = k.reshape(t, cache.shape[2], cache.shape[3])[real].to(cache.dtype)
        cache[1, meta.slot_mapping[real]] = v.reshape(t, cache.shape[2], cache.shape[3])[real].to(cache.dtype)
        return out


def planted(attention: type[PagedAttention]) -> torch.nn.Module:
    """graphrt's reference Qwen3 with ``attention`` in every layer."""
    model = load_torch_model(model_dir(), dtype=torch.float32, device="cpu")
    for layer in model.attention_layers():
        layer.__class__ = attention
    return model


# (attention, the property that must catch it, a fragment of its message)
PLANTED = {
    "negative slot as index": (NegativeSlotAsIndex, "kv_isolated", "outside the step's real slots"),
    "padded rows NaN": (UnguardedSoftmax, "kv_isolated", "finite"),
    "stale block-table rows": (StalePlan, "kv_isolated", "finite"),
    "read before store": (ReadBeforeStore, "kv_isolated", "finite"),
}


@pytest.mark.parametrize("bug", slow_except(PLANTED, "negative slot as index"))
def test_a_planted_bug_is_caught_and_shrunk(bug: str) -> None:
    attention, prop, fragment = PLANTED[bug]
    factory = RunnerFactory(functools.partial(planted, attention), "cpu", mode="FULL")
    result = check_property(prop, factory, examples=40)
    assert not result.passed, f"{bug} was not caught"
    assert fragment in result.error, result.line()
    requests = int(result.counterexample.split(" request(s)")[0].rsplit(" ", 1)[-1])
    assert requests <= 3, result.line()


class DoubledScale(PagedAttention):
    """Attention with twice the softmax scale: wrong the same way at every shape, padded or
    not, replayed or eager, so only a reference can see it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        return paged_attention_kernel(q, k, v, self.kv_cache, meta.slot_mapping, meta.query_start_loc,
                                      meta.seq_lens, meta.block_table, meta.token_req_idx, meta.block_size,
                                      2 * self.scale)


def test_a_reference_catches_a_bug_padding_cannot_see() -> None:
    factory = RunnerFactory(functools.partial(planted, DoubledScale), "cpu", mode="FULL")
    assert check_property("padding_invisible", factory, examples=EXAMPLES).passed
    result = check_property("matches_reference", factory, examples=20, reference=hf_reference)
    assert not result.passed, "a doubled softmax scale was not caught"
    assert "against the reference: logits differ" in result.error, result.line()
    assert result.counterexample.count("Step:") <= 3 and " 1 request(s)" in result.counterexample, result.line()
    wrong = check_property("matches_reference", factory, examples=2, reference=lambda step: np.zeros(3))
    assert "InputError: reference: returned an array of shape (3,)" in wrong.error, wrong.line()


# ---- strategies -----------------------------------------------------------------------------

def test_steps_shrink_to_few_requests_and_tokens() -> None:
    factory = RunnerFactory(model_dir(), "eager")
    args = dict(config=factory.config, num_kv_blocks=factory.num_kv_blocks, vocab_size=128)
    # No example database: a saved example from an earlier run would be the start of the
    # shrink, which may then stop short of the minimal step.
    two = find(steps(**args), lambda s: s.num_reqs >= 2, settings=settings(database=None))
    assert two.num_reqs == 2 and two.num_tokens == 2 and two.num_computed_tokens.tolist() == [0, 0]
    assert two.req_rows.tolist() == [0, 1] and (two.block_table[two.req_rows, 1:] == 0).all()
