"""Per-step broadcast of a step to a tensor-parallel worker: shared memory against gloo (issue 12).

The step is a 256-request decode step's prepared inputs -- input ids, positions, slot
mapping, query start locations, sequence lengths and a 256 x 128 block table (about 140 KB).
Consecutive steps are a decode loop's (:class:`DecodeLoop`, in persistent buffers as the
executor's): every position and sequence length + 1, new ids and slots, and each row whose
next token starts a block (1 in ``BLOCK_SIZE``) gains one block in the table; a request that
reaches the table's width is replaced by a new one (its whole row changes). Rank 0 sends it
to one spawned worker, side by side in one run:

* ``shm resident`` -- the tensor-parallel executor's case: rank 0 prepares the step straight
  into the :class:`graphrt.backends.torch.parallel.tp_channel.StepChannel`'s resident buffers (as the runner
  pads into the executor's staging buffers, which are those buffers) and sends a 14-word row;
  the worker copies the six arrays out and acknowledges; rank 0 waits for that before it
  writes the next step.
* ``shm arrays copied`` -- the same channel sending the six arrays: a fixed header and one copy
  per array into the segment (how the executor sent steps before the resident buffers).
* Each twice, as the executor's workers wait: polling the semaphore
  (``receive(spin=defaults.TP_WORKER_SPIN_S)``: workers on cuda / npu, whose host cores idle
  while the device runs the forward), and asleep on it (``spin=0``: workers on cpu / eager,
  whose forwards run on the host's cores; every send wakes a sleeping process). Timed on rank
  0: the ``send`` call; the round trip until the worker has copied the step out and
  acknowledged it; and, apart, rank 0 preparing the next step (``DecodeLoop.advance``): with
  resident buffers it writes memory the worker has just read, which costs what the copy's
  writes into the segment used to. The worker runs the same loop and checks every step it receives (after
  acknowledging it; rank 0 times the next step once the worker waits again). Rank 0 and the
  worker run on cores of their own (0 and 1), as tensor-parallel ranks do.
* ``gloo``  -- ``torch.distributed.broadcast`` of the same arrays as tensors over gloo
  (localhost TCP), one call per array, and once packed into one byte tensor. Timed on rank 0:
  the broadcast calls (gloo returns on the root once the data is sent).

Target: the executor's send of the 256-request step to workers on accelerators (resident
buffers, polling workers) costs <= 20 us on rank 0. With sleeping workers (cpu, eager) the
send also pays the OS's wake-up of the worker's core: printed beside it, not the target.

Run: ``python benchmarks/bench_step_channel.py [--quick]`` or ``graphrt bench``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from typing import Any, Sequence

import numpy as np

from bench_common import cpu_line, summarise
from graphrt.core import defaults

NUM_REQS, TABLE_WIDTH, BLOCK_SIZE, NUM_BLOCKS = 256, 128, 16, 1 << 16
TARGET_US = 20.0
#: The step's arrays: shape and dtype by field name.
LAYOUT = {"input_ids": ((NUM_REQS,), np.int32), "positions": ((NUM_REQS,), np.int32),
          "slot_mapping": ((NUM_REQS,), np.int64), "query_start_loc": ((NUM_REQS + 1,), np.int32),
          "seq_lens": ((NUM_REQS,), np.int32), "block_table": ((NUM_REQS, TABLE_WIDTH), np.int32)}


class DecodeLoop:
    """A decode loop's step inputs in persistent buffers; ``advance()`` makes the next step."""

    def __init__(self, seed: int = 0, out: dict[str, np.ndarray] | None = None) -> None:
        """``out``: buffers to keep the step in (by ``NAMES``), as the runner prepares into the
        executor's staging buffers; by default arrays of its own."""
        r = NUM_REQS
        b = out if out is not None else {name: np.zeros(shape, dtype) for name, (shape, dtype) in LAYOUT.items()}
        self.rng = np.random.default_rng(seed)
        self.rows = np.arange(r)
        self.next_block = 1
        self.ids, self.positions, self.slots = b["input_ids"], b["positions"], b["slot_mapping"]
        self.query_start, self.seq_lens, self.table = b["query_start_loc"], b["seq_lens"], b["block_table"]
        self.seq_lens[:] = self.rng.integers(1, TABLE_WIDTH * BLOCK_SIZE // 2, r)
        self.positions[:] = self.seq_lens - 1
        self.query_start[:] = np.arange(r + 1)
        self.table[:] = 0
        for row in range(r):
            self._new_blocks(row, 0, -(-int(self.seq_lens[row]) // BLOCK_SIZE))
        self._fill()

    def arrays(self) -> list[np.ndarray]:
        return [self.ids, self.positions, self.slots, self.query_start, self.seq_lens, self.table]

    def advance(self) -> None:
        self.positions += 1
        self.seq_lens += 1
        done = np.flatnonzero(self.seq_lens > TABLE_WIDTH * BLOCK_SIZE)
        for row in done:                        # a finished request's row goes to a new one
            self.seq_lens[row] = self.rng.integers(1, 512)
            self.positions[row] = self.seq_lens[row] - 1
            self.table[row] = 0
            self._new_blocks(row, 0, -(-int(self.seq_lens[row]) // BLOCK_SIZE))
        for row in np.flatnonzero(self.positions % BLOCK_SIZE == 0):    # a token starts a block
            self._new_blocks(row, int(self.positions[row]) // BLOCK_SIZE, 1)
        self._fill()

    def _new_blocks(self, row: int, first: int, count: int) -> None:
        blocks = (self.next_block + np.arange(count)) % (NUM_BLOCKS - 1) + 1
        self.table[row, first:first + count] = blocks
        self.next_block += count

    def _fill(self) -> None:
        self.ids[:] = self.rng.integers(0, 32000, NUM_REQS)
        block = self.table[self.rows, self.positions // BLOCK_SIZE]
        self.slots[:] = block.astype(np.int64) * BLOCK_SIZE + self.positions % BLOCK_SIZE


def step_arrays() -> list[np.ndarray]:
    return DecodeLoop().arrays()


def _pin(cpu: int) -> set[int]:
    """Run this process on ``cpu`` alone (as tensor-parallel ranks run, one per core): the
    worker's wake-up then never preempts rank 0 inside ``send``. Returns the old set."""
    old = os.sched_getaffinity(0)
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {cpu})
    return old


def _shm_worker(spec: Any, steps: int, waiting: Any, spin: float, resident: bool) -> None:
    from graphrt.backends.torch.parallel.tp_channel import StepChannel

    _pin(1)
    channel = StepChannel.attach(spec, 0)
    loop = DecodeLoop()
    mine = {name: np.zeros(shape, dtype) for name, (shape, dtype) in LAYOUT.items()}
    for i in range(steps):
        waiting.value = i + 1               # back in receive: rank 0 may time the next step
        _, got = channel.receive(timeout=60, copy=False, spin=spin)
        sources = channel.resident.values() if resident else got
        for dst, src in zip(mine.values(), sources):    # copied out, as a worker does
            dst[...] = src
        channel.acknowledge()
        if not all(np.array_equal(a, b) for a, b in zip(loop.arrays(), mine.values())):
            raise SystemExit(f"step {i}: the worker got other arrays than rank 0 sent")
        loop.advance()
    channel.close()


def bench_shm(steps: int, warmup: int, spin: float, resident: bool) -> dict[str, Any]:
    """``resident``: rank 0 keeps the step in the channel's resident buffers and sends an
    int64 row (the tensor-parallel executor's case); else it sends the six arrays."""
    from graphrt.backends.torch.parallel.tp_channel import StepChannel

    ctx = mp.get_context("spawn")
    channel = StepChannel.create(1, ctx=ctx, resident=LAYOUT if resident else None)
    waiting = ctx.Value("q", 0, lock=False)
    worker = ctx.Process(target=_shm_worker, args=(channel.spec, steps + warmup, waiting, spin, resident))
    loop = DecodeLoop(out=channel.resident if resident else None)
    row = np.zeros(14, np.int64)                 # the size of the executor's RUN row
    arrays = [row] if resident else loop.arrays()
    send_ns, trip_ns, prep_ns = [], [], []
    cpus = _pin(0)
    try:
        worker.start()
        channel.wait_ready([worker])        # the start-up handshake: a worker dead at start is named, not spun on
        for i in range(steps + warmup):
            p0 = time.perf_counter_ns()
            if i:
                channel.wait_acks(timeout=60)   # (the executor's wait before the next step)
                loop.advance()
            p1 = time.perf_counter_ns()
            row[0] = i
            while waiting.value != i + 1:   # the worker checked the last step: not timed
                pass
            t0 = time.perf_counter_ns()
            channel.send(1, arrays, timeout=60)
            t1 = time.perf_counter_ns()
            while channel._ack_words[0] != i + 1:
                pass
            t2 = time.perf_counter_ns()
            if i >= warmup:
                send_ns.append(t1 - t0)
                trip_ns.append(t2 - t0)
                prep_ns.append(p1 - p0)
    finally:
        if worker.pid is not None:
            worker.join(timeout=60)
        del loop, arrays
        channel.close()
        channel.unlink()
        os.sched_setaffinity(0, cpus)
    if worker.exitcode != 0:
        raise RuntimeError(f"the step channel's worker failed (exit code {worker.exitcode})")
    return {"send": summarise(send_ns), "round_trip": summarise(trip_ns), "prepare": summarise(prep_ns)}


def _gloo(rank: int, port: int, steps: int, warmup: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensors = [torch.from_numpy(a.copy()) for a in step_arrays()]
    packed = torch.zeros(sum(a.nbytes for a in step_arrays()), dtype=torch.uint8)
    result = {}
    for name, group in (("gloo, one call per array", tensors), ("gloo, one packed tensor", [packed])):
        ns = []
        for i in range(steps + warmup):
            dist.barrier()
            t0 = time.perf_counter_ns()
            for t in group:
                dist.broadcast(t, src=0)
            if i >= warmup:
                ns.append(time.perf_counter_ns() - t0)
        result[name] = ns
    if rank == 0:
        out.put({name: summarise(ns) for name, ns in result.items()})
    dist.barrier()
    dist.destroy_process_group()


def bench_gloo(steps: int, warmup: int) -> dict[str, Any]:
    from graphrt.backends.torch.parallel.tp_protocol import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo, args=(rank, port, steps, warmup, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark, print the table and return every number."""
    parser = argparse.ArgumentParser(prog="bench_step_channel", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="timed steps per variant")
    parser.add_argument("--quick", action="store_true", help="a tenth of the steps (smoke run)")
    args = parser.parse_args(argv)
    steps = max(50, args.steps // 10 if args.quick else args.steps)
    warmup = max(10, steps // 10)

    poll = defaults.TP_WORKER_SPIN_S
    variants = {"shm resident, worker polling (cuda, npu)": bench_shm(steps, warmup, poll, True),
                "shm resident, worker asleep (cpu, eager)": bench_shm(steps, warmup, 0.0, True),
                "shm arrays copied, worker polling": bench_shm(steps, warmup, poll, False),
                "shm arrays copied, worker asleep": bench_shm(steps, warmup, 0.0, False)}
    gloo = bench_gloo(steps, warmup)
    nbytes = sum(a.nbytes for a in step_arrays())
    host = f"{cpu_line()}, pid {os.getpid()}, load average {os.getloadavg()[0]:.2f}"
    print(f"Broadcast of a {NUM_REQS}-request decode step ({nbytes / 1024:.0f} KiB, 6 arrays) to 1 worker; "
          f"{host}; {steps} steps")
    print(f"{'variant':<66} {'median us':>10} {'p90 us':>9}")
    for name, v in variants.items():
        for what, key in (("send on rank 0", "send"), ("until the worker has it", "round_trip"),
                          ("rank 0 prepares the next step", "prepare")):
            print(f"{name + ', ' + what:<66} {v[key]['median_us']:>10.1f} {v[key]['p90_us']:>9.1f}")
    for name, v in gloo.items():
        print(f"{name:<66} {v['median_us']:>10.1f} {v['p90_us']:>9.1f}")
    ok = variants["shm resident, worker polling (cuda, npu)"]["send"]["median_us"] <= TARGET_US
    print(f"target: the executor's send to workers on accelerators (resident buffers, polling) <= {TARGET_US:.0f} us"
          f" -- {'PASS' if ok else 'FAIL'}; a sleeping worker (cpu, eager) adds the OS's wake-up to the send")
    return {"machine": host, "bytes": nbytes, "shm": variants, "gloo": gloo, "all_pass": ok}


if __name__ == "__main__":
    main()
