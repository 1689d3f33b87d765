"""What the XLA executor compiles for a key: its jitted program, the batch or sampling spec it
is compiled for, and abstract arguments of the shapes it will be called with (no device work)."""

from __future__ import annotations

from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp

from graphrt.backends.xla import extra_inputs as xla_extra
from graphrt.backends.xla.batch import batch_spec, sampling_spec
from graphrt.backends.xla.programs import XlaPrograms
from graphrt.core.dispatch import BatchDescriptor, SamplerKey
from graphrt.core.errors import GraphrtError
from graphrt.core.graph_modes import RuntimeMode


def abstract_inputs(programs: XlaPrograms, mode: RuntimeMode, key: Hashable, kv_cache: jax.Array | None,
                    state_caches: list[jax.Array], extra_inputs: Any,
                    table_width: Callable[[BatchDescriptor], int]) -> tuple[Any, Any, tuple[Any, ...]]:
    """(jitted function, spec, abstract arguments) of ``key``: a :class:`SamplerKey`'s sampler,
    or a FULL key's forward against the allocated ``kv_cache`` (and ``state_caches``) with
    ``table_width(key)`` block-table columns and the model's ``extra_inputs``."""
    if isinstance(key, SamplerKey):
        num_reqs, greedy = key.num_reqs, key.greedy
        logits = jax.ShapeDtypeStruct((num_reqs, int(programs.model_config.vocab_size)), jnp.float32)
        if key.logprobs:
            return programs.logprobs, None, (logits, jax.ShapeDtypeStruct((programs.max_reqs,), jnp.int32))
        if greedy:
            return programs.greedy, None, (logits,)
        spec = sampling_spec(num_reqs)
        if key.penalties:
            raise GraphrtError("the xla backend has no penalised sampler (repetition / presence / "
                               "frequency penalties): they run on the torch backends")
        return programs.sample_wide if key.wide_top_k else programs.sample, spec, (logits, spec)
    if mode is not RuntimeMode.FULL or not isinstance(key, BatchDescriptor) or key.num_reqs is None:
        raise GraphrtError(f"the xla backend compiles whole forwards (FULL keys with a request "
                           f"count); got {mode.value} {key}")
    if kv_cache is None:
        raise GraphrtError("allocate_kv_cache before building executables (they are compiled "
                           "for the KV cache's shape)")
    spec = batch_spec(key.num_tokens, key.num_reqs, key.uniform_decode, table_width(key))
    kv: Any = jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype)
    if programs.state_spec is not None:
        kv = (kv, tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in state_caches))
    future = (jax.ShapeDtypeStruct((programs.max_reqs,), jnp.int32),
              jax.ShapeDtypeStruct((key.num_reqs,), jnp.int32))
    extra = xla_extra.abstract_args(extra_inputs, key.num_tokens, key.num_reqs)
    return programs.forward, spec, (programs.weights, kv, spec, *future, *extra)
