"""A flax ``nnx.Module`` face over :mod:`graphrt.models.jax.decoder`, for runners that jit split modules.

Usage: ``graphdef, state = nnx.split(NnxDecoder(config, params, block_size=bs))`` then
``jax.jit(nnx_forward, static_argnums=0, donate_argnames=("kv_cache",))(graphdef, state, ...)``.
Only this module imports flax.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from graphrt.models.hf_config import DecoderConfig
from graphrt.layers.jax.paged_attention import AttentionMetadata
from graphrt.models.jax.decoder import Params, compute_logits, forward


def _values(tree: Any) -> Params:
    return jax.tree.map(lambda v: v[...], tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


class NnxDecoder(nnx.Module):
    """The reference decoder as an nnx module: params as ``nnx.Param`` leaves, config static."""

    def __init__(self, config: DecoderConfig, params: Params, *, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.params = nnx.data(jax.tree.map(nnx.Param, params))

    def __call__(self, kv_cache: jax.Array, input_ids: jax.Array, positions: jax.Array,
                 meta: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
        """Same as :func:`jax_decoder.forward` with this module's params, config and block size."""
        return forward(_values(self.params), kv_cache, input_ids, positions, meta,
                       config=self.config, block_size=self.block_size)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """Float32 logits [N, V] for final-normed ``hidden`` [N, H]."""
        return compute_logits(_values(self.params), hidden, config=self.config)


def nnx_forward(graphdef: nnx.GraphDef, state: nnx.State, kv_cache: jax.Array, input_ids: jax.Array,
                positions: jax.Array, meta: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
    """Merge a split :class:`NnxDecoder` and run its forward; jit with ``graphdef`` static."""
    return nnx.merge(graphdef, state)(kv_cache, input_ids, positions, meta)
