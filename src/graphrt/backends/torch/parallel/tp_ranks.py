"""Rank 0's side of its tensor-parallel workers: starting or joining them, waiting on them,
naming the one that failed, and stopping them.

* :class:`SpawnedRanks` -- rank 0 starts the workers, forms the group through its own
  rendezvous store and talks over the shared-memory step channel; a worker that exits is named
  with its exit code and error (also while the group forms), one that hangs by its call.
* :class:`JoinedRanks` -- ranks launched by someone else (``torchrun``) serve calls sent as gloo
  broadcasts; a failure names the call only.

Both gather every rank's status per call on a gloo control group (:class:`Agreement`), with a
deadline."""

from __future__ import annotations

import copy
import logging
import multiprocessing as mp
import signal
import threading
import time
from datetime import timedelta
from multiprocessing.connection import wait as wait_any
from typing import Any

import numpy as np
import torch.distributed as dist

from graphrt.backends.torch.parallel import tp_protocol as p
from graphrt.backends.torch.parallel import tp_rendezvous as rz
from graphrt.core import defaults
from graphrt.backends.torch.parallel.tp_liveness import Heartbeat, default_store
from graphrt.core.errors import ConfigError, GraphrtError, RankLostError
from graphrt.backends.torch.parallel.tp_channel import StepChannel

#: ... close() waits this long for workers to exit after the shutdown call, then terminates,
#: then kills, waiting this long after each.
TP_WORKER_JOIN_TIMEOUT_S = 10.0
#: ... after a failed collective, how long rank 0 waits for a worker's exit to show before
#: calling the others hung.
TP_FAULT_GRACE_S = 1.0
#: ... how workers start: "forkserver" (Linux: torch is imported once, in the fork server, so
#: later engines' workers start in milliseconds) or "spawn" (where forkserver is missing).
TP_WORKER_START_METHOD = "forkserver"

logger = logging.getLogger(__name__)

#: Whether a live SpawnedRanks of this process owns the default process group.
_OWNED_GROUP = [False]


class Ranks:
    """What the tensor-parallel executor needs of its workers, however they were started."""

    channel: Any
    agreement: p.Agreement
    timeout: float
    calls = 0                            # calls sent so far (the workers count the same)
    ready = False                        # every rank built its executor
    fault_error: GraphrtError | None = None
    closed = False
    #: The workers left on their own (each raised the same fault): no shutdown call to send.
    peers_left = False

    def check(self) -> None:
        """Raise the fault already seen (a fresh error of its class, with its message and
        fields), or refuse calls after close()."""
        if self.fault_error is not None:
            error = copy.copy(self.fault_error)
            error.__traceback__ = error.__cause__ = error.__context__ = None
            raise error
        if self.closed:
            raise GraphrtError("the tensor-parallel executor is closed")

    def send(self, method: int, arrays: list[np.ndarray]) -> None:
        """One call to every worker."""
        self.calls += 1
        self.channel.send(method, arrays, timeout=self.timeout)

    def wait(self, work: Any, timeout: float | None = None) -> None:
        """Wait for a control-group collective; a failure or the deadline raises."""
        work.wait(timedelta(seconds=timeout or self.timeout))

    def fault(self, doing: str, exc: BaseException | None) -> GraphrtError:
        """The error that names what failed during ``doing``; remembered for later calls."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the workers and release what rank 0 holds (idempotent)."""
        raise NotImplementedError


class SpawnedRanks(Ranks):
    """Worker processes rank 0 started, on this machine."""

    def __init__(self, setup: p.WorkerSetup,
                 resident: dict[str, tuple[tuple[int, ...], Any]] | None = None) -> None:
        """Start ``setup.tp_size - 1`` workers; ``resident``: the step channel's resident
        buffers (rank 0's staging buffers, name to shape and dtype)."""
        from graphrt.backends.torch.parallel.tp_worker import spawned_worker

        method = TP_WORKER_START_METHOD
        if method not in mp.get_all_start_methods():
            method = "spawn"
        ctx = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(["graphrt.backends.torch.parallel.tp_worker"])
        self.setup, self.timeout = setup, setup.timeout
        self.store: Any = rz.rank0_store(setup.tp_size, setup.timeout)
        self.channel = StepChannel.create(setup.tp_size - 1, ctx=ctx, resident=resident)
        self._counters = ctx.RawArray("q", 2 * setup.tp_size)
        self.counters = np.frombuffer(self._counters, dtype=np.int64).reshape(setup.tp_size, 2)
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.errors: dict[int, str] = {}
        self.group = False
        for rank in range(1, setup.tp_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=spawned_worker, name=f"graphrt-tp-rank{rank}", daemon=True,
                               args=(setup, rank, self.store.port, self.channel.spec, writer, self._counters))
            proc.start()
            writer.close()
            self.procs.append(proc)
            self.conns.append(reader)

    def connect(self) -> None:
        """Form the process group and the control group with the workers watched
        (:mod:`~graphrt.backends.torch.parallel.tp_rendezvous`): a worker that exits meanwhile fails
        start-up at once, named, instead of after the rendezvous timeout."""
        device = self.setup.device(0)
        store = rz.WatchedStore(self.store, self._check_alive)
        count = rz.group_count()
        try:
            dist.init_process_group(p.GROUP_BACKENDS[device.type], store=store, rank=0,
                                    world_size=self.setup.tp_size, timeout=timedelta(seconds=self.timeout))
            self.group = _OWNED_GROUP[0] = True
            self.agreement = p.Agreement(p.control_group(), self.setup.tp_size)
        except Exception as exc:  # noqa: BLE001 - a worker exited, or the rendezvous failed: named
            if not self.group:
                rz.forget_failed_group(count)
            raise self.fault("start-up (forming the process group)", exc) from exc
        if p.GROUP_BACKENDS[device.type] != "gloo":
            threading.Thread(target=self._abort_on_exit, name="graphrt-tp-watch", daemon=True).start()

    def _check_alive(self) -> None:
        """Raise when a worker has exited (the rendezvous calls this between its slices)."""
        if self._exited():
            raise GraphrtError("a tensor-parallel worker exited before the process group formed")

    def _abort_on_exit(self) -> None:
        """nccl / hccl wait on a dead peer until their timeout: when a worker exits while the
        engine runs, abort the group so rank 0's collective returns with an error at once."""
        wait_any([proc.sentinel for proc in self.procs])
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if self.closed or abort is None:
            return
        try:
            abort()
        except Exception as exc:  # noqa: BLE001 - the collective's own timeout still applies
            logger.warning("graphrt: aborting the tensor-parallel group failed: %s", exc)

    def _read_messages(self) -> None:
        for conn in self.conns:
            try:
                while conn.poll():
                    _, rank, error = conn.recv()           # ("error", rank, text)
                    self.errors[rank] = error
            except (EOFError, OSError):
                continue

    def _exited(self) -> list[tuple[int, int]]:
        return [(rank, proc.exitcode) for rank, proc in enumerate(self.procs, 1) if proc.exitcode is not None]

    def send(self, method: int, arrays: list[np.ndarray]) -> None:
        """One call to every worker, refused at once when one has exited."""
        for proc in self.procs:
            if proc.exitcode is not None:
                raise GraphrtError("a worker had exited")
        super().send(method, arrays)

    def wait(self, work: Any, timeout: float | None = None) -> None:
        """Poll the collective, waking early when a worker exits."""
        deadline = time.monotonic() + (timeout or self.timeout)
        sentinels = [proc.sentinel for proc in self.procs]
        while not work.is_completed():
            if self._exited():
                raise GraphrtError("a worker exited")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer within {timeout or self.timeout} s")
            wait_any(sentinels, timeout=0.002)
        work.wait()

    def fault(self, doing: str, exc: BaseException | None) -> GraphrtError:
        """Name the worker that exited (code, signal, its error) or fell behind (call not read /
        not finished); wait ``TP_FAULT_GRACE_S`` for an exit to show first."""
        if self.fault_error is not None:
            return self.fault_error
        if not self._exited():
            wait_any([proc.sentinel for proc in self.procs], timeout=TP_FAULT_GRACE_S)
        self._read_messages()
        parts = []
        for rank, code in self._exited():
            name = f" ({signal.Signals(-code).name})" if code < 0 and -code in signal.valid_signals() else ""
            error = self.errors.get(rank, "").strip().splitlines()
            parts.append(f"tensor-parallel worker rank {rank} exited with code {code}{name}"
                         + (f" ({error[0]})" if error else ""))
        if not parts and not self.group:
            parts.append("every tensor-parallel worker is alive but the process group did not form")
        if not parts:
            for rank in range(1, self.setup.tp_size):
                read, done = (int(v) for v in self.counters[rank])
                if read < self.calls:
                    parts.append(f"tensor-parallel worker rank {rank} is alive but did not read the call "
                                 f"(hung or stopped)")
                elif done < self.calls:
                    parts.append(f"tensor-parallel worker rank {rank} is alive but did not finish the call "
                                 f"(hung in its forward or a collective)")
        if not parts:
            parts.append("every tensor-parallel worker is alive and finished its part; rank 0 failed")
        text = str(exc).strip().splitlines()[0] if exc is not None and str(exc).strip() else ""
        cause = "" if exc is None else f": {type(exc).__name__}" + (f": {text}" if text else "")
        message = f"{'; '.join(parts)} during {doing}{cause}"
        exited = self._exited()
        self.fault_error = RankLostError(message, exited[0][0]) if exited else GraphrtError(message)
        return self.fault_error

    def close(self) -> None:
        """The shutdown call and a join when healthy; then terminate, then kill, whoever is left;
        then drop the channel (segment unlinked) and the process group."""
        if self.closed:
            return
        self.closed = True
        healthy = self.fault_error is None and self.group and not self._exited()
        if healthy:
            try:
                self.channel.send(p.SHUTDOWN, [], timeout=TP_WORKER_JOIN_TIMEOUT_S)
            except GraphrtError:
                healthy = False
        if healthy:
            _join(self.procs, TP_WORKER_JOIN_TIMEOUT_S)
        for action, seconds in (("terminate", TP_FAULT_GRACE_S), ("kill", TP_WORKER_JOIN_TIMEOUT_S)):
            alive = [proc for proc in self.procs if proc.exitcode is None]
            for proc in alive:
                getattr(proc, action)()
            _join(alive, seconds)
        for conn in self.conns:
            conn.close()
        self.channel.close()
        self.channel.unlink()
        self.channel = None           # its semaphores' names go with the last reference
        self.store = None             # the rendezvous port closes with it
        if self.group:
            _destroy_group()
            self.group = _OWNED_GROUP[0] = False
        left = [proc.pid for proc in self.procs if proc.exitcode is None]
        if left:
            logger.error("graphrt: tensor-parallel workers %s did not exit", left)


class JoinedRanks(Ranks):
    """Ranks launched by someone else (torchrun): rank 0 of the initialised default group."""

    def __init__(self, setup: p.WorkerSetup) -> None:
        if _OWNED_GROUP[0]:
            raise ConfigError("another tensor-parallel engine of this process holds the process group; "
                              "close it first (one tensor-parallel engine per process)")
        size, rank = dist.get_world_size(), dist.get_rank()
        if size != setup.tp_size or rank != 0:
            raise ConfigError(f"torch.distributed is initialised with {size} ranks (this is rank {rank}); "
                              f"tensor_parallel_size={setup.tp_size} needs exactly that many, the engine on "
                              "rank 0 and graphrt.backends.torch.parallel.tp_worker.serve() on the others")
        self.setup, self.timeout = setup, setup.timeout
        group = p.control_group()
        dist.broadcast_object_list([setup], 0, group=group)
        self.channel = p.BroadcastChannel(group, capacity=setup.step_bytes())
        self.agreement = p.Agreement(group, size)
        self.heartbeat = Heartbeat(default_store(), 0, size, group.group_name)

    def connect(self) -> None:
        """Nothing to wait for: the setup went out with the constructor."""

    def fault(self, doing: str, exc: BaseException | None) -> GraphrtError:
        """Name the ranks whose heartbeat stopped (:class:`RankLostError`); where every rank
        still beats, or the store does not answer, the call only."""
        if self.fault_error is not None:
            return self.fault_error
        cause = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        lost = self.heartbeat.lost() if exc is not None else None
        if lost:
            self.fault_error = RankLostError(
                f"tensor-parallel rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} lost (no heartbeat "
                f"for {defaults.RANK_LOST_NAMING_S} s: its process or node is gone) during {doing} ({cause}); "
                "every in-flight request failed and the engine stopped: rebuild it once the rank is back", lost[0])
        else:
            self.fault_error = GraphrtError(
                f"a tensor-parallel call failed during {doing} ({cause}); every rank still beats (or the store "
                "did not answer), so rank 0 cannot name one: see the ranks' logs")
        return self.fault_error

    def close(self) -> None:
        """Send the shutdown call (workers that still follow return from ``serve()``) and drop
        the control group; the default group stays its launcher's. Before the ranks were
        ready, rank 0 first joins the start-up agreement as failed."""
        if self.closed:
            return
        self.closed = True
        try:
            if not self.ready and self.fault_error is None:
                self.wait(self.agreement.start(1), TP_WORKER_JOIN_TIMEOUT_S)
            if not self.peers_left and not isinstance(self.fault_error, RankLostError):
                self.channel.send(p.SHUTDOWN, [], timeout=TP_WORKER_JOIN_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - closing anyway
            logger.warning("graphrt: the tensor-parallel shutdown call failed: %s", exc)
        finally:
            self.heartbeat.stop()
        dist.destroy_process_group(self.agreement.group)


def _join(procs: list[Any], seconds: float) -> None:
    """Join ``procs`` within ``seconds`` in all."""
    deadline = time.monotonic() + seconds
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))


def _destroy_group() -> None:
    """Tear the default group down (abort where a dead peer could make destroy wait)."""
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - nothing more to release
        logger.warning("graphrt: destroying the tensor-parallel process group failed: %s", exc)


__all__ = ["JoinedRanks", "Ranks", "SpawnedRanks"]
