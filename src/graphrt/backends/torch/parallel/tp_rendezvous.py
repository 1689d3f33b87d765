"""How spawned tensor-parallel ranks form their process group without rank 0 waiting on a dead
worker (docs/distributed.md, "Faults").

torch waits for a dead rank until the store timeout (300 s) and names none, so rank 0 owns the
store (:func:`rank0_store`) and forms its groups through a :class:`WatchedStore`, whose waits
run in short slices that raise as soon as a worker has exited. Workers (:func:`worker_store`)
join only once rank 0 is inside the rendezvous (:data:`OPEN_KEY`), so gloo never retries the
address of a worker that died earlier. One killed between publishing its address and rank 0
connecting is still seen only at the timeout."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from graphrt.core import defaults

#: ... while the process group forms, rank 0 checks for a rendezvous key this often (seconds),
#: and between checks whether a worker has exited: a dead worker fails start-up at once.
TP_RENDEZVOUS_POLL_S = 0.01

#: Set in rank 0's store by its first write or wait in the rendezvous; workers wait for it.
OPEN_KEY = "graphrt/rendezvous-open"


def rank0_store(world_size: int, timeout: float) -> Any:
    """Rank 0's rendezvous store on a free localhost port (``.port``), before any worker starts."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False)


def worker_store(port: int, setup: Any) -> Any:
    """A worker's connection to rank 0's store on ``port``, once rank 0 opened the rendezvous
    (``setup``: the worker's :class:`~graphrt.backends.torch.parallel.tp_protocol.WorkerSetup`). Rank 0
    dying meanwhile closes the store, which ends the wait with an error."""
    store = dist.TCPStore("127.0.0.1", port, setup.tp_size, is_master=False,
                          timeout=timedelta(seconds=setup.timeout))
    store.wait([OPEN_KEY], timedelta(seconds=defaults.TP_WORKER_START_TIMEOUT_S))
    return store


class WatchedStore(dist.Store):
    """Rank 0's view of ``store`` for forming groups: every wait polls in slices of
    ``TP_RENDEZVOUS_POLL_S`` and calls ``check()`` between them (it raises when a
    worker has exited); the first write or wait opens the rendezvous (:data:`OPEN_KEY`).
    Every other call goes straight to ``store``."""

    def __init__(self, store: Any, check: Callable[[], None], opened: bool = False) -> None:
        super().__init__()
        self.store, self.check_alive, self.opened = store, check, opened

    def _open(self) -> None:
        if not self.opened:
            self.store.set(OPEN_KEY, "1")
            self.opened = True

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Return once every key is set; raise what ``check()`` raises, or TimeoutError."""
        self._open()
        limit = (timeout or self.store.timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not self.store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"rendezvous keys {keys} not set within {limit} s")
            time.sleep(TP_RENDEZVOUS_POLL_S)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.store.get(key)

    def set(self, key: str, value: Any) -> None:
        self._open()
        self.store.set(key, value)

    def add(self, key: str, value: int) -> int:
        return self.store.add(key, value)

    def check(self, keys: list[str]) -> bool:
        return self.store.check(keys)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.store.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(key)

    def num_keys(self) -> int:
        return self.store.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.store.set_timeout(timeout)

    def clone(self) -> "WatchedStore":
        return WatchedStore(self.store.clone(), self.check_alive, self.opened)


def group_count() -> int | None:
    """torch's count of the process groups named so far (None where this torch keeps none)."""
    return getattr(getattr(dist.distributed_c10d, "_world", None), "group_count", None)


def forget_failed_group(count: int | None) -> None:
    """Give back the name a default group that failed to form took: torch names groups from a
    global count that only ``destroy_process_group`` resets, and kept, the next engine's rank 0
    would rendezvous under a name its fresh workers never use and wait out the timeout."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if count is not None and world is not None and not dist.is_initialized():
        world.group_count = count


__all__ = ["OPEN_KEY", "WatchedStore", "forget_failed_group", "group_count", "rank0_store", "worker_store"]
