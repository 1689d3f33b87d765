"""In-place refit and sleep / wake of the XLA executor's weights (docs/api.md,
"Reinforcement-learning rollouts").

Executables take the weights as arguments, so a refit replaces parameter buffers with new ones
of the same shapes, dtypes and shardings (``jax.device_put`` onto each leaf's sharding: no
compile) and a wake re-creates the deleted ones: nothing is recompiled. graphrt's decoder takes
its checkpoint's (Hugging Face) names, mapped as its loader maps them (stacked layers, ``[in,
out]`` projections: ``models/jax/loader.param_target``), one layer at a time or all; any other
params pytree takes its leaves' paths (``"layers.wq"``, or a hybrid model's checkpoint names).
Every tensor is checked before a buffer is replaced: all or nothing.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from graphrt.core.errors import GraphrtError, InputError
from graphrt.core.weight_reports import SleepReport, WakeReport, WeightsUpdate
from graphrt.models.checkpoint import NAMES_SHOWN


def _leaf_name(path: tuple[Any, ...]) -> str:
    """A pytree path as a dotted name (dict keys, attributes, indices; nnx's ``.value`` dropped)."""
    parts = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
    if parts and parts[-1] == "value" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _host(name: str, value: Any) -> np.ndarray:
    """A refit value on the host as numpy (a torch tensor, a jax or numpy array)."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):           # a torch tensor, without importing torch
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        return value.numpy()
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise InputError(name, f"not an array ({type(value).__name__}: {exc})") from None


def _read(source: Any) -> dict[str, Any]:
    """A refit's tensors by name: a checkpoint directory or ``.safetensors`` file (memory-mapped,
    headers checked), a mapping or an iterable of ``(name, array)``."""
    from graphrt.models.jax.loader import read_checkpoint, read_safetensors

    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            return read_checkpoint(path)
        if os.path.isfile(path) and path.endswith(".safetensors"):
            return read_safetensors(path)
        raise InputError("weights", f"{path!r} is neither a checkpoint directory nor a .safetensors file")
    pairs = source.items() if isinstance(source, Mapping) else source
    try:
        pairs = list(pairs)
    except TypeError:
        raise InputError("weights", f"a checkpoint path, a mapping or an iterable of (name, array), got "
                                    f"{type(source).__name__}") from None
    out: dict[str, Any] = {}
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise InputError(f"weights[{i}]", f"a (name, array) pair, got {type(pair).__name__}")
        if pair[0] in out:
            raise InputError(pair[0], "given twice")
        out[pair[0]] = pair[1]
    return out


def casts(src: Any, dst: Any) -> bool:
    """Floating point into floating point (bfloat16 and fp8 included), or within one other kind."""
    src, dst = jnp.dtype(src), jnp.dtype(dst)
    if jnp.issubdtype(dst, jnp.floating):
        return bool(jnp.issubdtype(src, jnp.floating))
    return bool(np.can_cast(src, dst, "same_kind"))


@dataclass(frozen=True)
class _Place:
    """Where one tensor goes: the leaf's index among the flattened leaves, the layer row (None:
    the whole leaf) and whether it is stored transposed."""

    leaf: int
    layer: int | None
    transpose: bool


class XlaWeights:
    """Refits and puts to sleep a params pytree (module docstring); ``config`` is the model's
    (a ``DecoderConfig`` for graphrt's decoder, whose checkpoint names it then takes)."""

    def __init__(self, config: Any, weights: Any, own_decoder: bool) -> None:
        self.config = config
        leaves, self._treedef = jax.tree_util.tree_flatten_with_path(weights)
        self._names = [_leaf_name(path) for path, _ in leaves]
        self._index = {name: i for i, name in enumerate(self._names)}
        self.own_decoder = own_decoder and "layers.wq" in self._index
        #: A sleep's host copies (None per leaf where level 2 dropped it) and the leaves' specs.
        self._asleep: tuple[int, list[np.ndarray | None], list[tuple[Any, Any, Any]]] | None = None

    def names(self) -> frozenset[str]:
        """What a full refit fills: the checkpoint's names (graphrt's decoder), else the leaves'."""
        if self.own_decoder:
            from graphrt.models.jax.loader import hf_names
            return frozenset(hf_names(self.config))
        return frozenset(self._names)

    def _place(self, name: str) -> _Place | str | None:
        """Where ``name`` goes, None if it fills nothing by design, or why it is refused."""
        if not self.own_decoder:
            return _Place(self._index[name], None, False) if name in self._index else "has no weight in the model"
        from graphrt.models.jax.loader import param_target
        found = param_target(self.config, name)
        if found is None:
            return "has no weight in the model"
        path, layer, transpose = found
        if not path:
            return None
        return _Place(self._index[".".join(path)], layer, transpose)

    def update(self, weights: Any, source: Any, *, check_only: bool = False) -> tuple[Any, WeightsUpdate]:
        """``weights`` with the refit's leaves replaced (same shapes, dtypes, shardings) and what
        was written; every tensor checked first (InputError naming each bad one, nothing made)."""
        t0 = time.perf_counter()
        leaves = self._treedef.flatten_up_to(weights)
        tensors = _read(source)
        writes: dict[int, list[tuple[_Place, np.ndarray, str]]] = {}
        problems: list[tuple[str, str]] = []
        skipped: list[str] = []
        for name, value in tensors.items():
            place = self._place(name)
            if isinstance(place, str) or place is None:
                (problems.append((name, place)) if isinstance(place, str) else skipped.append(name))
                continue
            arr = _host(name, value)
            leaf = leaves[place.leaf]
            want = tuple(leaf.shape[1:] if place.layer is not None else leaf.shape)
            got = tuple(arr.shape[::-1] if place.transpose else arr.shape)
            if not casts(arr.dtype, leaf.dtype):
                problems.append((name, f"has dtype {arr.dtype}, which does not cast to the weight's {leaf.dtype}"))
            elif got != want:
                shape = tuple(arr.shape)
                problems.append((name, f"has shape {shape}, the model expects "
                                       f"{want[::-1] if place.transpose else want}"))
            else:
                writes.setdefault(place.leaf, []).append((place, arr, name))
        if problems:
            shown = "; ".join(f"{n!r} {why}" for n, why in problems[:NAMES_SHOWN])
            more = f" (and {len(problems) - NAMES_SHOWN} more)" if len(problems) > NAMES_SHOWN else ""
            raise InputError(problems[0][0], f"the refit was refused and nothing was written: {len(problems)} "
                                             f"tensor(s) do not fit the model: {shown}{more}")
        done = sum(len(w) for w in writes.values())
        if check_only:
            return weights, WeightsUpdate(0, 0, time.perf_counter() - t0, frozenset(), tuple(skipped))
        new = list(leaves)
        nbytes = 0
        for index, items in writes.items():
            leaf = leaves[index]
            rows = {p.layer for p, _, _ in items}
            whole = None not in rows and len(rows) == leaf.shape[0]
            host = (np.empty(leaf.shape, leaf.dtype) if whole or None in rows else np.array(leaf))
            for place, arr, _ in items:
                value = arr.T if place.transpose else arr
                if place.layer is None:
                    host[...] = value
                else:
                    host[place.layer] = value
                nbytes += arr.nbytes
            new[index] = jax.device_put(host, leaf.sharding)
        tree = self._treedef.unflatten(new)
        return tree, WeightsUpdate(done, nbytes, time.perf_counter() - t0,
                                   frozenset(n for items in writes.values() for _, _, n in items), tuple(skipped))

    # ---- sleep and wake ----------------------------------------------------------------
    def sleep(self, level: int, weights: Any, caches: Iterable[Any]) -> SleepReport:
        """Copy the weights to the host (level 1; level 2: only their specs kept), then delete them
        and ``caches`` (the KV cache and recurrent states) on the device."""
        t0 = time.perf_counter()
        leaves = self._treedef.flatten_up_to(weights)
        devices = {d for leaf in leaves[:1] for d in leaf.sharding.device_set}
        before = _in_use(devices)
        hosts = [np.asarray(leaf) if level == 1 else None for leaf in leaves]
        specs = [(leaf.shape, leaf.dtype, leaf.sharding) for leaf in leaves]
        weight_bytes = sum(int(leaf.nbytes) for leaf in leaves)
        cache_bytes = 0
        for arr in (*leaves, *caches):
            if arr is not None and not arr.is_deleted():
                if not any(arr is leaf for leaf in leaves):
                    cache_bytes += int(arr.nbytes)
                arr.delete()
        after = _in_use(devices)
        self._asleep = (level, hosts, specs)
        offloaded = sum(h.nbytes for h in hosts if h is not None)
        return SleepReport(level, weight_bytes + cache_bytes, offloaded, weight_bytes, cache_bytes,
                           None if before is None or after is None else before - after, time.perf_counter() - t0)

    def wake(self) -> tuple[Any, WakeReport]:
        """The weights put back on their shardings (zeros where a level-2 sleep dropped them)."""
        if self._asleep is None:
            raise GraphrtError("wake: the executor is not asleep")
        t0 = time.perf_counter()
        level, hosts, specs = self._asleep
        leaves = [jax.device_put(h if h is not None else np.zeros(shape, dtype), sharding)
                  for h, (shape, dtype, sharding) in zip(hosts, specs)]
        self._asleep = None
        restored = sum(int(leaf.nbytes) for leaf in leaves)
        return self._treedef.unflatten(leaves), WakeReport(restored, time.perf_counter() - t0, level == 2)

    @property
    def asleep(self) -> bool:
        return self._asleep is not None


def _in_use(devices: set[Any]) -> int | None:
    """Bytes in use on ``devices`` where they say (GPUs, TPUs; the CPU does not)."""
    stats = [d.memory_stats() for d in devices]
    if not stats or not all(s and "bytes_in_use" in s for s in stats):
        return None
    return sum(int(s["bytes_in_use"]) for s in stats)


__all__ = ["XlaWeights", "casts"]
