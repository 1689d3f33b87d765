"""The CLI's multi-node launch: ``--nnodes`` / ``--node-rank`` / ``--dist-init-addr`` (or
torchrun's ``--master-addr`` / ``--master-port``) start ``torch.distributed`` or
``jax.distributed`` through :func:`graphrt.engine.launch.launch`; rank 0 then builds the engine
with ``tensor_parallel_size`` = the world size and the other ranks follow it. A recipe per
launcher: docs/distributed.md, "Launchers"."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from graphrt.core.errors import ConfigError

if TYPE_CHECKING:
    from graphrt.engine.launch import World

#: The process group each backend's ranks start (``--backend`` name -> graphrt.launch's).
LAUNCH_BACKENDS = {"cpu": "gloo", "eager": "gloo", "cuda": "nccl", "npu": "hccl", "xla": "xla"}


def launch_backend(backend: str) -> str:
    """``graphrt.launch``'s backend for a ``--backend`` name (ConfigError for ``auto``)."""
    from graphrt.registry import canonical_name

    name = canonical_name(backend) if backend != "auto" else "auto"
    if name not in LAUNCH_BACKENDS:
        raise ConfigError(f"--backend {backend}: the multi-node flags need a named backend, one of "
                          f"{sorted(LAUNCH_BACKENDS)} (each starts its own process group)")
    return LAUNCH_BACKENDS[name]


def start(args: argparse.Namespace) -> "World":
    """Check the flags, start the process group and return this process's World; sets
    ``args.tensor_parallel_size`` to the world size (an explicit other value: ConfigError).
    ``--model-dir`` is required: every node loads the checkpoint from rank 0's path."""
    from graphrt.engine.launch import init_distributed, world_from_args

    group = launch_backend(args.backend)
    if args.model_dir is None:
        raise ConfigError("--model-dir: the multi-node flags need a checkpoint every node can read at the same "
                          "path (the ranks load it from rank 0's path), not the demo's temporary one")
    if not os.path.isfile(os.path.join(args.model_dir, "config.json")):   # before any rank waits on rank 0
        raise ConfigError(f"--model-dir: {args.model_dir} has no config.json")
    world = world_from_args(args)
    tp = getattr(args, "tensor_parallel_size", None)
    if tp not in (None, 1, world.world_size):
        raise ConfigError(f"--tensor-parallel-size {tp}: the launched world has {world.world_size} ranks; "
                          "leave it unset or give the same number")
    args.tensor_parallel_size = world.world_size
    init_distributed(world, group)
    return world


def follow(args: argparse.Namespace) -> int:
    """A rank other than 0: follow rank 0's engine until it closes it; returns the exit status."""
    if launch_backend(args.backend) == "xla":
        from graphrt.backends.xla.follower import serve as serve_xla
        calls = serve_xla()
        print(f"followed rank 0: {calls} executor calls")
        return 0
    import torch.distributed as dist

    from graphrt.backends.torch.parallel.tp_worker import serve
    serve()
    dist.destroy_process_group()
    print("followed rank 0 until it closed the engine")
    return 0


def finish(args: argparse.Namespace) -> None:
    """Rank 0, after its engine closed: leave the torch process group (jax's ends with the process)."""
    if launch_backend(args.backend) != "xla":
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["LAUNCH_BACKENDS", "finish", "follow", "launch_backend", "start"]
