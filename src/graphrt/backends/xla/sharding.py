"""Tensor parallelism for the XLA backend: a 1-D mesh, Megatron-style weight shardings.

Column-parallel projections (q, k, v, gate, up, lm_head) are split on their output axis,
row-parallel ones (o, down) on their input axis; XLA inserts the all-reduces. KV heads (and
the KV cache's head axis) are split when their count divides the mesh, and replicated
otherwise, as vLLM does. Everything else (embedding, norms, step inputs) is replicated.
Weights are stacked on a leading layer axis (``jax_loader``), hence the leading ``None``.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from graphrt.core.errors import ConfigError
from graphrt.models.jax.model_config import JaxModelConfig

#: Name of the XLA backend's tensor-parallel mesh axis.
XLA_TP_AXIS = "tp"

_COLUMN = {"wq": P(None, None, XLA_TP_AXIS), "bq": P(None, XLA_TP_AXIS), "w_gate": P(None, None, XLA_TP_AXIS),
           "w_up": P(None, None, XLA_TP_AXIS), "lm_head": P(None, XLA_TP_AXIS)}
_ROW = {"wo": P(None, XLA_TP_AXIS, None), "w_down": P(None, XLA_TP_AXIS, None)}
_KV = {"wk": P(None, None, XLA_TP_AXIS), "wv": P(None, None, XLA_TP_AXIS), "bk": P(None, XLA_TP_AXIS),
       "bv": P(None, XLA_TP_AXIS)}


def make_mesh(tp_size: int, devices: Sequence[Any] | None = None) -> Mesh:
    """A 1-D ``tp`` mesh over the first ``tp_size`` devices."""
    devices = list(devices if devices is not None else jax.devices())
    if tp_size < 1:
        raise ConfigError(f"tp_size must be >= 1, got {tp_size}")
    if tp_size > len(devices):
        raise ConfigError(f"tp_size={tp_size} needs {tp_size} devices; {len(devices)} visible "
                          f"({devices[0].platform}); on CPU set "
                          f"XLA_FLAGS=--xla_force_host_platform_device_count={tp_size} before jax starts")
    return Mesh(np.asarray(devices[:tp_size]), (XLA_TP_AXIS,))


def mesh_size(mesh: Mesh) -> int:
    """Devices along the tensor-parallel axis."""
    if XLA_TP_AXIS not in mesh.axis_names or len(mesh.axis_names) != 1:
        raise ConfigError(f"the XLA backend shards over a 1-D mesh with axis {XLA_TP_AXIS!r}; "
                          f"got axes {mesh.axis_names}")
    return int(mesh.shape[XLA_TP_AXIS])


def kv_heads_sharded(config: JaxModelConfig, tp: int) -> bool:
    """Whether KV heads split over the mesh (else they are replicated on every device)."""
    return tp > 1 and config.num_key_value_heads % tp == 0


def check_tp(config: JaxModelConfig, tp: int) -> None:
    """Raise :class:`ConfigError` when the model's head or MLP sizes do not divide ``tp``
    (nothing to check on one device: a config may leave them out there, docs/xla.md)."""
    if tp <= 1:
        return
    for name, value in (("num_attention_heads", config.num_attention_heads),
                        ("intermediate_size", config.intermediate_size),
                        ("vocab_size", config.vocab_size)):
        if value % tp:
            raise ConfigError(f"tensor parallelism over {tp} devices needs {name} ({value}) "
                              f"divisible by {tp}")


def _leaf_name(path: tuple[Any, ...]) -> str | None:
    """The params-dict name of a leaf (nnx state paths end in ``.value`` after it)."""
    for entry in reversed(path):
        if hasattr(entry, "key"):
            return str(entry.key)
    return None


def weight_spec(name: str | None, config: JaxModelConfig, tp: int) -> P:
    """The partition spec of one weight by its params-dict name."""
    if tp == 1 or name is None:
        return P()
    if name in _COLUMN:
        return _COLUMN[name]
    if name in _ROW:
        return _ROW[name]
    if name in _KV and kv_heads_sharded(config, tp):
        return _KV[name]
    return P()


def weight_shardings(weights: Any, mesh: Mesh, config: JaxModelConfig) -> Any:
    """A pytree of ``NamedSharding`` matching ``weights`` (a params dict or an nnx state)."""
    tp = mesh_size(mesh)
    return jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(mesh, weight_spec(_leaf_name(path), config, tp)), weights)


def place(weights: Any, shardings: Any) -> Any:
    """``weights`` on their devices (``jax.device_put``); abstract leaves (``jax.ShapeDtypeStruct``)
    become structs carrying their sharding instead, so programs can be built and compiled ahead
    of time for devices this host does not have (deviceless TPU compiles: ``make compile-check``)."""
    if not any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree_util.tree_leaves(weights)):
        return jax.device_put(weights, shardings)
    return jax.tree_util.tree_map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                                  weights, shardings)


def kv_cache_sharding(mesh: Mesh, config: JaxModelConfig) -> NamedSharding:
    """The KV cache ``[layers, 2, rows, kv_heads, head_dim]``: split on heads when they divide."""
    tp = mesh_size(mesh)
    return NamedSharding(mesh, P(None, None, None, XLA_TP_AXIS, None) if kv_heads_sharded(config, tp) else P())


def kv_cache_format(sharding: NamedSharding, ndim: int) -> Format:
    """The KV cache's ``sharding`` with its layout fixed row-major (the last axis minor), for the
    forward's cache argument and result and for the cache it allocates. Left to the compiler,
    a TPU lays out an entry array of small minor axes (4 KV heads of 64) another way than the
    cache's gather and scatter read it, and the forward then copied the whole cache in and out
    every step (``make compile-check``); fixed, every executable and the allocation agree. It is
    every backend's default layout for the shapes it does not pad (CPU, GPU: always)."""
    return Format(Layout(tuple(range(ndim))), sharding)


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (step inputs, logits, sampler state)."""
    return NamedSharding(mesh, P())
