"""What rank 0 and its tensor-parallel workers say to each other: the method codes and each call's
int64 argument row (no pickle per call), :class:`WorkerSetup` (pickled once at start-up),
:class:`Agreement` (every rank's status per call on the gloo control group: a build failed on
any rank runs eagerly on all) and :class:`BroadcastChannel` (the step channel over gloo, for
ranks that share no memory)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from graphrt.config import GraphConfig
from graphrt.core import defaults
from graphrt.core.dispatch import BatchDescriptor
from graphrt.core.errors import InputError
from graphrt.core.inputs.fields import FIELD_DTYPES, buffer_shapes
from graphrt.backends.torch.parallel.tp_channel import (ALIGN, ENTRY_WORDS, HEADER_WORDS, aligned_nbytes, pack_entries,
                                       unpack_arrays)
from graphrt.core.graph_modes import RuntimeMode

#: ... the gloo control group's timeout: under torchrun idle workers wait on it for rank 0's
#: next call, for as long as the engine lives (rank 0 exiting ends the wait at once).
TP_CONTROL_TIMEOUT_S = 7 * 24 * 3600.0

#: Method codes (StepChannel's ``method``). REFIT's row: 1 to write (0: check only), then the
#: checkpoint's path (:func:`encode_text`) every rank reads its shard from.
ALLOCATE, BUILD, RUN, RECOVER, SHUTDOWN, MEASURE, MEMORY, REFIT = range(1, 9)
METHOD_NAMES = {ALLOCATE: "allocate_kv_cache", BUILD: "build", RUN: "run", RECOVER: "recover_kv_cache",
                SHUTDOWN: "shutdown", MEASURE: "measure_graph_memory", MEMORY: "memory_info",
                REFIT: "update_weights"}

MODES = (RuntimeMode.NONE, RuntimeMode.PIECEWISE, RuntimeMode.FULL)
MODE_CODE = {mode: code for code, mode in enumerate(MODES)}
#: A key as ints: mode code, num_tokens, num_reqs (-1: None), uniform_decode, num_loras,
#: max_seq_len (its context bucket; -1: None).
KEY_WORDS = 6
#: RUN's argument row: the key, then whether rank 0 runs it eagerly, the padded step's real
#: counts and flags (ModelInputs), the step number, and the padded array lengths. The seven
#: padded arrays follow the row, or (spawned workers) wait in the step channel's resident
#: buffers, where rank 0 prepared them.
(RUN_EAGER, RUN_NUM_REQS, RUN_NUM_TOKENS, RUN_MAX_QUERY, RUN_MAX_SEQ, RUN_UNIFORM, RUN_STEP,
 RUN_PADDED_TOKENS, RUN_PADDED_REQS) = range(KEY_WORDS, KEY_WORDS + 9)
RUN_WORDS = KEY_WORDS + 9

#: The process-group backend of each torch device type.
GROUP_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def encode_key(row: np.ndarray, mode: RuntimeMode, key: BatchDescriptor) -> None:
    """Write ``(mode, key)`` into the first :data:`KEY_WORDS` words of ``row``."""
    row[0] = MODE_CODE[mode]
    row[1] = key.num_tokens
    row[2] = -1 if key.num_reqs is None else key.num_reqs
    row[3] = key.uniform_decode
    row[4] = key.num_loras
    row[5] = -1 if key.max_seq_len is None else key.max_seq_len


def encode_text(text: str) -> list[int]:
    """``text`` as int64 words (its UTF-8 bytes, one per word) for a call's argument row."""
    return list(text.encode("utf-8"))


def decode_text(words: Sequence[int]) -> str:
    """The text :func:`encode_text` wrote."""
    return bytes(int(w) for w in words).decode("utf-8")


def decode_key(words: Sequence[int]) -> tuple[RuntimeMode, BatchDescriptor]:
    """The ``(mode, key)`` :func:`encode_key` wrote."""
    mode, tokens, reqs, uniform, loras, context = (int(w) for w in words[:KEY_WORDS])
    return MODES[mode], BatchDescriptor(tokens, None if reqs < 0 else reqs, bool(uniform), loras,
                                        None if context < 0 else context)


@dataclass(frozen=True)
class WorkerSetup:
    """Everything a worker rank needs to load its shard and build its executor (pickled once)."""

    backend: str                 # "module:Class" of rank 0's TorchBackend
    device_type: str
    device_index: int | None     # rank 0's; rank r uses index + r
    model_dir: str
    dtype: Any                   # a torch.dtype
    config: dict[str, Any]       # GraphConfig.model_dump()
    tp_size: int
    timeout: float               # the process group's timeout (defaults.TP_TIMEOUT_S)
    num_threads: int             # torch intra-op threads, as rank 0's
    env: dict[str, str] | None = None   # rank 0's environment (spawned workers take it over)

    def step_bytes(self) -> int:
        """Data bytes a broadcast channel needs for this engine's largest padded step (every
        field's staging buffer, aligned), and at least ``STEP_CHANNEL_BYTES``."""
        c = GraphConfig.create(**self.config)
        shapes = buffer_shapes(c.max_num_batched_tokens, c.max_num_seqs, c.max_blocks_per_req)
        need = sum(aligned_nbytes(shape, FIELD_DTYPES[name]) for name, shape in shapes.items())
        return max(defaults.STEP_CHANNEL_BYTES, need + ALIGN * (len(shapes) + 1))

    def device(self, rank: int) -> torch.device:
        """Rank ``rank``'s device: the same CPU, or the accelerator ``index + rank``."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, (self.device_index or 0) + rank)


def free_port() -> int:
    """A free localhost TCP port for the spawned ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def control_group() -> Any:
    """A gloo group over every rank (a collective call: every rank makes it, in the same order)
    for agreements and the torchrun step broadcasts; its long timeout lets idle workers wait."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=TP_CONTROL_TIMEOUT_S))


class Agreement:
    """Each rank's ``(status, a, b)`` for one call, all-gathered on the control group."""

    def __init__(self, group: Any, size: int) -> None:
        self.group = group
        self._mine = torch.zeros(3, dtype=torch.int64)
        self._all = [torch.zeros(3, dtype=torch.int64) for _ in range(size)]

    def start(self, status: int, a: int = 0, b: int = 0) -> Any:
        """Begin the gather of this rank's row; returns the ``Work`` to wait on."""
        self._mine[0], self._mine[1], self._mine[2] = status, a, b
        return dist.all_gather(self._all, self._mine, group=self.group, async_op=True)

    def rows(self) -> list[tuple[int, int, int]]:
        """Every rank's row, by rank (after the work completed)."""
        return [tuple(int(v) for v in t.tolist()) for t in self._all]   # type: ignore[misc]


class BroadcastChannel:
    """``StepChannel``'s ``send`` / ``receive`` as two gloo broadcasts from rank 0 -- a fixed
    int64 header (the step channel's entries; word 0 the bytes that follow), then the arrays'
    bytes -- into persistent buffers: the transport of ranks that share no memory (torchrun).
    ``receive`` returns views valid until the next one."""

    def __init__(self, group: Any, capacity: int = defaults.STEP_CHANNEL_BYTES,
                 max_arrays: int = defaults.STEP_CHANNEL_MAX_ARRAYS) -> None:
        self.group, self.capacity, self.max_arrays = group, capacity, max_arrays
        self._header = torch.zeros(HEADER_WORDS + ENTRY_WORDS * max_arrays, dtype=torch.int64)
        self._data = torch.zeros(capacity, dtype=torch.uint8)
        self._h, self._d = self._header.numpy(), self._data.numpy()
        #: No resident buffers: ranks that share no memory get every array in the broadcast.
        self.resident: dict[str, np.ndarray] = {}

    def send(self, method: int, arrays: Sequence[np.ndarray], timeout: float = defaults.TP_TIMEOUT_S) -> None:
        """Broadcast one call (rank 0)."""
        if len(arrays) > self.max_arrays:
            raise InputError("arrays", f"{len(arrays)} arrays, the channel holds {self.max_arrays}")
        entries, offsets, used = pack_entries(arrays, self.capacity)
        h = self._h
        h[0], h[1], h[2] = used, method, len(arrays)
        h[HEADER_WORDS:HEADER_WORDS + len(entries)] = entries
        for a, offset in zip(arrays, offsets):
            self._d[offset:offset + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        wait = timedelta(seconds=timeout)
        dist.broadcast(self._header, 0, group=self.group, async_op=True).wait(wait)
        if used:
            dist.broadcast(self._data[:used], 0, group=self.group, async_op=True).wait(wait)

    def receive(self, timeout: float | None = None, copy: bool = True,
                spin: float = 0.0) -> tuple[int, list[np.ndarray]]:
        """Wait for rank 0's next call (a worker): ``(method, arrays)``. ``spin`` is
        ``StepChannel``'s and unused: a broadcast has no wake-up to poll."""
        dist.broadcast(self._header, 0, group=self.group)
        h = self._h
        if h[0]:
            dist.broadcast(self._data[:int(h[0])], 0, group=self.group)
        return int(h[1]), unpack_arrays(h, self._d, 0, copy)

    def acknowledge(self) -> None:
        """Nothing to do: a broadcast is received once it returns."""

    def wait_acks(self, timeout: float | None = None) -> None:
        """Nothing to wait for: a broadcast has no resident buffers to overwrite."""

    def close(self) -> None:
        """Nothing to release (the group belongs to the process group)."""

    def unlink(self) -> None:
        """Nothing to remove."""


__all__ = ["ALLOCATE", "Agreement", "BUILD", "BroadcastChannel", "GROUP_BACKENDS", "MEASURE", "MEMORY",
           "METHOD_NAMES", "RECOVER", "REFIT", "RUN", "RUN_WORDS", "SHUTDOWN", "WorkerSetup", "control_group",
           "decode_key", "decode_text", "encode_key", "encode_text", "free_port"]
