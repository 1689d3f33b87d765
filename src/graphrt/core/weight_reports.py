"""What an executor reports of an in-place weight refit, a sleep and a wake (framework-free).

The executor fills these (backends/torch/weights.py, backends/xla/weights.py); the runner's
weights feature (graphrt/runner_weights.py) adds them up in its stats and returns them as dicts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Hashable

from graphrt.core.cache import describe_key
from graphrt.core.errors import InputError, StaleBufferError

#: The sleep levels: 1 offloads the weights to host memory, 2 drops them; both drop the caches.
SLEEP_LEVELS = (1, 2)


def check_level(level: Any) -> int:
    """``level`` as 1 or 2, else InputError naming it."""
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise InputError("level", f"sleep level must be 1 (weights offloaded to host memory, caches dropped) or 2 "
                                  f"(weights dropped too), got {level!r}")
    return int(level)


@dataclass(frozen=True)
class WeightsUpdate:
    """One refit: ``tensors`` checkpoint tensors copied (``skipped``: names that fill nothing by
    design, e.g. a tied head), ``bytes`` written into the model's storage, the seconds it took
    (checking included), and ``filled``: the weight names it wrote (the executor's
    :meth:`~graphrt.backends.base.Executor.weight_names` namespace)."""

    tensors: int
    bytes: int
    seconds: float
    filled: frozenset[str] = frozenset()
    skipped: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"tensors": self.tensors, "bytes": self.bytes, "seconds": round(self.seconds, 6),
                "skipped": list(self.skipped)}


@dataclass(frozen=True)
class SleepReport:
    """One sleep: ``level``; ``released_bytes`` the device bytes the executor let go (weights,
    module buffers, KV and state caches, by their sizes); ``offloaded_bytes`` those it keeps on
    the host to put back at wake; ``measured_bytes`` the drop in the device allocator's (or, on a
    CPU device, the process's resident) memory across the sleep, None where it cannot be read."""

    level: int
    released_bytes: int
    offloaded_bytes: int
    weight_bytes: int
    cache_bytes: int
    measured_bytes: int | None
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["seconds"] = round(self.seconds, 6)
        return out


@dataclass(frozen=True)
class WakeReport:
    """One wake: the bytes given back to the device, the buffers that came back at another
    address than the graphs captured (``moved``: their names; the runner recaptures the keys
    reading them), and whether the weights must be refit (a level-2 sleep dropped them)."""

    restored_bytes: int
    seconds: float
    needs_weights: bool
    moved: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        return {"restored_bytes": self.restored_bytes, "seconds": round(self.seconds, 6),
                "needs_weights": self.needs_weights, "moved": list(self.moved)}


def stale_error(stale: dict[Hashable, list[str]]) -> StaleBufferError:
    """The named error of graphs whose buffers moved (``stale``: cache key -> what moved, as an
    executor's ``stale_buffers`` says): every buffer with its module, and the graph keys."""
    buffers = sorted({b for moved in stale.values() for b in moved})
    keys = tuple(stale)
    shown = "; ".join(buffers[:6]) + (f"; and {len(buffers) - 6} more" if len(buffers) > 6 else "")
    key_text = ", ".join(describe_key(k) for k in keys[:6]) + (f", and {len(keys) - 6} more" if len(keys) > 6 else "")
    return StaleBufferError(
        f"{len(buffers)} buffer(s) captured graphs read were re-bound, converted or reallocated since capture: "
        f"{shown}; read by graph key(s) {key_text}. A replay would read the old memory, so steps are refused: "
        "copy new values in place (update_weights) instead of re-binding, or call runner.recapture() to capture "
        "these keys again over the current buffers", tuple(buffers), keys)


__all__ = ["SLEEP_LEVELS", "SleepReport", "WakeReport", "WeightsUpdate", "check_level", "stale_error"]
