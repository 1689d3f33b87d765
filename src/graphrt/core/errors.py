"""Errors raised by graphrt. Every one derives from :class:`GraphrtError`."""

from __future__ import annotations


class GraphrtError(Exception):
    """Base class of every error graphrt raises on purpose."""


class BackendUnavailableError(GraphrtError, RuntimeError):
    """A backend was asked for that cannot run here; the message says why."""


class InputError(GraphrtError, ValueError):
    """Bad input to a graphrt call. The message names the field and the bound.

    Raised before any persistent buffer or KV cache is touched.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class CacheMissError(GraphrtError, RuntimeError):
    """Strict mode: a step needed a graph or executable that warm-up did not build."""

    def __init__(self, key: object, reason: str, description: str | None = None) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"no captured graph / compiled executable for {description or key}: {reason}")


class GraphCaptureError(GraphrtError, RuntimeError):
    """Something inside a capture region would break a device graph (e.g. a host sync)."""


class ConfigError(GraphrtError, ValueError):
    """An invalid combination of configuration values."""


class KVCacheLostError(GraphrtError, RuntimeError):
    """A step failed after its executable had consumed the donated KV cache (XLA).

    The executor has already re-created the cache, zeroed, so the next step runs; but the KV
    of every request computed so far is gone. ``request_ids`` names the requests that held KV
    when an engine (``graphrt.LLM``) caught it -- it recomputes them -- and is empty when the
    error comes straight from ``ModelRunner.execute``: then every request is affected.
    """

    def __init__(self, message: str, request_ids: tuple[int, ...] = ()) -> None:
        self.request_ids = tuple(request_ids)
        super().__init__(message)


class GenerationError(GraphrtError, RuntimeError):
    """``LLM.generate`` failed: some of its requests failed and the rest were aborted.

    ``outputs`` has one ``RequestOutput`` per prompt, in prompt order: requests that finished
    before the failure keep their reason ("stop" / "length"), failed ones say "error" and
    aborted ones "abort" (each with ``error`` saying why). ``__cause__`` is the first fault.
    """

    def __init__(self, message: str, outputs: list) -> None:
        self.outputs = outputs
        super().__init__(message)


class WatchdogTimeout(GraphrtError, RuntimeError):
    """``graphrt.LLM``'s watchdog: a forward did not finish within ``watchdog_timeout``.

    The message names the step (requests, tokens) and the key it dispatched to; every
    thread's stack went to the log at ERROR. The engine refuses to step (raising this again)
    until ``llm.watchdog.reset()``. ``step`` describes the step, ``elapsed`` is how long its
    forward had run when the watchdog fired (seconds).
    """

    def __init__(self, message: str, step: str = "", elapsed: float = 0.0) -> None:
        self.step = step
        self.elapsed = elapsed
        super().__init__(message)


class StaleBufferError(GraphrtError, RuntimeError):
    """A buffer captured graphs read (a parameter, a module buffer, the KV or state cache, a LoRA
    slot, a sampler workspace) is no longer the one they captured: re-bound, moved by ``.to()``,
    reallocated. A replay would read the old memory, so every step is refused until
    ``runner.recapture()`` captures the named keys again (or the buffer is put back).

    ``buffers``: each moved buffer as ``"name (module m)"``; ``keys``: the graph keys reading them.
    """

    def __init__(self, message: str, buffers: tuple[str, ...] = (), keys: tuple[object, ...] = ()) -> None:
        self.buffers = tuple(buffers)
        self.keys = tuple(keys)
        super().__init__(message)


class EngineAsleepError(GraphrtError, RuntimeError):
    """A step (or a request) reached an engine that sleeps (``sleep()``), or that woke from a
    level-2 sleep and still lacks weights: ``wake()`` first, then refit what was dropped."""


class RequestsInFlightError(GraphrtError, RuntimeError):
    """``sleep()`` found requests queued or running and was not asked to drain them
    (``sleep(drain=True)``); ``request_ids`` names them. Nothing was released."""

    def __init__(self, message: str, request_ids: tuple[int, ...] = ()) -> None:
        self.request_ids = tuple(request_ids)
        super().__init__(message)


class CollectiveMismatchError(GraphrtError, RuntimeError):
    """The ranks of one parallel group captured different collective sequences for the same key
    (an op, group, shape or dtype differs, or one rank has more): replaying them would hang or
    reduce unrelated tensors. Raised on every rank; the key is never replayed, and the engine
    stops (an eager run of the same forward would meet the same mismatch).

    ``key``: the key being captured; ``first``: per rank, its first collective that differs
    from another rank's, as text (``"none (3 in all)"`` where a rank has fewer).
    """

    def __init__(self, message: str, key: object = None, first: dict[int, str] | None = None) -> None:
        self.key = key
        self.first = dict(first or {})
        super().__init__(message)


class RankLostError(GraphrtError, RuntimeError):
    """A rank of a parallel group is gone (its process or node died, or it stopped answering)
    while a call was in flight: ``rank`` names it. Every later call raises it again; the engine
    must be rebuilt."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        self.rank = rank
        super().__init__(message)


class StepMismatchError(GraphrtError, RuntimeError):
    """Multi-controller XLA: the ``jax.distributed`` processes of one engine were about to run
    different steps (another key, other inputs) -- their requests or schedules differ. Raised on
    every process before the step runs (running it would hang or mix the processes' data);
    ``steps`` has each process's key and input checksums."""

    def __init__(self, message: str, steps: list | None = None) -> None:
        self.steps = list(steps or [])
        super().__init__(message)
