"""The XLA backend's step inputs as pytrees, and how to say why two of them compile differently.

``XlaBatch`` (the forward's inputs) and ``SamplingMetadata`` (the sampler's) are registered
dataclasses: the arrays are pytree leaves, the padded sizes and the step kind are static
metadata kept apart from them (sglang-jax's pytree batches). An executable compiled for one batch accepts another
only when structure, dtypes and shapes all match; :func:`describe_change` names the field that
differs, for ``CacheMissError`` and ``InputError`` messages.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.export
import numpy as np

#: Forward input fields, in the order they travel (all int32).
BATCH_FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "state_slots", "block_table")
#: Sampler input fields of non-greedy steps.
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seeds", "steps", "min_p")


@dataclasses.dataclass(frozen=True)
class XlaBatch:
    """One padded forward step: token-level ``[T]`` and request-level ``[R]`` / ``[R+1]`` arrays.

    ``num_tokens`` / ``num_reqs`` are the padded sizes and ``uniform_decode`` the step kind;
    they are static, so they belong to the executable's key rather than to its inputs.
    """

    input_ids: Any
    positions: Any
    slot_mapping: Any
    query_start_loc: Any
    seq_lens: Any
    state_slots: Any      # [R]: each request's recurrent-state slot (-1: padding; a model without state: all -1)
    block_table: Any
    num_tokens: int = 0
    num_reqs: int = 0
    uniform_decode: bool = False


@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling parameters of a non-greedy sampler step (padded rows are greedy).

    ``seeds`` uint32 ``[R, 2]`` is each row's raw threefry key; ``steps`` uint32 ``[R]`` is
    folded into it, so a seeded request draws the same noise at the same step whatever
    else is in its batch.
    """

    temperature: Any  # float32 [R]; below the minimum temperature = greedy
    top_k: Any        # int32 [R]; the vocabulary size where disabled
    top_p: Any        # float32 [R]; 1.0 where disabled
    seeds: Any        # uint32 [R, 2]
    steps: Any        # uint32 [R]
    min_p: Any = None  # float32 [R]; 0.0 where disabled (None: no row has a min-p filter)


BATCH_META_FIELDS = ("num_tokens", "num_reqs", "uniform_decode")
jax.tree_util.register_dataclass(XlaBatch, data_fields=list(BATCH_FIELDS), meta_fields=list(BATCH_META_FIELDS))
jax.tree_util.register_dataclass(SamplingMetadata, data_fields=list(SAMPLING_FIELDS), meta_fields=[])


def _register_export(cls: type, data_fields: tuple[str, ...], meta_fields: tuple[str, ...]) -> None:
    """``cls`` (a registered dataclass) serializable in a ``jax.export`` artifact's calling
    convention: its static fields as JSON (ints and bools), rebuilt with its array fields."""
    def from_children(aux: tuple[Any, ...], children: Any) -> Any:
        return cls(**dict(zip(data_fields, children)), **dict(zip(meta_fields, aux)))

    jax.export.register_pytree_node_serialization(
        cls, serialized_name=f"graphrt.{cls.__name__}", serialize_auxdata=lambda aux: json.dumps(list(aux)).encode(),
        deserialize_auxdata=lambda data: tuple(json.loads(data.decode())), from_children=from_children)


_register_export(XlaBatch, BATCH_FIELDS, BATCH_META_FIELDS)
_register_export(SamplingMetadata, SAMPLING_FIELDS, ())


def batch_spec(num_tokens: int, num_reqs: int, uniform_decode: bool, width: int) -> XlaBatch:
    """The abstract batch of one forward key: ``ShapeDtypeStruct`` leaves, int32 everywhere."""
    i32 = np.dtype(np.int32)
    tok = jax.ShapeDtypeStruct((num_tokens,), i32)
    return XlaBatch(input_ids=tok, positions=tok, slot_mapping=tok,
                    query_start_loc=jax.ShapeDtypeStruct((num_reqs + 1,), i32),
                    seq_lens=jax.ShapeDtypeStruct((num_reqs,), i32),
                    state_slots=jax.ShapeDtypeStruct((num_reqs,), i32),
                    block_table=jax.ShapeDtypeStruct((num_reqs, width), i32),
                    num_tokens=num_tokens, num_reqs=num_reqs, uniform_decode=uniform_decode)


def sampling_spec(num_reqs: int) -> SamplingMetadata:
    """The abstract sampling metadata of ``num_reqs`` rows."""
    f32, i32, u32 = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint32)
    return SamplingMetadata(temperature=jax.ShapeDtypeStruct((num_reqs,), f32),
                            top_k=jax.ShapeDtypeStruct((num_reqs,), i32),
                            top_p=jax.ShapeDtypeStruct((num_reqs,), f32),
                            seeds=jax.ShapeDtypeStruct((num_reqs, 2), u32),
                            steps=jax.ShapeDtypeStruct((num_reqs,), u32),
                            min_p=jax.ShapeDtypeStruct((num_reqs,), f32))


def _path_name(path: tuple[Any, ...]) -> str:
    parts = []
    for entry in path:
        for attr in ("name", "key", "idx"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
    return ".".join(parts) or "<root>"


def _leaves(tree: Any) -> tuple[dict[str, Any], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return {_path_name(p): leaf for p, leaf in flat}, treedef


def _aval(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    return tuple(np.shape(leaf)), np.dtype(getattr(leaf, "dtype", np.asarray(leaf).dtype))


def describe_change(expected: Any, got: Any) -> str | None:
    """Why ``got`` would not run on an executable compiled for ``expected``; ``None`` if it would.

    Names the first field that differs and how, in this order: pytree structure (a field
    present in one and ``None`` or missing in the other), dtype, shape, and last the static
    metadata (padded sizes, step kind) that is part of the structure too.
    """
    exp_leaves, exp_def = _leaves(expected)
    got_leaves, got_def = _leaves(got)
    for name in exp_leaves:
        if name not in got_leaves:
            return f"pytree structure: field {name!r} is None or missing; the executable expects an array"
    for name in got_leaves:
        if name not in exp_leaves:
            return f"pytree structure: field {name!r} is an array; the executable expects None"
    for name, leaf in exp_leaves.items():
        (exp_shape, exp_dtype), (got_shape, got_dtype) = _aval(leaf), _aval(got_leaves[name])
        if exp_dtype != got_dtype:
            return f"dtype: field {name!r} is {got_dtype}; the executable expects {exp_dtype}"
        if exp_shape != got_shape:
            return f"shape: field {name!r} is {got_shape}; the executable expects {exp_shape}"
    if exp_def != got_def:
        return f"pytree structure: static fields differ ({got_def} versus the executable's {exp_def})"
    return None


def signature(tree: Any) -> tuple[Any, tuple[tuple[str, tuple[int, ...], str], ...]]:
    """A hashable (structure, per-field shape and dtype) summary of a pytree of arrays."""
    leaves, treedef = _leaves(tree)
    return treedef, tuple((name, *_fmt(leaf)) for name, leaf in leaves.items())


def _fmt(leaf: Any) -> tuple[tuple[int, ...], str]:
    shape, dtype = _aval(leaf)
    return shape, dtype.name
