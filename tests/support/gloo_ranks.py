"""Run a function on several torch.distributed ranks over gloo, each a spawned process.

``run_ranks(fn, world_size)`` starts one process per rank, joins them to one gloo group on a
free localhost port, calls ``fn(rank)`` in each and returns ``{rank: result}``. A rank that
raises is reported with its error instead of leaving the others (and the test) waiting;
``fn`` must be a module-level function (spawn pickles it by name).
"""

from __future__ import annotations

from typing import Any, Callable

import torch.multiprocessing as mp

from graphrt.backends.torch.parallel.tp_protocol import free_port


def _rank(fn: Callable[[int], Any], rank: int, world_size: int, port: int, results: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        value = fn(rank)
    except BaseException as err:                           # report, do not hang the parent
        results.put((rank, None, f"rank {rank} raised {err!r}"))
        dist.destroy_process_group()
        raise
    # Every rank past its last collective before any tears the group down: a rank that closed its
    # sockets while a peer still read from them made gloo abort that peer at exit (exit code -6,
    # seen once under a full suite's load).
    results.put((rank, value, None))
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(fn: Callable[[int], Any], world_size: int = 2, timeout: float = 120.0) -> dict[int, Any]:
    """``{rank: fn(rank)}`` from ``world_size`` gloo ranks; raises AssertionError naming any
    rank that raised, and checks every process exited cleanly."""
    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(fn, rank, world_size, port, results)) for rank in range(world_size)]
    for p in procs:
        p.start()
    try:
        replies = [results.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
    errors = [err for _, _, err in replies if err is not None]
    assert not errors, "\n".join(errors)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return {rank: value for rank, value, _ in replies}
