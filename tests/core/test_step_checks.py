"""One input-check path: the rules of ``core/inputs/host_loops.py``, compiled or interpreted.

* The numpy path has no checks of its own: it runs host_loops' ``check_step`` /
  ``check_requests`` in the interpreter, so numba-less installs check exactly what the
  compiled loops check.
* Interpreted and compiled, the checks give the same report for any step, corrupted ones with
  extreme integers included (the interpreter's integers do not overflow: a compiled check that
  did would disagree); ``prepare_step`` (check and write fused) reports exactly what
  ``check_step`` does, and writes what the numpy oracle writes.
* ``prepare`` writes into a spare set of buffers: a refused step leaves the last result as it
  was, and the next step is still right.
* The compiled loops carry no reference counting (it made them 4x slower).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphrt import InputError, InputPreparer
from graphrt.core.inputs import host_kernels, host_loops
from graphrt.core.inputs.prepare_numpy import NumpyPrepare
from graphrt.core.inputs.step_codes import E_OK
from test_inputs import EXTREMES, assert_matches, ref_for, scenarios
from support.fast_subset import examples

SETTINGS = settings(max_examples=examples(150), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])
MAX_TOKENS, MAX_REQS = 64, 8
FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
          "num_computed_tokens", "block_table", "state_slots")


def needs_numba() -> None:
    if host_kernels.resolve_kernel("auto") != "numba":
        pytest.skip("numba does not import here")


def outputs(width: int) -> list[np.ndarray]:
    """Output buffers of every field, filled with a sentinel."""
    return [np.full(shape, -77, dtype) for shape, dtype in (
        ((MAX_TOKENS,), np.int32), ((MAX_TOKENS,), np.int32), ((MAX_TOKENS,), np.int64),
        ((MAX_REQS + 1,), np.int32), ((MAX_REQS,), np.int32), ((MAX_REQS,), np.int32),
        ((MAX_REQS, width), np.int32), ((MAX_REQS,), np.int32))]


@st.composite
def corrupted_steps(draw):
    """A valid step with at most one value corrupted (small values, and the ends of int32 /
    int64 and their neighbours), its request arrays int32 or int64, its tables int32 or
    int64, and bounds or none: ``(token_ids, block_table, rows, computed, scheduled,
    block_size, vocab_size, num_blocks, state_table, slot_mark)``: the state table empty (a
    model without state) or a permutation of slots, possibly out of range or repeated."""
    tables, (step,) = draw(scenarios())
    token_ids, block_table = tables.token_ids.copy(), tables.block_table.copy()
    requests = [np.array(v, dtype=np.int64) for v in (step.rows, step.computed, step.scheduled)]
    target = draw(st.sampled_from(("none", "rows", "computed", "scheduled", "block", "token", "state")))
    num_rows = token_ids.shape[0]
    stateful = target == "state" or draw(st.booleans())
    num_slots = num_rows + draw(st.integers(0, 3)) if stateful else 0
    states = (np.array(draw(st.permutations(range(num_slots)))[:num_rows], dtype=np.int32) if stateful
              else np.zeros(0, np.int32))
    value = draw(st.one_of(st.integers(-3, 60), st.sampled_from(EXTREMES)))
    if draw(st.booleans()) or not -2**31 <= value * 2000 < 2**31:
        token_ids, block_table = token_ids.astype(np.int64), block_table.astype(np.int64)
    if target in ("rows", "computed", "scheduled"):
        requests[("rows", "computed", "scheduled").index(target)][draw(st.integers(0, len(step.rows) - 1))] = value
    elif target == "block":
        block_table[draw(st.integers(0, block_table.shape[0] - 1)),
                    draw(st.integers(0, block_table.shape[1] - 1))] = value
    elif target == "token":
        widest = (2**63 - 1) // 2000                      # value * 2000 stays in int64
        value = max(-widest, min(value, widest)) * 2000
        token_ids[draw(st.integers(0, token_ids.shape[0] - 1)),
                  draw(st.integers(0, token_ids.shape[1] - 1))] = value
    elif target == "state":
        where = draw(st.integers(0, num_rows - 1))
        states[where] = (max(-2**31, min(value, 2**31 - 1)) if draw(st.booleans())
                         else states[draw(st.integers(0, num_rows - 1))])      # a repeated slot
    if all(-2**31 <= int(v) < 2**31 for arr in requests for v in arr) and draw(st.booleans()):
        requests = [arr.astype(np.int32) for arr in requests]
    vocab_size, num_blocks = draw(st.sampled_from(((50_000, 400), (2**31, 2**31))))
    return (token_ids, block_table, *requests, tables.block_size, vocab_size, num_blocks, states,
            num_slots)


def test_the_numpy_path_runs_the_host_loops_checks(monkeypatch):
    """No second set of checks: the numpy preparer's check(), prepare() and write() go
    through host_loops' own check functions."""
    calls = []
    for name in ("check_step", "check_requests"):
        real = getattr(host_loops, name)
        monkeypatch.setattr(host_loops, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    prep = InputPreparer(max_num_reqs=2, max_num_tokens=8, block_size=2, kernel="numpy")
    step = dict(token_ids=np.arange(12, dtype=np.int32).reshape(2, 6),
                block_table=np.array([[1, 2, 0], [3, 4, 5]], dtype=np.int32),
                req_rows=np.array([1]), num_computed_tokens=np.array([2]), num_scheduled_tokens=np.array([3]))
    assert prep.prepare(**step).input_ids.tolist() == [8, 9, 10]
    prep.check(**step)
    prep.write(num_tokens=4, num_reqs=2)
    assert calls.count("check_step") == 2 and "check_requests" in calls
    with pytest.raises(InputError, match="row 5 out of range"):
        prep.prepare(**{**step, "req_rows": np.array([5])})


@SETTINGS
@given(corrupted_steps())
def test_compiled_and_interpreted_checks_agree(step):
    """One report for any step: host_loops.check_step interpreted, compiled, the compiled
    fused prepare_step and the numpy path's; when the step passes, the compiled prepare
    writes what the numpy oracle writes (and a refused one is refused by every form)."""
    needs_numba()
    token_ids, block_table, rows, computed, scheduled, bs, vocab_size, num_blocks, states, num_slots = step
    arrays = (token_ids, block_table, rows, computed, scheduled, bs, MAX_TOKENS, vocab_size, num_blocks)

    def marks():
        return np.zeros(token_ids.shape[0] + 1, dtype=np.int64), states, np.zeros(num_slots + 1, dtype=np.int64)

    reports = {"interpreted": host_loops.check_step(*arrays, *marks()),
               "compiled": host_kernels.compiled("check_step")(*arrays, *marks())}
    if rows.shape[0] <= MAX_REQS:
        compiled_out, oracle_out = outputs(block_table.shape[1]), outputs(block_table.shape[1])
        reports["prepare_step"] = host_kernels.compiled("prepare_step")(*arrays, *marks(), *compiled_out)
        reports["numpy"] = NumpyPrepare(MAX_TOKENS, MAX_REQS).prepare_step(*arrays, *marks(), *oracle_out)
    report = reports["interpreted"]
    assert all(tuple(r) == tuple(report) for r in reports.values()), reports
    if report[0] == E_OK and "numpy" in reports:
        for name, got, want in zip(FIELDS, compiled_out, oracle_out):
            assert np.array_equal(got, want), name


@SETTINGS
@given(scenarios(num_steps=4), st.lists(st.sampled_from(("ok", "null", "row", "token")), min_size=4,
                                        max_size=4), st.randoms(use_true_random=False))
def test_a_refused_step_leaves_the_last_result(host_kernel, scenario, faults, rnd: random.Random):
    """prepare() writes into the spare of two buffer sets: after any run of steps, some refused,
    the last accepted result is intact and every accepted one is right."""
    tables, steps = scenario
    prep = InputPreparer(max_num_reqs=8, max_num_tokens=8 * 48, block_size=tables.block_size,
                         vocab_size=50_000)
    last = kept = None
    for step, fault in zip(steps, faults):
        rows, computed, scheduled = step.arrays()
        token_ids, block_table = tables.token_ids.copy(), tables.block_table.copy()
        i = rnd.randrange(len(step.rows))
        if fault == "null":
            block_table[step.rows[i], (step.computed[i] + step.scheduled[i] - 1) // tables.block_size] = 0
        elif fault == "row":
            rows[i] = token_ids.shape[0]
        elif fault == "token":
            token_ids[step.rows[i], step.computed[i]] = 50_000
        kw = dict(token_ids=token_ids, block_table=block_table, req_rows=rows,
                  num_computed_tokens=computed, num_scheduled_tokens=scheduled)
        if fault == "ok":
            last = prep.prepare(**kw)
            assert_matches(last, ref_for(tables, step))
            kept = last.copy()
            continue
        with pytest.raises(InputError):
            prep.prepare(**kw)
        if last is not None:
            for name in FIELDS:
                assert np.array_equal(getattr(last, name), getattr(kept, name)), name


def test_the_loops_compile_without_reference_counting():
    """The loops allocate nothing; compiled with numba's reference counting, every helper call
    counted each array argument atomically, per request (4x slower)."""
    needs_numba()
    import numba

    assert host_loops.JIT_OPTIONS["_nrt"] is False
    assert host_loops.JIT_OPTIONS["_nrt"] is False   # the padding loops too: one file
    for name in ("check_step", "prepare_step", "write_checked_step", "fill_padding", "pad_step"):
        assert host_kernels.compiled(name).targetoptions["_nrt"] is False, name
    write = numba.njit(**host_loops.JIT_OPTIONS)(host_loops.write_step)      # uncached: inspectable
    out = outputs(3)
    write(np.ones((2, 6), np.int32), np.ones((2, 3), np.int32), np.array([1], np.int32),
          np.array([2], np.int32), np.array([3], np.int32), 2, *out[:-1])
    assert out[0][:3].tolist() == [1, 1, 1]
    ir = "".join(write.inspect_llvm().values())
    assert "NRT_incref" not in ir and "NRT_decref" not in ir
