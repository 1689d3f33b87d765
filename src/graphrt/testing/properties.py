"""The properties every backend, model and attention kernel under graphrt must have.

Each is ``property(factory, example)``: a runner factory (:mod:`graphrt.testing.runners`) and a
:class:`~graphrt.testing.step.Step` (or what its strategy draws); it raises an ``AssertionError``
saying what broke. Every example starts from the same runner history (a scrub step, then seeded
KV), so a stateful backend fails the same way when hypothesis shrinks it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from graphrt.core.dispatch import BatchDescriptor
from graphrt.core.errors import InputError
from graphrt.core.graph_modes import RuntimeMode
from graphrt.testing import access
from graphrt.testing.history import check_reproducible, history_cause
from graphrt.testing.runners import (Outputs, Planted, built_entry, can_run_unpadded, covering_keys, greedy,
                                     replay_at, restore, run_at, run_runner)
from graphrt.testing.step import BadStep, Split, Step
from graphrt.testing.checks import (checkpoints, close, close_rows, finite, same_shape, same_tokens,
                                    scrub, start, state_entries)

Factory = Callable[..., Any]


def blames_history(prop: Callable[[Factory, Any], None]) -> Callable[[Factory, Any], None]:
    """``prop``, whose failure first asks whether the example's step differs from itself
    (:func:`graphrt.testing.history.history_cause`): if it does, that is the cause the error
    leads with, and what ``prop`` saw follows, rather than blaming padding, NaN or a batchmate
    for a value a layer carried over from an earlier forward."""
    @functools.wraps(prop)
    def checked(factory: Factory, example: Any) -> None:
        try:
            prop(factory, example)
        except AssertionError as exc:
            cause = history_cause(factory, example)
            if cause is None:
                raise
            seen = str(exc).strip().splitlines()[0]
            raise AssertionError(f"{cause}\n  ({prop.__name__} saw it as: {seen})") from None
    return checked


# ------------------------------------------------------------------------------- properties

@blames_history
def padding_invisible(factory: Factory, step: Step) -> None:
    """Run by the runner, by the graph of every covering bucket (eagerly at the padded shape
    where none was built) and, with an eager path, unpadded: the same greedy tokens; logits,
    real hidden rows and real-slot KV within ``graphrt.tolerance``."""
    runner, planted = start(factory, step)
    got = [run_runner(runner, step)]
    eager = can_run_unpadded(runner)
    runs: list[tuple[Callable[..., Outputs], BatchDescriptor | None]] = [(run_at, None)] if eager else []
    shapes = set()
    for key in covering_keys(runner, step):
        if built_entry(runner, key) is not None:
            runs.append((replay_at, key))
            continue
        shape = (key.num_tokens, key.num_reqs or step.num_reqs, key.uniform_decode and not eager)
        if shape not in shapes:        # run eagerly, keys of one padded shape are one run
            shapes.add(shape)
            runs.append((run_at, key))
    for run, key in runs:
        restore(runner, planted)
        got.append(run(runner, step, key))
    ref = got[1] if len(got) > 1 else got[0]
    slots = step.write_slots()
    written = state_entries(step, runner, "writes")
    for out in got:
        what = f"padding is visible: {out.how} against {ref.how}"
        if out.tokens is not None:
            same_tokens(runner, out.tokens, ref.logits, what)
        same_tokens(runner, out.logits.argmax(-1), ref.logits, what)
        close(runner, out.logits, ref.logits, f"{what}: logits")
        close(runner, out.hidden, ref.hidden, f"{what}: hidden rows of the real tokens")
        close(runner, out.kv[:, :, slots], ref.kv[:, :, slots], f"{what}: KV written at the real slots")
        if out.state is not None:         # a state sums a request's tokens' products: a reordered sum
            close_rows(runner, out.state[written], ref.state[written], f"{what}: recurrent states written")


@blames_history
def kv_isolated(factory: Factory, step: Step) -> None:
    """With NaN in every KV slot the step does not read and in those it writes: the step changes
    no KV byte outside its real slots (the trash row aside), writes every real slot, computes
    only finite rows (padded included), and real outputs equal a run with numbers there.
    Checked on the runner's path and at its largest covering buckets."""
    runner, both = start(factory, step, nan_unused=True)
    planted = both.kv
    clean = np.nan_to_num(planted, nan=0.0)
    clean_state = None if both.state is None else np.nan_to_num(both.state, nan=0.0)
    keys = covering_keys(runner, step)
    chosen: list[BatchDescriptor | None] = [None]
    if keys:
        chosen.append(max(keys, key=lambda k: (k.num_tokens, k.num_reqs or 0)))
        chosen.append(max(keys, key=lambda k: (k.num_reqs or 0, k.num_tokens)))
    allowed = np.zeros(planted.shape[2], dtype=bool)
    allowed[step.write_slots()] = True
    allowed[-1] = True                                   # the trash row padded tokens write
    for key in dict.fromkeys(chosen):
        runs = []
        for values in (planted, clean):
            access.set_kv(runner, values)
            if both.state is not None:          # NaN where the step reads no state, or zeros there
                access.set_state(runner, both.state if values is planted else clean_state)
            before = access.kv_bits(runner)
            out = run_runner(runner, step) if key is None else run_at(runner, step, key)
            after = access.kv_bits(runner)
            touched = (before != after).reshape(*before.shape[:3], int(np.prod(before.shape[3:])))
            foreign = np.flatnonzero(touched.any(axis=(0, 1, 3)) & ~allowed)
            if foreign.size:
                raise AssertionError(f"KV isolation: {out.how} wrote KV slots {foreign.tolist()[:8]} outside the "
                                     f"step's real slots {sorted(step.write_slots().tolist())} and the trash row "
                                     f"{planted.shape[2] - 1}")
            written = np.flatnonzero(touched.any(axis=(0, 1, 3)))
            if values is planted:               # NaN planted in states too: which NaN reached the rows
                _finite_or_blame(runner, step, key, out, both)
            else:
                finite(out, step)
            broken = written[~np.isfinite(out.kv[:, :, written]).all(axis=(0, 1, 3, 4))]
            if broken.size:
                raise AssertionError(f"KV isolation: {out.how} wrote non-finite K/V into slots {broken.tolist()[:8]} "
                                     f"(the trash row is {planted.shape[2] - 1})")
            if values is planted and planted.shape[0]:   # NaN was there: a real token's store changes it
                                                         # (no attention layer: no KV to store)
                unwritten = np.setdiff1d(step.write_slots(), written)
                if unwritten.size:
                    raise AssertionError(f"KV isolation: {out.how} did not write the real slots "
                                         f"{unwritten.tolist()[:8]} of the step's tokens")
            runs.append(out)
        nan_run, clean_run = runs
        what = (f"with NaN in the KV slots it does not read, the step's real outputs differ from a run with "
                f"numbers there ({nan_run.how})")
        same_shape(runner, nan_run.logits, clean_run.logits, f"{what}: logits")
        same_shape(runner, nan_run.hidden, clean_run.hidden, f"{what}: hidden rows")


@blames_history
def replay_matches_eager(factory: Factory, step: Step) -> None:
    """The runner's replay equals the step run eagerly at the same padded shape: logits, real
    hidden rows and the whole KV bit for bit on a CPU (within tolerance on a GPU). N/A without
    an eager path (XLA)."""
    runner, planted = start(factory, step)
    if not can_run_unpadded(runner):
        return
    replay = run_runner(runner, step)
    restore(runner, planted)
    eager = run_at(runner, step, runner.last_step.key)
    what = f"replay differs from eager at the same shape: {replay.how} against {eager.how}"
    same_shape(runner, replay.logits, eager.logits, f"{what}: logits")
    same_shape(runner, replay.hidden, eager.hidden, f"{what}: hidden rows")
    same_shape(runner, replay.kv, eager.kv, f"{what}: KV cache")
    if replay.state is not None:                  # the trash slot aside: padding's alone
        same_shape(runner, replay.state[:-1], eager.state[:-1], f"{what}: recurrent states")


def no_build_after_warmup(factory: Factory, step: Step) -> None:
    """A step the bucket policy covers runs a graph / executable built during warm-up: no
    capture or compile, no miss, no failed build, and not eager where the runner has graphs."""
    runner, _ = start(factory, step)
    fwd, smp = runner.stats, runner.sampler_stats
    before = (access.build_count(runner), fwd.misses, fwd.unplanned_builds, fwd.failed_builds, fwd.entries,
              smp.misses, smp.unplanned_builds, smp.entries)
    run_runner(runner, step)
    info = runner.last_step
    after = (access.build_count(runner), fwd.misses, fwd.unplanned_builds, fwd.failed_builds, fwd.entries,
             smp.misses, smp.unplanned_builds, smp.entries)
    names = ("captures/compiles", "misses", "unplanned builds", "failed builds", "entries",
             "sampler misses", "sampler unplanned builds", "sampler entries")
    grew = [f"{n} {b} -> {a}" for n, b, a in zip(names, before, after) if a != b]
    why = f" (it ran eagerly: {info.eager_reason})" if info.eager_reason else ""
    if grew:
        raise AssertionError(f"built after warm-up for {info.mode.value} {info.key}: {', '.join(grew)}{why}")
    if runner.executor.capabilities.has_graphs and runner.dispatcher.keys() and covering_keys(runner, step) \
            and info.mode is RuntimeMode.NONE:
        raise AssertionError(f"a covered step ran eagerly: {info.eager_reason}")


def bad_input_rejected(factory: Factory, bad: BadStep) -> None:
    """A step breaking one bound raises :class:`~graphrt.InputError` naming the field (and
    ``bad.message``) and changes nothing: KV, staging and static buffers, outputs, sampler state.
    It carries a greedy batch (``bad.sampling_rows`` rows, else one per request)."""
    runner = factory()
    scrub(runner)
    before = access.device_state(runner)
    step = bad.step
    rows = bad.sampling_rows
    if rows is None:
        rows = int(np.asarray(step.kwargs()["req_rows"]).shape[0]) or None
    sampling = greedy(rows, runner.vocab_size) if rows is not None else None
    try:
        runner.execute(**step.kwargs(), sampling=sampling)
    except InputError as err:
        if err.field != bad.field:
            raise AssertionError(f"{bad.kind}: InputError names {err.field!r}, expected {bad.field!r}: {err}")
        if bad.message is not None and bad.message not in str(err):
            raise AssertionError(f"{bad.kind}: InputError does not say {bad.message!r}: {err}")
    except Exception as err:  # noqa: BLE001 - any other exception is the finding
        raise AssertionError(f"{bad.kind}: raised {type(err).__name__} instead of an InputError naming "
                             f"{bad.field!r}: {err}") from err
    else:
        raise AssertionError(f"{bad.kind}: accepted; expected an InputError naming {bad.field!r}")
    moved = access.changed(before, access.device_state(runner))
    if moved:
        raise AssertionError(f"{bad.kind}: rejected, but it changed {moved}")


def addresses_stable(factory: Factory, step: Step) -> None:
    """Every buffer a captured graph reads stays at its address across replays (torch
    backends; XLA has no static device buffers: it returns at once, the suite reports N/A)."""
    runner, _ = start(factory, step)
    first = access.addresses(runner)
    if first is None:
        return
    run_runner(runner, step)
    run_runner(runner, step)
    now = access.addresses(runner)
    moved = sorted(k for k in first if now.get(k) != first[k])
    if moved:
        raise AssertionError(f"static buffers moved between replays: {moved}")
    info = runner.last_step
    entry = runner.cache.lookup((info.mode, info.key)) if info.mode is not RuntimeMode.NONE else None
    recorded = getattr(entry, "input_ptrs", None) or {}
    stale = sorted(k for k, p in recorded.items() if k in now and now[k] != p)
    if stale:
        raise AssertionError(f"{info.mode.value} {info.key} was captured reading {stale} at other addresses")


@blames_history
def lifetime_matches_reference(factory: Factory, trace: list[Step]) -> None:
    """Requests' whole lifetimes through the runner equal the same steps run unpadded (or at the
    smallest covering bucket without an eager path): same greedy tokens, logits within tolerance;
    with recurrent state, within ``graphrt.reduction_tolerance`` of each row's magnitude (rounding
    carries across steps, and the recurrence may take another form at another shape)."""
    if not trace:
        return
    runner, planted = start(factory, trace[0])
    got = [run_runner(runner, step) for step in trace]
    restore(runner, planted)
    eager = can_run_unpadded(runner)
    for i, (step, out) in enumerate(zip(trace, got)):
        ref = run_at(runner, step, None if eager else covering_keys(runner, step)[0])
        what = f"step {i} of {len(trace)} of the lifetime: {out.how} against {ref.how}"
        same_tokens(runner, out.tokens, ref.logits, what)
        if planted.state is None:
            close(runner, out.logits, ref.logits, f"{what}: logits")
            continue
        close_rows(runner, out.logits, ref.logits, f"{what}: logits by request")


def replay_deterministic(factory: Factory, step: Step) -> None:
    """The same step, on the same KV and states, run twice with a step of another shape before
    each run, gives the same logits, hidden rows, KV and states (bit for bit on a CPU): on the
    runner's path and, with an eager path, eagerly at its own shape (where a layer's Python code
    runs every step). Catches a value a layer carries from one forward to the next."""
    runner, planted = start(factory, step)
    check_reproducible(runner, step, planted, run_runner, "by the runner")
    if can_run_unpadded(runner):
        check_reproducible(runner, step, planted, lambda r, s: run_at(r, s, None), "eagerly")


def _rows_of(step: Step, rounds: list[Step]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per round: for each of its tokens the row of the same token in the whole ``step``, and
    for each of its requests the request's index in ``step`` (whose last round it may be)."""
    starts = np.concatenate(([0], np.cumsum(step.num_scheduled_tokens)))
    row_of = {int(r): i for i, r in enumerate(step.req_rows)}
    done = [0] * step.num_reqs
    out = []
    for rnd in rounds:
        rows, reqs = [], []
        for row, n in zip(rnd.req_rows, rnd.num_scheduled_tokens):
            i = row_of[int(row)]
            rows.append(np.arange(starts[i] + done[i], starts[i] + done[i] + int(n)))
            done[i] += int(n)
            reqs.append(i)
        out.append((np.concatenate(rows), np.array(reqs)))
    return out


@blames_history
def chunking_invariant(factory: Factory, split: Split) -> None:
    """The step's tokens run in the split's chunks (``1 + k`` verification tokens as ``k + 1``
    single steps, a prefill in pieces) give what the whole step gives: each request's greedy
    token and last logits, every token's hidden row, the KV written at its slots and the
    recurrent states it leaves (its ring's entries of the last positions) -- within
    ``graphrt.tolerance`` of the model's dtype, row by row within ``graphrt.reduction_tolerance``
    of each row's magnitude for a model with recurrent state (a state's sum runs in another
    order). Catches a checkpoint ring written in the wrong order, a convolution window not
    shifted, a state read from the wrong entry: bugs every single step hides."""
    step = split.step
    rounds = split.rounds()
    if len(rounds) < 2:
        return
    runner, planted = start(factory, step)
    whole = run_runner(runner, step)
    restore(runner, planted)
    parts = [run_runner(runner, rnd) for rnd in rounds]
    compare = close_rows if planted.state is not None else close
    sizes = "; ".join(f"request {i}: {p}" for i, p in enumerate(split.pieces) if len(p) > 1)
    what = f"the step's tokens in chunks ({sizes}) differ from the whole step ({whole.how})"
    hidden = np.empty_like(whole.hidden)
    logits = np.empty_like(whole.logits)
    tokens = np.empty_like(whole.tokens)
    for out, (rows, reqs) in zip(parts, _rows_of(step, rounds)):
        hidden[rows] = out.hidden
        logits[reqs] = out.logits
        tokens[reqs] = out.tokens
    same_tokens(runner, tokens, whole.logits, what)
    compare(runner, logits, whole.logits, f"{what}: last logits of each request")
    compare(runner, hidden, whole.hidden, f"{what}: hidden rows")
    slots = step.write_slots()
    kv = parts[-1].kv
    if kv.shape[0]:
        rows_kv = np.moveaxis(kv[:, :, slots], 2, 0).reshape(len(slots), -1)
        want_kv = np.moveaxis(whole.kv[:, :, slots], 2, 0).reshape(len(slots), -1)
        compare(runner, rows_kv, want_kv, f"{what}: KV written at the step's slots")
    if planted.state is not None:
        written = state_entries(step, runner, "writes")
        entries = sorted(step.state_writes(checkpoints(runner)))
        close_rows(runner, parts[-1].state[written], whole.state[written],
                   f"{what}: recurrent states of the last positions (ring entries {entries})")


def _state_reads_blamed(runner: Any, step: Step, out: Outputs, rows_bad: np.ndarray, writes_bad: set[int]) -> str:
    """Which requests read state they must not, from the rows (``rows_bad``: padded hidden rows)
    and written states' requests (``writes_bad``) that came out non-finite."""
    c, t, r = checkpoints(runner), step.num_tokens, step.num_reqs
    owner = np.repeat(np.arange(r), np.asarray(step.num_scheduled_tokens, np.int64))
    reqs = set(owner[np.flatnonzero(rows_bad[:t])].tolist()) | writes_bad
    reqs |= set(np.flatnonzero(~np.isfinite(out.logits).all(axis=-1)).tolist())
    parts = []
    for i in sorted(reqs):
        row, computed = int(step.req_rows[i]), int(step.num_computed_tokens[i])
        slot = int(step.state_slots[row]) if step.state_slots is not None else row
        if computed == 0:
            parts.append(f"request {i} (slot {slot}) is new, 0 computed tokens: it must start from zeros, not read "
                         f"its slot's stale entries")
        else:
            parts.append(f"request {i} (slot {slot}, {computed} computed tokens) must read only checkpoint "
                         f"{(computed - 1) % c} of its slot, the state after its last computed token")
    if rows_bad[t:].any() or not np.isfinite(out.padded_logits[r:]).all():
        parts.append("padded rows must read no slot (they start from zeros)")
    return "; ".join(parts) or "no request's rows came out non-finite, but what it wrote did"


def _non_finite(out: Outputs, writes: tuple[np.ndarray, np.ndarray] | None) -> bool:
    bad = not (np.isfinite(out.padded_hidden).all() and np.isfinite(out.padded_logits).all())
    return bad or (writes is not None and out.state is not None and not np.isfinite(out.state[writes]).all())


def _finite_or_blame(runner: Any, step: Step, key: BatchDescriptor | None, out: Outputs, planted: Planted) -> None:
    """:func:`~graphrt.testing.checks.finite`, for a run with NaN planted in every KV slot and
    state entry the step does not read. Where NaN reached a row or a written state, the step runs
    again with numbers in those state entries (the KV as it was) to say what happened: a state
    entry the step must write and did not (it still holds what was planted), or one it read and
    must not (named per request) -- before blaming the rows."""
    writes = state_entries(step, runner, "writes") if planted.state is not None else None
    if planted.state is None or not np.isnan(planted.state).any() or not _non_finite(out, writes):
        finite(out, step)
        return
    numbers = planted.state.copy()
    nan = np.isnan(numbers)
    numbers[nan] = 0.5 * np.random.default_rng(step.seed + 13).standard_normal(int(nan.sum())).astype(np.float32)
    access.set_kv(runner, planted.kv)
    access.set_state(runner, numbers)
    before = access.state_bits(runner)
    again = run_runner(runner, step) if key is None else run_at(runner, step, key)
    touched = (before != access.state_bits(runner)).any(axis=2)
    c = checkpoints(runner)
    unwritten = [(int(a), int(b)) for a, b in zip(*writes) if not touched[a, b]]
    if unwritten:
        raise AssertionError(f"state isolation: {out.how} did not write its state entries (slot, checkpoint) "
                             f"{unwritten[:8]}: each request writes the state after each of its last "
                             f"min(scheduled, {c}) positions p at checkpoint p % {c} of its own slot (docs/hybrid.md)")
    if not _non_finite(again, writes):
        rows_bad = ~np.isfinite(out.padded_hidden).all(axis=-1)
        bad_writes = np.flatnonzero(~np.isfinite(out.state[writes]).all(axis=-1))
        slot_req = {} if step.state_slots is None else {int(step.state_slots[int(row)]): i
                                                        for i, row in enumerate(step.req_rows)}
        reqs = {slot_req[int(writes[0][i])] for i in bad_writes if int(writes[0][i]) in slot_req}
        what = f"hidden rows {np.flatnonzero(rows_bad).tolist()}" if rows_bad.any() else "states written"
        raise AssertionError(f"state isolation: {out.how} read recurrent state it must not: NaN was planted in "
                             f"every state entry the step does not read, and its {what} came out non-finite "
                             f"(finite with numbers there): {_state_reads_blamed(runner, step, out, rows_bad, reqs)}")
    finite(out, step)


def _confined_run(runner: Any, step: Step, key: BatchDescriptor | None, planted: Planted) -> Outputs:
    """Run ``step`` (the runner's path, or eagerly at ``key``) over the ``planted`` states and KV;
    raise unless only real requests' entries and the trash slot changed, every one of those
    written, finite, and rows are finite."""
    state, kv = planted.state, planted.kv
    c = checkpoints(runner)
    trash = state.shape[0] - 1
    writes = state_entries(step, runner, "writes")
    allowed = np.zeros(state.shape[:2], dtype=bool)
    allowed[writes] = True
    allowed[trash] = True
    access.set_kv(runner, kv)
    access.set_state(runner, state)
    before = access.state_bits(runner)
    out = run_runner(runner, step) if key is None else run_at(runner, step, key)
    touched = (before != access.state_bits(runner)).any(axis=2)
    foreign = np.argwhere(touched & ~allowed)
    if foreign.size:
        raise AssertionError(f"state isolation: {out.how} changed state entries (slot, checkpoint) "
                             f"{[tuple(x) for x in foreign.tolist()[:8]]} outside the step's own "
                             f"{sorted(step.state_writes(c))} and the trash slot {trash}")
    _finite_or_blame(runner, step, key, out, planted)
    bad = np.flatnonzero(~np.isfinite(out.state[writes]).all(axis=-1))
    if bad.size:
        raise AssertionError(f"state isolation: {out.how} wrote non-finite states into "
                             f"{[(int(writes[0][i]), int(writes[1][i])) for i in bad][:8]}")
    return out


def state_writes_confined(factory: Factory, step: Step) -> None:
    """:func:`state_isolated`'s first check alone, one run on the runner's path; the state sweep
    (:mod:`graphrt.testing.state_sweep`) checks it on thousands of steps."""
    runner, both = start(factory, step, nan_unused=True)
    if both.state is not None:
        _confined_run(runner, step, None, both)


@blames_history
def state_isolated(factory: Factory, step: Step) -> None:
    """A hybrid model's recurrent states: with NaN in every entry the step does not read, it
    changes no state byte but its real requests' entries and the trash slot, writes those finite,
    computes only finite rows, and real outputs equal a run with zeros there -- on the runner's
    path and at its largest covering buckets. And request 0's outputs and states do not change
    when every other request's tokens and states are replaced (bit for bit on a CPU). Without
    recurrent state: nothing to check."""
    runner, both = start(factory, step, nan_unused=True)
    if both.state is None:
        return
    c = checkpoints(runner)
    writes = state_entries(step, runner, "writes")
    clean_state, clean_kv = np.nan_to_num(both.state, nan=0.0), np.nan_to_num(both.kv, nan=0.0)
    keys = covering_keys(runner, step)
    chosen: list[BatchDescriptor | None] = [None]
    if keys:
        chosen.append(max(keys, key=lambda k: (k.num_tokens, k.num_reqs or 0)))
    for key in dict.fromkeys(chosen):
        runs = [_confined_run(runner, step, key, planted)
                for planted in (both, Planted(clean_kv, clean_state))]
        nan_run, clean_run = runs
        what = (f"with NaN in the state entries it does not read, the step's real outputs differ from a run with "
                f"zeros there ({nan_run.how})")
        same_shape(runner, nan_run.logits, clean_run.logits, f"{what}: logits")
        same_shape(runner, nan_run.hidden, clean_run.hidden, f"{what}: hidden rows")
        same_shape(runner, nan_run.state[writes], clean_run.state[writes], f"{what}: states written")
    if step.num_reqs < 2:
        return
    # the same step with every other request's scheduled tokens and read states redrawn
    rng = np.random.default_rng(step.seed + 11)
    other = Step(step.token_ids.copy(), step.block_table, step.req_rows, step.num_computed_tokens,
                 step.num_scheduled_tokens, step.block_size, step.seed, dict(step.overrides), step.extra_inputs,
                 step.state_slots)
    state = clean_state.copy()
    for i in range(1, step.num_reqs):
        row, begin = int(step.req_rows[i]), int(step.num_computed_tokens[i])
        stop = begin + int(step.num_scheduled_tokens[i])
        other.token_ids[row, begin:stop] = rng.integers(0, runner.vocab_size, size=stop - begin)
        if begin > 0:
            state[int(step.state_slots[row]), (begin - 1) % c] = rng.standard_normal(state.shape[2])
    mine = int(step.num_scheduled_tokens[0])
    mine_writes = state_entries(Step(step.token_ids, step.block_table, step.req_rows[:1], step.num_computed_tokens[:1],
                                step.num_scheduled_tokens[:1], step.block_size, state_slots=step.state_slots),
                           runner, "writes")
    outs = []
    for tokens_step, values in ((step, clean_state), (other, state)):
        access.set_kv(runner, clean_kv)
        access.set_state(runner, values)
        outs.append(run_runner(runner, tokens_step))
    a, b = outs
    what = f"request 0's outputs depend on the requests sharing its step ({a.how})"
    same_shape(runner, a.logits[:1], b.logits[:1], f"{what}: logits")
    same_shape(runner, a.hidden[:mine], b.hidden[:mine], f"{what}: hidden rows")
    same_shape(runner, a.state[mine_writes], b.state[mine_writes], f"{what}: its states")


#: Every property, by name, with the strategy kind it takes ("step", "bad", "trace", "split").
PROPERTIES: dict[str, tuple[Callable[[Factory, Any], None], str]] = {
    "padding_invisible": (padding_invisible, "step"),
    "kv_isolated": (kv_isolated, "step"),
    "replay_matches_eager": (replay_matches_eager, "step"),
    "no_build_after_warmup": (no_build_after_warmup, "step"),
    "bad_input_rejected": (bad_input_rejected, "bad"),
    "addresses_stable": (addresses_stable, "step"),
    "lifetime_matches_reference": (lifetime_matches_reference, "trace"),
    "state_isolated": (state_isolated, "step"),
    "chunking_invariant": (chunking_invariant, "split"),
    "replay_deterministic": (replay_deterministic, "step"),
}

__all__ = ["PROPERTIES", "addresses_stable", "bad_input_rejected", "blames_history", "chunking_invariant",
           "kv_isolated", "lifetime_matches_reference", "no_build_after_warmup", "padding_invisible",
           "replay_deterministic", "replay_matches_eager", "scrub", "state_isolated", "state_writes_confined"]
