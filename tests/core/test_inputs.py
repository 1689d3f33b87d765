"""Input preparation: ``prepare_inputs`` / ``InputPreparer`` against a per-token reference.

The reference below loops over requests and tokens exactly as vLLM's input preparation describes it;
the library is vectorised. Every field is compared, for hypothesis-generated schedules
of every kind (prefill, chunked prefill, prefix hits, decode, mixed), for rows out of
order and non-contiguous, and for a persistent preparer reused across steps of
different sizes. Bad inputs must raise ``InputError`` naming the field and leave the
caller's arrays and the previous result untouched.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphrt
from graphrt import InputError, InputPreparer, ModelInputs, prepare_inputs
from support.fast_subset import examples

#: Every test here runs on both host kernels (numba and numpy); see conftest.py.
pytestmark = pytest.mark.usefixtures("host_kernel")

#: Extreme integers: the ends of int32 / uint32 / int64 and their neighbours.
EXTREMES = (-2**63, -2**63 + 1, -2**32, -2**31 - 1, -2**31, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
            2**62, 2**63 - 2, 2**63 - 1)

SETTINGS = settings(max_examples=examples(150), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --------------------------------------------------------------------------------------
# The reference: one request, one token at a time.
# --------------------------------------------------------------------------------------

@dataclass
class Reference:
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    num_computed_tokens: list[int]
    block_table: list[list[int]]
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    uniform_decode: bool


def reference(token_ids, block_table, rows, computed, scheduled, bs) -> Reference:
    ids, positions, slots, qsl = [], [], [], [0]
    for row, done, new in zip(rows, computed, scheduled):
        for i in range(new):
            pos = done + i
            ids.append(int(token_ids[row][pos]))
            positions.append(pos)
            slots.append(int(block_table[row][pos // bs]) * bs + pos % bs)
        qsl.append(qsl[-1] + new)
    seq_lens = [c + s for c, s in zip(computed, scheduled)]
    return Reference(
        input_ids=ids, positions=positions, slot_mapping=slots, query_start_loc=qsl,
        seq_lens=seq_lens, num_computed_tokens=list(computed),
        block_table=[[int(b) for b in block_table[row]] for row in rows],
        num_reqs=len(rows), num_tokens=qsl[-1], max_query_len=max(scheduled),
        max_seq_len=max(seq_lens), uniform_decode=all(s == 1 for s in scheduled))


def assert_matches(got: ModelInputs, ref: Reference) -> None:
    """Field by field, with the documented dtypes and exact lengths."""
    for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "num_computed_tokens",
                 "block_table"):
        arr = getattr(got, name)
        assert arr.dtype == np.int32, (name, arr.dtype)
    assert got.slot_mapping.dtype == np.int64
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                 "num_computed_tokens"):
        assert getattr(got, name).tolist() == getattr(ref, name), name
    assert got.block_table.shape[0] == ref.num_reqs
    assert got.block_table.tolist() == ref.block_table
    assert got.num_reqs == ref.num_reqs
    assert got.num_tokens == ref.num_tokens
    assert got.padded_num_tokens == ref.num_tokens
    assert got.padded_num_reqs == ref.num_reqs
    assert got.max_query_len == ref.max_query_len
    assert got.max_seq_len == ref.max_seq_len
    assert got.uniform_decode == ref.uniform_decode
    assert isinstance(got.uniform_decode, bool)
    assert got.logits_indices.tolist() == [q - 1 for q in ref.query_start_loc[1:]]


# --------------------------------------------------------------------------------------
# Strategies: valid engine tables and one step's schedule over them.
# --------------------------------------------------------------------------------------

KINDS = ("prefill", "chunked", "prefix_hit", "decode", "mixed")


@dataclass
class Tables:
    token_ids: np.ndarray     # [rows, max_model_len]
    block_table: np.ndarray   # [rows, width]
    block_size: int


@dataclass
class Step:
    rows: list[int]
    computed: list[int]
    scheduled: list[int]

    def arrays(self, dtype=np.int32):
        return (np.array(self.rows, dtype=dtype), np.array(self.computed, dtype=dtype),
                np.array(self.scheduled, dtype=dtype))


def _request(draw, kind: str, max_len: int) -> tuple[int, int]:
    """(computed, scheduled) of one request of ``kind`` within ``max_len`` tokens."""
    if kind == "chunked" and max_len < 3:
        kind = "prefix_hit"
    if kind == "prefix_hit" and max_len < 2:
        kind = "prefill"
    if kind == "decode":
        return draw(st.integers(0, max_len - 1)), 1
    if kind == "prefill":
        return 0, draw(st.integers(1, max_len))
    if kind == "chunked":       # computed > 0, and scheduled < what is left of the prompt
        prompt = draw(st.integers(3, max_len))
        computed = draw(st.integers(1, prompt - 2))
        return computed, draw(st.integers(1, prompt - computed - 1))
    if kind == "prefix_hit":    # cached prefix counted as computed, the rest scheduled at once
        computed = draw(st.integers(1, max_len - 1))
        return computed, draw(st.integers(1, max_len - computed))
    computed = draw(st.integers(0, max_len - 1))
    return computed, draw(st.integers(1, max_len - computed))


@st.composite
def steps_over(draw, num_rows: int, max_len: int, max_reqs: int | None = None,
               kind: str | None = None) -> Step:
    """A schedule over tables of ``num_rows`` rows and ``max_len`` tokens per row."""
    kind = kind or draw(st.sampled_from(KINDS))
    order = draw(st.permutations(range(num_rows)))
    r = draw(st.integers(1, min(num_rows, max_reqs or num_rows)))
    rows = list(order[:r])   # out of order, possibly non-contiguous
    computed, scheduled = [], []
    for _ in rows:
        k = draw(st.sampled_from(("prefill", "chunked", "prefix_hit", "decode"))) \
            if kind == "mixed" else kind
        c, s = _request(draw, k, max_len)
        computed.append(c)
        scheduled.append(s)
    return Step(rows, computed, scheduled)


def build_tables(rng: random.Random, num_rows: int, max_len: int, block_size: int,
                 extra_cols: int, steps: list[Step], vocab: int = 50_000) -> Tables:
    """Distinct non-zero blocks covering every position any step touches; zeros elsewhere."""
    width = -(-max_len // block_size) + extra_cols
    need = [0] * num_rows
    for step in steps:
        for row, c, s in zip(step.rows, step.computed, step.scheduled):
            need[row] = max(need[row], -(-(c + s) // block_size))
    pool = list(range(1, sum(need) + 1 + rng.randrange(0, 50)))
    rng.shuffle(pool)
    table = np.zeros((num_rows, width), dtype=np.int32)
    for row in range(num_rows):
        for col in range(need[row]):
            table[row, col] = pool.pop()
    token_ids = np.array([[rng.randrange(vocab) for _ in range(max_len)] for _ in range(num_rows)],
                         dtype=np.int32).reshape(num_rows, max_len)
    return Tables(token_ids, table, block_size)


@st.composite
def scenarios(draw, num_steps: int = 1, kind: str | None = None, max_reqs: int | None = None):
    """Tables plus ``num_steps`` schedules over them."""
    num_rows = draw(st.integers(1, 8))
    block_size = draw(st.sampled_from((1, 2, 3, 4, 5, 8, 16)))
    max_len = draw(st.integers(3 if kind in ("chunked", "prefix_hit") else 1, 48))
    steps = [draw(steps_over(num_rows, max_len, max_reqs, kind)) for _ in range(num_steps)]
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    tables = build_tables(rng, num_rows, max_len, block_size, draw(st.integers(0, 2)), steps)
    return tables, steps


def ref_for(tables: Tables, step: Step, block_size: int | None = None) -> Reference:
    return reference(tables.token_ids.tolist(), tables.block_table.tolist(), step.rows,
                     step.computed, step.scheduled, block_size or tables.block_size)


def run_prepare_inputs(tables: Tables, step: Step, dtype=np.int32) -> ModelInputs:
    rows, computed, scheduled = step.arrays(dtype)
    return prepare_inputs(token_ids=tables.token_ids, block_table=tables.block_table,
                          req_rows=rows, num_computed_tokens=computed,
                          num_scheduled_tokens=scheduled, block_size=tables.block_size)


def run_preparer(prep: InputPreparer, tables: Tables, step: Step, **kw) -> ModelInputs:
    rows, computed, scheduled = step.arrays()
    return prep.prepare(token_ids=tables.token_ids, block_table=tables.block_table,
                        req_rows=rows, num_computed_tokens=computed,
                        num_scheduled_tokens=scheduled, **kw)


# --------------------------------------------------------------------------------------
# Seed 001's worked example.
# --------------------------------------------------------------------------------------

def seed_tables(step: int) -> Tables:
    """max_model_len 12, block size 2, table width 6, four request rows."""
    token_ids = np.array([[100 * r + j for j in range(12)] for r in range(4)], dtype=np.int32)
    table = np.zeros((4, 6), dtype=np.int32)
    table[0, :2] = [1, 2]
    table[1, :1] = [3]
    table[2, :3] = [4, 5, 6]
    if step == 2:        # blocks 7 and 8 added to request_1 and request_2
        table[1, 1] = 7
        table[2, 3] = 8
    return Tables(token_ids, table, 2)


SEED_STEP1 = Step(rows=[0, 1, 2], computed=[0, 0, 0], scheduled=[3, 2, 5])
# request_0 and request_1 decode one token; request_2 finishes its last 3 prompt tokens.
SEED_STEP2 = Step(rows=[0, 1, 2], computed=[3, 2, 5], scheduled=[1, 1, 3])


def check_seed_step1(got: ModelInputs) -> None:
    assert got.positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
    assert got.slot_mapping.tolist() == [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
    assert got.input_ids.tolist() == [0, 1, 2, 100, 101, 200, 201, 202, 203, 204]
    assert got.query_start_loc.tolist() == [0, 3, 5, 10]
    assert got.seq_lens.tolist() == [3, 2, 5]
    assert got.num_computed_tokens.tolist() == [0, 0, 0]
    assert got.block_table.tolist() == [[1, 2, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0],
                                        [4, 5, 6, 0, 0, 0]]
    assert (got.num_reqs, got.num_tokens, got.max_query_len, got.max_seq_len) == (3, 10, 5, 5)
    assert got.uniform_decode is False
    assert got.logits_indices.tolist() == [2, 4, 9]


def check_seed_step2(got: ModelInputs) -> None:
    # positions [3 | 2 | 5, 6, 7]; block-table indices [0*6+1, 1*6+1, 2*6+2, 2*6+3, 2*6+3]
    # -> device blocks [2, 7, 6, 8, 8]; offsets [1, 0, 1, 0, 1]
    assert got.positions.tolist() == [3, 2, 5, 6, 7]
    assert got.slot_mapping.tolist() == [5, 14, 13, 16, 17]
    assert got.input_ids.tolist() == [3, 102, 205, 206, 207]
    assert got.query_start_loc.tolist() == [0, 1, 2, 5]
    assert got.seq_lens.tolist() == [4, 3, 8]
    assert got.num_computed_tokens.tolist() == [3, 2, 5]
    assert got.block_table.tolist() == [[1, 2, 0, 0, 0, 0], [3, 7, 0, 0, 0, 0],
                                        [4, 5, 6, 8, 0, 0]]
    assert (got.num_reqs, got.num_tokens, got.max_query_len, got.max_seq_len) == (3, 5, 3, 8)
    assert got.uniform_decode is False
    assert got.logits_indices.tolist() == [0, 1, 4]


def test_seed_001_both_steps_prepare_inputs():
    check_seed_step1(run_prepare_inputs(seed_tables(1), SEED_STEP1))
    check_seed_step2(run_prepare_inputs(seed_tables(2), SEED_STEP2))


def test_seed_001_both_steps_persistent_preparer():
    prep = InputPreparer(max_num_reqs=4, max_num_tokens=10, block_size=2)
    check_seed_step1(run_preparer(prep, seed_tables(1), SEED_STEP1))
    check_seed_step2(run_preparer(prep, seed_tables(2), SEED_STEP2))
    # and back to the bigger step: nothing of step 2 may remain
    check_seed_step1(run_preparer(prep, seed_tables(1), SEED_STEP1))


def test_seed_001_matches_reference():
    for tables, step in ((seed_tables(1), SEED_STEP1), (seed_tables(2), SEED_STEP2)):
        assert_matches(run_prepare_inputs(tables, step), ref_for(tables, step))


def test_seed_001_decode_step_is_uniform():
    tables = seed_tables(2)
    step = Step(rows=[2, 0, 1], computed=[7, 3, 2], scheduled=[1, 1, 1])
    got = run_prepare_inputs(tables, step)
    assert got.uniform_decode is True
    assert got.max_query_len == 1
    assert got.positions.tolist() == [7, 3, 2]
    assert got.slot_mapping.tolist() == [17, 5, 14]
    assert_matches(got, ref_for(tables, step))


# --------------------------------------------------------------------------------------
# Properties against the reference.
# --------------------------------------------------------------------------------------

@SETTINGS
@given(scenarios())
def test_prepare_inputs_matches_reference(scenario):
    tables, (step,) = scenario
    assert_matches(run_prepare_inputs(tables, step), ref_for(tables, step))


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_each_schedule_kind_matches_reference(kind, data):
    tables, (step,) = data.draw(scenarios(kind=kind))
    got = run_prepare_inputs(tables, step)
    assert_matches(got, ref_for(tables, step))
    if kind == "decode":
        assert got.uniform_decode
    if kind == "prefill":
        assert got.num_computed_tokens.tolist() == [0] * got.num_reqs
    if kind in ("prefix_hit", "chunked"):
        assert (got.num_computed_tokens > 0).all()
    if kind == "chunked":   # a chunk never reaches the end of the token table's row
        assert (got.seq_lens < tables.token_ids.shape[1]).all()


@SETTINGS
@given(scenarios(num_steps=4))
def test_persistent_preparer_reused_across_steps(scenario):
    tables, steps = scenario
    max_tokens = max(sum(s.scheduled) for s in steps)
    max_reqs = max(len(s.rows) for s in steps)
    prep = InputPreparer(max_num_reqs=max_reqs, max_num_tokens=max_tokens,
                         block_size=tables.block_size)
    kept = []
    for step in steps:
        got = run_preparer(prep, tables, step)
        assert_matches(got, ref_for(tables, step))
        kept.append(got.copy())
    # copies survive later calls; the allocating path agrees with the persistent one
    for step, copy in zip(steps, kept):
        assert_matches(copy, ref_for(tables, step))
        assert_matches(run_prepare_inputs(tables, step), ref_for(tables, step))


@SETTINGS
@given(scenarios(num_steps=2))
def test_bigger_step_then_smaller_step_leaves_nothing_stale(scenario):
    tables, steps = scenario
    big, small = sorted(steps, key=lambda s: (sum(s.scheduled), len(s.rows)), reverse=True)
    prep = InputPreparer(max_num_reqs=8, max_num_tokens=8 * 48, block_size=tables.block_size)
    assert_matches(run_preparer(prep, tables, big), ref_for(tables, big))
    assert_matches(run_preparer(prep, tables, small), ref_for(tables, small))
    assert_matches(run_preparer(prep, tables, big), ref_for(tables, big))


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), scenarios())
def test_preparer_survives_a_change_of_table_width_and_block_size(first, second):
    """One preparer, two engines' worth of tables (different widths and block sizes)."""
    prep = InputPreparer(max_num_reqs=8, max_num_tokens=8 * 48, block_size=7)
    for tables, (step,) in (first, second, first):
        got = run_preparer(prep, tables, step, block_size=tables.block_size)
        assert_matches(got, ref_for(tables, step))


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from((np.int16, np.int32, np.int64, np.uint32, np.uint64)))
def test_any_integer_dtype_is_accepted(scenario, dtype):
    tables, (step,) = scenario
    t = Tables(tables.token_ids.astype(np.int64), tables.block_table.astype(np.int64),
               tables.block_size)
    got = run_prepare_inputs(t, step, dtype=dtype)
    assert_matches(got, ref_for(tables, step))


def test_python_lists_are_accepted():
    tables = seed_tables(1)
    got = prepare_inputs(token_ids=tables.token_ids.tolist(), block_table=tables.block_table.tolist(),
                         req_rows=[0, 1, 2], num_computed_tokens=[0, 0, 0],
                         num_scheduled_tokens=[3, 2, 5], block_size=2)
    check_seed_step1(got)


def test_prepare_inputs_does_not_write_the_callers_tables():
    tables = seed_tables(2)
    before = (tables.token_ids.copy(), tables.block_table.copy())
    run_prepare_inputs(tables, SEED_STEP2)
    assert np.array_equal(tables.token_ids, before[0])
    assert np.array_equal(tables.block_table, before[1])


def test_results_of_prepare_inputs_are_independent():
    a = run_prepare_inputs(seed_tables(1), SEED_STEP1)
    b = run_prepare_inputs(seed_tables(2), SEED_STEP2)
    check_seed_step1(a)
    check_seed_step2(b)
    for name in ("input_ids", "positions", "slot_mapping", "block_table"):
        assert not np.shares_memory(getattr(a, name), getattr(b, name))


def test_copy_is_deep():
    prep = InputPreparer(max_num_reqs=4, max_num_tokens=10, block_size=2)
    got = run_preparer(prep, seed_tables(1), SEED_STEP1)
    snap = got.copy()
    run_preparer(prep, seed_tables(2), SEED_STEP2)
    check_seed_step1(snap)


# --------------------------------------------------------------------------------------
# Bad inputs.
# --------------------------------------------------------------------------------------

def _base_kwargs() -> dict:
    t = seed_tables(1)
    return dict(token_ids=t.token_ids, block_table=t.block_table,
                req_rows=np.array([0, 1, 2], dtype=np.int32),
                num_computed_tokens=np.array([0, 0, 0], dtype=np.int32),
                num_scheduled_tokens=np.array([3, 2, 5], dtype=np.int32))


def _narrow_table(kw):
    kw["block_table"] = kw["block_table"][:, :2].copy()


def _null_block(kw):
    kw["block_table"] = kw["block_table"].copy()
    kw["block_table"][2, 2] = 0        # request 2's position 4 lands in the null block


def _negative_block(kw):
    kw["block_table"] = kw["block_table"].copy()
    kw["block_table"][0, 1] = -3


def _set(name, value):
    def mutate(kw):
        kw[name] = value
    return mutate


# (id, mutation, expected field)
BAD_INPUTS = [
    ("zero_scheduled", _set("num_scheduled_tokens", np.array([3, 0, 5], dtype=np.int32)),
     "num_scheduled_tokens"),
    ("negative_scheduled", _set("num_scheduled_tokens", np.array([3, -2, 5], dtype=np.int32)),
     "num_scheduled_tokens"),
    ("negative_computed", _set("num_computed_tokens", np.array([0, -1, 0], dtype=np.int32)),
     "num_computed_tokens"),
    ("past_token_table_width", _set("num_computed_tokens", np.array([0, 0, 8], dtype=np.int32)),
     "num_scheduled_tokens"),
    ("row_too_large", _set("req_rows", np.array([0, 1, 4], dtype=np.int32)), "req_rows"),
    ("row_negative", _set("req_rows", np.array([0, -1, 2], dtype=np.int32)), "req_rows"),
    ("repeated_row", _set("req_rows", np.array([0, 2, 2], dtype=np.int32)), "req_rows"),
    ("computed_length", _set("num_computed_tokens", np.array([0, 0], dtype=np.int32)),
     "num_computed_tokens"),
    ("scheduled_length", _set("num_scheduled_tokens", np.array([3, 2, 5, 1], dtype=np.int32)),
     "num_scheduled_tokens"),
    ("table_rows_mismatch", _set("block_table", np.ones((3, 6), dtype=np.int32)), "block_table"),
    ("table_too_narrow", _narrow_table, "block_table"),
    ("null_block", _null_block, "block_table"),
    ("negative_block", _negative_block, "block_table"),
    ("empty_batch", lambda kw: kw.update(req_rows=np.array([], dtype=np.int32),
                                         num_computed_tokens=np.array([], dtype=np.int32),
                                         num_scheduled_tokens=np.array([], dtype=np.int32)),
     "req_rows"),
    ("float_token_ids", lambda kw: kw.update(token_ids=kw["token_ids"].astype(np.float32)),
     "token_ids"),
    ("float_block_table", lambda kw: kw.update(block_table=kw["block_table"].astype(np.float64)),
     "block_table"),
    ("float_rows", _set("req_rows", np.array([0.0, 1.0, 2.0])), "req_rows"),
    ("float_computed", _set("num_computed_tokens", np.array([0.0, 0.0, 0.0])),
     "num_computed_tokens"),
    ("float_scheduled", _set("num_scheduled_tokens", np.array([3.0, 2.0, 5.0])),
     "num_scheduled_tokens"),
    ("bool_scheduled", _set("num_scheduled_tokens", np.array([True, True, True])),
     "num_scheduled_tokens"),
    ("token_ids_1d", lambda kw: kw.update(token_ids=kw["token_ids"].reshape(-1)), "token_ids"),
    ("block_table_3d", lambda kw: kw.update(block_table=kw["block_table"][None]), "block_table"),
    ("rows_2d", _set("req_rows", np.array([[0, 1, 2]], dtype=np.int32)), "req_rows"),
]


def _snapshot(kw: dict) -> dict:
    return {k: np.array(v, copy=True) for k, v in kw.items()}


def _assert_unchanged(kw: dict, snap: dict) -> None:
    for k, v in snap.items():
        now = np.asarray(kw[k])
        assert now.dtype == v.dtype and now.shape == v.shape and np.array_equal(now, v), k


def _assert_same_inputs(a: ModelInputs, b: ModelInputs) -> None:
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                 "num_computed_tokens", "block_table"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    for name in ("num_reqs", "num_tokens", "max_query_len", "max_seq_len", "uniform_decode"):
        assert getattr(a, name) == getattr(b, name), name


def _check_error(excinfo, field: str) -> None:
    err = excinfo.value
    assert isinstance(err, ValueError) and isinstance(err, graphrt.GraphrtError)
    assert err.field == field
    assert field in str(err)


@pytest.mark.parametrize("case_id,mutate,field", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_prepare_inputs(case_id, mutate, field):
    kw = _base_kwargs()
    mutate(kw)
    snap = _snapshot(kw)
    with pytest.raises(InputError) as excinfo:
        prepare_inputs(**kw, block_size=2)
    _check_error(excinfo, field)
    _assert_unchanged(kw, snap)


@pytest.mark.parametrize("case_id,mutate,field", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_preparer_leaves_previous_result_intact(case_id, mutate, field):
    prep = InputPreparer(max_num_reqs=4, max_num_tokens=16, block_size=2)
    # a previous (different) step whose result views the persistent buffers
    previous = run_preparer(prep, seed_tables(2), SEED_STEP2)
    previous_copy = previous.copy()
    kw = _base_kwargs()
    mutate(kw)
    snap = _snapshot(kw)
    with pytest.raises(InputError) as excinfo:
        prep.prepare(**kw)
    _check_error(excinfo, field)
    _assert_unchanged(kw, snap)
    _assert_same_inputs(previous, previous_copy)
    check_seed_step2(previous)
    # the preparer still works after the error
    check_seed_step1(run_preparer(prep, seed_tables(1), SEED_STEP1))


@pytest.mark.parametrize("limits,field", [
    (dict(max_num_reqs=4, max_num_tokens=9), "num_scheduled_tokens"),   # 10 tokens > 9
    (dict(max_num_reqs=2, max_num_tokens=16), "req_rows"),              # 3 requests > 2
])
def test_preparer_limits(limits, field):
    prep = InputPreparer(block_size=2, **limits)
    previous = run_preparer(prep, seed_tables(2), Step([0, 1], [3, 2], [1, 1]))
    previous_copy = previous.copy()
    kw = _base_kwargs()
    snap = _snapshot(kw)
    with pytest.raises(InputError) as excinfo:
        prep.prepare(**kw)
    _check_error(excinfo, field)
    assert str(limits["max_num_tokens" if field == "num_scheduled_tokens" else "max_num_reqs"]) \
        in str(excinfo.value)
    _assert_unchanged(kw, snap)
    _assert_same_inputs(previous, previous_copy)


@pytest.mark.parametrize("block_size", [0, -2])
def test_bad_block_size(block_size):
    kw = _base_kwargs()
    snap = _snapshot(kw)
    with pytest.raises(InputError) as excinfo:
        prepare_inputs(**kw, block_size=block_size)
    _check_error(excinfo, "block_size")
    with pytest.raises(InputError) as excinfo:
        InputPreparer(max_num_reqs=4, max_num_tokens=16, block_size=block_size)
    _check_error(excinfo, "block_size")
    prep = InputPreparer(max_num_reqs=4, max_num_tokens=16, block_size=2)
    previous = run_preparer(prep, seed_tables(2), SEED_STEP2)
    previous_copy = previous.copy()
    with pytest.raises(InputError) as excinfo:
        prep.prepare(**kw, block_size=block_size)
    _check_error(excinfo, "block_size")
    _assert_unchanged(kw, snap)
    _assert_same_inputs(previous, previous_copy)


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_num_reqs=0, max_num_tokens=4, block_size=2), "max_num_reqs"),
    (dict(max_num_reqs=4, max_num_tokens=0, block_size=2), "max_num_tokens"),
    (dict(max_num_reqs=4, max_num_tokens=4, block_size=2, vocab_size=0), "vocab_size"),
    (dict(max_num_reqs=4, max_num_tokens=4, block_size=2, num_blocks=-1), "num_blocks"),
    (dict(max_num_reqs=4, max_num_tokens=4, block_size=2, table_width=0), "table_width"),
])
def test_bad_preparer_limits(kwargs, field):
    with pytest.raises(InputError) as excinfo:
        InputPreparer(**kwargs)
    _check_error(excinfo, field)


@settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.data(), st.sampled_from((0, -1, -100_000)))
def test_unallocated_block_is_always_caught(scenario, data, bad):
    """Put a null or negative id in one block column the step's attention reads (a computed
    column or a scheduled one): InputError on block_table naming the row and column, nothing
    written."""
    tables, (step,) = scenario
    needed = sorted({(row, col) for row, c, s in zip(step.rows, step.computed, step.scheduled)
                     for col in range(-(-(c + s) // tables.block_size))})
    row, col = data.draw(st.sampled_from(needed))
    broken = tables.block_table.copy()
    broken[row, col] = bad
    snap = broken.copy()
    prep = InputPreparer(max_num_reqs=8, max_num_tokens=8 * 48, block_size=tables.block_size)
    previous = run_preparer(prep, tables, step)
    previous_copy = previous.copy()
    rows, computed, scheduled = step.arrays()
    with pytest.raises(InputError) as excinfo:
        prep.prepare(token_ids=tables.token_ids, block_table=broken, req_rows=rows,
                     num_computed_tokens=computed, num_scheduled_tokens=scheduled)
    _check_error(excinfo, "block_table")
    assert f"(row {row}) column {col} holds block {bad}" in str(excinfo.value)
    assert np.array_equal(broken, snap)
    _assert_same_inputs(previous, previous_copy)


@pytest.mark.parametrize("bad", [0, -1, -100_000])
def test_a_decode_reads_every_computed_column(bad):
    """The issue-15 repro at the preparer: a decode of a row whose computed block column 0
    is null or negative (the scheduled token is in column 1, which is fine)."""
    prep = _seed_preparer(num_blocks=9)
    kw = _base_kwargs()
    kw["block_table"] = kw["block_table"].copy()
    kw["block_table"][2, 0] = bad
    kw.update(req_rows=np.array([2], np.int32), num_computed_tokens=np.array([4], np.int32),
              num_scheduled_tokens=np.array([1], np.int32))
    with pytest.raises(InputError) as excinfo:
        prep.prepare(**kw)
    _check_error(excinfo, "block_table")
    assert f"request 0 (row 2) column 0 holds block {bad}" in str(excinfo.value)
    assert "null block" in str(excinfo.value)
    # columns past the request's tokens are not read: a -1 there (an engine's "unused") is fine
    kw["block_table"][2, 0] = 4
    kw["block_table"][2, 4:] = -1
    assert prep.prepare(**kw).slot_mapping.tolist() == [12]


def test_a_computed_length_past_the_table_names_num_computed_tokens():
    kw = _base_kwargs()
    kw["num_computed_tokens"] = np.array([0, 12, 0], np.int32)
    with pytest.raises(InputError) as excinfo:
        _seed_preparer().prepare(**kw)
    _check_error(excinfo, "num_computed_tokens")
    assert "request 1 has 12 computed tokens" in str(excinfo.value)


@pytest.mark.parametrize("strict", [False, True])
def test_tables_the_loops_have_no_variant_for(strict, caplog):
    """A Fortran-ordered, strided, read-only or int16 table: copied (one warning per kind) or,
    strict, refused naming the field and what to pass. Request arrays of any form are fine."""
    prep = _seed_preparer(strict=strict)
    base = _base_kwargs()
    wide = np.zeros((4, 12), np.int32)
    wide[:, ::2] = base["block_table"]
    read_only = base["token_ids"].copy()
    read_only.flags.writeable = False
    for field, value in (("block_table", np.asfortranarray(base["block_table"])),
                         ("block_table", wide[:, ::2]), ("token_ids", read_only),
                         ("block_table", base["block_table"].astype(np.int16))):
        kw = {**base, field: value}
        if strict:
            with pytest.raises(InputError) as excinfo:
                prep.prepare(**kw)
            _check_error(excinfo, field)
            assert "strict" in str(excinfo.value) and f"np.array({field}, dtype=np.int32" in str(excinfo.value)
        else:
            with caplog.at_level("WARNING", logger="graphrt"):
                check_seed_step1(prep.prepare(**kw))
                check_seed_step1(prep.prepare(**kw))
    assert len(caplog.records) == (0 if strict else 4)
    for dtype in (np.int64, np.uint16, np.uint64):       # request arrays: converted, never refused
        kw = {**base, "req_rows": base["req_rows"].astype(dtype),
              "num_computed_tokens": base["num_computed_tokens"][::-1][::-1].astype(dtype)}
        check_seed_step1(prep.prepare(**kw))


# --------------------------------------------------------------------------------------
# Runner bounds, the check / write split, and the two kernels agreeing.
# --------------------------------------------------------------------------------------

def _seed_preparer(**kw) -> InputPreparer:
    return InputPreparer(max_num_reqs=4, max_num_tokens=16, block_size=2, **kw)


@pytest.mark.parametrize("bad_id,expected", [(500, "token id 500 outside the vocabulary [0, 300)"),
                                             (-1, "token id -1 outside the vocabulary")])
def test_vocab_bound(bad_id, expected):
    prep = _seed_preparer(vocab_size=300)
    previous = run_preparer(prep, seed_tables(2), SEED_STEP2)
    previous_copy = previous.copy()
    kw = _base_kwargs()
    kw["token_ids"] = kw["token_ids"].copy()
    kw["token_ids"][2, 3] = bad_id          # request 2's 4th scheduled token
    with pytest.raises(InputError) as excinfo:
        prep.prepare(**kw)
    _check_error(excinfo, "token_ids")
    assert expected in str(excinfo.value) and "request 2, position 3" in str(excinfo.value)
    _assert_same_inputs(previous, previous_copy)
    kw["token_ids"][2, 3] = 299             # the largest id in the vocabulary is fine
    ids = prep.prepare(**kw).input_ids.tolist()
    assert ids[8] == 299


def test_vocab_bound_ignores_unscheduled_positions():
    prep = _seed_preparer(vocab_size=300)
    kw = _base_kwargs()
    kw["token_ids"] = kw["token_ids"].copy()
    kw["token_ids"][0, 11] = 10**6          # past request 0's scheduled tokens
    check_seed_step1(prep.prepare(**kw))


def test_block_bound_covers_the_whole_scheduled_row():
    """A block id past the KV cache anywhere in a scheduled row (attention may read any column
    of a captured graph's static block table) is an error; in an unscheduled row it is not."""
    prep = _seed_preparer(num_blocks=9)
    check_seed_step1(prep.prepare(**_base_kwargs()))
    kw = _base_kwargs()
    kw["block_table"] = kw["block_table"].copy()
    kw["block_table"][3, 5] = 50            # row 3 is not scheduled
    check_seed_step1(prep.prepare(**kw))
    kw["block_table"][1, 5] = 9             # row 1 is, in a column past its tokens
    with pytest.raises(InputError) as excinfo:
        prep.prepare(**kw)
    _check_error(excinfo, "block_table")
    assert "block 9 is outside the KV cache's 9 blocks" in str(excinfo.value)


def test_table_width_bound():
    prep = _seed_preparer(table_width=7)
    with pytest.raises(InputError) as excinfo:
        prep.prepare(**_base_kwargs())
    _check_error(excinfo, "block_table")
    assert "6 columns" in str(excinfo.value) and "configured for 7" in str(excinfo.value)


def test_max_num_tokens_below_max_num_reqs_bounds_decode_steps_too():
    prep = InputPreparer(max_num_reqs=4, max_num_tokens=2, block_size=2)
    with pytest.raises(InputError) as excinfo:
        run_preparer(prep, seed_tables(2), Step([0, 1, 2], [3, 2, 5], [1, 1, 1]))
    _check_error(excinfo, "num_scheduled_tokens")
    assert "max_num_tokens=2" in str(excinfo.value)


def _buffers(max_tokens: int, max_reqs: int, width: int) -> dict[str, np.ndarray]:
    """Staging buffers like a backend's, filled with a sentinel."""
    return {name: np.full((max_reqs, width) if name == "block_table" else
                          (max_reqs + 1 if name == "query_start_loc" else
                           max_reqs if name in ("seq_lens", "num_computed_tokens") else max_tokens,),
                          -77, dtype=graphrt.core.inputs.fields.FIELD_DTYPES[name])
            for name in graphrt.core.inputs.fields.ARRAY_FIELDS}


@SETTINGS
@given(scenarios(), st.integers(0, 9), st.integers(0, 3))
def test_check_then_write_equals_prepare_then_pad(scenario, more_tokens, more_reqs):
    tables, (step,) = scenario
    t, r = sum(step.scheduled), len(step.rows)
    prep = InputPreparer(max_num_reqs=8, max_num_tokens=8 * 48, block_size=tables.block_size)
    expected = graphrt.Padder().pad(run_preparer(prep, tables, step).copy(),
                                    num_tokens=t + more_tokens, num_reqs=r + more_reqs)
    rows, computed, scheduled = step.arrays()
    shape = prep.check(token_ids=tables.token_ids, block_table=tables.block_table, req_rows=rows,
                       num_computed_tokens=computed, num_scheduled_tokens=scheduled)
    assert shape == (t, r, max(step.scheduled), max(c + s for c, s in zip(step.computed, step.scheduled)),
                     max(step.scheduled) == 1)
    out = _buffers(8 * 48 + 9, 8 + 3, tables.block_table.shape[1])
    got = prep.write(num_tokens=t + more_tokens, num_reqs=r + more_reqs, out=out)
    _assert_same_inputs(got, expected)
    assert got.input_ids.base is out["input_ids"] or got.input_ids.base is out["input_ids"].base
    # nothing past the bucket was written
    assert (out["input_ids"][t + more_tokens:] == -77).all()
    assert (out["block_table"][r + more_reqs:] == -77).all()


def test_write_needs_a_successful_check():
    prep = _seed_preparer()
    with pytest.raises(graphrt.GraphrtError, match="check"):
        prep.write(num_tokens=10, num_reqs=3)
    prep.check(**_base_kwargs())
    bad = _base_kwargs()
    _null_block(bad)
    with pytest.raises(InputError):
        prep.check(**bad)
    with pytest.raises(graphrt.GraphrtError, match="check"):   # the failed check cleared it
        prep.write(num_tokens=10, num_reqs=3)


def test_the_preparer_owns_its_padder(host_kernel):
    """``write`` pads with the preparer's own padder (issue 44): ``Padder(kernel=kernel)`` by
    default, or the one it was given, whose fills the padded rows then hold."""
    kernel = host_kernel
    default = _seed_preparer(kernel=kernel)
    assert isinstance(default.padder, graphrt.Padder) and default.padder.kernel == kernel
    padder = graphrt.Padder({"input_ids": 7, "seq_lens": 5}, kernel=kernel)
    prep = _seed_preparer(kernel=kernel, padder=padder)
    assert prep.padder is padder
    prep.check(**_base_kwargs())
    padded = prep.write(num_tokens=14, num_reqs=4)
    assert padded.input_ids[10:].tolist() == [7] * 4 and padded.seq_lens[3] == 5
    default.check(**_base_kwargs())
    padded = default.write(num_tokens=14, num_reqs=4)
    assert padded.input_ids[10:].tolist() == [0] * 4 and padded.seq_lens[3] == 0


def test_write_below_the_real_size_is_an_error():
    prep = _seed_preparer()
    prep.check(**_base_kwargs())
    with pytest.raises(InputError) as excinfo:
        prep.write(num_tokens=9, num_reqs=3)
    _check_error(excinfo, "num_tokens")


@pytest.mark.parametrize("case_id,mutate,field", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_both_kernels_raise_the_same_error(case_id, mutate, field):
    if graphrt.core.inputs.host_kernels.resolve_kernel("auto") != "numba":
        pytest.skip("numba does not import here")
    messages = []
    for kernel in ("numba", "numpy"):
        kw = _base_kwargs()
        mutate(kw)
        with pytest.raises(InputError) as excinfo:
            InputPreparer(max_num_reqs=4, max_num_tokens=16, block_size=2, kernel=kernel).prepare(**kw)
        messages.append(str(excinfo.value))
    assert messages[0] == messages[1]


@SETTINGS
@given(scenarios(), st.data())
def test_both_kernels_agree_on_random_faults(scenario, data):
    """Corrupt one request value or one table entry at random (small values, and the ends of
    int32 / int64 and their neighbours): both kernels give the same result, or the same error."""
    if graphrt.core.inputs.host_kernels.resolve_kernel("auto") != "numba":
        pytest.skip("numba does not import here")
    tables, (step,) = scenario
    rows, computed, scheduled = [a.astype(np.int64) for a in step.arrays()]
    token_ids, block_table = tables.token_ids.copy(), tables.block_table.copy()
    target = data.draw(st.sampled_from(("rows", "computed", "scheduled", "block", "token")))
    i = data.draw(st.integers(0, len(rows) - 1))
    value = data.draw(st.one_of(st.integers(-3, 60), st.sampled_from(EXTREMES)))
    if not -2**31 <= value * 2000 < 2**31:            # the ends of int64 / int32, and around them
        token_ids, block_table = token_ids.astype(np.int64), block_table.astype(np.int64)
    if value in EXTREMES and target == "token":
        value = -(-value // 2000) if value < 0 else value // 2000   # value * 2000 stays in int64
    if target == "rows":
        rows[i] = value
    elif target == "computed":
        computed[i] = value
    elif target == "scheduled":
        scheduled[i] = value
    elif target == "block":
        block_table[data.draw(st.integers(0, block_table.shape[0] - 1)),
                    data.draw(st.integers(0, block_table.shape[1] - 1))] = value
    else:
        token_ids[data.draw(st.integers(0, token_ids.shape[0] - 1)),
                  data.draw(st.integers(0, token_ids.shape[1] - 1))] = value * 2000
    results = []
    for kernel in ("numba", "numpy"):
        prep = InputPreparer(max_num_reqs=8, max_num_tokens=64, block_size=tables.block_size,
                             vocab_size=50_000, num_blocks=400, kernel=kernel)
        try:
            results.append(prep.prepare(token_ids=token_ids, block_table=block_table, req_rows=rows,
                                        num_computed_tokens=computed,
                                        num_scheduled_tokens=scheduled).copy())
        except InputError as err:
            results.append(str(err))
    if isinstance(results[0], str) or isinstance(results[1], str):
        assert results[0] == results[1]
    else:
        _assert_same_inputs(results[0], results[1])


@pytest.mark.parametrize("field,index,value", [
    ("num_computed_tokens", 2, 40),       # past the token table
    ("num_computed_tokens", 0, -1),       # negative
    ("req_rows", 1, 9),                   # outside the tables
    ("num_scheduled_tokens", 1, 0),       # no token
    ("num_scheduled_tokens", 0, 4),       # in bounds, but one token more than the bucket was chosen for
], ids=["past-table", "negative-computed", "row-out-of-range", "zero-scheduled", "more-tokens"])
def test_write_refuses_a_step_changed_since_check(field, index, value):
    """The write indexes the tables by the request arrays (the compiled one without bounds
    checks), so it runs the request check again, on both paths: a caller that edits the arrays
    in between gets an error and the staging buffers stay untouched."""
    prep = _seed_preparer()
    kw = _base_kwargs()
    prep.check(**kw)
    kw[field][index] = value
    out = _buffers(10, 3, kw["block_table"].shape[1])
    before = {name: buf.copy() for name, buf in out.items()}
    with pytest.raises(graphrt.GraphrtError, match="changed between"):
        prep.write(num_tokens=10, num_reqs=3, out=out)
    for name, buf in out.items():
        assert np.array_equal(buf, before[name]), name
    with pytest.raises(graphrt.GraphrtError, match="check"):     # the refused write cleared it
        prep.write(num_tokens=10, num_reqs=3, out=out)
