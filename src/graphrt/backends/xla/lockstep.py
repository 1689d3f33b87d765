"""Multi-controller XLA with one scheduler: process 0 leads, the other processes follow.

``graphrt.LLM(model_dir, backend="xla", tensor_parallel_size=N)`` on process 0 of a
``jax.distributed`` job whose processes' devices make the N-device mesh: process 0 builds the
engine, schedules, prepares and pads every step, and before each executor call that touches the
devices (allocation, compiles, forward, samplers, refit, sleep / wake) publishes it -- the method
and its arguments -- on the coordination service's key-value store. Every other process runs
:func:`graphrt.backends.xla.follower.serve`: it builds the same executor from process 0's setup and makes the same calls in
the same order, so the compiled programs meet in their collectives, as the torch TP workers
follow their rank 0 (docs/distributed.md, "Multi-controller XLA").

A call's device arguments (the last forward's logits, a sampler's tokens still on the device)
go as references to the follower's own result of the same call; an executor entry as its key
(the follower's own compile of it). The random sampler's host generator is seeded alike on every
process (the seed is in the setup), so its rows agree. Only process 0 reads tokens (from its
addressable shard of the replicated output).
"""

from __future__ import annotations

import functools
import itertools
import logging
import pickle
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from graphrt.core import defaults
from graphrt.core.errors import ConfigError, GraphrtError, RankLostError

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

#: The key-value store's prefix for one engine's messages (a process runs one engine at a time).
_PREFIX = "graphrt/xla-lockstep"
#: Engines this process led or followed: each one's messages under its own number (the
#: processes make their engines in the same order).
_ENGINES = itertools.count()
#: The call that ends a follower's loop.
CLOSE = "close"


@dataclass(frozen=True)
class Setup:
    """What a follower needs to build process 0's executor: the checkpoint, the config, the
    weights' dtype name, the mesh size and the sampler's host seed."""

    model_dir: str
    config: dict
    dtype: Any
    tp_size: int
    sampler_seed: int


@dataclass(frozen=True)
class EntryRef:
    """An executor entry, sent as its key: the follower runs its own compile of that key."""

    key: Any


@dataclass(frozen=True)
class ResultRef:
    """A device array a previous call returned, sent as that call's number."""

    call: int


def client() -> Any:
    """This process's ``jax.distributed`` client (its coordination service's key-value store);
    a ConfigError naming the fix where jax.distributed is not initialised."""
    from jax._src import distributed

    found = distributed.global_state.client
    if found is None:
        raise ConfigError("tensor_parallel_size across processes needs jax.distributed: call "
                          "graphrt.launch('xla', ...) (or jax.distributed.initialize) on every process first")
    return found


def lockstep(method: F) -> F:
    """Mark an executor method every process must call in the same order. Marking costs
    nothing: an executor alone runs its methods as written; :func:`lead` wraps the marked ones of
    a leading executor so that each call is published (under the leader's lock) before it runs."""
    method.__lockstep__ = True  # type: ignore[attr-defined]
    return method


def lead(executor: Any, leader: Leader) -> None:
    """Make ``executor`` process 0's: every :func:`lockstep` method of its class is replaced, on
    this instance only, by one that publishes the call to the followers first."""
    executor.leader = leader
    cls = type(executor)
    for name in dir(cls):
        if getattr(getattr(cls, name, None), "__lockstep__", False):
            setattr(executor, name, _published(leader, name, getattr(executor, name)))


def _published(leader: Leader, name: str, bound: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(bound)
    def call(*args: Any, **kwargs: Any) -> Any:
        with leader.lock:
            number = leader.publish(name, args, kwargs)
            try:
                result = bound(*args, **kwargs)
            except Exception as exc:
                named = leader.fault(name, exc)
                if named is exc:
                    raise
                raise named from exc
            leader.keep(number, result)
            return result
    return call


class Results:
    """The device arrays the last few calls returned, by call number: logits and tokens are
    read by the next calls (the sampler, the logprobs, the next forward's future tokens)."""

    def __init__(self) -> None:
        self.by_number: dict[int, Any] = {}
        self.by_id: dict[int, int] = {}

    def keep(self, number: int, result: Any) -> None:
        import jax

        if not isinstance(result, jax.Array):
            return
        self.by_number[number] = result
        self.by_id[id(result)] = number
        while len(self.by_number) > defaults.XLA_LOCKSTEP_RESULTS_KEPT:
            oldest = next(iter(self.by_number))
            self.by_id.pop(id(self.by_number.pop(oldest)), None)


class Leader:
    """Process 0's side: numbers and publishes each lockstep call."""

    def __init__(self, setup: Setup) -> None:
        import jax

        self.client = client()
        self.followers = list(range(1, jax.process_count()))
        self.lock = threading.RLock()
        self._results = Results()
        self._number = 0
        self._acked = 0
        self.closed = False
        self.prefix = engine_prefix()
        self._put(0, pickle.dumps(setup))

    def _put(self, number: int, payload: bytes) -> None:
        self.client.key_value_set_bytes(f"{self.prefix}/{number}", payload)
        if number % defaults.XLA_LOCKSTEP_GC_EVERY == 0:
            self._collect()

    def _collect(self) -> None:
        """Delete the messages every follower has read (their acknowledgements)."""
        acks = []
        for rank in self.followers:
            acks.append(int(self._try_get(f"ack/{rank}") or 0))
        upto = min(acks, default=0)
        for number in range(self._acked, upto):
            self.client.key_value_delete(f"{self.prefix}/{number}")
        self._acked = max(self._acked, upto)

    def _try_get(self, name: str) -> str | None:
        """A follower's word (its acknowledgement, its error), or None where it has said none."""
        try:
            return self.client.key_value_try_get(f"{self.prefix}/{name}")
        except Exception:  # noqa: BLE001 - NOT_FOUND: nothing said yet
            return None

    def _ref(self, value: Any) -> Any:
        import jax

        from graphrt.backends.xla.entries import XlaEntry

        if isinstance(value, XlaEntry):
            return EntryRef(value.key)
        if type(value) is tuple:                 # a plain tuple (future=(rows, tokens)); others by value
            return tuple(self._ref(v) for v in value)
        if isinstance(value, jax.Array):
            number = self._results.by_id.get(id(value))
            if number is None:
                raise GraphrtError("multi-controller XLA: a device array that no lockstep call returned was "
                                   "passed to the executor; the followers cannot have it")
            return ResultRef(number)
        return value

    def publish(self, name: str, args: tuple, kwargs: dict) -> int:
        """Send one call (its arguments by value, device arrays and entries by reference)."""
        if self.closed:
            raise GraphrtError(f"multi-controller XLA: {name} after the engine was closed")
        self._number += 1
        payload = (name, tuple(self._ref(a) for a in args), {k: self._ref(v) for k, v in kwargs.items()})
        try:
            self._put(self._number, pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise ConfigError(f"multi-controller XLA: the arguments of {name} cannot be sent to the other "
                              f"processes ({exc})") from exc
        return self._number

    def keep(self, number: int, result: Any) -> None:
        self._results.keep(number, result)

    def fault(self, name: str, exc: Exception) -> Exception:
        """The error of a call that failed here: what a follower reported, where one did."""
        reports = []
        for rank in self.followers:
            got = self._try_get(f"error/{rank}")
            if got:
                reports.append(f"process {rank}: {got}")
        if not reports:
            return exc
        return GraphrtError(f"multi-controller XLA: {name} failed ({type(exc).__name__}: {exc}); the followers "
                            f"reported: {'; '.join(reports)}")

    def close(self) -> None:
        """Tell the followers to return from ``serve()`` (once) and wait, up to
        ``defaults.XLA_LOCKSTEP_CLOSE_WAIT_S``, until each has read it: process 0 hosts the
        coordination service, and a follower still waiting on it when process 0 exits is
        terminated by jax instead of returning."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self._number += 1
            try:
                self._put(self._number, pickle.dumps((CLOSE, (), {})))
            except Exception as exc:  # noqa: BLE001 - the followers may be gone already
                logger.warning("multi-controller XLA: could not tell the followers to stop: %s", exc)
                return
            deadline = time.monotonic() + defaults.XLA_LOCKSTEP_CLOSE_WAIT_S
            waiting = list(self.followers)
            while waiting and time.monotonic() < deadline:
                waiting = [r for r in waiting if int(self._try_get(f"ack/{r}") or 0) <= self._number]
                if waiting:
                    time.sleep(0.01)
            if waiting:
                logger.warning("multi-controller XLA: processes %s did not read the close within %.0f s",
                               waiting, defaults.XLA_LOCKSTEP_CLOSE_WAIT_S)


def engine_prefix() -> str:
    """The key-value prefix of this process's next engine (process 0 and the followers count
    their engines alike)."""
    return f"{_PREFIX}/{next(_ENGINES)}"


def report_error(client: Any, prefix: str, rank: int, exc: BaseException) -> None:
    """A follower's failure, where process 0 reads it when its own call fails (best effort)."""
    try:
        client.key_value_set(f"{prefix}/error/{rank}", f"{type(exc).__name__}: {exc}", allow_overwrite=True)
    except Exception:  # noqa: BLE001 - the report is best effort; the error is raised anyway
        pass


def start_leader(config: Any, model_dir: str, dtype: Any, tp_size: int) -> tuple[Leader, int]:
    """Process 0: publish the setup; returns the leader and the sampler seed its executor uses."""
    seed = secrets.randbits(63)
    setup = Setup(model_dir, config.model_dump(), dtype, tp_size, seed)
    return Leader(setup), seed


def receive(client: Any, prefix: str, number: int, rank: int, timeout: float | None = None) -> Any:
    """Message ``number``, waiting in slices (at most ``timeout`` seconds: a GraphrtError
    after); rank 0's coordination service gone: RankLostError."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if deadline is not None and time.monotonic() > deadline:
            raise GraphrtError(f"multi-controller XLA: process 0 published no engine within {timeout:.0f} s; it builds "
                               "graphrt.LLM(model_dir, backend='xla', tensor_parallel_size=N) while this process "
                               "runs serve() (see its log: did it fail before?)")
        try:
            payload = client.blocking_key_value_get_bytes(f"{prefix}/{number}",
                                                          int(defaults.XLA_LOCKSTEP_POLL_S * 1000))
        except Exception as exc:  # noqa: BLE001 - a deadline is a poll; anything else lost rank 0
            text = str(exc)
            if "DEADLINE_EXCEEDED" in text or "timed out" in text.lower():
                continue
            raise RankLostError(f"multi-controller XLA: process {rank} lost process 0 (its coordination "
                                f"service stopped answering while waiting for call {number}: {text})", 0) from exc
        client.key_value_set(f"{prefix}/ack/{rank}", str(number + 1), allow_overwrite=True)
        return pickle.loads(payload)


__all__ = ["CLOSE", "Leader", "Results", "Setup", "engine_prefix", "lockstep", "receive", "report_error", "start_leader"]
