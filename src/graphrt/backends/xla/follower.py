"""A follower of multi-controller XLA: every ``jax.distributed`` process but 0 runs :func:`serve`
while process 0 builds ``graphrt.LLM(model_dir, backend="xla", tensor_parallel_size=N)``: it
builds the same executor from process 0's setup and makes process 0's executor calls in the
same order (:mod:`graphrt.backends.xla.lockstep`; docs/distributed.md, "Multi-controller XLA")."""

from __future__ import annotations

from typing import Any

from graphrt.backends.xla import lockstep as ls
from graphrt.core import defaults
from graphrt.core.errors import ConfigError


def serve() -> int:
    """A follower's loop (every ``jax.distributed`` process but 0): build process 0's executor
    and make its calls until process 0 closes the engine; returns the number of calls made.

    Call it where process 0 calls ``graphrt.LLM(..., backend="xla", tensor_parallel_size=N)``,
    after the same ``graphrt.launch("xla", ...)``."""
    import jax

    from graphrt.backends.xla.backend import XlaBackend
    from graphrt.backends.xla.entries import XlaEntry
    from graphrt.config import GraphConfig

    rank = jax.process_index()
    if rank == 0:
        raise ConfigError("graphrt.backends.xla.follower.serve() runs on the processes other than 0; "
                          "process 0 builds graphrt.LLM(..., backend='xla', tensor_parallel_size=N)")
    client = ls.client()
    prefix = ls.engine_prefix()
    setup: ls.Setup = ls.receive(client, prefix, 0, rank, timeout=defaults.XLA_LOCKSTEP_SETUP_TIMEOUT_S)
    config = GraphConfig(**setup.config)
    backend = XlaBackend(tp_size=setup.tp_size)
    executor = backend.open_lockstep(setup.model_dir, config, setup.dtype, setup.sampler_seed)
    entries: dict[Any, Any] = {}
    results = ls.Results()

    def resolve(value: Any) -> Any:
        if isinstance(value, ls.EntryRef):
            return entries.get(value.key)
        if isinstance(value, ls.ResultRef):
            return results.by_number[value.call]
        if type(value) is tuple:
            return tuple(resolve(v) for v in value)
        return value

    number = 0
    try:
        while True:
            number += 1
            name, args, kwargs = ls.receive(client, prefix, number, rank)
            if name == ls.CLOSE:
                return number - 1
            result = getattr(executor, name)(*(resolve(a) for a in args),
                                             **{k: resolve(v) for k, v in kwargs.items()})
            if name == "build":
                entries[args[1]] = result[0]
            elif name == "build_many":
                entries.update((key, built.entry) for (_, key), built in zip(args[0], result))
            elif isinstance(result, XlaEntry):
                entries[result.key] = result
            results.keep(number, result)
    except Exception as exc:
        ls.report_error(client, prefix, rank, exc)
        raise


__all__ = ["serve"]
