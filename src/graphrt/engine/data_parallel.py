"""``graphrt.DataParallelLLM``: ``data_parallel_size`` engine processes behind one front.

    with graphrt.DataParallelLLM(model_dir, data_parallel_size=2, backend="cpu") as dp:
        outs = dp.generate(prompts, graphrt.SamplingParams(max_tokens=8))   # prompt order

Each worker is a spawned process (or, with ``data_parallel_backend="ray"``, a Ray actor on a
cluster's node: engine/dp_ray.py) holding a whole :class:`~graphrt.LLM`; the front validates
requests, spreads them by SGLang's ``load_balance_method`` and gathers outputs. A dead worker is
seen at once through its sentinel, and every call then raises a ``GraphrtError`` naming it. See
docs/api.md, "Data parallelism", and docs/distributed.md, "Ray".
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
from collections.abc import Mapping
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
#: Where the workers run (vLLM's ``--data-parallel-backend``, same names and default): ``mp``
#: spawned processes on this machine; ``ray`` Ray actors on a connected cluster (engine/dp_ray.py).
DATA_PARALLEL_BACKENDS = ("mp", "ray")
DEFAULT_DATA_PARALLEL_BACKEND = "mp"
#: ``ray``: each replica's bundle (Ray resource names) and how the bundles are placed (Ray's
#: placement-group strategies; SPREAD: replicas on different nodes where there is room).
DEFAULT_RAY_RESOURCES = {"CPU": 1}
DEFAULT_RAY_PLACEMENT_STRATEGY = "SPREAD"
RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def check_worker_args(model: str | os.PathLike, llm_kwargs: dict[str, Any]) -> None:
    """Refuse at the front what each worker's ``LLM(model, **llm_kwargs)`` would refuse before
    loading, as LLM raises it: a bad value costs no process start."""
    bound = inspect.signature(LLM).bind(os.fspath(model), **llm_kwargs)   # others: graph_fields
    bound.apply_defaults()
    args = bound.arguments
    check_engine_args(args["model"], args["config"], graph_fields=args["graph_fields"],
                      keywords=inspect.signature(LLM.__init__).parameters, **{name: args[name] for name in ENGINE_ARGS})


def ray_replicas() -> Any:
    """engine/dp_ray.py, or the ConfigError saying how to get Ray when it does not import."""
    try:
        from graphrt.engine import dp_ray
    except ImportError as exc:
        raise ConfigError(f"data_parallel_backend='ray' needs Ray, which does not import here "
                          f"({type(exc).__name__}: {exc}): pip install 'graphrt[ray]'") from exc
    return dp_ray


def check_ray_args(backend: str, device_ids: Sequence[int | str] | None,
                   resources: Mapping[str, float] | None, strategy: str | None) -> None:
    """Refuse Ray options without ``data_parallel_backend='ray'``, and bad ones with it."""
    if backend not in DATA_PARALLEL_BACKENDS:
        raise ConfigError(f"data_parallel_backend must be one of {DATA_PARALLEL_BACKENDS}, got {backend!r}")
    if backend != "ray":
        for name, value in (("ray_resources", resources), ("ray_placement_strategy", strategy)):
            if value is not None:
                raise ConfigError(f"{name} is for data_parallel_backend='ray', got backend {backend!r}")
        return
    if device_ids is not None:
        raise ConfigError("device_ids is for data_parallel_backend='mp': Ray gives each replica "
                          "its devices, ask for them with ray_resources={'CPU': 1, 'GPU': 1}")
    if strategy is not None and strategy not in RAY_PLACEMENT_STRATEGIES:
        raise ConfigError(f"ray_placement_strategy must be one of {RAY_PLACEMENT_STRATEGIES}, "
                          f"got {strategy!r}")
    if resources is not None and (not isinstance(resources, Mapping) or any(
            not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0
            for k, v in resources.items()) or not any(v > 0 for v in resources.values())):
        raise ConfigError(f"ray_resources must map Ray resource names to amounts >= 0, one at "
                          f"least > 0 (one replica's bundle, e.g. {{'CPU': 1, 'GPU': 1}}), "
                          f"got {resources!r}")


class DataParallelLLM:
    """``data_parallel_size`` :class:`~graphrt.LLM` workers behind one front.

    ``model`` must be a directory (each worker loads it); other keywords go to each worker's
    ``LLM`` and are checked here first. ``data_parallel_backend="mp"`` (default): workers are
    processes spawned here; ``device_ids[i]``, if given, is put in worker i's ``device_env``
    variable (``CUDA_VISIBLE_DEVICES`` by default; ``ASCEND_RT_VISIBLE_DEVICES`` on Ascend)
    before it imports a framework; without it every worker sees every device.
    ``data_parallel_backend="ray"``: workers are Ray actors on the cluster this process joined
    with ``ray.init``, one per bundle of ``ray_resources`` (default ``{"CPU": 1}``) in a
    placement group of ``ray_placement_strategy`` (default ``SPREAD``); docs/distributed.md.
    """

    def __init__(self, model: str | os.PathLike, *,
                 data_parallel_size: int = DEFAULT_DATA_PARALLEL_SIZE,
                 load_balance_method: str = DEFAULT_LOAD_BALANCE_METHOD,
                 device_ids: Sequence[int | str] | None = None,
                 device_env: str = DP_DEVICE_ENV,
                 start_timeout: float = DP_WORKER_START_TIMEOUT_S,
                 data_parallel_backend: str = DEFAULT_DATA_PARALLEL_BACKEND,
                 ray_resources: Mapping[str, float] | None = None,
                 ray_placement_strategy: str | None = None,
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
        check_ray_args(data_parallel_backend, device_ids, ray_resources, ray_placement_strategy)
        check_worker_args(model, llm_kwargs)
        dp_ray = ray_replicas() if data_parallel_backend == "ray" else None
        if dp_ray is not None:
            dp_ray.check_connected()
        self.data_parallel_size = data_parallel_size
        self.load_balance_method = load_balance_method
        self.data_parallel_backend = data_parallel_backend
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
        try:
            if dp_ray is not None:
                dp_ray.start_workers(os.fspath(model), llm_kwargs, data_parallel_size,
                                     ray_resources or DEFAULT_RAY_RESOURCES,
                                     ray_placement_strategy or DEFAULT_RAY_PLACEMENT_STRATEGY,
                                     start_timeout, self._workers)
            else:
                self._start_processes(os.fspath(model), llm_kwargs, device_ids, device_env)
            self._await(lambda: all(w.info is not None for w in self._workers), start_timeout,
                        "to start")
        except BaseException:
            self.close()
            raise
        infos = [w.info for w in self._workers]
        self.config = infos[0]["config"]
        self._vocab_size = infos[0]["vocab_size"]
        self._kv_capacity = min(i["kv_capacity"] for i in infos)

    def _start_processes(self, model: str, llm_kwargs: dict[str, Any],
                         device_ids: Sequence[int | str] | None, device_env: str) -> None:
        """``mp``: spawn the workers here, each with its two pipes."""
        ctx = multiprocessing.get_context("spawn")
        for rank in range(self.data_parallel_size):
            env = {} if device_ids is None else {device_env: str(device_ids[rank])}
            req_out, req_in = ctx.Pipe(duplex=False)
            rep_out, rep_in = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, name=f"graphrt-dp-worker-{rank}",
                               args=(rank, model, llm_kwargs, env, req_out, rep_in))
            proc.start()
            req_out.close()     # the child has its own copies: EOF now tracks the child
            rep_in.close()
            self._workers.append(Worker(rank, proc, req_in, rep_out))

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
        """Per worker: rank, pid, where (``pid N``, or a Ray actor's node and pid), alive,
        ``requests`` sent, ``queue_length`` and ``engine`` (its LLM.stats plus ``waiting`` /
        ``running``; None for a dead worker)."""
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
                    "data_parallel_backend": self.data_parallel_backend,
                    "workers": [{"rank": w.rank, "pid": w.pid, "where": w.where, "alive": w.dead is None,
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


__all__ = ["DATA_PARALLEL_BACKENDS", "DataParallelLLM", "LOAD_BALANCE_METHODS"]
