"""graphrt's XLA programs as ``jax.export`` artifacts: each key's forward or sampler, lowered for
several platforms at once (``cpu``, ``cuda``, ``tpu``; none of their devices needed), to
serialize, reload (``jax.export.deserialize``) and call with the arguments the executor passes.

What it proves without a device: every program lowers for each platform, and the artifact runs
where one is (``make compile-check`` reloads them on the CPU). The step's pytrees
(``XlaBatch``, ``SamplingMetadata``, the decoder's ``AttentionMetadata``) are registered for
export serialization where they are defined. docs/xla.md, "Exporting the programs"."""

from __future__ import annotations

from typing import Any, Hashable, Iterable, Sequence

import jax
import jax.export

from graphrt.core.graph_modes import RuntimeMode

#: The platforms :func:`export_programs` lowers for by default.
EXPORT_PLATFORMS = ("cpu", "cuda", "tpu")


def export_programs(executor: Any, keys: Iterable[Hashable] | None = None,
                    platforms: Sequence[str] = EXPORT_PLATFORMS) -> dict[Hashable, jax.export.Exported]:
    """Each of ``keys`` (default: every key ``executor`` compiled -- forward
    ``BatchDescriptor``s and ``SamplerKey``s) exported for ``platforms``, against the executor's
    allocated KV cache, by key. ``executor`` is an :class:`~graphrt.backends.xla.executor.XlaExecutor`
    (``runner.executor``). An artifact takes the arguments its executable does (weights, KV
    cache, batch, future tokens and rows[, extra inputs]; logits[, sampling metadata]) and does
    not donate the cache."""
    keys = list(executor.compiles.keys()) if keys is None else list(keys)
    out = {}
    for key in keys:
        jitted, _, args = executor.program(RuntimeMode.FULL, key)
        out[key] = jax.export.export(jitted, platforms=tuple(platforms))(*args)
    return out


__all__ = ["EXPORT_PLATFORMS", "export_programs"]
