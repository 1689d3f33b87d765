"""``graphrt.engine.launch``: one world description from whatever started this process, and the
process group started from it.

A cluster says who a process is in its own words: torchrun (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` / ``MASTER_PORT``), SLURM (``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_JOB_NODELIST``), a Kubernetes LeaderWorkerSet
(``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX``), or SGLang-style flags
(``--nnodes``, ``--node-rank``, ``--dist-init-addr``). :func:`detect_world` reads them into
one :class:`World`; :func:`init_distributed` starts ``torch.distributed`` (or
``jax.distributed`` for ``backend="xla"``) from it; :func:`launch` does both. Which source
wins, and a copy-paste recipe per launcher: docs/distributed.md, "Launchers"."""

from __future__ import annotations

import argparse
import os
import re
from datetime import timedelta
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from graphrt.core import defaults
from graphrt.core.errors import ConfigError

Source = Literal["flags", "torchrun", "slurm", "lws"]


class World(BaseModel):
    """Who this process is among all the processes of one job (every field checked)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(ge=0, description="this process's global rank")
    world_size: int = Field(ge=1, description="processes in the job")
    local_rank: int = Field(ge=0, description="this process's index on its node (its device index)")
    local_world_size: int = Field(ge=1, description="processes per node")
    node_rank: int = Field(ge=0, description="this node's index")
    nnodes: int = Field(ge=1, description="nodes in the job")
    master_addr: str = Field(min_length=1, description="host of rank 0's rendezvous")
    master_port: int = Field(ge=1, le=65535, description="port of rank 0's rendezvous")
    source: Source = Field(description="what the world was read from")

    @model_validator(mode="after")
    def _consistent(self) -> "World":
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} is outside nnodes {self.nnodes}")
        if self.local_rank >= self.local_world_size:
            raise ValueError(f"local_rank {self.local_rank} is outside local_world_size {self.local_world_size}")
        return self

    @property
    def init_method(self) -> str:
        """torch.distributed's TCP rendezvous address (``tcp://host:port``)."""
        return f"tcp://{_bracket(self.master_addr)}:{self.master_port}"

    def same_job(self, other: "World") -> bool:
        """Whether ``other`` describes the same process of the same job (the source aside)."""
        return self.model_dump(exclude={"source"}) == other.model_dump(exclude={"source"})


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compact host list as host names, without ``scontrol``: ``node[01-03,7],gpu-a``
    is ``node01 node02 node03 node7 gpu-a`` (zero padding kept; one bracket group per name)."""
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?([^,\[]*)", text):
        prefix, ranges, suffix = match.group(1), match.group(2), match.group(3)
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise ConfigError(f"SLURM_JOB_NODELIST={text!r}: cannot read the range {part!r} "
                                  "(expected digits, e.g. node[01-04,7])")
            width = len(low)
            for n in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{n:0{width}d}{suffix}")
    if not hosts:
        raise ConfigError(f"SLURM_JOB_NODELIST={text!r} names no host")
    return hosts


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise ConfigError(f"{name} is not set; the launcher's environment is incomplete")
        return default
    try:
        return int(value.split("(")[0])          # SLURM_TASKS_PER_NODE-style "2(x3)"
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def _split_addr(addr: str, flag: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{flag}={addr!r}: expected host:port, e.g. 10.0.0.1:{defaults.LAUNCH_MASTER_PORT}")
    return host.strip("[]"), int(port)


def _make(source: Source, **fields: Any) -> World:
    try:
        return World(source=source, **fields)
    except ValueError as exc:                   # pydantic's ValidationError is a ValueError
        raise ConfigError(f"the world read from {source} is inconsistent: {exc}") from None


def detect_world(env: Mapping[str, str] | None = None, *, nnodes: int | None = None, node_rank: int | None = None,
                 dist_init_addr: str | None = None, nproc_per_node: int = 1, local_rank: int = 0,
                 master_addr: str | None = None, master_port: int | None = None) -> World:
    """This process's :class:`World`. Sources, first match wins: the flags (``dist_init_addr``
    given -- or torchrun's spelling ``master_addr`` / ``master_port``, never both: one node per
    ``node_rank`` with ``nproc_per_node`` processes, this one ``local_rank``),
    torchrun (``RANK`` and ``WORLD_SIZE`` set), SLURM (``SLURM_PROCID``), LeaderWorkerSet
    (``LWS_LEADER_ADDRESS``; ``nproc_per_node`` processes per pod, ``LOCAL_RANK`` this one).
    ``MASTER_ADDR`` / ``MASTER_PORT`` override SLURM's and LWS's rendezvous where set. Nothing
    found is a :class:`ConfigError` naming the variables looked for."""
    env = os.environ if env is None else env
    port = _int(env, "MASTER_PORT", defaults.LAUNCH_MASTER_PORT)
    if master_addr is not None or master_port is not None:
        if dist_init_addr is not None:
            raise ConfigError("--dist-init-addr and --master-addr / --master-port name the same rendezvous: give one")
        if master_addr is None:
            raise ConfigError("--master-port needs --master-addr (rank 0's host)")
        dist_init_addr = f"{_bracket(master_addr)}:{defaults.LAUNCH_MASTER_PORT if master_port is None else master_port}"
    if dist_init_addr is not None:
        host, port = _split_addr(dist_init_addr, "--dist-init-addr")
        nodes, node = nnodes or 1, node_rank or 0
        return _make("flags", rank=node * nproc_per_node + local_rank, world_size=nodes * nproc_per_node,
                     local_rank=local_rank, local_world_size=nproc_per_node, node_rank=node, nnodes=nodes,
                     master_addr=host, master_port=port)
    if nnodes is not None or node_rank is not None:
        raise ConfigError("--nnodes / --node-rank need --dist-init-addr host:port (or --master-addr / --master-port: "
                          "rank 0's node)")
    if "RANK" in env and "WORLD_SIZE" in env:
        world, local = _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK", 0)
        per_node = _int(env, "LOCAL_WORLD_SIZE", world)
        return _make("torchrun", rank=_int(env, "RANK"), world_size=world, local_rank=local,
                     local_world_size=per_node, node_rank=_int(env, "GROUP_RANK", _int(env, "RANK") // per_node),
                     nnodes=max(1, world // per_node), master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                     master_port=port)
    if "SLURM_PROCID" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_STEP_NODELIST")
        hosts = expand_nodelist(nodelist) if nodelist else []
        world = _int(env, "SLURM_NTASKS")
        nodes = _int(env, "SLURM_NNODES", len(hosts) or 1)
        master = env.get("MASTER_ADDR") or (hosts[0] if hosts else None)
        if master is None:
            raise ConfigError("SLURM: neither MASTER_ADDR nor SLURM_JOB_NODELIST is set, so rank 0's host is unknown")
        return _make("slurm", rank=_int(env, "SLURM_PROCID"), world_size=world, local_rank=_int(env, "SLURM_LOCALID", 0),
                     local_world_size=_int(env, "SLURM_NTASKS_PER_NODE", max(1, world // nodes)),
                     node_rank=_int(env, "SLURM_NODEID", 0), nnodes=nodes, master_addr=master, master_port=port)
    if "LWS_LEADER_ADDRESS" in env:
        pods, pod, local = _int(env, "LWS_GROUP_SIZE"), _int(env, "LWS_WORKER_INDEX"), _int(env, "LOCAL_RANK", 0)
        return _make("lws", rank=pod * nproc_per_node + local, world_size=pods * nproc_per_node, local_rank=local,
                     local_world_size=nproc_per_node, node_rank=pod, nnodes=pods,
                     master_addr=env.get("MASTER_ADDR") or env["LWS_LEADER_ADDRESS"], master_port=port)
    raise ConfigError("no launcher found: set --dist-init-addr (with --nnodes, --node-rank), or run under torchrun "
                      "(RANK, WORLD_SIZE), SLURM (SLURM_PROCID, SLURM_NTASKS) or a LeaderWorkerSet "
                      "(LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX)")


def init_distributed(world: World, backend: str = "gloo", timeout: float = defaults.TP_TIMEOUT_S) -> None:
    """Start the process group of ``world``: ``torch.distributed`` with ``backend`` ("gloo",
    "nccl", "hccl"), or ``jax.distributed`` (``backend="xla"``, coordinator at the master's
    address). Every process of the job calls this; it returns once all have joined."""
    if backend == "xla":
        import jax

        if not jax.config.jax_cpu_collectives_implementation:    # host devices talk over gloo
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"{_bracket(world.master_addr)}:{world.master_port}",
                                   num_processes=world.world_size, process_id=world.rank,
                                   initialization_timeout=int(timeout))
        return
    import torch.distributed as dist

    if dist.is_initialized():
        raise ConfigError("torch.distributed is already initialised in this process; launch once per process")
    dist.init_process_group(backend, init_method=world.init_method, rank=world.rank, world_size=world.world_size,
                            timeout=timedelta(seconds=timeout))


def launch(backend: str = "gloo", env: Mapping[str, str] | None = None, timeout: float = defaults.TP_TIMEOUT_S,
           **flags: Any) -> World:
    """:func:`detect_world` (``flags``: its keyword arguments), then :func:`init_distributed`."""
    world = detect_world(env, **flags)
    init_distributed(world, backend, timeout)
    return world


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    """The multi-node flags: SGLang's ``--nnodes``, ``--node-rank``, ``--dist-init-addr``, and
    torchrun's ``--master-addr`` / ``--master-port`` for the same rendezvous."""
    group = parser.add_argument_group("multi-node (graphrt.launch; docs/distributed.md, \"Launchers\")")
    group.add_argument("--nnodes", type=int, default=None, help="nodes in the job (with --dist-init-addr)")
    group.add_argument("--node-rank", type=int, default=None, help="this node's index, 0 on rank 0's node")
    group.add_argument("--dist-init-addr", default=None, help="host:port of rank 0's rendezvous")
    group.add_argument("--master-addr", default=None, help="torchrun's spelling: rank 0's host (with --master-port)")
    group.add_argument("--master-port", type=int, default=None,
                       help=f"torchrun's spelling: rank 0's port (default {defaults.LAUNCH_MASTER_PORT})")


def launch_requested(args: argparse.Namespace) -> bool:
    """Whether any :func:`add_launch_args` flag was given."""
    return any(getattr(args, name, None) is not None
               for name in ("nnodes", "node_rank", "dist_init_addr", "master_addr", "master_port"))


def world_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> World:
    """The :class:`World` of parsed :func:`add_launch_args` flags (or, without them, the env);
    ``--master-addr host --master-port p`` is ``--dist-init-addr host:p``."""
    return detect_world(env, nnodes=args.nnodes, node_rank=args.node_rank, dist_init_addr=args.dist_init_addr,
                        master_addr=getattr(args, "master_addr", None), master_port=getattr(args, "master_port", None))


__all__ = ["World", "add_launch_args", "detect_world", "expand_nodelist", "init_distributed", "launch",
           "launch_requested", "world_from_args"]
