"""The worker processes of :class:`~graphrt.engine.data_parallel.DataParallelLLM`, as its front
holds them: a handle per process (:class:`Worker`), every live front's workers (:data:`LIVE`),
and how they are stopped -- asked, joined, terminated, killed -- by ``close()``, garbage
collection or interpreter exit (:func:`shutdown_all`, registered before multiprocessing's own
exit hook so the workers stop before it joins them).
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing.util  # noqa: F401 - imported before our atexit hook, so ours runs first
import time
from multiprocessing.connection import Connection
from typing import Any

from graphrt.core.errors import GraphrtError

DP_WORKER_JOIN_TIMEOUT_S = 10.0

#: Seconds a stopping worker is waited for after terminate, then after kill.
DP_WORKER_KILL_TIMEOUT_S = 5.0


class Worker:
    """One engine process (or a Ray replica standing for one: engine/dp_ray.py) and its two
    pipes, as the front sees it."""

    def __init__(self, rank: int, process: Any, requests: Any, replies: Connection, *,
                 where: str | None = None) -> None:
        # process: a multiprocessing.Process, or what stands for one (dp_ray.RayReplica);
        # requests: its pipe's sending Connection, or anything with send / close
        self.rank, self.process, self.requests, self.replies = rank, process, requests, replies
        self.pid: int = process.pid
        self.where = where or f"pid {self.pid}"
        self.in_flight: set[int] = set()       # sent, output not received yet
        self.num_requests = 0                   # ever sent
        self.info: dict[str, Any] | None = None  # the worker's "ready" report
        self.stats: dict[str, Any] | None = None
        self.fault: str | None = None          # the traceback a failing worker sent
        self.dead: GraphrtError | None = None

    @property
    def name(self) -> str:
        return f"data-parallel worker {self.rank} ({self.where})"


LIVE: dict[int, list[Worker]] = {}      # key -> workers of every front not yet shut down
_KEYS = itertools.count()


def new_key() -> int:
    """A fresh key for a front's entry in :data:`LIVE`."""
    return next(_KEYS)


def shutdown(key: int) -> None:
    """Stop a front's workers (once): ask, join, then terminate, then kill; close the pipes."""
    workers = LIVE.pop(key, None)
    if workers is None:
        return
    for w in workers:
        try:
            w.requests.send(("stop",))
        except (OSError, ValueError):
            pass    # already gone
    deadline = time.monotonic() + DP_WORKER_JOIN_TIMEOUT_S
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        for stop in (w.process.terminate, w.process.kill):
            if w.process.is_alive():
                stop()
                w.process.join(DP_WORKER_KILL_TIMEOUT_S)
        w.requests.close()
        w.replies.close()


@atexit.register
def shutdown_all() -> None:
    """At interpreter exit, before multiprocessing joins its children: stop every front's.
    (Not through the fronts' ``weakref.finalize``: those are disabled once weakref's own exit
    hook has run, which comes first.)"""
    for key in list(LIVE):
        shutdown(key)
