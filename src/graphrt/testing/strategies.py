"""Hypothesis strategies for scheduler steps over an engine's persistent tables.

* :func:`steps` -- valid steps within a :class:`~graphrt.GraphConfig`: prefills, chunks, prefix
  hits, decodes (``1 + num_speculative_tokens`` tokens) and mixed batches; rows in any order,
  shared prefix blocks, unused columns holding the null block or stale ids.
* :func:`bad_steps` -- a valid step with one bound broken, and the field the InputError must name.
* :func:`traces` -- a few requests' whole lifetimes, the block table growing as they need blocks.
* :func:`splits` -- a step and a split of its requests' tokens into chunks (or single tokens).

With ``num_state_slots`` every step carries a state-slot table, and with ``extra_inputs`` a seeded
array per declared input; bad steps then also break those. Everything shrinks towards one
request with one token at position 0. Needs ``hypothesis``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
from hypothesis import strategies as st

from graphrt.config import GraphConfig
from graphrt.core import defaults
from graphrt.core.inputs.extra_inputs import ExtraInput
from graphrt.testing.step import BadStep, Split, Step

_I32 = np.int32


def _check_room(config: GraphConfig, num_kv_blocks: int, num_rows: int) -> None:
    need = config.max_num_seqs * config.max_blocks_per_req + 1
    if num_kv_blocks < need:
        raise ValueError(f"num_kv_blocks={num_kv_blocks}: the strategies give every scheduled request "
                         f"its own blocks, so they need max_num_seqs * max_blocks_per_req + 1 = {need}")
    if num_rows < config.max_num_seqs:
        raise ValueError(f"num_rows={num_rows} is below max_num_seqs={config.max_num_seqs}")


def _table(draw: Callable[[Any], Any], config: GraphConfig, num_kv_blocks: int, num_rows: int,
           rows: Sequence[int], computed: Sequence[int], scheduled: Sequence[int],
           rng: np.random.Generator) -> np.ndarray:
    """A block table whose scheduled rows cover their positions with distinct blocks; full
    prefix blocks may be shared with an earlier request (prefix caching); columns past a
    request's need hold the null block or stale ids; unscheduled rows hold stale ids."""
    bs, width = config.block_size, config.max_blocks_per_req
    table = rng.integers(1, num_kv_blocks, size=(num_rows, width)).astype(_I32)   # stale everywhere
    pool = list(draw(st.permutations(range(1, num_kv_blocks))))
    full: list[tuple[int, int]] = []           # (row, full computed blocks) of earlier requests
    for row, c, n in zip(rows, computed, scheduled):
        need = -(-(c + n) // bs)
        for col in range(need):
            donors = [r for r, f in full if f > col] if col < c // bs else []
            if donors and draw(st.booleans()):
                table[row, col] = table[draw(st.sampled_from(donors)), col]
            else:
                table[row, col] = pool.pop()
        if draw(st.sampled_from(("null", "stale"))) == "null":
            table[row, need:] = defaults.NULL_BLOCK
        full.append((row, c // bs))
    return table


def _schedule(draw: Callable[[Any], Any], config: GraphConfig, num_rows: int
              ) -> tuple[list[int], list[int], list[int]]:
    budget, model_len, q = config.max_num_batched_tokens, config.max_model_len, config.decode_query_len
    decode = draw(st.booleans()) and q <= model_len
    r = draw(st.integers(1, min(config.max_num_seqs, budget // q if decode else budget, num_rows)))
    rows = draw(st.lists(st.integers(0, num_rows - 1), min_size=r, max_size=r, unique=True))
    computed, scheduled, left = [], [], budget
    for i in range(r):
        n = q if decode else draw(st.integers(1, min(model_len, left - (r - i - 1))))
        computed.append(draw(st.integers(0, model_len - n)))
        scheduled.append(n)
        left -= n
    return rows, computed, scheduled


def _extras(specs: Mapping[str, ExtraInput] | None, seed: int, num_tokens: int,
            num_reqs: int) -> dict[str, np.ndarray] | None:
    """A seeded array per declared extra input, of its level's rows, shape and dtype."""
    if not specs:
        return None
    rng = np.random.default_rng(seed + 1)
    out = {}
    for name, spec in specs.items():
        shape, dtype = (spec.rows(num_tokens, num_reqs), *spec.shape), np.dtype(spec.dtype)
        if dtype.kind == "f":
            out[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            out[name] = rng.random(shape) < 0.5
        else:
            out[name] = rng.integers(0, 100, size=shape).astype(dtype)
    return out


def _state_table(draw: Callable[[Any], Any], num_rows: int, rows: Sequence[int],
                 num_state_slots: int | None) -> np.ndarray | None:
    """Each table row's state slot: the scheduled rows distinct ones, the other rows the rest
    while they last (then a slot of a scheduled row: a stale entry no check reads)."""
    if not num_state_slots:
        return None
    order = list(draw(st.permutations(range(num_state_slots))))
    table = np.zeros(num_rows, _I32)
    others = [r for r in range(num_rows) if r not in set(rows)]
    for k, row in enumerate(list(rows) + others):
        table[row] = order[k % num_state_slots]
    return table


def _make(draw: Callable[[Any], Any], config: GraphConfig, num_kv_blocks: int, vocab_size: int,
          num_rows: int, rows: Sequence[int], computed: Sequence[int], scheduled: Sequence[int],
          extra_inputs: Mapping[str, ExtraInput] | None = None, num_state_slots: int | None = None) -> Step:
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size, size=(num_rows, config.max_model_len)).astype(_I32)
    table = _table(draw, config, num_kv_blocks, num_rows, rows, computed, scheduled, rng)
    return Step(tokens, table, np.asarray(rows, _I32), np.asarray(computed, _I32),
                np.asarray(scheduled, _I32), config.block_size, seed,
                extra_inputs=_extras(extra_inputs, seed, int(sum(scheduled)), len(rows)),
                state_slots=_state_table(draw, num_rows, rows, num_state_slots))


def steps(config: GraphConfig, *, num_kv_blocks: int, vocab_size: int, num_rows: int | None = None,
          extra_inputs: Mapping[str, ExtraInput] | None = None,
          num_state_slots: int | None = None) -> st.SearchStrategy[Step]:
    """Valid steps for a runner of ``config`` with ``num_kv_blocks`` KV blocks and a model of
    ``vocab_size`` tokens (and the declared ``extra_inputs``; ``num_state_slots`` recurrent-state
    slots), over tables of ``num_rows`` rows (default ``max_num_seqs + 2``)."""
    rows_ = config.max_num_seqs + 2 if num_rows is None else num_rows
    _check_room(config, num_kv_blocks, rows_)

    @st.composite
    def draw_step(draw: Callable[[Any], Any]) -> Step:
        rows, computed, scheduled = _schedule(draw, config, rows_)
        return _make(draw, config, num_kv_blocks, vocab_size, rows_, rows, computed, scheduled, extra_inputs,
                     num_state_slots)

    return draw_step()


def splits(config: GraphConfig, *, num_kv_blocks: int, vocab_size: int, num_rows: int | None = None,
           extra_inputs: Mapping[str, ExtraInput] | None = None,
           num_state_slots: int | None = None) -> st.SearchStrategy[Split]:
    """A step of :func:`steps` and a split of each request's scheduled tokens into chunks: one
    token each half of the time (a ``1 + k`` verification step against ``k + 1`` single steps),
    else up to 4 chunks at drawn cuts. Shrinks towards a single cut. Arguments as for :func:`steps`."""
    base = steps(config, num_kv_blocks=num_kv_blocks, vocab_size=vocab_size, num_rows=num_rows,
                 extra_inputs=extra_inputs, num_state_slots=num_state_slots)

    @st.composite
    def draw_split(draw: Callable[[Any], Any]) -> Split:
        step = draw(base)
        singles = draw(st.booleans())
        pieces = []
        for n in (int(x) for x in step.num_scheduled_tokens):
            if singles or n == 1:
                pieces.append([1] * n)
                continue
            cuts = sorted(draw(st.lists(st.integers(1, n - 1), min_size=1, max_size=3, unique=True)))
            bounds = [0, *cuts, n]
            pieces.append([b - a for a, b in zip(bounds, bounds[1:])])
        return Split(step, pieces)

    return draw_split()


# ---------------------------------------------------------------------------------- bad steps

def _bad(kind: str, field: str, step: Step, *, sampling_rows: int | None = None, **changes: Any) -> BadStep:
    step.overrides.update(changes)
    return BadStep(step, field, kind, sampling_rows)


def _break(draw: Callable[[Any], Any], kind: str, step: Step, config: GraphConfig,
           num_kv_blocks: int, vocab_size: int) -> BadStep:
    """``step`` with the bound ``kind`` broken (the field each check of core/inputs/preparer.py names)."""
    i = draw(st.integers(0, step.num_reqs - 1))
    rows, c, n = step.req_rows.copy(), step.num_computed_tokens.copy(), step.num_scheduled_tokens.copy()
    row, bs = int(rows[i]), step.block_size
    if kind == "row outside the tables":
        rows[i] = draw(st.sampled_from((step.token_ids.shape[0], -1)))
        return _bad(kind, "req_rows", step, req_rows=rows)
    if kind == "row scheduled twice":
        rows[(i + 1) % step.num_reqs] = rows[i]
        return _bad(kind, "req_rows", step, req_rows=rows)
    if kind == "empty batch":
        empty = np.zeros(0, _I32)
        return _bad(kind, "req_rows", step, req_rows=empty, num_computed_tokens=empty, num_scheduled_tokens=empty)
    if kind == "lengths differ":
        field = draw(st.sampled_from(("num_computed_tokens", "num_scheduled_tokens")))
        value = np.append(c, 0) if field == "num_computed_tokens" else np.append(n, 1)
        return _bad(kind, field, step, **{field: value.astype(_I32)})
    if kind == "no token scheduled":
        n[i] = draw(st.integers(-2, 0))
        return _bad(kind, "num_scheduled_tokens", step, num_scheduled_tokens=n)
    if kind == "negative computed tokens":
        c[i] = draw(st.integers(-3, -1))
        return _bad(kind, "num_computed_tokens", step, num_computed_tokens=c)
    if kind == "past the model length":
        if n[i] >= 2 and draw(st.booleans()):     # the scheduled tokens run past the token table
            c[i] = config.max_model_len - int(n[i]) + draw(st.integers(1, int(n[i]) - 1))
            return _bad(kind, "num_scheduled_tokens", step, num_computed_tokens=c)
        c[i] = config.max_model_len + draw(st.integers(0, 2))   # nothing left to schedule
        return _bad(kind, "num_computed_tokens", step, num_computed_tokens=c)
    if kind == "overflowing value":
        field = draw(st.sampled_from(("req_rows", "num_computed_tokens", "num_scheduled_tokens")))
        value = step.kwargs()[field].astype(np.int64)
        value[i] = draw(st.sampled_from((2**31, 2**62, 2**63 - 1)))
        return _bad(kind, field, step, **{field: value})
    if kind == "null block in a column attention reads":
        table = step.block_table.copy()
        table[row, draw(st.integers(0, (int(c[i]) + int(n[i]) - 1) // bs))] = draw(
            st.sampled_from((defaults.NULL_BLOCK, -1)))
        return _bad(kind, "block_table", step, block_table=table)
    if kind == "block id beyond the KV cache":
        table = step.block_table.copy()
        table[row, draw(st.integers(0, table.shape[1] - 1))] = num_kv_blocks + draw(st.integers(0, 3))
        return _bad(kind, "block_table", step, block_table=table)
    if kind == "block table of the wrong width":
        return _bad(kind, "block_table", step, block_table=np.ascontiguousarray(step.block_table[:, :-1]))
    if kind == "tables with different row counts":
        return _bad(kind, "block_table", step, block_table=np.ascontiguousarray(step.block_table[:-1]))
    if kind == "token id outside the vocabulary":
        tokens = step.token_ids.copy()
        tokens[row, draw(st.integers(int(c[i]), int(c[i]) + int(n[i]) - 1))] = draw(
            st.sampled_from((vocab_size, -1)))
        return _bad(kind, "token_ids", step, token_ids=tokens)
    if kind == "non-integer array":
        field = draw(st.sampled_from(("req_rows", "num_computed_tokens", "num_scheduled_tokens")))
        return _bad(kind, field, step, **{field: step.kwargs()[field].astype(np.float32)})
    if kind in EXTRA_KINDS:
        name = draw(st.sampled_from(sorted(step.extra_inputs)))
        arrays = dict(step.extra_inputs)
        arr = arrays[name]
        if kind == "extra input of the wrong shape":
            arrays[name] = np.ascontiguousarray(arr[:-1]) if len(arr) > 1 else np.concatenate([arr, arr])
        elif kind == "extra input of the wrong dtype":
            arrays[name] = arr.astype(np.int64 if arr.dtype.kind in "fb" else np.float32)
        else:
            del arrays[name]
        return _bad(kind, f"extra_inputs[{name!r}]", step, extra_inputs=arrays)
    if kind == "state slot outside the slots":
        slots = step.state_slots.copy()
        past = int(np.max(slots)) + 1 + draw(st.integers(0, 3))     # every slot is in the table: max + 1 is past them
        slots[row] = draw(st.sampled_from((-1, past, 2**31 - 1)))
        return _bad(kind, "state_slots", step, state_slots=slots)
    if kind == "state slot held twice":
        slots = step.state_slots.copy()
        slots[int(rows[(i + 1) % step.num_reqs])] = slots[row]
        return _bad(kind, "state_slots", step, state_slots=slots)
    if kind == "sampling rows differ":
        return _bad(kind, "sampling", step, sampling_rows=step.num_reqs + draw(st.sampled_from((1, -1))))
    raise AssertionError(kind)


#: Every bound :func:`bad_steps` breaks (one per example).
BAD_KINDS = ("row outside the tables", "row scheduled twice", "empty batch", "lengths differ",
             "no token scheduled", "negative computed tokens", "past the model length",
             "overflowing value", "null block in a column attention reads", "block id beyond the KV cache",
             "block table of the wrong width", "tables with different row counts",
             "token id outside the vocabulary", "non-integer array", "sampling rows differ",
             "extra input of the wrong shape", "extra input of the wrong dtype", "extra input missing",
             "state slot outside the slots", "state slot held twice")
#: The kinds that break a declared extra input (drawn only for a model that declares some).
EXTRA_KINDS = ("extra input of the wrong shape", "extra input of the wrong dtype", "extra input missing")
#: The kinds that break a recurrent-state slot (drawn only for a model with recurrent state).
STATE_KINDS = ("state slot outside the slots", "state slot held twice")


def bad_steps(config: GraphConfig, *, num_kv_blocks: int, vocab_size: int, num_rows: int | None = None,
              kinds: Sequence[str] = BAD_KINDS,
              extra_inputs: Mapping[str, ExtraInput] | None = None,
              num_state_slots: int | None = None) -> st.SearchStrategy[BadStep]:
    """Steps that break exactly one bound (one of ``kinds``; the extra-input kinds only where
    ``extra_inputs`` declares some), each with the field its :class:`~graphrt.InputError` must
    name. Arguments as for :func:`steps`."""
    rows_ = config.max_num_seqs + 2 if num_rows is None else num_rows
    _check_room(config, num_kv_blocks, rows_)
    unknown = set(kinds) - set(BAD_KINDS)
    if unknown:
        raise ValueError(f"unknown bad-step kinds {sorted(unknown)}; known: {BAD_KINDS}")

    kinds = [k for k in kinds if (extra_inputs or k not in EXTRA_KINDS) and (num_state_slots or k not in STATE_KINDS)]

    @st.composite
    def draw_bad(draw: Callable[[Any], Any]) -> BadStep:
        kind = draw(st.sampled_from(kinds))
        rows, computed, scheduled = _schedule(draw, config, rows_)
        if kind in ("row scheduled twice", "state slot held twice") and len(rows) < 2:
            rows, computed, scheduled = rows + [(rows[0] + 1) % rows_], computed + [0], scheduled + [1]
            if sum(scheduled) > config.max_num_batched_tokens:
                scheduled[0] -= 1
                if scheduled[0] < 1:          # a one-token budget: no two requests fit
                    kind = "row outside the tables"
                    rows, computed, scheduled = rows[:1], computed[:1], [1]
        step = _make(draw, config, num_kv_blocks, vocab_size, rows_, rows, computed, scheduled, extra_inputs,
                     num_state_slots)
        return _break(draw, kind, step, config, num_kv_blocks, vocab_size)

    return draw_bad()


# -------------------------------------------------------------------------------------- traces

def traces(config: GraphConfig, *, num_kv_blocks: int, vocab_size: int, num_rows: int | None = None,
           max_requests: int = 3, max_decodes: int = 4, prefix_hits: bool = True,
           extra_inputs: Mapping[str, ExtraInput] | None = None,
           num_state_slots: int | None = None) -> st.SearchStrategy[list[Step]]:
    """The steps of up to ``max_requests`` requests' whole lifetimes, in order: each joins with a
    prompt (with ``prefix_hits`` maybe already partly computed), prefills in chunks, then decodes
    up to ``max_decodes`` tokens; blocks are allocated as first needed. Without ``prefix_hits``
    every KV slot a step reads was written by an earlier step."""
    rows_ = config.max_num_seqs + 2 if num_rows is None else num_rows
    _check_room(config, num_kv_blocks, rows_)
    bs, model_len = config.block_size, config.max_model_len

    @st.composite
    def draw_trace(draw: Callable[[Any], Any]) -> list[Step]:
        k = draw(st.integers(1, min(max_requests, config.max_num_seqs)))
        rows = draw(st.lists(st.integers(0, rows_ - 1), min_size=k, max_size=k, unique=True))
        seed = draw(st.integers(0, 2**16))
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, vocab_size, size=(rows_, model_len)).astype(_I32)
        table = np.zeros((rows_, config.max_blocks_per_req), _I32)
        pool = list(draw(st.permutations(range(1, num_kv_blocks))))
        slots = _state_table(draw, rows_, rows, num_state_slots)
        reqs = []
        for row in rows:
            decodes = draw(st.integers(0, max_decodes))
            prompt = draw(st.integers(1, model_len - decodes))
            done = draw(st.integers(0, prompt - 1)) if prefix_hits else 0
            reqs.append(dict(row=row, join=draw(st.integers(0, 2)), done=done,
                             prompt=prompt, end=prompt + decodes,
                             chunk=draw(st.integers(1, config.max_num_batched_tokens))))
        out: list[Step] = []
        t = 0
        while any(q["done"] < q["end"] for q in reqs):
            batch, left = [], config.max_num_batched_tokens
            for q in reqs:
                if q["join"] > t or q["done"] >= q["end"] or left == 0:
                    continue
                n = min(q["chunk"], q["prompt"] - q["done"], left) if q["done"] < q["prompt"] else 1
                for col in range((q["done"] + n - 1) // bs + 1):   # a prefix hit's blocks too
                    if table[q["row"], col] == defaults.NULL_BLOCK:
                        table[q["row"], col] = pool.pop()
                batch.append((q["row"], q["done"], n))
                q["done"] += n
                left -= n
            t += 1
            if batch:
                r, c, n = (np.asarray(v, _I32) for v in zip(*batch))
                out.append(Step(tokens, table.copy(), r, c, n, bs, seed + t,
                                extra_inputs=_extras(extra_inputs, seed + t, int(n.sum()), len(r)),
                                state_slots=slots))
        return out

    return draw_trace()


__all__ = ["BAD_KINDS", "EXTRA_KINDS", "STATE_KINDS", "bad_steps", "splits", "steps", "traces"]
