"""Per-step broadcast of a step to a tensor-parallel worker: shared memory against gloo (issue 12).

The step is a 256-request decode step's prepared inputs -- input ids, positions, slot
mapping, query start locations, sequence lengths and a 256 x 128 block table (about 140 KB).
Rank 0 sends it to one spawned worker, side by side in one run:

* ``shm``   -- :class:`graphrt.core.step_channel.StepChannel`: a fixed header and one copy per
  array into a shared-memory segment, a semaphore wakes the worker (seed 004's design,
  without pickle). Timed on rank 0: the ``send`` call; and the round trip until the worker
  has copied the step out and acknowledged it.
* ``gloo``  -- ``torch.distributed.broadcast`` of the same arrays as tensors over gloo
  (localhost TCP), one call per array, and once packed into one byte tensor. Timed on rank 0:
  the broadcast calls (gloo returns on the root once the data is sent).

Target: the shared-memory send of the 256-request step costs <= 20 us on rank 0.

Run: ``python benchmarks/bench_step_channel.py [--quick]`` or ``graphrt bench``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import time
from typing import Any, Sequence

import numpy as np

from bench_common import cpu_line, summarise

NUM_REQS, TABLE_WIDTH = 256, 128
TARGET_US = 20.0


def step_arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    r = NUM_REQS
    return [rng.integers(0, 32000, r).astype(np.int32), rng.integers(0, 2048, r).astype(np.int32),
            rng.integers(0, 1 << 20, r).astype(np.int64), np.arange(r + 1, dtype=np.int32),
            rng.integers(1, 2048, r).astype(np.int32),
            rng.integers(1, 4096, (r, TABLE_WIDTH)).astype(np.int32)]


def _shm_worker(spec: Any, steps: int) -> None:
    from graphrt.core.step_channel import StepChannel

    channel = StepChannel.attach(spec, 0)
    for _ in range(steps):
        channel.receive(timeout=60)
    channel.close()


def bench_shm(steps: int, warmup: int) -> dict[str, Any]:
    from graphrt.core.step_channel import StepChannel

    ctx = mp.get_context("spawn")
    channel = StepChannel.create(1, ctx=ctx)
    worker = ctx.Process(target=_shm_worker, args=(channel.spec, steps + warmup))
    arrays = step_arrays()
    send_ns, trip_ns = [], []
    try:
        worker.start()
        for i in range(steps + warmup):
            t0 = time.perf_counter_ns()
            channel.send(1, arrays, timeout=60)
            t1 = time.perf_counter_ns()
            while channel._ack_words[0] != i + 1:
                pass
            t2 = time.perf_counter_ns()
            if i >= warmup:
                send_ns.append(t1 - t0)
                trip_ns.append(t2 - t0)
    finally:
        if worker.pid is not None:
            worker.join(timeout=60)
        channel.close()
        channel.unlink()
    return {"send": summarise(send_ns), "round_trip": summarise(trip_ns)}


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
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
    shm = bench_shm(steps, warmup)
    gloo = bench_gloo(steps, warmup)
    nbytes = sum(a.nbytes for a in step_arrays())
    host = f"{cpu_line()}, pid {os.getpid()}"
    rows = [("shm, send on rank 0", shm["send"]), ("shm, until the worker has it", shm["round_trip"]),
            *gloo.items()]
    print(f"Broadcast of a {NUM_REQS}-request decode step ({nbytes / 1024:.0f} KiB, 6 arrays) to 1 worker; "
          f"{host}; {steps} steps")
    print(f"{'variant':<32} {'median us':>10} {'p90 us':>9}")
    for name, s in rows:
        print(f"{name:<32} {s['median_us']:>10.1f} {s['p90_us']:>9.1f}")
    ok = shm["send"]["median_us"] <= TARGET_US
    print(f"target: shm send <= {TARGET_US:.0f} us -- {'PASS' if ok else 'FAIL'}")
    return {"machine": host, "bytes": nbytes, "shm": shm, "gloo": gloo, "all_pass": ok}


if __name__ == "__main__":
    main()
