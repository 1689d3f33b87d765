"""The garbage collector kept out of graph builds, by any number of threads at once.

Its switches are process-wide. A build that saves ``gc.isenabled()``, disables the collector and
restores what it saved turns it back on under a build running on another thread (two engines in
one process, each with a background builder), which then saw it off and leaves it as found; a
warm-up's ``gc.unfreeze()`` hands the objects another warm-up froze back to the collector. Here
the first thread in pauses (or freezes) and the last one out restores.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator


class _Holds:
    """How many threads hold each switch, and whether the collector was on before the first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.paused = 0
        self.was_enabled = False
        self.frozen = 0


_HOLDS = _Holds()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """``gc.disable()`` for the block; the collector's earlier state back once no thread is in one."""
    with _HOLDS.lock:
        if _HOLDS.paused == 0:
            _HOLDS.was_enabled = gc.isenabled()
            gc.disable()
        _HOLDS.paused += 1
    try:
        yield
    finally:
        with _HOLDS.lock:
            _HOLDS.paused -= 1
            if _HOLDS.paused == 0 and _HOLDS.was_enabled:
                gc.enable()


@contextlib.contextmanager
def objects_frozen() -> Iterator[None]:
    """Collect, then ``gc.freeze()`` every object alive now for the block (a collection between
    captures costs seconds, vLLM #21146); ``gc.unfreeze()`` once no thread is in one."""
    gc.collect()
    with _HOLDS.lock:
        gc.freeze()
        _HOLDS.frozen += 1
    try:
        yield
    finally:
        with _HOLDS.lock:
            _HOLDS.frozen -= 1
            if _HOLDS.frozen == 0:
                gc.unfreeze()


__all__ = ["collector_paused", "objects_frozen"]
