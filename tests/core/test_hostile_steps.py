"""Hostile steps against the host input checks (issue 15), on both host kernels.

* Extreme integers (int64 min / max, values near 2**31, 2**32, 2**63, negatives) in every
  integer input: an ``InputError`` naming the field, no crash, and through a runner not one
  byte of the KV cache changed. The issue's original repro (a computed length of 2**63 - 1,
  which overflowed the bound checks: a segfault on numba, a foreign KV write on numpy) runs
  on both kernels, refused with the KV cache untouched.
* Block ids checked in every column a step's attention reads, computed ones included.
* Strict mode covers the host kernels: after warm-up, a step with another array dtype or
  layout runs without compiling, or raises ``InputError`` saying what to pass.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import graphrt
from graphrt import InputError, InputPreparer, ModelRunner
from graphrt.core.inputs import host_kernels
from support.runner_steps import LIMITS, VOCAB, bits, greedy
from support.fast_subset import examples

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
#: The integers an adversary tries first: the ends of every integer type and their neighbours.
EXTREMES = sorted({v for base in (0, 2**31, 2**32, 2**62, 2**63) for sign in (1, -1)
                   for d in (-1, 0, 1) for v in (sign * base + d,) if INT64_MIN <= v <= INT64_MAX}
                  | {INT64_MIN, INT64_MAX, -100_000})
INTEGERS = st.one_of(st.sampled_from(EXTREMES), st.integers(INT64_MIN, INT64_MAX))
REQUEST_FIELDS = ("req_rows", "num_computed_tokens", "num_scheduled_tokens")
FIELDS = REQUEST_FIELDS + ("token_ids", "block_table", "block_size")

#: The preparer-level step: four table rows of 12 tokens, block size 2, six columns.
ROWS, COMPUTED, SCHEDULED = [0, 1, 2], [3, 2, 5], [1, 1, 3]
MODEL_LEN, BLOCK_SIZE, NUM_BLOCKS, VOCAB_SIZE = 12, 2, 9, 500


def preparer_tables() -> tuple[np.ndarray, np.ndarray]:
    token_ids = np.array([[100 * r + j for j in range(MODEL_LEN)] for r in range(4)], dtype=np.int32)
    table = np.zeros((4, 6), dtype=np.int32)
    table[0, :2], table[1, :2], table[2, :4] = [1, 2], [3, 7], [4, 5, 6, 8]
    return token_ids, table


def dtype_for(value: int, data) -> type:
    """An integer dtype that holds ``value`` (drawn: narrow, int64, or unsigned)."""
    choices = [np.int64]
    if INT32_MIN <= value <= INT32_MAX:
        choices.append(np.int32)
    if 0 <= value <= 2**64 - 1:
        choices.append(np.uint64)
    return data.draw(st.sampled_from(choices))


def plant(field: str, value: int, data) -> tuple[dict, int | None]:
    """The valid step with ``value`` planted in ``field`` (a request array's entry, or a table
    entry that the step reads); returns the step's arguments and the block size to pass."""
    token_ids, table = preparer_tables()
    kw = dict(token_ids=token_ids, block_table=table,
              req_rows=np.array(ROWS, dtype=np.int32), num_computed_tokens=np.array(COMPUTED, dtype=np.int32),
              num_scheduled_tokens=np.array(SCHEDULED, dtype=np.int32))
    block_size = None
    if field in REQUEST_FIELDS:
        arr = kw[field].astype(dtype_for(value, data))
        arr[data.draw(st.integers(0, 2))] = value
        kw[field] = arr
    elif field == "token_ids":
        arr = token_ids.astype(np.int32 if INT32_MIN <= value <= INT32_MAX else np.int64)
        i = data.draw(st.integers(0, 2))                       # a scheduled position of request i
        arr[ROWS[i], COMPUTED[i] + data.draw(st.integers(0, SCHEDULED[i] - 1))] = value
        kw[field] = arr
    elif field == "block_table":
        arr = table.astype(np.int32 if INT32_MIN <= value <= INT32_MAX else np.int64)
        i = data.draw(st.integers(0, 2))                       # a column the request's attention reads
        used = -(-(COMPUTED[i] + SCHEDULED[i]) // BLOCK_SIZE)
        arr[ROWS[i], data.draw(st.integers(0, used - 1))] = value
        kw[field] = arr
    else:
        block_size = value
    return kw, block_size


def is_valid(field: str, value: int, bounded: bool) -> bool:
    """Whether ``value`` planted in ``field`` may still make a valid step (not hostile, skipped)."""
    if field == "req_rows":
        return 0 <= value <= 3                # a row of the table (maybe the one it replaces)
    if field == "num_computed_tokens":
        return 0 <= value <= MODEL_LEN
    if field == "num_scheduled_tokens":
        return 1 <= value <= MODEL_LEN
    if field == "token_ids":
        return 0 <= value < (VOCAB_SIZE if bounded else 2**31)
    if field == "block_table":
        return 1 <= value < (NUM_BLOCKS if bounded else 2**31)
    return 1 <= value <= INT32_MAX            # block_size


@pytest.fixture(scope="module", params=("bounded", "unbounded"))
def bounds(request, host_kernel) -> dict:
    """A runner's bounds (vocabulary, KV cache), or none (then the int32 outputs bound ids)."""
    return dict(vocab_size=VOCAB_SIZE, num_blocks=NUM_BLOCKS) if request.param == "bounded" else {}


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=INTEGERS, data=st.data())
def test_extreme_integers_raise_an_input_error_naming_the_field(bounds, field, value, data):
    assume(not is_valid(field, value, bool(bounds)))
    prep = InputPreparer(max_num_reqs=4, max_num_tokens=16, block_size=BLOCK_SIZE, **bounds)
    token_ids, table = preparer_tables()
    previous = prep.prepare(token_ids=token_ids, block_table=table, req_rows=np.array([0, 1]),
                            num_computed_tokens=np.array([0, 0]), num_scheduled_tokens=np.array([3, 2]))
    kept = previous.copy()
    kw, block_size = plant(field, value, data)
    snap = {k: v.copy() for k, v in kw.items()}
    for call in ("prepare", "check"):
        with pytest.raises(InputError) as err:
            getattr(prep, call)(**kw, block_size=block_size)
        assert err.value.field == field, f"{call}: {err.value}"
        assert str(value) in str(err.value), str(err.value)
    for k, v in kw.items():
        assert v.dtype == snap[k].dtype and np.array_equal(v, snap[k]), k
    for name in graphrt.core.inputs.fields.ARRAY_FIELDS:
        assert np.array_equal(getattr(previous, name), getattr(kept, name)), name
    if field not in ("token_ids", "block_table") or not bounds:     # the allocating convenience too
        with pytest.raises(InputError) as err:
            graphrt.prepare_inputs(**kw, block_size=BLOCK_SIZE if block_size is None else block_size)
        assert err.value.field == field, str(err.value)


def test_prepare_inputs_sizes_its_buffers_from_the_table_not_the_schedule():
    """A schedule of 2**40 tokens is an InputError, not a 4 TiB allocation."""
    token_ids, table = preparer_tables()
    with pytest.raises(InputError) as err:
        graphrt.prepare_inputs(token_ids=token_ids, block_table=table, req_rows=[0, 1],
                               num_computed_tokens=[0, 0], num_scheduled_tokens=[2**40, 2**40],
                               block_size=BLOCK_SIZE)
    assert err.value.field == "num_scheduled_tokens"


# ---- through a runner: not one byte of the KV cache changes ---------------------------------

def make_runner(model_dir, tables, backend: str = "cpu", **kw) -> ModelRunner:
    extra = dict(cudagraph_capture_sizes=[16], mode="FULL") if backend == "cpu" else \
        dict(precompile_token_paddings=[8, 32], precompile_bs_paddings=[1, 8], warmup=False)
    return ModelRunner(model_dir, backend=backend, num_kv_blocks=tables.num_kv_blocks, progress=False,
                       **LIMITS, **{**extra, **kw})


def kv_bytes(runner) -> np.ndarray:
    """The KV cache's bits, as a host array (torch or jax)."""
    kv = runner.executor.kv_cache
    if hasattr(kv, "float"):       # torch
        return bits(kv).cpu().numpy().copy()
    return np.asarray(kv).view(np.uint8).copy()


def fill_kv(runner) -> None:
    import torch

    kv = runner.executor.kv_cache
    kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(3), dtype=kv.dtype))


@pytest.fixture(scope="module")
def runner(model_dir, tables, host_kernel):
    r = make_runner(model_dir, tables)
    fill_kv(r)
    return r


@settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS[:-1]), value=INTEGERS, data=st.data())
def test_extreme_integers_through_the_runner_touch_no_kv_byte(runner, tables, field, value, data):
    rows, computed, scheduled = [0, 1, 2], [5, 0, 7], [1, 4, 2]
    kw = dict(token_ids=tables.token_ids, block_table=tables.block_table,
              req_rows=np.array(rows, np.int32), num_computed_tokens=np.array(computed, np.int32),
              num_scheduled_tokens=np.array(scheduled, np.int32))
    i = data.draw(st.integers(0, 2))
    if field in REQUEST_FIELDS:
        assume(not 0 <= value <= 64)          # rows 0..7, lengths up to max_model_len: maybe valid
        kw[field] = kw[field].astype(dtype_for(value, data))
        kw[field][i] = value
    else:
        bound = VOCAB if field == "token_ids" else runner.num_kv_blocks
        assume(not (field == "token_ids" and 0 <= value < bound or field == "block_table" and 1 <= value < bound))
        arr = kw[field].astype(np.int32 if INT32_MIN <= value <= INT32_MAX else np.int64)
        if field == "token_ids":
            arr[rows[i], computed[i] + data.draw(st.integers(0, scheduled[i] - 1))] = value
        else:
            used = -(-(computed[i] + scheduled[i]) // tables.block_size)
            arr[rows[i], data.draw(st.integers(0, used - 1))] = value
        kw[field] = arr
    before = kv_bytes(runner)
    with pytest.raises(InputError) as err:
        runner.execute(**kw, sampling=greedy(3))
    assert err.value.field == field, str(err.value)
    assert np.array_equal(kv_bytes(runner), before)


def test_the_issue_repro_is_refused_with_the_kv_untouched(runner, tables):
    """num_computed_tokens = 2**63 - 1 through ModelRunner.execute: issue 15's repro, a segfault
    under numba. In process, with both kernels: the property tests above drive the same path
    with every extreme integer, so a crash here would crash them too."""
    before = kv_bytes(runner)
    with pytest.raises(InputError) as err:
        runner.execute(token_ids=tables.token_ids, block_table=tables.block_table, req_rows=[0],
                       num_computed_tokens=np.array([2**63 - 1]), num_scheduled_tokens=[1])
    assert err.value.field == "num_computed_tokens"
    assert np.array_equal(kv_bytes(runner), before)


# ---- block ids in every column attention reads ------------------------------------------------

@pytest.mark.parametrize("backend,kernel", [("cpu", "numba"), ("cpu", "numpy"), ("xla", None)])
def test_a_bad_block_in_a_computed_column_is_caught_before_the_kv_write(model_dir, tables, backend, kernel):
    """Prefill row 0 with 8 tokens (two blocks), break block column 0, decode the row: the
    decode's attention would read column 0, so the step is refused with nothing written."""
    if backend == "xla":
        pytest.importorskip("jax")
    if kernel == "numba" and host_kernels.resolve_kernel("auto") != "numba":
        pytest.skip("numba does not import here")
    runner = make_runner(model_dir, tables, backend, host_kernel=kernel)
    runner.execute(token_ids=tables.token_ids, block_table=tables.block_table, req_rows=np.array([0], np.int32),
                   num_computed_tokens=np.array([0], np.int32), num_scheduled_tokens=np.array([8], np.int32))
    for bad in (-1, 0, -100_000):
        blocks = tables.block_table.copy()
        blocks[0, 0] = bad
        before = kv_bytes(runner)
        with pytest.raises(InputError) as err:
            runner.execute(token_ids=tables.token_ids, block_table=blocks, req_rows=np.array([0], np.int32),
                           num_computed_tokens=np.array([8], np.int32),
                           num_scheduled_tokens=np.array([1], np.int32))
        assert err.value.field == "block_table"
        assert f"row 0) column 0 holds block {bad}" in str(err.value), str(err.value)
        assert np.array_equal(kv_bytes(runner), before)
    # the same decode with the row intact runs
    runner.execute(token_ids=tables.token_ids, block_table=tables.block_table, req_rows=np.array([0], np.int32),
                   num_computed_tokens=np.array([8], np.int32), num_scheduled_tokens=np.array([1], np.int32))


# ---- strict mode covers the host kernels --------------------------------------------------------

def _strided(a: np.ndarray) -> np.ndarray:
    wide = np.zeros((a.shape[0], 2 * a.shape[1]), dtype=a.dtype)
    wide[:, ::2] = a
    return wide[:, ::2]


def _read_only(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


#: name -> (how the step's arrays change, whether strict mode runs it without compiling;
#: otherwise it raises an InputError naming this field).
VARIANTS = {
    "int64 token table": (lambda kw: kw.update(token_ids=kw["token_ids"].astype(np.int64)), None),
    "int64 block table": (lambda kw: kw.update(block_table=kw["block_table"].astype(np.int64)), None),
    "int64 tables": (lambda kw: kw.update(token_ids=kw["token_ids"].astype(np.int64),
                                          block_table=kw["block_table"].astype(np.int64)), None),
    "int64 req_rows, int32 counts": (lambda kw: kw.update(req_rows=kw["req_rows"].astype(np.int64)), None),
    "int64 request arrays": (lambda kw: kw.update(**{k: kw[k].astype(np.int64) for k in REQUEST_FIELDS}), None),
    "uint16 counts": (lambda kw: kw.update(num_scheduled_tokens=kw["num_scheduled_tokens"].astype(np.uint16)), None),
    "strided req_rows": (lambda kw: kw.update(req_rows=np.repeat(kw["req_rows"], 2)[::2]), None),
    "read-only req_rows": (lambda kw: kw.update(req_rows=_read_only(kw["req_rows"])), None),
    "python lists": (lambda kw: kw.update(**{k: kw[k].tolist() for k in REQUEST_FIELDS}), None),
    "fortran block table": (lambda kw: kw.update(block_table=np.asfortranarray(kw["block_table"])), "block_table"),
    "strided block table": (lambda kw: kw.update(block_table=_strided(kw["block_table"])), "block_table"),
    "strided token table": (lambda kw: kw.update(token_ids=_strided(kw["token_ids"])), "token_ids"),
    "read-only token table": (lambda kw: kw.update(token_ids=_read_only(kw["token_ids"])), "token_ids"),
    "int16 block table": (lambda kw: kw.update(block_table=kw["block_table"].astype(np.int16)), "block_table"),
}


def numba_signatures() -> int:
    """Compiled specializations of every host loop so far."""
    loops = host_kernels.compiled_loops()
    assert {"check_step", "write_checked_step", "fill_padding"} <= set(loops), "the runner's loops were never compiled"
    return sum(len(loop.signatures) for loop in loops.values())


@pytest.fixture(scope="module")
def strict_pair(model_dir, tables):
    if host_kernels.resolve_kernel("auto") != "numba":
        pytest.skip("numba does not import here")
    return {strict: make_runner(model_dir, tables, strict=strict, host_kernel="numba")
            for strict in (True, False)}


def _good_step(tables) -> dict:
    return dict(token_ids=tables.token_ids, block_table=tables.block_table,
                req_rows=np.array([0, 1, 2], np.int32), num_computed_tokens=np.array([0, 0, 0], np.int32),
                num_scheduled_tokens=np.array([3, 2, 4], np.int32))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_strict_mode_never_compiles_a_host_kernel(strict_pair, tables, name):
    mutate, refused = VARIANTS[name]
    runner = strict_pair[True]
    expected = runner.execute(**_good_step(tables), sampling=greedy(3)).copy()
    kw = _good_step(tables)
    mutate(kw)
    compiled = numba_signatures()
    if refused is None:
        np.testing.assert_array_equal(runner.execute(**kw, sampling=greedy(3)), expected)
    else:
        with pytest.raises(InputError) as err:
            runner.execute(**kw, sampling=greedy(3))
        assert err.value.field == refused
        assert "strict" in str(err.value) and "pass " in str(err.value), str(err.value)
    assert numba_signatures() == compiled, "a host loop compiled after warm-up"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_non_strict_mode_runs_every_variant(strict_pair, tables, name, caplog):
    mutate, refused = VARIANTS[name]
    runner = strict_pair[False]
    expected = runner.execute(**_good_step(tables), sampling=greedy(3)).copy()
    kw = _good_step(tables)
    mutate(kw)
    compiled = numba_signatures()
    with caplog.at_level(logging.WARNING, logger="graphrt"):
        for _ in range(2):
            np.testing.assert_array_equal(runner.execute(**kw, sampling=greedy(3)), expected)
    assert numba_signatures() == compiled, "converted inputs compiled a host loop"
    warned = [r for r in caplog.records if refused is not None and refused in r.getMessage()]
    assert len(warned) <= 1                          # once per preparer and reason, not per step
