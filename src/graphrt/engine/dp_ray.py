"""Ray replicas of :class:`graphrt.DataParallelLLM` (``data_parallel_backend="ray"``): each
worker a Ray actor, on whichever node of a connected Ray cluster its bundle is placed, behind
the same front as the worker processes.

Placement: one placement group of ``data_parallel_size`` bundles (``ray_resources`` each,
``{"CPU": 1}`` by default) with ``ray_placement_strategy`` (``SPREAD`` by default: replicas on
different nodes where the cluster has room); replica r is one actor in bundle r. Ray gives an
actor with ``GPU`` in its bundle that many devices (it sets ``CUDA_VISIBLE_DEVICES``).

The actor runs a worker's body (``dp_worker.run_worker``) on a thread. The front sends with
``put`` (its own concurrency group of one thread, so one sender's requests stay in order) and
receives through ``take``, a long poll in another group. On the front, a thread per replica
(:class:`RayReplica`) forwards what ``take`` returns onto a local pipe: the front waits on Ray
replicas exactly as on processes, and that pipe closing is the replica's end. The replica
stands for a ``multiprocessing.Process`` in the front's :class:`~graphrt.engine.dp_processes.Worker`
(``pid``, ``sentinel``, ``exitcode``, ``join``, ``is_alive``, ``terminate``, ``kill``), so
shutdown, faults and load balance are the front's, unchanged. Needs ``pip install 'graphrt[ray]'``.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from multiprocessing import Pipe
from typing import Any, Mapping

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from graphrt.core.errors import ConfigError, GraphrtError
from graphrt.engine.dp_processes import Worker
from graphrt.engine.dp_worker import run_worker

#: Seconds one ``take`` long poll waits for a reply before returning none (the forwarding
#: thread then asks again; a dead actor fails the pending call at once, whatever this is).
RAY_TAKE_WAIT_S = 1.0
#: What a replica's thread puts in its outbox once its worker body has returned.
ENDED = ("ended",)

#: How to reach a cluster, for the error a front without one raises.
RAY_CONNECT_HINT = ("call ray.init(address='auto') on a node of a cluster started with "
                    "`ray start --head` (other nodes: `ray start --address=HEAD_IP:6379`), or "
                    "ray.init() for a cluster on this machine alone, before DataParallelLLM(...)")


class _Outbox:
    """A replica's replies (``send``) queued for the front's ``take``."""

    def __init__(self, box: "queue.Queue[tuple]") -> None:
        self._box = box

    def send(self, msg: tuple) -> None:
        self._box.put(msg)


@ray.remote(concurrency_groups={"requests": 1, "replies": 1})
class ReplicaActor:
    """One data-parallel worker as a Ray actor: a ``graphrt.LLM`` served on a thread."""

    def __init__(self, model: str, llm_kwargs: dict[str, Any]) -> None:
        self._inbox: queue.Queue[tuple] = queue.Queue()
        self._outbox: queue.Queue[tuple] = queue.Queue()
        threading.Thread(target=self._run, args=(model, llm_kwargs), daemon=True,
                         name="graphrt-dp-replica").start()

    def _run(self, model: str, llm_kwargs: dict[str, Any]) -> None:
        try:
            run_worker(model, llm_kwargs, self._inbox, _Outbox(self._outbox))
        finally:
            self._outbox.put(ENDED)

    def where(self) -> tuple[str, int]:
        """The node's address and this actor's process id."""
        return ray.util.get_node_ip_address(), os.getpid()

    @ray.method(concurrency_group="requests")
    def put(self, msg: tuple) -> None:
        self._inbox.put(msg)

    @ray.method(concurrency_group="replies")
    def take(self, wait_s: float) -> list[tuple]:
        """Every reply queued, waiting up to ``wait_s`` for the first."""
        try:
            msgs = [self._outbox.get(timeout=wait_s)]
        except queue.Empty:
            return []
        while True:
            try:
                msgs.append(self._outbox.get_nowait())
            except queue.Empty:
                return msgs


def kill_actor(actor: Any) -> None:
    """End an actor now (no restart); nothing if it, or Ray, is gone already."""
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already dead, or Ray shut down at exit
        pass


class Placement:
    """The replicas' placement group, removed once the last replica using it has ended."""

    def __init__(self, group: PlacementGroup, users: int) -> None:
        self.group, self._users, self._lock = group, users, threading.Lock()

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users != 0:
                return
        try:
            remove_placement_group(self.group)
        except Exception:  # noqa: BLE001 - Ray shut down at exit: it removed the group itself
            pass


class RaySender:
    """A replica's request side: ``send`` calls the actor's ``put`` (fire and forget)."""

    def __init__(self, actor: Any) -> None:
        self._actor, self._closed = actor, False

    def send(self, msg: tuple) -> None:
        if self._closed:
            raise OSError("the replica's sender is closed")
        try:
            self._actor.put.remote(msg)
        except Exception as exc:  # noqa: BLE001 - Ray shut down: as a pipe whose reader is gone
            raise OSError(f"Ray refused the call: {exc}") from exc

    def close(self) -> None:
        self._closed = True


class RayReplica:
    """A Ray actor as the front's worker process: a thread forwards its replies onto a pipe
    whose reading end (``sentinel``, also the Worker's ``replies``) closes when it ends."""

    def __init__(self, rank: int, actor: Any, placement: Placement, pid: int) -> None:
        self.pid = pid
        self.exitcode: int | None = None
        self._actor, self._placement = actor, placement
        self.sentinel, self._out = Pipe(duplex=False)
        self._thread = threading.Thread(target=self._forward, daemon=True,
                                        name=f"graphrt-dp-ray-{rank}")
        self._thread.start()

    def _forward(self) -> None:
        code = 0
        try:
            while True:
                msgs = ray.get(self._actor.take.remote(RAY_TAKE_WAIT_S))
                for msg in msgs:
                    if msg == ENDED:
                        return
                    if msg[0] in ("failed", "fault"):
                        code = 1
                    self._out.send(msg)
        except Exception as exc:  # noqa: BLE001 - the actor (or its node, or Ray) is gone
            code = 1
            try:
                self._out.send(("fault", f"its Ray actor is gone: {type(exc).__name__}: {exc}"))
            except OSError:
                pass
        finally:
            self.exitcode = code
            kill_actor(self._actor)
            self._placement.release()
            self._out.close()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def terminate(self) -> None:
        kill_actor(self._actor)

    kill = terminate


def check_connected() -> None:
    """Refuse a front when this process has not joined a Ray cluster."""
    if not ray.is_initialized():
        raise ConfigError(f"data_parallel_backend='ray' needs this process connected to a Ray "
                          f"cluster: {RAY_CONNECT_HINT}")


def bundle_options(bundle: Mapping[str, float]) -> dict[str, Any]:
    """``actor.options`` asking for exactly one bundle's resources."""
    extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
    opts: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0),
                            "resources": extra}
    if "memory" in bundle:
        opts["memory"] = bundle["memory"]
    return opts


def start_workers(model: str, llm_kwargs: dict[str, Any], size: int, bundle: Mapping[str, float],
                  strategy: str, timeout: float, into: list[Worker]) -> None:
    """Place ``size`` replicas, start one actor per bundle and append each as a Worker to
    ``into`` (the front's list, so a front closed half-way stops those started)."""
    check_connected()
    deadline = time.monotonic() + timeout
    group = placement_group([dict(bundle) for _ in range(size)], strategy=strategy)
    try:
        ray.get(group.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise GraphrtError(f"Ray could not place {size} replicas of ray_resources={dict(bundle)} "
                           f"({strategy}) within {timeout} s; the cluster has "
                           f"{ray.available_resources()} free of {ray.cluster_resources()}") from None
    placement = Placement(group, size)
    actors = [ReplicaActor.options(**bundle_options(bundle), scheduling_strategy=PlacementGroupSchedulingStrategy(
                  group, placement_group_bundle_index=rank)).remote(model, llm_kwargs)
              for rank in range(size)]
    started = 0
    try:
        for rank, actor in enumerate(actors):
            try:
                node, pid = ray.get(actor.where.remote(), timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - names the replica, whatever Ray raised
                raise GraphrtError(f"data-parallel worker {rank} (a Ray actor) failed to start: "
                                   f"{type(exc).__name__}: {exc} (graphrt and the model directory "
                                   f"must be reachable on every node)") from None
            replica = RayReplica(rank, actor, placement, pid)
            started += 1
            into.append(Worker(rank, replica, RaySender(actor), replica.sentinel,
                               where=f"Ray actor on {node}, pid {pid}"))
    except BaseException:
        for actor in actors[started:]:
            kill_actor(actor)
            placement.release()
        raise


__all__ = ["RAY_CONNECT_HINT", "RayReplica", "ReplicaActor", "check_connected", "start_workers"]
