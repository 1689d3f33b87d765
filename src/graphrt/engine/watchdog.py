"""The engine's watchdog (SGLang's ``watchdog_timeout``): a forward that does not finish in time.

One daemon thread sleeps until an armed forward's deadline; then it logs the step and every
thread's stack and raises :class:`~graphrt.core.errors.WatchdogTimeout` in the stepping thread
(``PyThreadState_SetAsyncExc``; steps refused until :meth:`Watchdog.reset`) or, with
``action="kill"``, SIGKILLs the process. See docs/api.md, "Watchdog".

Limit: the exception lands at the thread's next bytecode, so a forward hung in one C call raises
only once it returns; a C call hanging with the GIL held stops the watchdog thread too.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from typing import TYPE_CHECKING, Any, Callable

from graphrt.core import defaults
from graphrt.core.errors import ConfigError, GraphrtError, WatchdogTimeout

if TYPE_CHECKING:
    from graphrt.runner import ModelRunner

#: The watchdog thread wakes this often (at most; timeout / 2 for shorter timeouts) to notice a
#: new forward (arming only stores a timestamp), then sleeps until its deadline.
WATCHDOG_POLL_INTERVAL = 1.0
#: close() waits this long for the watchdog thread to end (it is a daemon thread either way).
WATCHDOG_JOIN_TIMEOUT = 5.0

logger = logging.getLogger(__name__)

#: What a firing watchdog does after logging (``watchdog_action``).
ACTIONS = ("raise", "kill")


class Watchdog:
    """One daemon thread watching the forwards that :meth:`arm` / :meth:`disarm` bracket.

    ``describe(context)`` (on the watchdog thread, when it fires) says what the forward was
    running. ``lock``: the engine's lock; :meth:`reset` takes it, so it fails while the timed-out
    forward has not returned.

    The heartbeat: arming is plain attribute writes the thread polls (``context``, ``thread``,
    ``count += 1``, ``started``, then ``armed = True``), and so is a return (``armed = False``);
    only when :attr:`deciding` is set or :attr:`fired` is the forward's ``count`` must the
    stepping thread call :meth:`disarm` (it raises; calling it always is correct too, and takes
    the lock). The engine's loop writes them itself, with no call into this module per step
    (:meth:`arm` makes the same writes).
    """

    enabled = True

    def __init__(self, timeout: float, *, action: str = defaults.DEFAULT_WATCHDOG_ACTION,
                 describe: Callable[[Any], str] = repr, lock: Any = None,
                 poll_interval: float | None = None, name: str = "graphrt-watchdog") -> None:
        check_watchdog_args(timeout, action)
        if not timeout:
            raise ConfigError("Watchdog: watchdog_timeout must be > 0 (None / 0 means no watchdog)")
        self.timeout = float(timeout)
        self.action = action
        self.poll_interval = (min(WATCHDOG_POLL_INTERVAL, self.timeout / 2)
                              if poll_interval is None else float(poll_interval))
        self.error: WatchdogTimeout | None = None   # set when it fires; cleared by reset()
        self.num_fires = 0
        self._describe = describe
        self._engine_lock = lock
        self._lock = threading.Lock()   # a fire's decision + injection vs. disarm
        # The heartbeat (see the class): written by the stepping thread, polled by the watchdog's.
        self.armed = False
        self.count = 0                  # forwards armed so far
        self.started = 0.0              # time.monotonic() when the armed forward started
        self.thread = 0                 # the stepping thread's ident
        self.context: Any = None
        #: Set by the watchdog's thread while it decides whether to raise (before it reads ``armed``).
        self.deciding = False
        #: The count of the forward it fired for.
        self.fired = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)
        self._thread.start()

    # ---- the stepping thread ---------------------------------------------------------
    def arm(self, context: Any) -> None:
        """A forward starts on this thread; ``context`` is what a dump describes (the heartbeat's
        writes, which the engine's loop makes itself)."""
        self.context = context
        self.thread = threading.get_ident()
        self.count += 1
        self.started = time.monotonic()
        self.armed = True

    def disarm(self) -> None:
        """The forward returned (or raised). If the watchdog fired for it, raise its
        :class:`WatchdogTimeout` here (a still pending one dropped first), so the step fails."""
        self.armed = False
        with self._lock:    # a fire in progress completes first; none can start after this
            if self.fired != self.count or self.error is None:
                return
            try:
                _bytecode_boundary()        # an injected exception still pending is raised here
            except WatchdogTimeout:
                pass
        raise self.error

    def check(self) -> None:
        """Refuse to step after a fire that was not :meth:`reset`: the engine's state is unknown."""
        if self.error is not None:
            raise WatchdogTimeout(f"graphrt: the engine refuses to step after a watchdog timeout; call "
                                  f"llm.watchdog.reset() once the hang is understood, or close it "
                                  f"(the timeout: {self.error})", self.error.step, self.error.elapsed)

    # ---- the user ----------------------------------------------------------------------
    def reset(self, timeout: float = 1.0) -> None:
        """Let the engine step again after a fire. Waits up to ``timeout`` s for the engine's
        lock; if the forward is still hung, raises :class:`GraphrtError` and stays refused."""
        lock = self._engine_lock
        if lock is not None and not lock.acquire(timeout=timeout):
            raise GraphrtError("watchdog reset: the timed-out forward still holds the engine (hung "
                               "inside a C call?); this engine cannot be recovered in this process")
        try:
            self.error = None
        finally:
            if lock is not None:
                lock.release()

    def close(self) -> None:
        """Stop and join the thread (idempotent; also run when the engine is collected)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(WATCHDOG_JOIN_TIMEOUT)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the watchdog thread -----------------------------------------------------------
    def _watch(self) -> None:
        stop = self._stop
        while not stop.is_set():
            if not self.armed:
                stop.wait(self.poll_interval)
                continue
            count = self.count
            left = self.started + self.timeout - time.monotonic()
            if left > 0:
                stop.wait(left)             # the deadline of the forward it saw (or a newer one's)
            elif self.fired == count:
                stop.wait(self.poll_interval)   # fired already; that forward has not returned yet
            else:
                try:
                    self._fire(count)
                except Exception:  # noqa: BLE001 - the watchdog must outlive a failed dump
                    logger.exception("graphrt watchdog: firing failed")
                    self.fired = count

    def _fire(self, count: int) -> None:
        """Dump and log (before deciding: the stacks are the hang's), then, if the same forward
        still runs, raise in its thread (or kill the process)."""
        elapsed = time.monotonic() - self.started
        try:
            step = self._describe(self.context)
        except Exception as exc:  # noqa: BLE001 - a description is best effort
            step = f"(describing the step failed: {exc!r})"
        message = (f"graphrt watchdog: a forward has not finished after {elapsed:.2f} s "
                   f"(watchdog_timeout={self.timeout:g} s): {step}")
        logger.error("%s; action=%s. Every thread's stack (the forward runs in thread %d):\n%s",
                     message, self.action, self.thread, thread_stacks(self.thread))
        if self.action == "kill":
            _kill_own_process()
        # Set before ``armed`` is read: a forward returning now either reads it set (and waits in
        # disarm()) or cleared ``armed`` before that read (and is not raised in).
        self.deciding = True
        try:
            with self._lock:
                if not (self.armed and self.count == count):
                    logger.error("graphrt watchdog: that forward returned after all; nothing raised")
                    return
                self.error = WatchdogTimeout(message, step, elapsed)
                self.fired = count          # before ``deciding`` is cleared
                self.num_fires += 1
                injected = _set_async_exc(self.thread, _injectable(message, step, elapsed))
        finally:
            self.deciding = False
        if not injected:
            logger.error("graphrt watchdog: could not raise in thread %d; the step fails when its "
                         "forward returns", self.thread)


class NoWatchdog:
    """``watchdog_timeout`` None or 0: no thread; arming, disarming and checking do nothing."""

    enabled = False
    timeout = None
    action = None
    error = None
    num_fires = 0
    alive = False
    # The heartbeat's fields (:class:`Watchdog`): written, never read; never fired.
    armed, count, started, thread, context, deciding, fired = False, 0, 0.0, 0, None, False, -1

    def arm(self, context: Any) -> None:
        pass

    def disarm(self) -> None:
        pass

    def check(self) -> None:
        pass

    def reset(self, timeout: float = 1.0) -> None:
        pass

    def close(self) -> None:
        pass


def check_watchdog_args(timeout: float | None, action: str) -> None:
    """Refuse a bad ``watchdog_timeout`` / ``watchdog_action`` (ConfigError naming it)."""
    if action not in ACTIONS:
        raise ConfigError(f"watchdog_action={action!r}: expected one of {ACTIONS}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not math.isfinite(timeout) or timeout < 0):
        raise ConfigError(f"watchdog_timeout={timeout!r}: expected seconds > 0, or None / 0 for none")


def engine_watchdog(runner: ModelRunner, timeout: float | None, action: str, *, owner: Any,
                    lock: Any) -> Watchdog | NoWatchdog:
    """``graphrt.LLM``'s watchdog over ``runner``: stopped by ``owner.close()`` or when ``owner``
    is garbage collected (the thread holds no reference to it)."""
    check_watchdog_args(timeout, action)
    if not timeout:
        return NoWatchdog()
    dog = Watchdog(timeout, action=action, describe=functools.partial(describe_step, runner), lock=lock)
    weakref.finalize(owner, dog.close)
    return dog


def describe_step(runner: ModelRunner, step: Any) -> str:
    """A scheduled step's shape, and the mode and key the runner's dispatcher gives it."""
    sched = [int(n) for n in step.num_scheduled]
    t, r = sum(sched), len(sched)
    q = runner.config.decode_query_len
    uniform = bool(sched) and max(sched) == q and t == r * q
    ids = [req.request_id for req in step.requests]
    shape = (f"step of {r} request(s) {ids if r <= 16 else ids[:16] + ['...']}, {t} token(s), "
             f"{'uniform decode' if uniform else 'mixed'}")
    longest = max((req.num_computed_tokens + n for req, n in zip(step.requests, sched)), default=0)
    try:
        d = runner.dispatcher.dispatch(t, r, uniform, 0, runner.dispatcher.context_bucket(longest))
    except Exception as exc:  # noqa: BLE001 - the shape alone still helps
        return f"{shape}; dispatching it failed: {exc!r}"
    return (f"{shape}; backend {runner.backend.name}, dispatched to mode {d.mode.name} "
            f"key {d.key} ({d.reason})")


def thread_stacks(target: int | None = None) -> str:
    """Every thread's stack, named, the ``target`` thread marked (for a log record)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        mark = "  <- the timed-out forward" if ident == target else ""
        parts.append(f"Thread {names.get(ident, '?')!r} (ident {ident}){mark}, most recent call last:\n"
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def _injectable(message: str, step: str, elapsed: float) -> type[WatchdogTimeout]:
    """A WatchdogTimeout subclass carrying this message (an async exception must be a class)."""
    def __init__(self: WatchdogTimeout, *args: Any) -> None:
        WatchdogTimeout.__init__(self, *(args or (message, step, elapsed)))
    return type("WatchdogTimeout", (WatchdogTimeout,), {"__init__": __init__,
                                                        "__module__": WatchdogTimeout.__module__})


def _bytecode_boundary() -> None:
    """A Python call: CPython raises a pending async exception on entering it. Used rather than
    ``PyThreadState_SetAsyncExc(ident, NULL)``, which before 3.13 leaves the eval breaker set
    for good (every later call slow: a hypothesis shrink took >60 min instead of 7 s)."""


def _set_async_exc(ident: int, exc_type: type[BaseException]) -> bool:
    """Raise ``exc_type`` in thread ``ident`` at its next bytecode."""
    try:
        set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    except AttributeError:          # not CPython
        return False
    return set_async_exc(ctypes.c_ulong(ident), ctypes.py_object(exc_type)) == 1


def _kill_own_process() -> None:
    """SGLang's crash: flush the log handlers, then SIGKILL this process (os._exit without it)."""
    for handler in logging.getLogger().handlers + logger.handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - dying anyway
            pass
    if hasattr(signal, "SIGKILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)


__all__ = ["ACTIONS", "NoWatchdog", "Watchdog", "check_watchdog_args", "describe_step",
           "engine_watchdog", "thread_stacks"]
