"""Padding: every field grown to a bucket with safe fill values, the real prefix untouched.

Inputs come from ``prepare_inputs`` over valid steps drawn by ``graphrt.testing``'s ``steps``
strategy; targets are any sizes at or above the real ones.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphrt import ConfigError, GraphConfig, InputError, ModelInputs, Padder, prepare_inputs
from graphrt.core import defaults
from graphrt.core.inputs.fields import ARRAY_FIELDS, REQUEST_FIELDS, TOKEN_FIELDS, buffer_shapes
from graphrt.testing.strategies import steps
from support.fast_subset import examples

#: Every test here runs on both host kernels (numba and numpy); see conftest.py.
pytestmark = pytest.mark.usefixtures("host_kernel")

SETTINGS = settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = {"input_ids": np.int32, "positions": np.int32, "slot_mapping": np.int64,
          "query_start_loc": np.int32, "seq_lens": np.int32, "num_computed_tokens": np.int32,
          "block_table": np.int32, "state_slots": np.int32}
SCALARS = ("num_reqs", "num_tokens", "max_query_len", "max_seq_len", "uniform_decode")


# --------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------

@st.composite
def prepared(draw) -> ModelInputs:
    """``prepare_inputs`` over a step the kit's ``steps`` strategy draws (any mix of prefill,
    chunks, prefix hits and decodes over a shared, stale or null-tailed block table) for a
    drawn config, its block table sometimes wider than the model length needs."""
    block_size = draw(st.sampled_from((1, 2, 4, 5, 16)))
    max_num_seqs = draw(st.integers(1, 8))
    config = GraphConfig.create(max_num_seqs=max_num_seqs, block_size=block_size,
                                max_model_len=draw(st.integers(1, 40)),
                                max_num_batched_tokens=draw(st.integers(max_num_seqs, 8 * 40)))
    blocks = config.max_num_seqs * config.max_blocks_per_req + 1 + draw(st.integers(0, 20))
    step = draw(steps(config, num_kv_blocks=blocks, vocab_size=1000))
    table = np.pad(step.block_table, ((0, 0), (0, draw(st.integers(0, 2)))))
    rows = table.shape[0]
    state = {}
    if draw(st.booleans()):          # a model with recurrent state: any distinct slot per row
        slots = rows + draw(st.integers(0, 4))
        state = dict(state_slots=np.array(draw(st.permutations(range(slots)))[:rows]), num_state_slots=slots)
    return prepare_inputs(**{**step.kwargs(), "block_table": table}, block_size=block_size, **state)


@st.composite
def padded_case(draw):
    """(inputs, target tokens, target requests)."""
    inputs = draw(prepared())
    t = inputs.num_tokens + draw(st.integers(0, 24))
    r = inputs.num_reqs + draw(st.integers(0, 6))
    return inputs, t, r


def persistent_padder(**kw) -> Padder:
    return Padder(max_num_tokens=8 * 40 + 24, max_num_reqs=8 + 6, **kw)


# --------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------

def check_padded(orig: ModelInputs, out: ModelInputs, t: int, r: int,
                 fills: dict[str, int] | None = None) -> None:
    fills = dict(defaults.PAD_FILL_VALUES, **(fills or {}))
    n, q = orig.num_tokens, orig.num_reqs
    # shapes and dtypes
    for name in ARRAY_FIELDS:
        assert getattr(out, name).dtype == DTYPES[name], name
    for name in TOKEN_FIELDS:
        assert getattr(out, name).shape == (t,), name
    assert out.query_start_loc.shape == (r + 1,)
    assert out.seq_lens.shape == out.num_computed_tokens.shape == (r,)
    assert out.block_table.shape == (r, orig.block_table.shape[1])
    assert (out.padded_num_tokens, out.padded_num_reqs) == (t, r)
    # real counts and scalars stay real
    for name in SCALARS:
        assert getattr(out, name) == getattr(orig, name), name
    # real prefix unchanged
    for name in TOKEN_FIELDS:
        assert np.array_equal(getattr(out, name)[:n], getattr(orig, name)[:n]), name
    for name in REQUEST_FIELDS:
        assert np.array_equal(getattr(out, name)[:q], getattr(orig, name)[:q]), name
    assert np.array_equal(out.query_start_loc[:q + 1], orig.query_start_loc[:q + 1])
    # token fills
    for name in TOKEN_FIELDS:
        assert (getattr(out, name)[n:] == fills[name]).all(), name
    # request fills
    assert (out.seq_lens[q:] == fills["seq_lens"]).all()
    assert (out.num_computed_tokens[q:] == fills["num_computed_tokens"]).all()
    assert (out.block_table[q:] == fills["block_table"]).all()
    # state isolation: padded requests hold no live slot, real ones exactly theirs
    assert (out.state_slots[q:] == fills["state_slots"]).all() and (out.state_slots[q:] < 0).all()
    live = out.state_slots[:q]
    assert (live >= 0).all() or (live == -1).all()
    assert len(set(live[live >= 0].tolist())) == int((live >= 0).sum())
    # query_start_loc: non-decreasing, repeats its last real value; padded requests own no tokens
    qsl = out.query_start_loc
    assert (np.diff(qsl) >= 0).all()
    assert (qsl[q:] == qsl[q]).all() and qsl[-1] == n
    assert (np.diff(qsl)[q:] == 0).all()
    assert np.array_equal(out.logits_indices, orig.logits_indices)
    # KV isolation: only real tokens own real slots, and they own exactly the original ones
    writes = np.flatnonzero(out.slot_mapping >= 0)
    assert (writes < n).all()
    assert (out.slot_mapping[n:] < 0).all()
    assert sorted(out.slot_mapping[writes].tolist()) == sorted(orig.slot_mapping[:n].tolist())


def snapshot(x: ModelInputs) -> ModelInputs:
    return x.copy()


def same(a: ModelInputs, b: ModelInputs) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) and getattr(a, f).dtype == getattr(b, f).dtype
               for f in ARRAY_FIELDS) and all(getattr(a, s) == getattr(b, s) for s in SCALARS)


# --------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------

@SETTINGS
@given(padded_case())
def test_padding_rules(case):
    inputs, t, r = case
    before = snapshot(inputs)
    out = Padder().pad(inputs, num_tokens=t, num_reqs=r)
    check_padded(inputs, out, t, r)
    assert same(inputs, before), "pad must not modify its input"


@SETTINGS
@given(padded_case())
def test_padding_to_the_real_size_is_the_identity(case):
    inputs, _, _ = case
    out = Padder().pad(inputs, num_tokens=inputs.num_tokens, num_reqs=inputs.num_reqs)
    assert same(out, inputs)


@SETTINGS
@given(padded_case(), st.booleans())
def test_padding_is_idempotent(case, persistent):
    inputs, t, r = case
    padder = persistent_padder() if persistent else Padder()
    once = padder.pad(inputs, num_tokens=t, num_reqs=r).copy()
    twice = padder.pad(once, num_tokens=t, num_reqs=r)
    assert same(twice, once)


@SETTINGS
@given(padded_case(), st.integers(0, 10), st.integers(0, 3), st.booleans())
def test_padding_composes(case, more_tokens, more_reqs, persistent):
    """Padding a padded step further equals padding the original to the larger target."""
    inputs, t, r = case
    padder = persistent_padder() if persistent else Padder()
    direct = Padder().pad(inputs, num_tokens=t + more_tokens, num_reqs=r + more_reqs)
    step = padder.pad(inputs, num_tokens=t, num_reqs=r)
    again = padder.pad(step, num_tokens=t + more_tokens, num_reqs=r + more_reqs)
    assert same(again, direct)


@SETTINGS
@given(padded_case(), padded_case())
def test_persistent_padder_matches_and_leaves_nothing_stale(first, second):
    """Larger step, then smaller step, then larger again: equal to the allocating Padder."""
    big, small = sorted((first, second), key=lambda c: (c[1], c[2]), reverse=True)
    padder = persistent_padder()
    results = []
    for inputs, t, r in (big, small, big):
        out = padder.pad(inputs, num_tokens=t, num_reqs=r)
        expected = Padder().pad(inputs, num_tokens=t, num_reqs=r)
        assert same(out, expected)
        check_padded(inputs, out, t, r)
        results.append(out)
    # results are views of the same persistent buffers (no allocation per step)
    if big[0].block_table.shape[1] == small[0].block_table.shape[1]:
        assert np.shares_memory(results[0].input_ids, results[1].input_ids)
        assert np.shares_memory(results[0].block_table, results[1].block_table)


def test_persistent_padder_grows_past_its_limits():
    inputs = _seed_inputs()
    padder = Padder(max_num_tokens=4, max_num_reqs=1)
    out = padder.pad(inputs, num_tokens=16, num_reqs=5)
    check_padded(inputs, out, 16, 5)
    small = padder.pad(inputs, num_tokens=10, num_reqs=3)
    check_padded(inputs, small, 10, 3)


@SETTINGS
@given(padded_case(),
       st.fixed_dictionaries({}, optional={
           "input_ids": st.integers(0, 100), "positions": st.integers(0, 100),
           "slot_mapping": st.integers(-100, -1), "seq_lens": st.integers(0, 5),
           "num_computed_tokens": st.integers(0, 5), "block_table": st.integers(0, 3)}))
def test_fill_value_overrides(case, fills):
    inputs, t, r = case
    padder = Padder(fills)
    assert padder.fill_values == dict(defaults.PAD_FILL_VALUES, **fills)
    out = padder.pad(inputs, num_tokens=t, num_reqs=r)
    check_padded(inputs, out, t, r, fills)
    assert defaults.PAD_FILL_VALUES["slot_mapping"] == -1, "overrides must not leak into defaults"


# --------------------------------------------------------------------------------------
# Examples and errors
# --------------------------------------------------------------------------------------

def _seed_inputs() -> ModelInputs:
    """Seed 001, step 1."""
    token_ids = np.array([[100 * r + j for j in range(12)] for r in range(4)], dtype=np.int32)
    table = np.zeros((4, 6), dtype=np.int32)
    table[0, :2], table[1, :1], table[2, :3] = [1, 2], [3], [4, 5, 6]
    return prepare_inputs(token_ids=token_ids, block_table=table, req_rows=np.array([0, 1, 2]),
                          num_computed_tokens=np.array([0, 0, 0]),
                          num_scheduled_tokens=np.array([3, 2, 5]), block_size=2)


def test_seed_example_padded_to_a_bucket():
    out = Padder().pad(_seed_inputs(), num_tokens=16, num_reqs=4)
    assert out.input_ids.tolist() == [0, 1, 2, 100, 101, 200, 201, 202, 203, 204] + [0] * 6
    assert out.positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4] + [0] * 6
    assert out.slot_mapping.tolist() == [2, 3, 4, 6, 7, 8, 9, 10, 11, 12] + [-1] * 6
    assert out.query_start_loc.tolist() == [0, 3, 5, 10, 10]
    assert out.seq_lens.tolist() == [3, 2, 5, 0]
    assert out.num_computed_tokens.tolist() == [0, 0, 0, 0]
    assert out.block_table.tolist()[3] == [0] * 6
    assert (out.num_tokens, out.num_reqs) == (10, 3)
    assert (out.padded_num_tokens, out.padded_num_reqs) == (16, 4)


@pytest.mark.parametrize("fills", [{"bogus": 0}, {"query_start_loc": 0}, {"slot_map": -1}])
def test_unknown_fill_field_is_a_config_error(fills):
    with pytest.raises(ConfigError) as excinfo:
        Padder(fills)
    assert repr(next(iter(fills))) in str(excinfo.value)


@pytest.mark.parametrize("slot_fill", [0, 1, 12345])
def test_non_negative_slot_fill_is_a_config_error(slot_fill):
    with pytest.raises(ConfigError) as excinfo:
        Padder({"slot_mapping": slot_fill})
    assert "slot_mapping" in str(excinfo.value)


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("target,field", [((9, 3), "num_tokens"), ((10, 2), "num_reqs"),
                                          ((0, 0), "num_tokens")])
def test_target_below_real_is_an_input_error(persistent, target, field):
    inputs = _seed_inputs()
    before = inputs.copy()
    padder = Padder(max_num_tokens=16, max_num_reqs=4) if persistent else Padder()
    previous = padder.pad(inputs, num_tokens=16, num_reqs=4)
    previous_copy = previous.copy()
    with pytest.raises(InputError) as excinfo:
        padder.pad(inputs, num_tokens=target[0], num_reqs=target[1])
    assert excinfo.value.field == field
    assert field in str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)
    assert same(inputs, before)
    assert same(previous, previous_copy)


# --------------------------------------------------------------------------------------
# The tables both implementations read
# --------------------------------------------------------------------------------------

def test_buffer_shapes_hold_every_padded_step():
    """One shape table for the padder's buffers and a backend's staging buffers: T per token
    field, R + 1 for query_start_loc, R per request field, block-table rows W wide."""
    shapes = buffer_shapes(24, 5, 7)
    assert list(shapes) == list(ARRAY_FIELDS)
    assert all(shapes[name] == (24,) for name in TOKEN_FIELDS)
    assert shapes["query_start_loc"] == (6,)
    assert shapes["seq_lens"] == shapes["num_computed_tokens"] == (5,)
    assert shapes["block_table"] == (5, 7)
    out = {name: np.zeros(shape, dtype=DTYPES[name]) for name, shape in shapes.items()}
    inputs = _seed_inputs()
    for t, r in ((10, 3), (16, 4), (24, 5)):
        padded = Padder().pad(inputs, num_tokens=t, num_reqs=r)
        assert {name: getattr(padded, name).shape for name in ARRAY_FIELDS} == buffer_shapes(t, r, 6)
    padded = Padder().pad(_seed_inputs(), num_tokens=24, num_reqs=5,
                          out=dict(out, block_table=np.zeros((5, 6), dtype=np.int32)))
    check_padded(inputs, padded, 24, 5)


def test_one_rule_table_for_both_implementations():
    """Padder.rules is the one table: a fill for every field of defaults (overrides applied),
    query_start_loc repeating its last row; the compiled loops get the same rows."""
    padder = Padder({"input_ids": 7})
    assert list(padder.rules) == list(ARRAY_FIELDS)
    for name, rule in padder.rules.items():
        if name == "query_start_loc":
            assert rule.repeat_last and defaults.QUERY_START_LOC_FILL == "repeat_last"
        else:
            assert not rule.repeat_last and rule.fill == padder.fill_values[name]
    assert padder.rules["input_ids"].fill == 7
    assert padder.kernel_rules.tolist() == [[*rule.level, rule.fill, int(rule.repeat_last)]
                                           for rule in padder.rules.values()]
