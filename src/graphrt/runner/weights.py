"""A runner's weights and memory: in-place refit, sleep / wake, and the live-buffer check
(``runner.weights``; ``ModelRunner.update_weights``, ``sleep``, ``wake`` and ``recapture`` call it).

A captured graph reads fixed buffers, so nothing it reads may change unseen:

* a refit copies into the parameters' storage (the executor's ``update_weights``), so every graph
  and executable uses the new values with no rebuild;
* sleep gives the weights' and caches' memory back and wake takes it again in the same storage
  objects; where the device put a buffer back at another address, the graphs reading it are
  recaptured (``stats.recaptured``, a warning in the log) -- never replayed stale;
* the live-buffer check (the executor's ``stale_buffers``) runs at every refit, sleep, wake and
  LoRA load: a buffer re-bound or reallocated under the graphs is a
  :class:`~graphrt.core.errors.StaleBufferError` naming it, its module and the graph keys, and
  every step is refused until :meth:`RunnerWeights.recapture`.

Steps are refused while asleep, after a level-2 wake until every weight was refit, and while
stale (:attr:`RunnerWeights.blocked`; :meth:`RunnerWeights.refusal` is the error).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Hashable

from graphrt.core.cache import FailedBuild, GraphCache, describe_key
from graphrt.core.dispatch import SamplerKey
from graphrt.core.errors import EngineAsleepError, GraphrtError, InputError, StaleBufferError
from graphrt.core.graph_modes import RuntimeMode
from graphrt.core.weight_reports import stale_error

logger = logging.getLogger("graphrt.runner")

#: At most this many missing weight names in a refusal.
MISSING_SHOWN = 6


@dataclass
class WeightStats:
    """What a runner's weights feature did (``runner.weights.stats``; ``LLM.stats["weights"]``)."""

    refits: int = 0
    refit_tensors: int = 0
    refit_bytes: int = 0
    refit_seconds: float = 0.0          # all refits together
    last_refit_seconds: float = 0.0
    sleeps: int = 0
    wakes: int = 0
    released_bytes: int = 0             # by the last sleep
    measured_bytes: int | None = None   # the last sleep's measured drop (None: not measurable here)
    recaptured: int = 0                 # graph keys built again over moved buffers
    checks: int = 0                     # live-buffer checks run
    stale_found: int = 0                # checks that found a buffer moved under the graphs

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["refit_seconds"] = round(self.refit_seconds, 6)
        out["last_refit_seconds"] = round(self.last_refit_seconds, 6)
        return out


class RunnerWeights:
    """The runner's weights feature (module docstring), over ``executor`` and the runner's two
    caches; every public method takes the runner's step ``lock``."""

    def __init__(self, executor: Any, cache: GraphCache, sampler_cache: GraphCache, lock: Any,
                 building: Callable[[], bool] = lambda: False) -> None:
        """``building()``: whether background warm-up still builds keys (a sleep waits for it)."""
        self.executor, self.cache, self.sampler_cache = executor, cache, sampler_cache
        #: The executor's buffer watch, asked for once (``Executor.buffer_watch``): before each step
        #: the runner reads its ``due`` and runs :meth:`verify` when set; None: nothing can move.
        self.watch = executor.buffer_watch()
        self._lock = lock
        self._building = building
        #: The sleep level while asleep, else None.
        self.level: int | None = None
        #: Weights a level-2 wake left unwritten: steps are refused until a refit fills them.
        self.unfilled: frozenset[str] = frozenset()
        #: The stale buffers a check found: steps are refused until :meth:`recapture`.
        self.stale: StaleBufferError | None = None
        #: Whether steps are refused now (:meth:`refusal` says why).
        self.blocked = False
        self.stats = WeightStats()

    # ---- refusal ---------------------------------------------------------------------
    def refusal(self) -> GraphrtError:
        """The error of a step refused now (:attr:`blocked`)."""
        if self.level is not None:
            return EngineAsleepError(f"the runner sleeps (level {self.level}): its weights and caches are released; "
                                     "call wake() before running a step")
        if self.unfilled:
            shown = ", ".join(sorted(self.unfilled)[:MISSING_SHOWN])
            return EngineAsleepError(f"the runner woke from a level-2 sleep, which dropped its weights, and "
                                     f"{len(self.unfilled)} are not refit yet ({shown}"
                                     f"{', ...' if len(self.unfilled) > MISSING_SHOWN else ''}): call "
                                     "update_weights(...) with them before running a step")
        if self.stale is not None:
            return StaleBufferError(str(self.stale), self.stale.buffers, self.stale.keys)
        return GraphrtError("steps are not refused")

    def _update_blocked(self) -> None:
        self.blocked = self.level is not None or bool(self.unfilled) or self.stale is not None

    # ---- the live-buffer check -----------------------------------------------------------
    def entries(self) -> list[tuple[Hashable, Any]]:
        """Every built entry of both caches by its cache key (failed builds left out)."""
        out = []
        for cache in (self.cache, self.sampler_cache):
            for key in cache.keys():
                entry = cache.lookup(key)
                if entry is not None and not isinstance(entry, FailedBuild):
                    out.append((key, entry))
        return out

    def verify(self) -> None:
        """The live-buffer check, the runner's lock held: a :class:`StaleBufferError` naming every
        moved buffer, its module and the keys reading it; steps are refused from then on."""
        self.stats.checks += 1
        stale = self.executor.stale_buffers(self.entries())
        if not stale:
            return
        self.stats.stale_found += 1
        self.stale = stale_error(stale)
        self._update_blocked()
        logger.error("graphrt: %s", self.stale)
        raise StaleBufferError(str(self.stale), self.stale.buffers, self.stale.keys)

    def check(self) -> None:
        """:meth:`verify` under the runner's lock (a caller's own check, e.g. after touching the model)."""
        with self._lock:
            self.verify()

    def verify_if_changed(self) -> None:
        """Before a step (the runner's lock held): :meth:`verify` when the executor's watch says
        something may have moved since the last check (:attr:`watch`)."""
        if self.watch is not None and self.watch.due:
            self.verify()

    def ready(self) -> None:
        """Whether a step may run now, before any is scheduled (``graphrt.LLM`` refuses requests
        early): the refusal when :attr:`blocked`, else the due live-buffer check."""
        with self._lock:
            if self.blocked:
                raise self.refusal()
            self.verify_if_changed()

    def recapture(self) -> int:
        """Build again every key whose buffers moved, over the current buffers; steps run again.
        Returns how many keys were recaptured."""
        with self._lock:
            self.stats.checks += 1
            n = self._recapture(self.executor.stale_buffers(self.entries()), "runner.recapture()")
            self.stale = None
            self._update_blocked()
            return n

    def _recapture(self, stale: dict[Hashable, list[str]], why: str) -> int:
        """Rebuild each key of ``stale`` in its cache (a failed build: it runs eagerly from now on)."""
        for cache_key in stale:
            if isinstance(cache_key, SamplerKey):
                target, mode, key = self.sampler_cache, RuntimeMode.FULL, cache_key
            else:
                target, (mode, key) = self.cache, cache_key
            t0 = time.perf_counter()
            try:
                entry, nbytes = self.executor.build(mode, key)
            except Exception as exc:  # noqa: BLE001 - the key runs eagerly, as after a failed capture
                reason = self.executor.describe_build_failure(exc)
                logger.warning("graphrt: recapturing %s failed, it runs eagerly: %s", describe_key(cache_key), reason)
                target.replace(cache_key, FailedBuild(reason))
                continue
            target.replace(cache_key, entry, seconds=time.perf_counter() - t0, nbytes=nbytes)
        if stale:
            moved = sorted({b for buffers in stale.values() for b in buffers})
            self.stats.recaptured += len(stale)
            logger.warning("graphrt: %s: %d graph key(s) recaptured because %d buffer(s) they read moved (%s%s)",
                           why, len(stale), len(moved), "; ".join(moved[:4]), "; ..." if len(moved) > 4 else "")
        return len(stale)

    # ---- refit -----------------------------------------------------------------------------
    def update(self, source: Any) -> dict[str, Any]:
        """Refit in place (``ModelRunner.update_weights``): the live-buffer check, then every tensor
        of ``source`` checked and copied; returns what was written and how long it took."""
        with self._lock:
            if self.level is not None:
                raise EngineAsleepError(f"update_weights: the runner sleeps (level {self.level}); call wake() first, "
                                        "then refit")
            if source is None:
                raise InputError("weights", "a checkpoint path, a mapping or an iterable of (name, tensor), got None")
            self.verify()
            result = self.executor.update_weights(source)
            self.unfilled = self.unfilled - result.filled
            self._update_blocked()
            s = self.stats
            s.refits += 1
            s.refit_tensors += result.tensors
            s.refit_bytes += result.bytes
            s.refit_seconds += result.seconds
            s.last_refit_seconds = result.seconds
            logger.info("graphrt: refit %d tensors (%.1f MB) in place in %.4f s%s", result.tensors, result.bytes / 1e6,
                        result.seconds, f"; {len(self.unfilled)} weights still to refit" if self.unfilled else "")
            return {**result.as_dict(), "unfilled": len(self.unfilled)}

    # ---- sleep and wake --------------------------------------------------------------------
    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Release the weights (offloaded at level 1, dropped at 2) and the KV and state caches;
        every step is refused until :meth:`wake`. Returns the bytes released and measured."""
        with self._lock:
            if self.level is not None:
                raise EngineAsleepError(f"sleep: the runner already sleeps (level {self.level})")
            if self._building():
                raise GraphrtError("sleep: background warm-up still builds keys over these buffers; wait for it "
                                   "(runner.background.wait()) first")
            self.verify()                    # nothing stale goes to sleep unseen
            report = self.executor.sleep(level)
            self.level = report.level
            self._update_blocked()
            s = self.stats
            s.sleeps += 1
            s.released_bytes, s.measured_bytes = report.released_bytes, report.measured_bytes
            logger.info("graphrt: asleep at level %d: %.1f MB released (weights %.1f MB, caches %.1f MB; %.1f MB "
                        "kept on the host), measured %s", report.level, report.released_bytes / 1e6,
                        report.weight_bytes / 1e6, report.cache_bytes / 1e6, report.offloaded_bytes / 1e6,
                        "n/a" if report.measured_bytes is None else f"{report.measured_bytes / 1e6:.1f} MB")
            return report.as_dict()

    def wake(self) -> dict[str, Any]:
        """Take the memory back in the same storage objects; recapture the keys whose buffers came
        back elsewhere. After a level-2 sleep steps wait for a refit of every weight."""
        with self._lock:
            if self.level is None:
                raise GraphrtError("wake: the runner is not asleep")
            report = self.executor.wake()
            self.level = None
            if report.needs_weights:
                self.unfilled = frozenset(self.executor.weight_names())
            self.stats.wakes += 1
            self.stats.checks += 1
            recaptured = self._recapture(self.executor.stale_buffers(self.entries()), "wake")
            self._update_blocked()
            logger.info("graphrt: awake: %.1f MB restored in %.4f s, %d graph key(s) recaptured%s",
                        report.restored_bytes / 1e6, report.seconds, recaptured,
                        "; refit the weights before the next step" if self.unfilled else "")
            return {**report.as_dict(), "recaptured": recaptured}


__all__ = ["RunnerWeights", "WeightStats"]
