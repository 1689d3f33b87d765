"""``graphrt.DataParallelLLM``: ``data_parallel_size`` engine processes behind one front.

    with graphrt.DataParallelLLM(model_dir, data_parallel_size=2, backend="cpu") as dp:
        outs = dp.generate(prompts, graphrt.SamplingParams(max_tokens=8))   # prompt order

Each worker is a spawned process holding a whole :class:`~graphrt.LLM`; the front validates
requests, spreads them by SGLang's ``load_balance_method`` and gathers outputs. A dead worker is
seen at once through its sentinel, and every call then raises a ``GraphrtError`` naming it. See
docs/api.md, "Data parallelism".
"""

from __future__ import annotations

import inspect
import itertools
import multiprocessing
import os
import signal
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

from graphrt.core.errors import ConfigError, GenerationError, GraphrtError, InputError
from graphrt.engine.dp_processes import DP_WORKER_KILL_TIMEOUT_S, LIVE, Worker, new_key, shutdown
from graphrt.engine.dp_worker import worker_main
from graphrt.engine.engine_args import ENGINE_ARGS, check_engine_args
from graphrt.engine.llm import LLM
from graphrt.engine.outputs import RequestOutput
from graphrt.engine.sampling_params import SamplingParams
from graphrt.engine.validation import params_per_prompt, validate_request

DP_POLL_INTERVAL_S = 0.1

#: graphrt.DataParallelLLM: worker processes (SGLang's ``--data-parallel-size``; 1 there means
#: no DP) and how requests are spread over them (SGLang's ``--load-balance-method`` and default).
DEFAULT_DATA_PARALLEL_SIZE = 2
DEFAULT_LOAD_BALANCE_METHOD = "round_robin"
#: ... the environment variable a worker's ``device_ids`` entry is written to.
DP_DEVICE_ENV = "CUDA_VISIBLE_DEVICES"
#: ... seconds for every worker to load and warm up; for stats replies.
DP_WORKER_START_TIMEOUT_S = 600.0
DP_STATS_TIMEOUT_S = 30.0
#: ... seconds ``step()`` waits for an output by default, and the longest single wait on the
#: workers' pipes (a dead worker is seen at once through its process sentinel regardless).
DP_STEP_WAIT_S = 0.05

#: SGLang's ``--load-balance-method`` values that graphrt implements.
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue")


def check_worker_args(model: str | os.PathLike, llm_kwargs: dict[str, Any]) -> None:
    """Refuse at the front what each worker's ``LLM(model, **llm_kwargs)`` would refuse before
    loading, as LLM raises it: a bad value costs no process start."""
    bound = inspect.signature(LLM).bind(os.fspath(model), **llm_kwargs)   # others: graph_fields
    bound.apply_defaults()
    args = bound.arguments
    check_engine_args(args["model"], args["config"], graph_fields=args["graph_fields"],
                      keywords=inspect.signature(LLM.__init__).parameters, **{name: args[name] for name in ENGINE_ARGS})


class DataParallelLLM:
    """``data_parallel_size`` :class:`~graphrt.LLM` worker processes behind one front.

    ``model`` must be a directory (each worker loads it); other keywords go to each worker's
    ``LLM`` and are checked here first. ``device_ids[i]``, if given, is put in worker i's
    ``device_env`` variable (``CUDA_VISIBLE_DEVICES`` by default; ``ASCEND_RT_VISIBLE_DEVICES``
    on Ascend) before it imports a framework; without it every worker sees every device.
    """

    def __init__(self, model: str | os.PathLike, *,
                 data_parallel_size: int = DEFAULT_DATA_PARALLEL_SIZE,
                 load_balance_method: str = DEFAULT_LOAD_BALANCE_METHOD,
                 device_ids: Sequence[int | str] | None = None,
                 device_env: str = DP_DEVICE_ENV,
                 start_timeout: float = DP_WORKER_START_TIMEOUT_S,
                 **llm_kwargs: Any) -> None:
        if not (isinstance(model, str) or hasattr(model, "__fspath__")):
            raise InputError("model", f"pass the model's directory (each worker process loads it), "
                                      f"not a {type(model).__name__}")
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) \
                or data_parallel_size < 1:
            raise ConfigError(f"data_parallel_size must be an integer >= 1, got {data_parallel_size!r}")
        if load_balance_method not in LOAD_BALANCE_METHODS:
            raise ConfigError(f"load_balance_method must be one of {LOAD_BALANCE_METHODS}, "
                              f"got {load_balance_method!r}")
        if device_ids is not None and len(device_ids) != data_parallel_size:
            raise ConfigError(f"device_ids has {len(device_ids)} entries for "
                              f"data_parallel_size={data_parallel_size}")
        check_worker_args(model, llm_kwargs)
        self.data_parallel_size = data_parallel_size
        self.load_balance_method = load_balance_method
        self._workers: list[Worker] = []
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._next_rr = 0
        self._done: dict[int, RequestOutput] = {}   # received, not yet returned
        self._streamed: set[int] = set()             # add_request ids not yet returned by step()
        self._abandoned: set[int] = set()            # ids of failed generate calls: dropped
        self._owner: dict[int, int] = {}             # request id -> worker rank
        self._broken: GraphrtError | None = None
        self._closed = False
        self._key = new_key()
        LIVE[self._key] = self._workers
        self._finalizer = weakref.finalize(self, shutdown, self._key)   # when collected
        self._finalizer.atexit = False              # at exit: dp_processes.shutdown_all
        ctx = multiprocessing.get_context("spawn")
        try:
            for rank in range(data_parallel_size):
                env = {} if device_ids is None else {device_env: str(device_ids[rank])}
                req_out, req_in = ctx.Pipe(duplex=False)
                rep_out, rep_in = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=worker_main, name=f"graphrt-dp-worker-{rank}",
                                   args=(rank, os.fspath(model), llm_kwargs, env, req_out, rep_in))
                proc.start()
                req_out.close()     # the child has its own copies: EOF now tracks the child
                rep_in.close()
                self._workers.append(Worker(rank, proc, req_in, rep_out))
            self._await(lambda: all(w.info is not None for w in self._workers), start_timeout,
                        "to start")
        except BaseException:
            self.close()
            raise
        infos = [w.info for w in self._workers]
        self.config = infos[0]["config"]
        self._vocab_size = infos[0]["vocab_size"]
        self._kv_capacity = min(i["kv_capacity"] for i in infos)

    # ---- requests ---------------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 timeout: float | None = None) -> list[RequestOutput]:
        """Generate for every prompt across the workers; outputs in prompt order.

        Every prompt is validated first (InputError naming its index). A request failing in its
        worker makes the call wait for the rest, then raise ``GenerationError`` with all outputs.
        ``timeout`` (s, None: none): past it a ``GraphrtError`` names the workers still owing.
        """
        prompts = list(prompt_token_ids)
        params = params_per_prompt(prompts, sampling_params)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            self._validate(p, sp, f"prompt_token_ids[{i}]")
        with self._lock:
            self._check_usable()
            self._pump(0.0)
            ids = [self._dispatch(p, sp) for p, sp in zip(prompts, params)]
        try:
            self._await(lambda: all(i in self._done for i in ids), timeout, "to answer generate()",
                        ids)
        except BaseException:
            with self._lock:
                self._abandoned.update(i for i in ids if self._done.pop(i, None) is None)
            raise
        with self._lock:
            outs = [self._done.pop(i) for i in ids]
        failed = [o for o in outs if o.finish_reason == "error"]
        if failed:
            raise GenerationError(f"generate(): {len(failed)} of {len(outs)} requests failed in a "
                                  f"worker's step (first: {failed[0].error})", outs)
        return outs

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Send one request to a worker now; its output comes back from ``step()``."""
        params = params or SamplingParams()
        self._validate(prompt_token_ids, params, "prompt_token_ids")
        with self._lock:
            self._check_usable()
            self._pump(0.0)     # fresh counts for shortest_queue
            rid = self._dispatch(prompt_token_ids, params)
            self._streamed.add(rid)
            return rid

    def step(self, timeout: float = DP_STEP_WAIT_S) -> list[RequestOutput]:
        """The ``add_request`` outputs received since the last call (in arrival order),
        waiting up to ``timeout`` seconds for one while any is unfinished."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                self._check_usable()
                ready = [i for i in self._streamed if i in self._done]
                left = deadline - time.monotonic()
                if ready or not self._streamed or left <= 0:
                    break
                self._pump(min(left, DP_POLL_INTERVAL_S))
            self._streamed.difference_update(ready)
            return sorted((self._done.pop(i) for i in ready), key=lambda o: o.request_id)

    def has_unfinished(self) -> bool:
        """Whether an ``add_request`` request's output has not been returned by ``step()``."""
        with self._lock:
            return bool(self._streamed)

    def worker_of(self, request_id: int) -> int:
        """The rank of the worker a request was sent to."""
        return self._owner[request_id]

    # ---- state ------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, Any]:
        """Per worker: rank, pid, alive, ``requests`` sent, ``queue_length`` and ``engine`` (its
        LLM.stats plus ``waiting`` / ``running``; None for a dead worker)."""
        with self._lock:
            if self._closed:
                raise GraphrtError("DataParallelLLM is closed")
            live = [w for w in self._workers if w.dead is None]
            for w in live:
                w.stats = None
                try:
                    w.requests.send(("stats",))
                except (OSError, ValueError):
                    self._pump(0.0)     # it died: the sentinel says so
            self._await(lambda: all(w.stats is not None or w.dead is not None for w in live),
                        DP_STATS_TIMEOUT_S, "to report stats", raise_dead=False)
            return {"data_parallel_size": self.data_parallel_size,
                    "load_balance_method": self.load_balance_method,
                    "workers": [{"rank": w.rank, "pid": w.pid, "alive": w.dead is None,
                                 "requests": w.num_requests, "queue_length": len(w.in_flight),
                                 "engine": w.stats if w.dead is None else None}
                                for w in self._workers]}

    def close(self) -> None:
        """Stop and join every worker (terminate, then kill, what does not stop in time)."""
        self._closed = True
        self._finalizer.detach()
        shutdown(self._key)

    def __enter__(self) -> "DataParallelLLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------
    def _validate(self, prompt: Sequence[int], params: SamplingParams, where: str) -> None:
        validate_request(prompt, params, where, config=self.config, vocab_size=self._vocab_size,
                         kv_capacity=self._kv_capacity)

    def _check_usable(self) -> None:
        if self._closed:
            raise GraphrtError("DataParallelLLM is closed")
        if self._broken is not None:
            raise GraphrtError(str(self._broken)) from self._broken

    def _pick(self) -> Worker:
        if self.load_balance_method == "round_robin":
            w = self._workers[self._next_rr]
            self._next_rr = (self._next_rr + 1) % len(self._workers)
            return w
        return min(self._workers, key=lambda w: (len(w.in_flight), w.rank))

    def _dispatch(self, prompt: Sequence[int], params: SamplingParams) -> int:
        rid = next(self._ids)
        w = self._pick()
        try:
            w.requests.send(("add", rid, [int(t) for t in prompt], params))
        except (OSError, ValueError):
            self._pump(DP_POLL_INTERVAL_S)     # its sentinel names the death
            self._check_usable()
            raise GraphrtError(f"{w.name} stopped taking requests") from None
        w.in_flight.add(rid)
        w.num_requests += 1
        self._owner[rid] = w.rank
        return rid

    def _await(self, done: Any, timeout: float | None, what: str, ids: Sequence[int] = (), *,
               raise_dead: bool = True) -> None:
        """Pump until ``done()``; raise if a worker died (``raise_dead``) or past ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if raise_dead:
                    self._check_usable()
                if done():
                    return
                left = DP_POLL_INTERVAL_S if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    owing = sorted({w.name for w in self._workers for i in ids if i in w.in_flight})
                    raise GraphrtError(f"DataParallelLLM: the workers took more than {timeout} s "
                                       f"{what}" + (f"; still owing outputs: {', '.join(owing)}"
                                                    if owing else ""))
                self._pump(min(left, DP_POLL_INTERVAL_S))

    def _pump(self, timeout: float) -> None:
        """Receive what the workers sent, waiting up to ``timeout`` s; mark dead workers."""
        live = [w for w in self._workers if w.dead is None]
        by_obj: dict[Any, Worker] = {w.replies: w for w in live}
        by_obj.update((w.process.sentinel, w) for w in live)
        ready = wait(list(by_obj), timeout) if by_obj else []
        for obj in ready:       # messages first: a dying worker's last words come before its end
            if isinstance(obj, Connection):
                self._drain(by_obj[obj])
        for obj in ready:
            if not isinstance(obj, Connection) and by_obj[obj].dead is None:
                self._mark_dead(by_obj[obj])

    def _drain(self, w: Worker) -> None:
        try:
            while w.dead is None and w.replies.poll():
                self._handle(w, w.replies.recv())
        except (EOFError, OSError):
            self._mark_dead(w)

    def _handle(self, w: Worker, msg: tuple) -> None:
        kind = msg[0]
        if kind == "outs":
            for out in msg[1]:
                w.in_flight.discard(out.request_id)
                if out.request_id in self._abandoned:
                    self._abandoned.discard(out.request_id)
                else:
                    self._done[out.request_id] = out
        elif kind == "ready":
            w.info = msg[1]
        elif kind == "stats":
            w.stats = msg[1]
        elif kind in ("failed", "fault"):
            w.fault = msg[1]

    def _mark_dead(self, w: Worker) -> None:
        w.process.join(DP_WORKER_KILL_TIMEOUT_S)   # its pipe closed: it is ending
        code = w.process.exitcode
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else
               f"exited with code {code}" if code is not None else "closed its pipe")
        how = how if w.info is not None else f"failed to start ({how})"
        lost = f"; its unfinished requests {sorted(w.in_flight)} are lost" if w.in_flight else ""
        why = f"; its traceback:\n{w.fault}" if w.fault else ""
        w.dead = GraphrtError(f"{w.name} {how}{lost}{why}")
        if self._broken is None:
            self._broken = w.dead


__all__ = ["DataParallelLLM", "LOAD_BALANCE_METHODS"]
