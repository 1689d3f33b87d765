"""LoRA adapters in a step, host side: each request's slot, checked; how many distinct adapters
the step runs (the key's ``num_loras``); and the two tables a graph reads:

* ``lora_index`` ``[T]`` -- each token's slot, ``NO_LORA`` (-1) for no adapter and padding;
* ``lora_groups`` ``[max_loras]`` -- the active slots ascending, then ``LORA_GROUP_PAD``; a graph
  of ``num_loras = n`` applies the first ``n`` groups.

A bad ``lora_ids`` raises :class:`~graphrt.core.errors.InputError` before anything is written."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from graphrt.core import defaults
from graphrt.core.buckets import BucketPolicy
from graphrt.core.errors import InputError

NO_LORA = defaults.NO_LORA
LORA_GROUP_PAD = defaults.LORA_GROUP_PAD
#: The staging buffers a LoRA-capable executor exposes (``Executor.lora.host_buffers``).
LORA_INDEX, LORA_GROUPS = "lora_index", "lora_groups"


def lora_buckets(max_loras: int) -> BucketPolicy:
    """The adapter counts keys are captured for besides 0 (``max_loras > 0``: LoRA on): powers
    of two, then ``max_loras`` (as vLLM's ``cudagraph_specialize_lora``, which counts the
    no-adapter group too)."""
    return BucketPolicy.powers_of_two(max_loras)


def _as_ids(lora_ids: Any, num_reqs: int) -> np.ndarray:
    """``lora_ids`` as a 1-D integer array (None entries of a list become ``NO_LORA``)."""
    if type(lora_ids) is np.ndarray and lora_ids.dtype.kind in "iu" and lora_ids.ndim == 1:
        arr = lora_ids
    else:
        if isinstance(lora_ids, (list, tuple)) and any(v is None for v in lora_ids):
            lora_ids = [NO_LORA if v is None else v for v in lora_ids]
        try:
            arr = np.asarray(lora_ids)
        except (TypeError, ValueError):
            raise InputError("lora_ids", f"must be one adapter slot per request, got {lora_ids!r}") from None
        if arr.ndim != 1:
            raise InputError("lora_ids", f"must be 1-D (one adapter slot per request), got shape {arr.shape}")
        if arr.dtype.kind == "O" and arr.size and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                                                      for v in arr):
            if not all(-(2**63) <= v < 2**63 for v in arr):
                bad = next(i for i, v in enumerate(arr) if not -(2**63) <= v < 2**63)
                raise InputError(f"lora_ids[{bad}]", f"must be -1 (no adapter) or a slot, got {arr[bad]!r}")
            arr = arr.astype(np.int64)
        if arr.size and arr.dtype.kind not in "iu":
            raise InputError("lora_ids", f"must hold integer slots (-1 or None: no adapter), "
                                         f"got an array of {arr.dtype}")
    if arr.shape[0] != num_reqs:
        raise InputError("lora_ids", f"{arr.shape[0]} rows for {num_reqs} requests")
    return arr


class LoraInputs:
    """A runner's LoRA host state: checks a step's ``lora_ids`` against the slots and what is
    loaded in them, counts its adapters, and writes its tables (persistent scratch buffers,
    so a step allocates no buffer)."""

    def __init__(self, max_loras: int, max_num_reqs: int, host_buffers: Mapping[str, np.ndarray],
                 loaded: np.ndarray) -> None:
        if max_loras <= 0:
            raise InputError("max_loras", f"LoraInputs needs max_loras > 0, got {max_loras}")
        self.max_loras = int(max_loras)
        self.index = host_buffers[LORA_INDEX]
        self.groups = host_buffers[LORA_GROUPS]
        self.loaded = loaded                                   # bool [max_loras], the executor's
        self._seen = np.zeros(self.max_loras + 1, dtype=bool)  # [0]: no adapter, [1 + s]: slot s
        self._shifted = np.zeros(max_num_reqs, dtype=np.int64)

    def check(self, lora_ids: Any, num_reqs: int) -> tuple[np.ndarray | None, int]:
        """``(ids, active adapters)`` of a step of ``num_reqs`` requests; ``(None, 0)`` for
        ``lora_ids=None``. Raises :class:`InputError` naming ``lora_ids`` (and the row) for a
        wrong shape or type, a slot outside ``[-1, max_loras)``, or a slot with no adapter."""
        if lora_ids is None:
            return None, 0
        ids = _as_ids(lora_ids, num_reqs)
        if not num_reqs:
            return ids, 0
        lo, hi = int(ids.min()), int(ids.max())
        if lo < NO_LORA or hi >= self.max_loras:
            ok = (ids >= NO_LORA) & (ids < self.max_loras)
            row = int(np.flatnonzero(~ok)[0])
            raise InputError(f"lora_ids[{row}]", f"must be -1 (no adapter) or a slot in [0, {self.max_loras}) "
                                                 f"(max_loras), got {int(ids[row])}")
        if hi < 0:
            return ids, 0
        shifted = self._shifted[:num_reqs]
        np.add(ids, 1, out=shifted)
        seen = self._seen
        seen[:] = False
        seen[shifted] = True
        empty = seen[1:] & ~self.loaded
        if empty.any():
            slot = int(np.flatnonzero(empty)[0])
            row = int(np.flatnonzero(ids == slot)[0])
            raise InputError(f"lora_ids[{row}]", f"slot {slot} holds no adapter: runner.lora.load({slot}, ...) first")
        return ids, int(np.count_nonzero(seen[1:]))

    def write(self, ids: np.ndarray, num_scheduled_tokens: np.ndarray, num_tokens: int,
              padded_tokens: int) -> None:
        """Write the tables of the step ``check`` last accepted: each of its ``num_tokens``
        tokens' slot (the rest up to ``padded_tokens`` ``NO_LORA``) and its active slots."""
        index = self.index
        index[:num_tokens] = np.repeat(ids, num_scheduled_tokens)
        index[num_tokens:padded_tokens] = NO_LORA
        active = np.flatnonzero(self._seen[1:])
        self.groups[:active.shape[0]] = active
        self.groups[active.shape[0]:] = LORA_GROUP_PAD


class RunnerLora:
    """A runner's LoRA feature, held as an object: the executor's adapter ``slots`` (loaded
    and emptied under the runner's step ``lock``, so no step reads a half-copied adapter) and
    each step's adapter tables (:class:`LoraInputs`)."""

    enabled = True

    def __init__(self, slots: Any, max_loras: int, max_num_reqs: int, lock: Any) -> None:
        self.slots = slots
        self.inputs = LoraInputs(max_loras, max_num_reqs, slots.host_buffers, slots.loaded)
        self._lock = lock
        #: Run under the lock before a load (the runner's live-buffer check); None: nothing.
        self.before_load: Callable[[], None] | None = None
        self._none = np.zeros(0, np.int32)

    def load(self, slot: int, weights: Mapping[str, tuple[Any, Any]], scale: float = 1.0) -> None:
        """Copy an adapter into ``slot`` of the persistent stacks, so graphs captured before see it
        (``runner.lora.load``): ``weights`` maps names of :meth:`targets` to ``(lora_a [rank, in],
        lora_b [out, rank])`` (PEFT's layout), ``scale`` is PEFT's ``alpha / rank``. Every value is
        checked first: ``InputError`` names the bad field and nothing is copied."""
        with self._lock:
            if self.before_load is not None:
                self.before_load()
            self.slots.load(slot, weights, scale)

    def remove(self, slot: int) -> bool:
        """Empty ``slot``; False if it held nothing (``runner.lora.remove``: steps naming it are
        refused until it is loaded again)."""
        with self._lock:
            return self.slots.remove(slot)

    def targets(self) -> dict[str, tuple[int, int]]:
        """The LoRA-capable modules by name, as ``(in_features, out_features)``."""
        return self.slots.targets()

    def check(self, lora_ids: Any, num_reqs: int) -> tuple[np.ndarray | None, int]:
        """A step's adapter ids and its distinct adapters (:meth:`LoraInputs.check`)."""
        return self.inputs.check(lora_ids, num_reqs)

    def no_adapters(self, num_reqs: int) -> np.ndarray:
        """Ids of ``num_reqs`` requests without an adapter, checked (a data-parallel rank whose
        key has adapter slots from another rank's step)."""
        return self.inputs.check(np.full(num_reqs, NO_LORA, np.int32), num_reqs)[0]

    def write(self, ids: np.ndarray, num_scheduled_tokens: np.ndarray, num_tokens: int,
              padded_tokens: int) -> None:
        """Write the checked step's tables (:meth:`LoraInputs.write`)."""
        self.inputs.write(ids, num_scheduled_tokens, num_tokens, padded_tokens)

    def write_padding(self, padded_tokens: int) -> None:
        """Tables of a step of padding only: no token has an adapter."""
        self.inputs.write(self.inputs.check(self._none, 0)[0], self._none, 0, padded_tokens)


def lora_off(field: str = "lora_ids") -> InputError:
    """The error for adapters passed to (or loaded into) a runner built without LoRA."""
    hint = ", or pass lora_ids=None" if field == "lora_ids" else ""
    return InputError(field, f"LoRA is off (max_loras=0): build the runner with max_loras > 0{hint}")


class LoraOff:
    """``runner.lora`` of a runner built without LoRA (``max_loras=0``): ``enabled`` is False, and
    loading, removing or listing adapters raises the error that says how to turn LoRA on."""

    enabled = False

    def load(self, slot: int, weights: Mapping[str, tuple[Any, Any]], scale: float = 1.0) -> None:
        raise lora_off("slot")

    def remove(self, slot: int) -> bool:
        raise lora_off("slot")

    def targets(self) -> dict[str, tuple[int, int]]:
        raise lora_off("slot")


__all__ = ["LORA_GROUPS", "LORA_GROUP_PAD", "LORA_INDEX", "LoraInputs", "LoraOff", "NO_LORA", "RunnerLora", "lora_buckets",
           "lora_off"]
