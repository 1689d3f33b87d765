"""Host time of input preparation (issue 2): graphrt vs a per-request loop vs plain numpy.

Two steps of a 256-request engine (max_model_len 4096, block_size 16, a 512-row table):

* ``decode`` -- every request schedules one token, computed lengths 100..4000;
* ``mixed``  -- 8192 tokens: a few prefill chunks of hundreds of tokens, the rest decode.

Seven implementations compute the same outputs (checked before timing):

* ``graphrt`` -- :meth:`graphrt.InputPreparer.prepare`, one preparer reused (persistent buffers),
  with its default kernel (numba's compiled loops where numba imports);
* ``gr-bounded`` -- the same with the bounds a runner passes (``vocab_size``, ``num_blocks``):
  every block id of each scheduled row is checked against the KV cache too;
* ``gr-runner`` -- a runner's path on that bounded preparer: ``check`` then ``write`` into
  staging buffers (no padding: the bucket is the step's size);
* ``gr-numpy`` -- the preparer on ``kernel="numpy"``, for reference: the same checks
  interpreted, numpy writes (graphrt's fallback where numba is missing; a tenth of the calls);
* ``loop``    -- a per-request Python loop with numpy slicing, what a naive engine writes;
* ``loop_lists`` -- a per-request loop in nano-vllm's style: Python lists extended per token
  and per block range, converted to numpy once (the engine's lists are built untimed);
* ``numpy``   -- plain vectorised numpy (repeat / cumsum / take), fresh arrays every call.

Also times :meth:`graphrt.Padder.pad` (persistent buffers) of decode steps to their vLLM bucket.
Reports medians and p90 in microseconds; the targets are speed-up ratios over ``graphrt``.

Run: ``python benchmarks/bench_inputs.py [--quick]`` or ``make bench``.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from bench_common import summarise

from graphrt import GraphConfig, InputPreparer, ModelInputs, Padder
from graphrt.core.inputs.fields import FIELD_DTYPES, buffer_shapes

NUM_TABLE_ROWS = 512
NUM_REQS = 256
MAX_MODEL_LEN = 4096
BLOCK_SIZE = 16
MIXED_TOKENS = 8192
MIXED_PREFILLS = 16
VOCAB = 32000

#: (step, baseline) -> minimum speed-up of graphrt over the baseline (median / median).
TARGETS: dict[tuple[str, str], float] = {
    ("decode", "loop"): 20.0,
    ("decode", "loop_lists"): 20.0,
    ("decode", "numpy"): 1.5,
    ("mixed", "loop"): 50.0,
    ("mixed", "loop_lists"): 50.0,
    ("mixed", "numpy"): 1.5,
}

#: Every output compared between implementations (arrays, then scalars).
ARRAY_OUTPUTS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                 "num_computed_tokens", "block_table")
SCALAR_OUTPUTS = ("num_tokens", "max_query_len", "max_seq_len")

Outputs = dict[str, object]


@dataclass(frozen=True)
class Step:
    """One scheduled step over the engine's persistent tables."""

    name: str
    token_ids: np.ndarray            # int32 [rows, max_model_len]
    block_table: np.ndarray          # int32 [rows, max_model_len // block_size]
    req_rows: np.ndarray             # int64 [R]
    num_computed_tokens: np.ndarray  # int64 [R]
    num_scheduled_tokens: np.ndarray  # int64 [R]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.num_scheduled_tokens.sum())

    @property
    def num_reqs(self) -> int:
        return int(self.req_rows.shape[0])


def make_tables(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Token-id table and block table; every block-table entry is a distinct non-null block."""
    width = MAX_MODEL_LEN // BLOCK_SIZE
    token_ids = rng.integers(1, VOCAB, size=(NUM_TABLE_ROWS, MAX_MODEL_LEN), dtype=np.int32)
    blocks = rng.permutation(NUM_TABLE_ROWS * width).astype(np.int32) + 1
    return token_ids, blocks.reshape(NUM_TABLE_ROWS, width)


def decode_step(rng: np.random.Generator, tables: tuple[np.ndarray, np.ndarray]) -> Step:
    """256 requests, one token each, on a random permutation of the table's rows."""
    rows = rng.permutation(NUM_TABLE_ROWS)[:NUM_REQS].astype(np.int64)
    computed = rng.integers(100, 4001, size=NUM_REQS, dtype=np.int64)
    scheduled = np.ones(NUM_REQS, dtype=np.int64)
    return Step("decode", *tables, rows, computed, scheduled, BLOCK_SIZE)


def mixed_step(rng: np.random.Generator, tables: tuple[np.ndarray, np.ndarray]) -> Step:
    """8192 tokens over 256 requests: 16 prefill chunks of hundreds of tokens, 240 decodes."""
    rows = rng.permutation(NUM_TABLE_ROWS)[:NUM_REQS].astype(np.int64)
    num_decode = NUM_REQS - MIXED_PREFILLS
    raw = rng.integers(200, 800, size=MIXED_PREFILLS)
    chunks = (raw * (MIXED_TOKENS - num_decode) // raw.sum()).astype(np.int64)
    chunks[-1] += MIXED_TOKENS - num_decode - chunks.sum()
    # Prefill chunks start at a block boundary (fresh prompt, prefix-cache hit or earlier chunk).
    prefill_computed = rng.integers(0, MAX_MODEL_LEN - chunks + 1) // BLOCK_SIZE * BLOCK_SIZE
    scheduled = np.concatenate([chunks, np.ones(num_decode, dtype=np.int64)])
    computed = np.concatenate([prefill_computed,
                               rng.integers(100, 4001, size=num_decode, dtype=np.int64)])
    order = rng.permutation(NUM_REQS)
    return Step("mixed", *tables, rows, computed[order], scheduled[order], BLOCK_SIZE)


def prepare_graphrt(preparer: InputPreparer, step: Step) -> ModelInputs:
    """graphrt's fast path: outputs are views of the preparer's persistent buffers."""
    return preparer.prepare(token_ids=step.token_ids, block_table=step.block_table,
                            req_rows=step.req_rows, num_computed_tokens=step.num_computed_tokens,
                            num_scheduled_tokens=step.num_scheduled_tokens)


def prepare_loop(step: Step) -> Outputs:
    """Reference: one Python iteration per request, numpy slicing inside."""
    rows = step.req_rows.tolist()
    computed = step.num_computed_tokens.tolist()
    scheduled = step.num_scheduled_tokens.tolist()
    bs, r, t = step.block_size, len(rows), sum(scheduled)
    input_ids = np.empty(t, dtype=np.int32)
    positions = np.empty(t, dtype=np.int32)
    slot_mapping = np.empty(t, dtype=np.int64)
    query_start_loc = np.zeros(r + 1, dtype=np.int32)
    seq_lens = np.empty(r, dtype=np.int32)
    num_computed = np.empty(r, dtype=np.int32)
    block_table = np.empty((r, step.block_table.shape[1]), dtype=np.int32)
    start = 0
    for i, (row, c, n) in enumerate(zip(rows, computed, scheduled)):
        end = start + n
        pos = np.arange(c, c + n)
        input_ids[start:end] = step.token_ids[row, c:c + n]
        positions[start:end] = pos
        slot_mapping[start:end] = step.block_table[row, pos // bs].astype(np.int64) * bs + pos % bs
        query_start_loc[i + 1] = end
        seq_lens[i] = c + n
        num_computed[i] = c
        block_table[i] = step.block_table[row]
        start = end
    return {"input_ids": input_ids, "positions": positions, "slot_mapping": slot_mapping,
            "query_start_loc": query_start_loc, "seq_lens": seq_lens,
            "num_computed_tokens": num_computed, "block_table": block_table,
            "num_tokens": t, "max_query_len": max(scheduled),
            "max_seq_len": max(c + n for c, n in zip(computed, scheduled))}


def engine_lists(step: Step) -> tuple[list[list[int]], list[list[int]]]:
    """The scheduled requests' token ids and block ids as Python lists: the state a
    list-based engine (nano-vllm's ``Sequence``) keeps; built outside the timed region."""
    token_lists = [step.token_ids[row].tolist() for row in step.req_rows.tolist()]
    block_lists = [step.block_table[row].tolist() for row in step.req_rows.tolist()]
    return token_lists, block_lists


def prepare_loop_lists(step: Step, lists: tuple[list[list[int]], list[list[int]]]) -> Outputs:
    """Reference in nano-vllm's style: a loop over requests that extends Python lists
    (ids and positions per token, slots one block range at a time), converted to numpy once."""
    token_lists, block_lists = lists
    bs = step.block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    for tokens, blocks, c, n in zip(token_lists, block_lists, step.num_computed_tokens.tolist(),
                                    step.num_scheduled_tokens.tolist()):
        input_ids.extend(tokens[c:c + n])
        positions.extend(range(c, c + n))
        pos = c
        while pos < c + n:
            end = min((pos // bs + 1) * bs, c + n)
            base = blocks[pos // bs] * bs
            slot_mapping.extend(range(base + pos % bs, base + (end - 1) % bs + 1))
            pos = end
        query_start_loc.append(query_start_loc[-1] + n)
        seq_lens.append(c + n)
    scheduled = step.num_scheduled_tokens
    return {"input_ids": np.array(input_ids, dtype=np.int32),
            "positions": np.array(positions, dtype=np.int32),
            "slot_mapping": np.array(slot_mapping, dtype=np.int64),
            "query_start_loc": np.array(query_start_loc, dtype=np.int32),
            "seq_lens": np.array(seq_lens, dtype=np.int32),
            "num_computed_tokens": step.num_computed_tokens.astype(np.int32),
            "block_table": np.array(block_lists, dtype=np.int32),
            "num_tokens": len(input_ids), "max_query_len": int(scheduled.max()),
            "max_seq_len": max(seq_lens)}


def prepare_numpy(step: Step) -> Outputs:
    """Baseline: vectorised numpy without persistent buffers (fresh arrays every call).

    Position of token ``j`` of the step = ``j + shift[req(j)]`` with
    ``shift = computed - (first token index of the request)``; one ``np.repeat`` spreads each
    request-level value over its tokens, ``np.take`` on the flattened tables gathers.
    """
    rows, computed, scheduled = step.req_rows, step.num_computed_tokens, step.num_scheduled_tokens
    bs = step.block_size
    cu = np.cumsum(scheduled)
    t = int(cu[-1])
    shift = computed - cu + scheduled
    positions = np.arange(t) + np.repeat(shift, scheduled)
    token_rows = np.repeat(rows, scheduled)
    input_ids = np.take(step.token_ids.reshape(-1), token_rows * step.token_ids.shape[1] + positions)
    block_cols = positions // bs
    blocks = np.take(step.block_table.reshape(-1), token_rows * step.block_table.shape[1] + block_cols)
    slot_mapping = blocks * np.int64(bs) + (positions - block_cols * bs)
    query_start_loc = np.zeros(rows.shape[0] + 1, dtype=np.int32)
    query_start_loc[1:] = cu
    seq_lens = (computed + scheduled).astype(np.int32)
    return {"input_ids": input_ids, "positions": positions.astype(np.int32),
            "slot_mapping": slot_mapping, "query_start_loc": query_start_loc, "seq_lens": seq_lens,
            "num_computed_tokens": computed.astype(np.int32),
            "block_table": np.take(step.block_table, rows, axis=0),
            "num_tokens": t, "max_query_len": int(scheduled.max()), "max_seq_len": int(seq_lens.max())}


def outputs_of(inputs: ModelInputs) -> Outputs:
    """The compared fields of graphrt's result."""
    return {name: getattr(inputs, name) for name in ARRAY_OUTPUTS + SCALAR_OUTPUTS}


def check_identical(step: Step, results: dict[str, Outputs]) -> None:
    """Raise ``AssertionError`` naming the first output where an implementation differs."""
    ref_name, ref = next(iter(results.items()))
    for name, out in results.items():
        for field in ARRAY_OUTPUTS:
            a, b = np.asarray(ref[field]), np.asarray(out[field])
            if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a, b):
                raise AssertionError(f"{step.name}: {name}.{field} ({b.dtype}{list(b.shape)}) differs "
                                     f"from {ref_name}.{field} ({a.dtype}{list(a.shape)})")
        for field in SCALAR_OUTPUTS:
            if int(ref[field]) != int(out[field]):
                raise AssertionError(f"{step.name}: {name}.{field} = {out[field]} but "
                                     f"{ref_name}.{field} = {ref[field]}")


def time_calls(fns: dict[str, Callable[[], object]], iters: dict[str, int], warmup: int,
               rounds: int) -> dict[str, np.ndarray]:
    """Nanoseconds per call of each function, in interleaved rounds (drift hits all alike).

    The garbage collector is off while timing, for every implementation equally.
    """
    samples: dict[str, list[int]] = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    clock = time.perf_counter_ns
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            for name, fn in fns.items():
                out = samples[name]
                for _ in range(max(1, iters[name] // rounds)):
                    t0 = clock()
                    fn()
                    out.append(clock() - t0)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: np.asarray(v, dtype=np.float64) for name, v in samples.items()}


def runner_path(preparer: InputPreparer, staging: dict[str, np.ndarray], step: Step) -> ModelInputs:
    """A runner's host work: check the step, then write it into its staging buffers."""
    shape = preparer.check(token_ids=step.token_ids, block_table=step.block_table,
                           req_rows=step.req_rows, num_computed_tokens=step.num_computed_tokens,
                           num_scheduled_tokens=step.num_scheduled_tokens)
    return preparer.write(num_tokens=shape.num_tokens, num_reqs=shape.num_reqs, out=staging)


def bench_step(step: Step, preparers: dict[str, InputPreparer], iters: int, warmup: int,
               rounds: int) -> dict[str, dict[str, float]]:
    """Check the implementations agree on ``step``, then time them."""
    lists = engine_lists(step)
    bounded = preparers["gr-bounded"]
    staging = {name: np.zeros(shape, FIELD_DTYPES[name]) for name, shape in
               buffer_shapes(bounded.max_num_tokens, bounded.max_num_reqs, step.block_table.shape[1]).items()}
    results = {name: outputs_of(prepare_graphrt(prep, step)) for name, prep in preparers.items()}
    results.update({"gr-runner": outputs_of(runner_path(bounded, staging, step)),
                    "loop": prepare_loop(step), "loop_lists": prepare_loop_lists(step, lists),
                    "numpy": prepare_numpy(step)})
    check_identical(step, results)
    fns = {name: (lambda prep=prep: prepare_graphrt(prep, step)) for name, prep in preparers.items()}
    fns.update({"gr-runner": lambda: runner_path(bounded, staging, step),
                "loop": lambda: prepare_loop(step),
                "loop_lists": lambda: prepare_loop_lists(step, lists),
                "numpy": lambda: prepare_numpy(step)})
    fewer = max(rounds, iters // 10)
    counts = {"graphrt": iters, "gr-bounded": iters, "gr-runner": iters, "gr-numpy": fewer,
              "loop": fewer, "loop_lists": fewer, "numpy": iters}
    order = ("graphrt", "gr-bounded", "gr-runner", "gr-numpy", "loop", "loop_lists", "numpy")
    timed = time_calls({name: fns[name] for name in order}, counts, warmup, rounds)
    return {name: summarise(ns) for name, ns in timed.items()}


def bench_padding(step: Step, preparer: InputPreparer, iters: int, warmup: int,
                  rounds: int) -> list[dict[str, object]]:
    """Time ``Padder.pad`` of decode steps (all 256 requests, and the first 250) to their vLLM bucket."""
    policy = GraphConfig().capture_policy()
    padder = Padder(max_num_tokens=preparer.max_num_tokens, max_num_reqs=preparer.max_num_reqs)
    rows = []
    for num_reqs in (step.num_reqs, step.num_reqs - 6):
        sub = Step(step.name, step.token_ids, step.block_table, step.req_rows[:num_reqs],
                   step.num_computed_tokens[:num_reqs], step.num_scheduled_tokens[:num_reqs],
                   step.block_size)
        inputs = prepare_graphrt(preparer, sub).copy()
        bucket = policy.bucket_for(inputs.num_tokens)
        padded = padder.pad(inputs, num_tokens=bucket, num_reqs=bucket)
        if padded.padded_num_tokens != bucket or not np.array_equal(
                padded.slot_mapping[:inputs.num_tokens], inputs.slot_mapping):
            raise AssertionError(f"Padder.pad to {bucket} did not keep the real tokens")
        ns = time_calls({"pad": lambda: padder.pad(inputs, num_tokens=bucket, num_reqs=bucket)},
                        {"pad": iters}, warmup, rounds)["pad"]
        rows.append({"num_reqs": num_reqs, "bucket": bucket, **summarise(ns)})
    return rows


def verdicts(timings: dict[str, dict[str, dict[str, float]]]) -> list[dict[str, object]]:
    """One row per target: the measured speed-up of graphrt and PASS / FAIL."""
    rows = []
    for (step, baseline), target in TARGETS.items():
        ratio = timings[step][baseline]["median_us"] / timings[step]["graphrt"]["median_us"]
        rows.append({"step": step, "baseline": baseline, "ratio": ratio, "target": target,
                     "pass": ratio >= target})
    return rows


def format_report(steps: dict[str, Step], timings: dict[str, dict[str, dict[str, float]]],
                  targets: list[dict[str, object]], padding: list[dict[str, object]],
                  kernel: str) -> str:
    """The human-readable tables."""
    lines = [f"Input preparation, host time per step (us; median / p90 over n calls); "
             f"graphrt kernel: {kernel}", ""]
    head = f"{'step':<8}{'tokens':>7}{'reqs':>6}  {'impl':<11}{'median':>10}{'p90':>10}{'n':>7}"
    lines += [head, "-" * len(head)]
    for name, step in steps.items():
        for impl, s in timings[name].items():
            lines.append(f"{name:<8}{step.num_tokens:>7}{step.num_reqs:>6}  {impl:<11}"
                         f"{s['median_us']:>10.1f}{s['p90_us']:>10.1f}{s['n']:>7}")
    lines += ["", "Speed-up of graphrt (baseline median / graphrt median)", ""]
    head = f"{'step':<8}{'baseline':<10}{'speed-up':>10}{'target':>9}  result"
    lines += [head, "-" * len(head)]
    for row in targets:
        lines.append(f"{row['step']:<8}{row['baseline']:<10}{row['ratio']:>9.2f}x"
                     f"{row['target']:>8.1f}x  {'PASS' if row['pass'] else 'FAIL'}")
    lines += ["", "Padder.pad (persistent buffers), decode step to its vLLM bucket", ""]
    head = f"{'reqs':>6}{'bucket':>8}{'median':>10}{'p90':>10}{'n':>7}"
    lines += [head, "-" * len(head)]
    for row in padding:
        lines.append(f"{row['num_reqs']:>6}{row['bucket']:>8}{row['median_us']:>10.1f}"
                     f"{row['p90_us']:>10.1f}{row['n']:>7}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark, print the tables and return every number (for tooling)."""
    parser = argparse.ArgumentParser(prog="bench_inputs", description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=3000,
                        help="timed calls of graphrt / numpy per step (the loop gets 1/10)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed calls per implementation")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a tenth of the iterations (smoke run)")
    args = parser.parse_args(argv)
    iters = max(args.rounds, args.iters // 10 if args.quick else args.iters)

    rng = np.random.default_rng(args.seed)
    tables = make_tables(rng)
    steps = {"decode": decode_step(rng, tables), "mixed": mixed_step(rng, tables)}
    limits = dict(max_num_reqs=NUM_REQS, max_num_tokens=MIXED_TOKENS, block_size=BLOCK_SIZE)
    preparer = InputPreparer(**limits)
    preparers = {"graphrt": preparer,
                 "gr-bounded": InputPreparer(**limits, vocab_size=VOCAB,
                                             num_blocks=int(tables[1].max()) + 1),
                 "gr-numpy": InputPreparer(**limits, kernel="numpy")}
    timings = {name: bench_step(step, preparers, iters, args.warmup, args.rounds)
               for name, step in steps.items()}
    padding = bench_padding(steps["decode"], preparer, iters, args.warmup, args.rounds)
    targets = verdicts(timings)
    print(format_report(steps, timings, targets, padding, preparer.kernel))
    return {"timings_us": timings, "targets": targets, "padding_us": padding, "kernel": preparer.kernel,
            "steps": {name: {"num_tokens": s.num_tokens, "num_reqs": s.num_reqs}
                      for name, s in steps.items()},
            "all_pass": all(row["pass"] for row in targets)}


if __name__ == "__main__":
    main()
