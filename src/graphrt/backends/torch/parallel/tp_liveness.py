"""Which rank of a tensor-parallel group is gone: a heartbeat per rank in the job's store.

Ranks launched outside graphrt (torchrun, :mod:`graphrt.engine.launch`) share no process handles, so
a survivor cannot ask the operating system which peer died. Instead each rank bumps its own
counter in the process group's store every ``defaults.RANK_HEARTBEAT_S`` from a daemon
thread; after a collective fails, :meth:`Heartbeat.lost` watches the counters for
``defaults.RANK_LOST_NAMING_S`` and names the ranks whose counter stood still. Where the store
itself is gone (it lived on the lost node) the answer is None: unknown."""

from __future__ import annotations

import threading
import time
from typing import Any

from graphrt.core import defaults


def default_store() -> Any:
    """The default process group's store, or None where torch does not expose it."""
    try:
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: no naming, the generic error stays
        return None


class Heartbeat:
    """This rank's counter, bumped from a daemon thread; :meth:`lost` names the stopped ranks."""

    def __init__(self, store: Any, rank: int, size: int, name: str,
                 interval: float = defaults.RANK_HEARTBEAT_S) -> None:
        self.store, self.rank, self.size, self.interval = store, rank, size, interval
        self.prefix = f"graphrt/heartbeat/{name}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None:
            self._beat()
            self._thread = threading.Thread(target=self._run, name=f"graphrt-heartbeat-{rank}", daemon=True)
            self._thread.start()

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def _beat(self) -> None:
        self.store.add(self._key(self.rank), 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone: nothing left to tell
                return

    def _counts(self) -> list[int] | None:
        """Every rank's counter, or None when the store does not answer in time."""
        box: list[Any] = [None]

        def read() -> None:
            try:
                box[0] = [int(self.store.add(self._key(rank), 0)) for rank in range(self.size)]
            except Exception:  # noqa: BLE001 - unreadable store: unknown
                box[0] = None
        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        thread.join(self.interval * 5)
        return box[0]

    def lost(self, watch: float = defaults.RANK_LOST_NAMING_S) -> list[int] | None:
        """The other ranks whose counter did not move within ``watch`` seconds (None: the store
        did not answer -- it may have lived on the lost node)."""
        if self.store is None:
            return None
        before = self._counts()
        if before is None:
            return None
        time.sleep(max(watch, 2.5 * self.interval))
        after = self._counts()
        if after is None:
            return None
        return [rank for rank in range(self.size) if rank != self.rank and after[rank] == before[rank]]

    def stop(self) -> None:
        """Stop beating (the engine closed: a stopped counter then means nothing)."""
        self._stop.set()


__all__ = ["Heartbeat", "default_store"]
