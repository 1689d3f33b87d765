"""Worker processes of tests/distributed/test_step_channel.py, in a module light to import
(numpy and the step channel, no torch), so a spawned worker is up in about a second."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from graphrt.backends.torch.parallel.tp_channel import ChannelSpec, StepChannel


def read_steps(spec: ChannelSpec, reader: int, steps: int, results: Any, start_delay: float = 0.0) -> None:
    """Attach as ``reader`` after ``start_delay`` seconds (a slow start: imports on a loaded
    machine), then read ``steps`` steps, putting ``(reader, method, per-array sums)`` on
    ``results`` after each."""
    time.sleep(start_delay)
    channel = StepChannel.attach(spec, reader)
    try:
        for _ in range(steps):
            method, arrays = channel.receive(timeout=60)
            results.put((reader, method, [int(a.astype(np.int64).sum()) for a in arrays]))
    finally:
        channel.close()
