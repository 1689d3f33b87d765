"""Block tables wider than the configured width (``max_model_len / block_size``): accepted, the
extra columns ignored by the outputs and checked like the rest (their block ids bounded by the
KV cache), and a request that needs more columns than the configured width refused even when
the wider table would hold it (what the device attends over is the configured width).

The property: a wider table gives exactly the outputs (or the error) of the same table
trimmed to the configured width, on both host kernels, through ``prepare`` and through a
runner's ``check`` + ``write`` into config-width staging buffers. Then end to end: a cpu
runner's tokens and logits with a wider table equal the trimmed table's.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphrt
from graphrt import InputError, InputPreparer, ModelInputs
from graphrt.core.inputs.fields import ARRAY_FIELDS, FIELD_DTYPES, buffer_shapes
from support.fast_subset import examples

#: The preparer's tests run on both host kernels (numba and numpy); see conftest.py.
both_kernels = pytest.mark.usefixtures("host_kernel")

SETTINGS = settings(max_examples=examples(120), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MAX_REQS, MAX_TOKENS, VOCAB = 6, 6 * 48, 1000


def _same(a: ModelInputs, b: ModelInputs) -> None:
    for name in ARRAY_FIELDS:
        got, want = getattr(a, name), getattr(b, name)
        assert got.shape == want.shape and np.array_equal(got, want), name
    for name in ("num_reqs", "num_tokens", "max_query_len", "max_seq_len", "uniform_decode"):
        assert getattr(a, name) == getattr(b, name), name


@st.composite
def wide_steps(draw):
    """(token_ids, trimmed block table, wider block table, rows, computed, scheduled, block
    size, num_blocks): the configured width is the trimmed table's. The token table may be
    wider than that width covers, so some requests need more columns than it has."""
    bs = draw(st.sampled_from((1, 2, 3, 4, 8)))
    model_len = draw(st.integers(1, 40))
    width = -(-model_len // bs)
    token_width = model_len + draw(st.integers(0, 2 * bs))
    extra = draw(st.integers(1, 3))
    num_rows = draw(st.integers(1, MAX_REQS))
    rows = draw(st.permutations(range(num_rows)))[:draw(st.integers(1, num_rows))]
    computed, scheduled = [], []
    for _ in rows:
        c = draw(st.integers(0, token_width - 1))
        computed.append(c)
        scheduled.append(draw(st.integers(1, min(token_width - c, 48))))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    full = np.zeros((num_rows, width + extra), np.int32)
    ids = list(range(1, num_rows * (width + extra) + 1))
    rng.shuffle(ids)
    for row, c, n in zip(rows, computed, scheduled):
        need = min(-(-(c + n) // bs), width + extra)
        full[row, :need] = [ids.pop() for _ in range(need)]
    num_blocks = num_rows * (width + extra) + 1 + draw(st.integers(0, 5))
    # The extra columns past what a request needs: anything a valid table may hold there
    # (unallocated 0, stale ids, negative fillers).
    for row in range(num_rows):
        for col in range(width, width + extra):
            if full[row, col] == 0 and draw(st.booleans()):
                full[row, col] = draw(st.integers(-2, num_blocks - 1))
    fault = draw(st.sampled_from(("none", "none", "extra_past_cache", "null_block", "token")))
    if fault == "extra_past_cache":
        full[rng.randrange(num_rows), width + rng.randrange(extra)] = num_blocks + rng.randrange(3)
    elif fault == "null_block":
        full[rows[0], 0] = 0
    token_ids = np.array([[rng.randrange(VOCAB) for _ in range(token_width)] for _ in range(num_rows)],
                         np.int32).reshape(num_rows, token_width)
    if fault == "token":
        token_ids[rows[-1], computed[-1]] = VOCAB
    arrays = [np.array(v, np.int32) for v in (rows, computed, scheduled)]
    dtype = draw(st.sampled_from((np.int32, np.int64)))
    return (token_ids, np.ascontiguousarray(full[:, :width]).astype(dtype), full.astype(dtype),
            *arrays, bs, num_blocks)


def _preparer(bs: int, width: int, num_blocks: int) -> InputPreparer:
    return InputPreparer(max_num_reqs=MAX_REQS, max_num_tokens=MAX_TOKENS, block_size=bs,
                         vocab_size=VOCAB, num_blocks=num_blocks, table_width=width)


def _outcome(run):
    try:
        return run().copy()
    except InputError as err:
        return err


def _staging(width: int) -> dict[str, np.ndarray]:
    return {name: np.full(shape, -77, FIELD_DTYPES[name])
            for name, shape in buffer_shapes(MAX_TOKENS + 4, MAX_REQS + 2, width).items()}


@both_kernels
@SETTINGS
@given(wide_steps(), st.integers(0, 4), st.integers(0, 2))
def test_a_wider_table_gives_the_trimmed_tables_outputs(step, more_tokens, more_reqs):
    token_ids, trimmed, wide, rows, computed, scheduled, bs, num_blocks = step
    width = trimmed.shape[1]
    past_cache = bool(set(np.nonzero((wide[:, width:] >= num_blocks).any(axis=1))[0]) & set(rows.tolist()))
    kw = dict(token_ids=token_ids, req_rows=rows, num_computed_tokens=computed, num_scheduled_tokens=scheduled)
    results = {}
    for name, table in (("trimmed", trimmed), ("wide", wide)):
        prep = _preparer(bs, width, num_blocks)
        prepared = _outcome(lambda: prep.prepare(block_table=table, **kw))

        def check_write():
            shape = prep.check(block_table=table, **kw)
            return prep.write(num_tokens=shape.num_tokens + more_tokens,
                              num_reqs=shape.num_reqs + more_reqs, out=_staging(width))

        results[name] = (prepared, _outcome(check_write))
    for (trim, wide_result) in zip(results["trimmed"], results["wide"]):
        if past_cache and not isinstance(trim, InputError):
            # A block id past the KV cache in an extra column of a scheduled row: refused.
            assert isinstance(wide_result, InputError) and wide_result.field == "block_table"
            assert "outside the KV cache" in str(wide_result)
        elif isinstance(trim, InputError):
            assert isinstance(wide_result, InputError), "the wider table let a bad step through"
            assert wide_result.field == trim.field, (str(trim), str(wide_result))
        else:
            assert not isinstance(wide_result, InputError), str(wide_result)
            assert wide_result.block_table.shape[1] == width
            _same(wide_result, trim)


def _seed(width_extra: int = 1, **kw) -> tuple[InputPreparer, dict]:
    """Block size 2, max_model_len 8 (configured width 4), three requests."""
    token_ids = np.arange(4 * 10, dtype=np.int32).reshape(4, 10)
    table = np.arange(1, 4 * (4 + width_extra) + 1, dtype=np.int32).reshape(4, 4 + width_extra)
    prep = InputPreparer(max_num_reqs=4, max_num_tokens=16, block_size=2, table_width=4, **kw)
    return prep, dict(token_ids=token_ids, block_table=table, req_rows=np.array([0, 1, 2], np.int32),
                      num_computed_tokens=np.array([0, 2, 7], np.int32),
                      num_scheduled_tokens=np.array([3, 2, 1], np.int32))


@both_kernels
def test_one_column_wider_is_accepted_and_the_extra_column_ignored():
    prep, kw = _seed()
    got = prep.prepare(**kw).copy()
    assert got.block_table.shape == (3, 4)
    assert np.array_equal(got.block_table, kw["block_table"][:3, :4])
    trimmed = {**kw, "block_table": np.ascontiguousarray(kw["block_table"][:, :4])}
    _same(got, _seed()[0].prepare(**trimmed))


@both_kernels
def test_extra_columns_are_bounded_by_the_kv_cache():
    prep, kw = _seed(num_blocks=17)
    kw["block_table"] = np.minimum(kw["block_table"], 16)
    prep.prepare(**kw)
    kw["block_table"][1, 4] = 17                  # row 1 is scheduled; column 4 is an extra one
    with pytest.raises(InputError, match=r"block 17 is outside the KV cache's 17 blocks .*column 4"):
        prep.prepare(**kw)
    with pytest.raises(InputError, match="block 17"):
        prep.check(**kw)


@both_kernels
def test_a_request_past_the_configured_width_is_refused_though_the_table_holds_it():
    """Request 2 reaches 9 tokens: 5 blocks of 2, one past the 4 columns the device reads
    (max_model_len 8), though the 5-column table and the 10-token table would hold it."""
    prep, kw = _seed()
    kw["num_scheduled_tokens"] = np.array([3, 2, 2], np.int32)
    for call in (prep.prepare, prep.check):
        with pytest.raises(InputError, match="request 2 needs 5 blocks of 2 tokens") as excinfo:
            call(**kw)
        assert excinfo.value.field == "block_table" and "first 4 columns" in str(excinfo.value)


@both_kernels
def test_a_narrower_table_is_still_refused():
    prep, kw = _seed(width_extra=-1)
    with pytest.raises(InputError, match="3 columns; this preparer was configured for 4"):
        prep.prepare(**kw)


# ---- end to end: a cpu runner ----------------------------------------------------------

def test_cpu_runner_gives_the_trimmed_tables_tokens(model_dir, tables):
    import torch

    from support.runner_steps import LIMITS, greedy

    runner = graphrt.ModelRunner(model_dir, backend="cpu", num_kv_blocks=tables.num_kv_blocks, progress=False,
                                 cudagraph_capture_sizes=[4, 8], mode="FULL", **LIMITS)
    extra = np.random.default_rng(1).integers(0, tables.num_kv_blocks, size=(tables.block_table.shape[0], 2))
    wide = np.ascontiguousarray(np.concatenate([tables.block_table, extra.astype(np.int32)], axis=1))
    steps = [([0, 1], [0, 0], [3, 2]), ([0, 1, 2], [3, 2, 0], [1, 1, 4]), ([0, 1, 2], [4, 3, 4], [1, 1, 1])]
    seen = []
    for table in (tables.block_table, wide):
        runner.executor.kv_cache.copy_(torch.randn(runner.executor.kv_cache.shape,
                                                   generator=torch.Generator().manual_seed(0)))
        out = []
        for rows, computed, scheduled in steps:
            step = tables.step(rows, computed, scheduled)
            tokens = runner.execute(**{**step.kwargs(), "block_table": table}, sampling=greedy(len(rows)))
            out.append((tokens.copy(), runner.outputs.logits()))
        seen.append(out)
    for (tok_a, log_a), (tok_b, log_b) in zip(*seen):
        assert np.array_equal(tok_a, tok_b) and np.array_equal(log_a, log_b)
    assert runner.stats.misses == 0
