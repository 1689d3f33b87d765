"""A tensor-parallel worker rank: load this rank's shard, then follow rank 0's calls.

Each call that must run on every rank (allocate the KV cache, build, run, shut down) arrives as
a method code and raw arrays; the worker runs it on its own
:class:`~graphrt.backends.torch.executor.TorchExecutor` (only rank 0 samples).
:func:`spawned_worker` is the process target rank 0 starts (shared-memory channel, an error
pipe, a call counter that names a hung rank); :func:`serve` serves ranks of a group launched
elsewhere (``torchrun``; docs/distributed.md)."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import multiprocessing as mp
import os
import signal
import traceback
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from graphrt.backends.torch.parallel import tp_protocol as p
from graphrt.backends.torch.parallel.collective_log import CollectiveLog, agreed, gather_mismatch
from graphrt.backends.torch.executor import TorchExecutor
from graphrt.backends.torch.parallel.tp_rendezvous import worker_store
from graphrt.config import GraphConfig
from graphrt.core import defaults
from graphrt.core.dispatch import SamplerKey
from graphrt.backends.torch.parallel.tp_liveness import Heartbeat, default_store
from graphrt.core.errors import CollectiveMismatchError, ConfigError, GraphrtError, RankLostError
from graphrt.core.inputs.fields import ARRAY_FIELDS, FIELDS, ModelInputs, field_rows
from graphrt.backends.torch.parallel.tp_channel import ChannelSpec, StepChannel
from graphrt.core.graph_modes import RuntimeMode

#: ... an idle worker checks that rank 0 is alive this often (seconds).
TP_WORKER_POLL_S = 1.0

logger = logging.getLogger(__name__)


class Follower:
    """One worker rank's executor, following rank 0's calls from ``channel`` until shutdown."""

    def __init__(self, setup: p.WorkerSetup, rank: int, channel: Any, agreement: p.Agreement,
                 counters: np.ndarray | None = None, parent: Any = None) -> None:
        self.setup, self.rank, self.channel, self.agreement = setup, rank, channel, agreement
        self.counters, self.parent = counters, parent
        self.calls = 0
        #: How long to poll for rank 0's next call before sleeping (defaults.TP_WORKER_SPIN_S).
        self.spin = defaults.STEP_CHANNEL_SPIN_S if setup.device_type == "cpu" else defaults.TP_WORKER_SPIN_S
        self.executor: TorchExecutor | None = None
        self.entries: dict[tuple[int, ...], tuple[Any, Any]] = {}

    def start(self) -> None:
        """Load this rank's shard and build its executor; every rank then agrees it is ready."""
        status = 1
        try:
            s = self.setup
            module, cls = s.backend.split(":")
            backend = getattr(importlib.import_module(module), cls)(s.device(self.rank))
            model = backend.load_model(s.model_dir, s.dtype, tp_rank=self.rank, tp_size=s.tp_size,
                                       model_impl=s.config.get("model_impl", "auto"),
                                       trust_remote_code=s.config.get("trust_remote_code", False))
            self.executor = TorchExecutor(model, GraphConfig.create(**s.config), backend.device, backend.graph_api())
            status = 0
        finally:
            self.agreement.start(status).wait()

    def loop(self) -> None:
        """Follow rank 0's calls until it sends SHUTDOWN (or, spawned, until it is gone)."""
        while True:
            method, arrays = self._next()
            self.calls += 1
            if self.counters is not None:
                self.counters[0] = self.calls
            if method == p.SHUTDOWN:
                return
            if method == p.RUN:
                self._run(arrays)
            else:
                self._call(method, arrays[0].tolist() if arrays else [])
            if self.counters is not None:
                self.counters[1] = self.calls

    def _next(self) -> tuple[int, list[np.ndarray]]:
        if self.parent is None:
            return self.channel.receive(copy=False, spin=self.spin)
        while True:
            try:
                return self.channel.receive(timeout=TP_WORKER_POLL_S, copy=False, spin=self.spin)
            except GraphrtError:
                if not self.parent.is_alive():
                    raise GraphrtError(f"tensor-parallel worker rank {self.rank}: rank 0 is gone") from None

    def _run(self, arrays: list[np.ndarray]) -> None:
        """Copy the padded step into this executor's staging buffers, then replay or run it."""
        ex = self.executor
        words = arrays[0].tolist()
        host, views = ex.host_buffers, []
        if len(arrays) == 1:                # the arrays wait in rank 0's resident buffers
            t, r = words[p.RUN_PADDED_TOKENS], words[p.RUN_PADDED_REQS]
            resident = self.channel.resident
            arrays = arrays + [resident[name][:field_rows(FIELDS[name].level, t, r)] for name in ARRAY_FIELDS]
        for name, src in zip(ARRAY_FIELDS, arrays[1:]):
            dst = host[name][:len(src)]
            dst[...] = src
            views.append(dst)
        self.channel.acknowledge()
        padded = ModelInputs(*views, words[p.RUN_NUM_REQS], words[p.RUN_NUM_TOKENS], words[p.RUN_MAX_QUERY],
                             words[p.RUN_MAX_SEQ], bool(words[p.RUN_UNIFORM]))
        found = None if words[p.RUN_EAGER] else self.entries.get(tuple(words[:p.KEY_WORDS]))
        if found is None:
            mode, key = p.decode_key(words)
            ex.run(RuntimeMode.NONE, key, None, padded)
        else:
            mode, key, entry = found
            ex.run(mode, key, entry, padded)

    def _call(self, method: int, words: list[int]) -> None:
        """A call other than RUN: each ends with every rank's status gathered on the control group;
        rank 0 decides what a failure means (a build runs eagerly, anything else stops the ranks)."""
        self.channel.acknowledge()
        ex, status, a, b = self.executor, 0, 0, 0
        log = CollectiveLog(dry=self.setup.device_type == "cpu")
        try:
            if method == p.ALLOCATE:
                ex.allocate_kv_cache(words[0], words[1])
            elif method == p.BUILD:
                mode, key = p.decode_key(words)
                with log:
                    entry, _ = ex.build(mode, key)
                self.entries[tuple(words[:p.KEY_WORDS])] = (mode, key, entry)
                a, b = log.signature(), len(log.entries)
            elif method == p.RECOVER:
                ex.recover_kv_cache()
            elif method == p.MEASURE:
                with log:
                    ex.measure_graph_memory(_jobs(words))
            elif method == p.MEMORY:
                a, b = ex.memory_info() or (0, 0)
            elif method == p.REFIT:          # this rank's shard of the checkpoint rank 0 names
                ex.update_weights(p.decode_text(words[1:]), check_only=not words[0])
            else:
                raise GraphrtError(f"unknown tensor-parallel method {method}")
        except Exception as exc:  # noqa: BLE001 - every rank learns it through the agreement
            logger.warning("graphrt: tensor-parallel rank %d: %s failed: %s", self.rank,
                           p.METHOD_NAMES.get(method, method), exc, exc_info=True)
            status = 1
        self.agreement.start(status, a, b).wait()
        if method == p.BUILD and not agreed(self.agreement.rows()):
            self.entries.pop(tuple(words[:p.KEY_WORDS]), None)     # never replayed
            error = gather_mismatch(self.agreement.group, self.setup.tp_size, p.decode_key(words)[1], log.entries)
            logger.error("graphrt: tensor-parallel rank %d: %s", self.rank, error)
            raise error
        if method == p.BUILD and any(row[0] for row in self.agreement.rows()):
            self.entries.pop(tuple(words[:p.KEY_WORDS]), None)     # eager on every rank


def _jobs(words: list[int]) -> list[tuple[RuntimeMode, Any]]:
    """MEASURE's jobs: per job a kind (0: forward key, 1: sampler key) and the key's words (a
    sampler key's: mode, requests, -1, greedy, logprobs, -1)."""
    jobs = []
    for i in range(0, len(words), 1 + p.KEY_WORDS):
        kind, key_words = words[i], words[i + 1:i + 1 + p.KEY_WORDS]
        mode, key = p.decode_key(key_words)
        jobs.append((mode, SamplerKey(key.num_tokens, bool(key.uniform_decode), bool(key.num_loras)) if kind else key))
    return jobs


def _configure(setup: p.WorkerSetup, rank: int) -> None:
    """This process's threads and device before anything touches them."""
    torch.set_num_threads(setup.num_threads)
    device = setup.device(rank)
    if device.type != "cpu":
        getattr(torch, device.type).set_device(device)


def spawned_worker(setup: p.WorkerSetup, rank: int, port: int, spec: ChannelSpec, conn: Any,
                   counters: Any) -> None:
    """Process target of worker ``rank``, started by rank 0: join the group through rank 0's
    rendezvous store on ``port``, load the shard, follow the step channel; an error is sent to
    rank 0 through ``conn`` and ends the process with exit code 1. Ctrl-C is rank 0's to
    handle: it stops the workers itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if setup.env is not None:
        os.environ.clear()
        os.environ.update(setup.env)
    channel = None
    try:
        _configure(setup, rank)
        dist.init_process_group(p.GROUP_BACKENDS[setup.device(rank).type], store=worker_store(port, setup),
                                rank=rank, world_size=setup.tp_size, timeout=timedelta(seconds=setup.timeout))
        agreement = p.Agreement(p.control_group(), setup.tp_size)
        channel = StepChannel.attach(spec, rank - 1)
        view = np.frombuffer(counters, dtype=np.int64)[2 * rank:2 * rank + 2]
        follower = Follower(setup, rank, channel, agreement, view, mp.parent_process())
        follower.start()
        follower.loop()
    except BaseException as exc:  # noqa: BLE001 - rank 0 names this rank and shows why
        try:
            conn.send(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        if channel is not None:
            channel.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def serve() -> None:
    """Ranks 1.. of a tensor-parallel group launched by someone else (``torchrun``, env://):
    call this after ``torch.distributed.init_process_group`` while rank 0 builds
    ``graphrt.LLM`` / ``ModelRunner`` with ``tensor_parallel_size`` = the world size; returns
    when rank 0 closes its engine. The setup (model directory, backend, config) comes from
    rank 0; the caller keeps the process group (see docs/distributed.md)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        raise ConfigError("serve() runs on ranks 1.. of an initialised torch.distributed group; "
                          "rank 0 builds the engine with tensor_parallel_size = the world size")
    rank, size = dist.get_rank(), dist.get_world_size()
    group = p.control_group()
    box: list[Any] = [None]
    dist.broadcast_object_list(box, 0, group=group)
    setup: p.WorkerSetup = box[0]
    if setup.tp_size != size:
        raise ConfigError(f"rank 0 asked for tensor_parallel_size={setup.tp_size}, the group has {size} ranks")
    local = int(os.environ.get("LOCAL_RANK", rank))
    if setup.device_type != "cpu":             # rank r's device is device_index + r: LOCAL_RANK here
        setup = dataclasses.replace(setup, device_index=local - rank)
    _configure(setup, rank)
    channel = p.BroadcastChannel(group, capacity=setup.step_bytes())
    follower = Follower(setup, rank, channel, p.Agreement(group, size))
    heartbeat = Heartbeat(default_store(), rank, size, group.group_name)    # names a lost peer below
    try:
        follower.start()
        follower.loop()
    except (CollectiveMismatchError, RankLostError):
        raise
    except Exception as exc:  # noqa: BLE001 - a peer gone is named; anything else is raised as it is
        lost = heartbeat.lost()
        if lost is None:                     # the store does not answer: it lived on rank 0's node
            lost = [0]
        if lost:
            raise RankLostError(f"tensor-parallel rank {rank}: rank{'s' if len(lost) > 1 else ''} "
                                f"{', '.join(map(str, lost))} lost during call {follower.calls} "
                                f"({type(exc).__name__}: {str(exc).strip()[:200]}); this rank stops", lost[0]) from exc
        raise
    finally:
        heartbeat.stop()
        dist.destroy_process_group(group)


__all__ = ["Follower", "serve", "spawned_worker"]
