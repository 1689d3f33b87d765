"""The engine process's graphrt state under vLLM: one :class:`GraphCache` of the keys vLLM's
dispatcher runs (strict once ``capture_model`` is over), the device-graph API and pool every
wrapper captures into, and the step accounting. It imports no vLLM: the wrappers (:mod:`.wrapper`)
and the runner (:mod:`.worker`) tell it what happened.

One step is counted once, by whoever sees it whole: the FULL wrapper for a FULL step, the first
PIECEWISE piece for a PIECEWISE step and, where PIECEWISE pieces exist, for an eager step (else
the FULL wrapper counts those too). Only traffic counts: steps after warm-up (:meth:`Session.seal`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Hashable

from graphrt.core.cache import GraphCache, describe_key
from graphrt.core.eager import EagerCause
from graphrt.core.errors import CacheMissError
#: graphrt's messages under vLLM go to a child of vLLM's logger, so they appear in vLLM's log, its
#: format and its level (``VLLM_LOGGING_LEVEL``).
LOGGER = "vllm.graphrt"
logger = logging.getLogger(LOGGER)


@dataclass
class StepSizes:
    """The real size of the step the runner is about to run (set by the runner, read by a wrapper)."""

    tokens: int = 0
    reqs: int = 0


@dataclass
class Session:
    """graphrt's state in one vLLM engine process (see the module docstring)."""

    cache: GraphCache = field(default_factory=lambda: GraphCache(strict=True))
    #: Captured graph objects (a PIECEWISE key has one per piece).
    graphs: int = 0
    #: ``(graph API, GraphPool)``, made on first capture for the device vLLM runs on.
    device: tuple[Any, Any] | None = None
    step: StepSizes = field(default_factory=StepSizes)
    #: The largest token count vLLM captures, and whether PIECEWISE pieces exist (they count eager steps).
    max_capture_size: int = 0
    has_piecewise: bool = True
    mode_name: str = ""

    @property
    def sealed(self) -> bool:
        return self.cache.sealed

    def configure(self, *, max_capture_size: int, has_piecewise: bool, mode_name: str) -> None:
        """What vLLM's resolved compilation config says (before capture)."""
        self.max_capture_size, self.has_piecewise, self.mode_name = int(max_capture_size), has_piecewise, mode_name

    def pool(self, device_type: str) -> Any:
        """The :class:`~graphrt.backends.torch.device_graphs.GraphPool` of graphrt's graph API for
        ``device_type`` (``cpu``: the recording graph; ``cuda``: CUDA graphs, for a CUDA platform,
        which the plugin does not hand vLLM yet: :data:`graphrt.integrations.vllm.PLATFORMS`), made once."""
        if self.device is None:
            from graphrt.backends.torch.device_graphs import GraphPool

            if device_type == "cuda":
                from graphrt.backends.torch.cuda import CudaGraphAPI

                api: Any = CudaGraphAPI()
            else:
                from graphrt.backends.torch.cpu import CpuGraphAPI

                api = CpuGraphAPI()
            self.device = (api, GraphPool(api))
        return self.device[1]

    def check_capture(self, key: Hashable, module: str) -> None:
        """A wrapper is about to capture ``key``: after warm-up that is a late capture, which
        strict mode refuses naming the key and the module."""
        if self.sealed:
            self.cache.stats.misses += 1
            raise CacheMissError(key, f"vLLM asked {module} for a graph after warm-up; graphrt captures only the "
                                      f"keys of vLLM's capture sizes during capture_model "
                                      f"({len(self.cache)} keys captured: {self.describe_keys()})",
                                 description=describe_key(key))

    def captured(self, key: Hashable, *, seconds: float, nbytes: int, first: bool) -> None:
        """One graph of ``key`` was captured (``first``: by the wrapper that counts the key)."""
        self.graphs += 1
        if first:
            self.cache.put(key, True, seconds=seconds, nbytes=nbytes)
        elif key in self.cache:
            entry = self.cache.stats.per_key[key]
            entry.build_seconds += seconds
            entry.build_bytes += int(nbytes)

    def seal(self) -> None:
        """Warm-up is over: later captures are refused (strict), and steps count from now on."""
        self.cache.seal()
        logger.info("graphrt: captured %d keys (%d graphs) for vLLM, %s: %s", len(self.cache), self.graphs,
                    self.mode_name, self.describe_keys())

    def describe_keys(self) -> str:
        keys = [describe_key(k) for k in self.cache.keys()]
        return ", ".join(keys[:8]) + (", ..." if len(keys) > 8 else "")

    def replayed(self, key: Hashable, padded_tokens: int, padded_reqs: int | None) -> None:
        """A traffic step replayed ``key``."""
        if self.sealed:
            self.cache.record_step(real_tokens=self.step.tokens, padded_tokens=padded_tokens,
                                   real_reqs=self.step.reqs, padded_reqs=padded_reqs or self.step.reqs,
                                   key=key, hit=True)

    def ran_eagerly(self, num_tokens: int, uniform: bool) -> None:
        """A traffic step of ``num_tokens`` (padded) tokens ran without a graph: vLLM's dispatcher
        chose none. The cause: above the largest capture size, or the mode does not cover it."""
        if not self.sealed:
            return
        if num_tokens > self.max_capture_size:      # reasons are counted: no per-step numbers in them
            cause = EagerCause.ABOVE_LARGEST_BUCKET
            reason = f"more tokens than vLLM's largest capture size ({self.max_capture_size})"
        else:
            cause = EagerCause.MODE
            kind = "uniform decode" if uniform else "mixed / prefill"
            reason = f"cudagraph_mode {self.mode_name} has no graph for a {kind} step"
        self.cache.record_step(real_tokens=self.step.tokens, padded_tokens=num_tokens, real_reqs=self.step.reqs,
                               padded_reqs=self.step.reqs, eager_reason=reason, eager_cause=cause)

    def report(self) -> dict[str, Any]:
        """Plain numbers: keys and graphs captured, replays per runtime mode, and the cache's statistics."""
        by_mode: dict[str, int] = {}
        for key, entry in self.cache.stats.per_key.items():
            by_mode[key[0]] = by_mode.get(key[0], 0) + entry.hits
        return {"keys": len(self.cache), "graphs": self.graphs, "mode": self.mode_name, "replays_by_mode": by_mode,
                **self.cache.stats.as_dict()}

    def summary(self) -> str:
        """One line for the engine's log."""
        s = self.cache.stats
        return (f"graphrt under vLLM ({self.mode_name}): {len(self.cache)} keys / {self.graphs} graphs captured, "
                f"{s.steps} steps: {s.hits} replayed, {s.summary()}")

    def reset(self) -> None:
        """Forget everything (a new engine in this process)."""
        fresh = Session()
        self.__dict__.update(fresh.__dict__)


#: This process's session (vLLM runs one engine per worker process).
SESSION = Session()
