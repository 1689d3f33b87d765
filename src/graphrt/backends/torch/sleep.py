"""Sleep and wake of a torch executor: its memory given back and taken again, the storage
objects the captured graphs hold kept (docs/api.md, "Reinforcement-learning rollouts").

``sleep(1)`` copies the parameters and module buffers to host memory and drops the KV and state
caches; ``sleep(2)`` drops the parameters too (the caller refits them after waking); module
buffers (LoRA slots, rotary tables) are kept on the host at either level. Dropping is
``untyped_storage().resize_(0)``: every tensor and graph keeps its storage object, and
:meth:`TorchSleep.wake` resizes each back (zeroed caches, the host copies written in). A device
allocator may hand the storage back at another address: wake names those buffers, and the
runner recaptures the graphs that read them (the live-buffer check,
:mod:`~graphrt.backends.torch.live_buffers`, finds them).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from graphrt.core.errors import ConfigError, GraphrtError
from graphrt.core.weight_reports import SleepReport, WakeReport, check_level

logger = logging.getLogger(__name__)

@dataclass
class _Held:
    """One storage put to sleep: what it was, and its host copy (None: dropped)."""

    name: str
    kind: str                   # "weight", "buffer" or "cache"
    storage: Any                # the torch.UntypedStorage every tensor of it keeps
    nbytes: int
    ptr: int
    host: torch.Tensor | None


def _bytes_of(storage: Any) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def resident_bytes() -> int | None:
    """This process's resident memory (Linux ``/proc/self/statm``), None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class TorchSleep:
    """Puts a torch executor's ``model`` and caches (``caches()``: the KV and state tensors by
    name) to sleep and back; ``graph_api`` synchronises and releases device memory (None: eager)."""

    def __init__(self, model: torch.nn.Module, caches: Callable[[], dict[str, torch.Tensor]], device: torch.device,
                 graph_api: Any, pin: bool) -> None:
        self.model, self._caches, self.device, self.graph_api, self.pin = model, caches, device, graph_api, pin
        #: The level slept at, None while awake.
        self.level: int | None = None
        self._held: list[_Held] = []

    def _collect(self, level: int) -> list[_Held]:
        """Every distinct storage to put to sleep, checked resizable first (all or nothing)."""
        seen: dict[int, _Held] = {}
        groups: list[tuple[str, Iterable[tuple[str, torch.Tensor]]]] = [
            ("cache", self._caches().items()),
            ("weight", self.model.named_parameters(remove_duplicate=False)),
            ("buffer", self.model.named_buffers(remove_duplicate=False))]
        for kind, named in groups:
            for name, t in named:
                storage = t.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes == 0 or ptr in seen:
                    continue
                if not storage.resizable():
                    raise ConfigError(f"sleep: the storage of {name} cannot be resized (memory-mapped or borrowed "
                                      f"from another library), so it cannot be released in place; load the model "
                                      f"with its own storage (graphrt's loaders do)")
                seen[ptr] = _Held(name, kind, storage, nbytes, ptr, None)
        return list(seen.values())

    def sleep(self, level: int) -> SleepReport:
        """Offload (level 1) or drop (level 2) the weights, drop the caches; what was released."""
        level = check_level(level)
        if self.level is not None:
            raise GraphrtError(f"sleep: already asleep (level {self.level}); wake() first")
        t0 = time.perf_counter()
        held = self._collect(level)
        if self.graph_api is not None:
            self.graph_api.synchronize()
        before = self._free_bytes()
        offloaded = 0
        with torch.no_grad():
            for h in held:
                if h.kind == "buffer" or (h.kind == "weight" and level == 1):
                    h.host = torch.empty(h.nbytes, dtype=torch.uint8, pin_memory=self.pin)
                    h.host.copy_(_bytes_of(h.storage))
                    offloaded += h.nbytes
            for h in held:
                h.storage.resize_(0)
        if self.graph_api is not None:
            self.graph_api.release_memory()
        after = self._free_bytes()
        self._held, self.level = held, level
        weights = sum(h.nbytes for h in held if h.kind != "cache")
        caches = sum(h.nbytes for h in held if h.kind == "cache")
        return SleepReport(level, weights + caches, offloaded, weights, caches,
                           None if before is None or after is None else after - before, time.perf_counter() - t0)

    def wake(self) -> WakeReport:
        """Every storage back at its size: host copies written in, caches (and weights dropped at
        level 2) zeroed; names the buffers that came back at another address."""
        if self.level is None:
            raise GraphrtError("wake: the executor is not asleep")
        t0 = time.perf_counter()
        moved = []
        with torch.no_grad():
            for h in self._held:
                h.storage.resize_(h.nbytes)
                data = _bytes_of(h.storage)
                if h.host is not None:
                    data.copy_(h.host)
                else:
                    data.zero_()
                if h.storage.data_ptr() != h.ptr:
                    moved.append(h.name)
        if self.graph_api is not None:
            self.graph_api.synchronize()
        needs = self.level == 2
        restored = sum(h.nbytes for h in self._held)
        self._held, self.level = [], None
        return WakeReport(restored, time.perf_counter() - t0, needs, tuple(moved))

    def _free_bytes(self) -> int | None:
        """Free device memory (the device's own count), or on a CPU device minus the process's
        resident memory: what a sleep's difference measures."""
        info = self.graph_api.memory_info() if self.graph_api is not None else None
        if info is not None:
            return int(info[0])
        if self.device.type == "cpu":
            rss = resident_bytes()
            return None if rss is None else -rss
        return None


__all__ = ["TorchSleep", "resident_bytes"]
