"""The worker process of :class:`graphrt.DataParallelLLM`: one ``graphrt.LLM`` and its loop.

Messages from the front (over a one-way pipe, read by a thread into a queue so the front's
sends never wait for a step): ``("add", request_id, prompt, params)``, ``("stats",)``,
``("stop",)``. Replies (over another pipe): ``("ready", info)`` or ``("failed", traceback)``
once the engine is built, ``("outs", [RequestOutput, ...])`` after a step that finished
requests (ids are the front's), ``("stats", dict)``, and ``("fault", traceback)`` just before a
worker whose loop raised exits. The front's pipe closing (it exited or was killed) stops it.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any, Protocol

from graphrt.engine.outputs import RequestOutput


def read_requests(requests: Connection, inbox: "queue.Queue[tuple]") -> None:
    """Move the front's messages into ``inbox``, so the front's sends never wait for a step;
    the front's end closing (it exited or died) stops the worker."""
    try:
        while True:
            inbox.put(requests.recv())
    except (EOFError, OSError):
        inbox.put(("stop",))


def thread_lock_for_progress_bars() -> None:
    """Give tqdm a thread lock instead of its default, which holds a multiprocessing RLock: a
    named semaphore in /dev/shm that a worker killed or terminated (``close()`` while it is
    busy) never unlinks -- it stays until the front exits, and the resource tracker warns of
    a leak. A worker's progress bars are its own process's, so a thread lock serves them."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


class Replies(Protocol):
    """Where a worker's replies go: a pipe's ``Connection``, or a Ray replica's outbox."""

    def send(self, msg: tuple) -> None: ...


def worker_main(rank: int, model: str, llm_kwargs: dict[str, Any], env: dict[str, str],
                requests: Connection, replies: Connection) -> None:
    """A worker process: one ``graphrt.LLM`` serving the requests the front sends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the front's: it stops the workers
    os.environ.update(env)                          # before any framework sees the devices
    inbox: queue.Queue[tuple] = queue.Queue()
    threading.Thread(target=read_requests, args=(requests, inbox), daemon=True,
                     name=f"graphrt-dp-reader-{rank}").start()
    run_worker(model, llm_kwargs, inbox, replies)


def run_worker(model: str, llm_kwargs: dict[str, Any], inbox: "queue.Queue[tuple]",
               replies: Replies) -> None:
    """Build the worker's ``graphrt.LLM``, say ``ready`` (or ``failed``), then serve ``inbox``
    until ``stop``: the body of a worker process, and of a Ray replica's thread."""
    thread_lock_for_progress_bars()                 # before the engine's warm-up makes a bar
    try:
        from graphrt.engine.llm import LLM
        llm = LLM(model, **llm_kwargs)
    except BaseException:
        replies.send(("failed", traceback.format_exc()))
        raise SystemExit(1) from None
    replies.send(("ready", {"config": llm.config, "vocab_size": llm.runner.vocab_size,
                            "kv_capacity": llm.allocator.capacity, "pid": os.getpid(),
                            "backend": llm.runner.backend.name}))
    try:
        serve(llm, inbox, replies)
    except BaseException:
        try:
            replies.send(("fault", traceback.format_exc()))
        except OSError:
            pass
        raise


def serve(llm: Any, inbox: "queue.Queue[tuple]", replies: Replies) -> None:
    """The worker's loop: take every message, run one step if there is work, send outputs."""
    front_ids: dict[int, int] = {}      # the LLM's request id -> the front's
    while True:
        msgs = [] if llm.has_unfinished() else [inbox.get()]
        while True:
            try:
                msgs.append(inbox.get_nowait())
            except queue.Empty:
                break
        outs: list[RequestOutput] = []
        for msg in msgs:
            if msg[0] == "stop":
                return
            if msg[0] == "stats":
                replies.send(("stats", {**llm.stats, "waiting": len(llm.scheduler.waiting),
                                        "running": len(llm.scheduler.running)}))
            elif msg[0] == "add":
                _, rid, prompt, params = msg
                try:
                    front_ids[llm.add_request(prompt, params)] = rid
                except Exception as exc:  # noqa: BLE001 - the front validated; answer, never drop
                    outs.append(RequestOutput(rid, prompt, [], "error", f"{type(exc).__name__}: {exc}"))
        if llm.has_unfinished():
            outs.extend(dataclasses.replace(o, request_id=front_ids.pop(o.request_id))
                        for o in llm.step())
        if outs:
            replies.send(("outs", outs))


__all__ = ["Replies", "read_requests", "run_worker", "serve", "thread_lock_for_progress_bars", "worker_main"]
