"""Recurrent-state specs: what each group of recurrent layers keeps per running request.

A hybrid model's ``state_spec()`` (docs/hybrid.md, "State specs") names groups of recurrent
layers and the tensors of one request's state. One slot per running request; per layer and
tensor the executor allocates ``[num_slots + 1, checkpoints, *shape]``: slot ``num_slots`` is
the trash slot padding uses, and ``checkpoints`` = 1 + num_speculative_tokens is a ring indexed
by ``position % checkpoints``, so rejected drafts roll back by themselves. Slots are taken from
the KV budget first (:func:`state_memory`). The standard library only."""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any, Collection, Sequence

from graphrt.core.errors import ConfigError
from graphrt.core.kv_spec import KV_CACHE_DTYPE_BYTES as DTYPE_BYTES, is_int, check_covered, claim_layers, \
    kv_cache_dtype_name

#: The model method (and the prefix of every field named in an error).
STATE_SPEC_FIELD = "state_spec"
#: The recurrent layer's method saying what it keeps per request: one shape per state tensor,
#: in the spec's tensor order, without the slot and checkpoint dimensions.
STATE_SHAPES = "state_shapes"


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a request's state in each layer of a group: ``shape`` per slot (and
    checkpoint); ``dtype`` "auto" (the weights' dtype) or a name / torch / numpy / JAX dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: Any = "auto"

    def nbytes(self) -> int:
        """Bytes of one slot's tensor (a resolved dtype)."""
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class StateGroup:
    """Recurrent layers (indices into ``model.state_layers()``) with one state layout; ``kind``
    names the mixer for logs ("mamba2", "gated_delta_net")."""

    layers: tuple[int, ...]
    tensors: tuple[StateTensor, ...]
    kind: str = "recurrent"

    def bytes_per_slot(self) -> int:
        """Bytes of one request's state (one checkpoint) over the group's layers."""
        return len(self.layers) * sum(t.nbytes() for t in self.tensors)


@dataclass(frozen=True)
class StateSpec:
    """Every recurrent layer's per-request state, by group (empty: a model without state)."""

    groups: tuple[StateGroup, ...] = ()

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def bytes_per_slot(self) -> int:
        """Bytes of one request's state over every layer, one checkpoint (a resolved spec)."""
        return sum(g.bytes_per_slot() for g in self.groups)

    def layer_tensors(self, layer: int) -> tuple[StateTensor, ...]:
        """The state tensors of recurrent layer ``layer``."""
        return next(g.tensors for g in self.groups if layer in g.layers)


@dataclass(frozen=True)
class StateMemory:
    """The state cache's size: ``num_slots`` live slots and the trash slot, ``checkpoints`` each,
    ``bytes_per_slot`` per checkpoint over every layer."""

    num_slots: int
    checkpoints: int
    bytes_per_slot: int

    @property
    def nbytes(self) -> int:
        return (self.num_slots + 1) * self.checkpoints * self.bytes_per_slot

    def as_dict(self) -> dict[str, int]:
        return {"state_slots": self.num_slots, "state_checkpoints": self.checkpoints,
                "state_bytes_per_slot": self.bytes_per_slot, "state_bytes": self.nbytes}

    def summary(self) -> str:
        return (f"recurrent state: {self.num_slots} slots + 1 trash slot x {self.checkpoints} checkpoint(s) x "
                f"{self.bytes_per_slot} bytes = {self.nbytes / 2**20:.2f} MiB")


def state_memory(spec: StateSpec, *, max_num_seqs: int, decode_query_len: int) -> StateMemory:
    """The state cache a runner allocates: a slot per running request (``max_num_seqs``), a
    checkpoint per token a verification step schedules (``decode_query_len``)."""
    return StateMemory(int(max_num_seqs), int(decode_query_len), spec.bytes_per_slot())


def check_state_fits(memory: StateMemory, budget: int, per_block: int) -> int:
    """The budget left for the KV cache once the states are out of it; raises
    :class:`ConfigError` with the numbers when the states leave fewer than 2 KV blocks of
    ``per_block`` bytes (0: a model without attention needs none)."""
    left = int(budget) - memory.nbytes
    need = 2 * per_block
    if left < need:
        what = f"2 KV blocks of {per_block} bytes ({need})" if per_block else "nothing"
        raise ConfigError(
            f"kv_cache_memory: the recurrent states need {memory.nbytes} bytes ({memory.num_slots} slots "
            f"(max_num_seqs) + 1 trash slot, x {memory.checkpoints} checkpoint(s) (1 + num_speculative_tokens), "
            f"x {memory.bytes_per_slot} bytes per slot) of a {budget}-byte budget, leaving {left} where the KV "
            f"cache needs {what}: raise the budget or lower max_num_seqs")
    return left


def resolve_state_spec(declared: Any, *, model_dtype: Any, supported: Collection[str], backend: str,
                       num_layers: int | None = None) -> StateSpec:
    """The model's declared state spec checked and made concrete: every tensor's dtype a name in
    ``supported`` ("auto": ``model_dtype``), its shape positive ints, tensor names unique in a
    group, the groups' layers disjoint and, where ``num_layers`` (``len(model.state_layers())``)
    is known, covering them. :class:`ConfigError` naming the field otherwise."""
    if not isinstance(declared, StateSpec):
        raise ConfigError(f"{STATE_SPEC_FIELD}: the model returned {declared!r}; return a graphrt.StateSpec "
                          "(docs/hybrid.md)")
    seen: dict[int, int] = {}
    groups = []
    for i, group in enumerate(declared.groups):
        field = f"{STATE_SPEC_FIELD}.groups[{i}]"
        if not isinstance(group, StateGroup):
            raise ConfigError(f"{field}: {group!r} is not a graphrt StateGroup")
        layers = claim_layers(group.layers, STATE_SPEC_FIELD, i, seen, num_layers, "recurrent")
        tensors = _tensors(group.tensors, field, model_dtype, supported, backend)
        groups.append(replace(group, layers=layers, tensors=tensors))
    check_covered(seen, num_layers, STATE_SPEC_FIELD, "recurrent layers (state_layers())")
    return StateSpec(tuple(groups))


def check_against_state_layers(spec: StateSpec, kept: Sequence[Sequence[tuple[int, ...]] | None],
                               kinds: Sequence[str] | None = None) -> None:
    """Every group agrees with what its layers say they keep: ``kept[i]`` is recurrent layer
    ``i``'s per-request state shapes in the spec's tensor order (its ``state_shapes()``; None:
    it says nothing). A :class:`ConfigError` names the group, the tensor, the layer and both
    shapes -- before anything is allocated (a lying spec made every capture fail on an index
    error and the first step die inside a GenerationError)."""
    for i, group in enumerate(spec.groups):
        for layer in group.layers:
            shapes = kept[layer] if layer < len(kept) else None
            if shapes is None:
                continue
            where = f"recurrent layer {layer}" + (f" ({kinds[layer]})" if kinds is not None else "")
            if len(shapes) != len(group.tensors):
                raise ConfigError(
                    f"{STATE_SPEC_FIELD}.groups[{i}].tensors: {len(group.tensors)} state tensors "
                    f"({', '.join(t.name for t in group.tensors)}), but {where} keeps {len(shapes)} "
                    f"({', '.join(str(tuple(s)) for s in shapes)}, its {STATE_SHAPES}())")
            for j, (tensor, shape) in enumerate(zip(group.tensors, shapes)):
                if tuple(tensor.shape) != tuple(shape):
                    raise ConfigError(
                        f"{STATE_SPEC_FIELD}.groups[{i}].tensors[{j}] ({tensor.name!r}).shape: {tuple(tensor.shape)}, "
                        f"but {where} keeps {tuple(shape)} per request (its {STATE_SHAPES}()); declare what the "
                        "layer keeps")


def state_array_names(spec: StateSpec) -> list[tuple[str, int]]:
    """(field, layer) of each state array in the order the xla backend hands them to the forward
    -- layer-major, tensor-minor: recurrent layer 0's tensors in the spec's order, then layer 1's
    -- where ``field`` is ``state_spec.groups[i].tensors[j] ('name')`` (for errors)."""
    out = []
    for layer in range(spec.num_layers):
        i = next(k for k, g in enumerate(spec.groups) if layer in g.layers)
        out.extend((f"{STATE_SPEC_FIELD}.groups[{i}].tensors[{j}] ({t.name!r})", layer)
                   for j, t in enumerate(spec.groups[i].tensors))
    return out


def _tensors(tensors: Any, field: str, model_dtype: Any, supported: Collection[str],
             backend: str) -> tuple[StateTensor, ...]:
    out, names = [], set()
    for j, tensor in enumerate(tuple(tensors)):
        where = f"{field}.tensors[{j}]"
        if not isinstance(tensor, StateTensor):
            raise ConfigError(f"{where}: {tensor!r} is not a graphrt StateTensor")
        if not isinstance(tensor.name, str) or not tensor.name or tensor.name in names:
            raise ConfigError(f"{where}.name: {tensor.name!r} must be a non-empty name, unique in its group")
        names.add(tensor.name)
        shape = tuple(tensor.shape)
        if not shape or any(not is_int(d) or d <= 0 for d in shape):
            raise ConfigError(f"{where}.shape: {shape} must be ints > 0 (one slot's tensor)")
        declared = kv_cache_dtype_name(tensor.dtype, f"{where}.dtype")
        name = kv_cache_dtype_name(model_dtype, "dtype") if declared == "auto" else declared
        if name not in supported or name not in DTYPE_BYTES:
            raise ConfigError(f"{where}.dtype: {name} is not a state dtype the {backend} backend holds; one of "
                              f"{sorted(set(supported) & set(DTYPE_BYTES))}")
        out.append(StateTensor(tensor.name, tuple(operator.index(d) for d in shape), name))
    if not out:
        raise ConfigError(f"{field}.tensors: empty; a recurrent layer keeps at least one state tensor")
    return tuple(out)


__all__ = ["STATE_SHAPES", "STATE_SPEC_FIELD", "StateGroup", "StateMemory", "StateSpec", "StateTensor",
           "check_against_state_layers", "check_state_fits", "resolve_state_spec", "state_array_names",
           "state_memory"]
