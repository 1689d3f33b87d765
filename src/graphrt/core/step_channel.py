"""Rank 0 to its workers: one step's arrays through shared memory, with a fixed header.

Seed 004 (nano-vllm) drives tensor-parallel workers this way: rank 0 writes the call into a
shared-memory segment and sets one event per worker; each worker reads it and runs the same
forward, whose all-reduces then keep the ranks in step. nano-vllm pickles ``[method, args]``;
graphrt sends a step as raw arrays instead -- a small fixed header (sequence number, a method
code, and per array its dtype, shape and offset) followed by the arrays' bytes -- so the hot
path is one ``memcpy`` per array, no pickle.

* :class:`StepChannel` -- ``StepChannel.create(num_readers, capacity)`` in rank 0, then
  ``channel.spec`` (a picklable :class:`ChannelSpec`) to each worker, which calls
  ``StepChannel.attach(spec, reader)``. ``send(method, arrays)`` / ``receive()``.
* Flow control: each reader has an acknowledgement slot in the header; the writer waits
  until every reader acknowledged the previous step before it overwrites the segment
  (normally at once: the workers read before they run the forward). Waits have a timeout, so
  a dead worker gives :class:`~graphrt.core.errors.GraphrtError`, never a hang.
* ``close()`` in every process, ``unlink()`` once in rank 0: no segment is left in /dev/shm.
  Workers spawned by rank 0 share its resource tracker, so an attach there registers nothing
  new; rank 0's unlink is the one that counts.

numpy and the standard library only.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import struct
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, Sequence

import numpy as np

from graphrt.core import defaults
from graphrt.core.errors import GraphrtError, InputError

_DTYPES = (np.int32, np.int64, np.float32, np.float16, np.uint8, np.bool_, np.float64, np.int16)
_CODE = {np.dtype(d): i for i, d in enumerate(_DTYPES)}
_ALIGN = 64
#: Header int64 words: seq, method, number of arrays, then per array: code, ndim, 4 dims, offset, nbytes.
_FIXED, _PER_ARRAY, _MAX_DIMS = 3, 8, 4
_PAD = [(0,) * (_MAX_DIMS - d) for d in range(_MAX_DIMS + 1)]
_SEQ = struct.Struct("<q")


@functools.lru_cache(maxsize=None)
def _struct(count: int) -> struct.Struct:
    """The header after the sequence number for ``count`` arrays: method, count, entries."""
    return struct.Struct(f"<{2 + _PER_ARRAY * count}q")


@dataclass(frozen=True)
class ChannelSpec:
    """What a worker needs to attach: the segment's name, its layout, and the wake-ups."""

    name: str
    capacity: int
    num_readers: int
    max_arrays: int
    wakeups: tuple[Any, ...]      # one multiprocessing semaphore per reader


class StepChannel:
    """One writer (rank 0), ``num_readers`` readers, one step in flight; see the module doc."""

    def __init__(self, shm: shared_memory.SharedMemory, spec: ChannelSpec, reader: int | None) -> None:
        self._shm, self.spec, self.reader = shm, spec, reader
        words = _FIXED + _PER_ARRAY * spec.max_arrays
        self._header = np.ndarray((words,), dtype=np.int64, buffer=shm.buf)
        self._ack_words = shm.buf[words * 8:(words + spec.num_readers) * 8].cast("q")
        self._data_start = -(-(words + spec.num_readers) * 8 // _ALIGN) * _ALIGN
        self._seq = 0

    @classmethod
    def create(cls, num_readers: int, capacity: int = defaults.STEP_CHANNEL_BYTES,
               max_arrays: int = defaults.STEP_CHANNEL_MAX_ARRAYS, ctx: Any = None) -> "StepChannel":
        """Rank 0: a new segment of ``capacity`` data bytes for ``num_readers`` workers."""
        for name, value in (("num_readers", num_readers), ("capacity", capacity), ("max_arrays", max_arrays)):
            if not isinstance(value, int) or value < 1:
                raise InputError(name, f"must be an integer >= 1, got {value!r}")
        ctx = ctx or mp.get_context("spawn")
        head = (_FIXED + _PER_ARRAY * max_arrays + num_readers) * 8
        shm = shared_memory.SharedMemory(create=True, size=-(-head // _ALIGN) * _ALIGN + capacity)
        spec = ChannelSpec(shm.name, capacity, num_readers, max_arrays,
                           tuple(ctx.Semaphore(0) for _ in range(num_readers)))
        channel = cls(shm, spec, None)
        channel._header[:] = 0
        for i in range(num_readers):
            channel._ack_words[i] = 0
        return channel

    @classmethod
    def attach(cls, spec: ChannelSpec, reader: int) -> "StepChannel":
        """A worker: attach to rank 0's segment as reader ``reader`` (0-based)."""
        if not 0 <= reader < spec.num_readers:
            raise InputError("reader", f"must be in [0, {spec.num_readers}), got {reader}")
        return cls(shared_memory.SharedMemory(name=spec.name), spec, reader)

    # ---- writer ----------------------------------------------------------------------
    def send(self, method: int, arrays: Sequence[np.ndarray], timeout: float = defaults.STEP_CHANNEL_TIMEOUT_S) -> None:
        """Write one step (``method`` code and arrays) and wake every reader."""
        if self.reader is not None:
            raise GraphrtError("send() is rank 0's; this channel was attached as a reader")
        if not isinstance(method, int) or not 0 <= method < 2**63:
            raise InputError("method", f"must be an integer in [0, 2**63), got {method!r}")
        if len(arrays) > self.spec.max_arrays:
            raise InputError("arrays", f"{len(arrays)} arrays, the channel holds {self.spec.max_arrays}")
        self._wait_acks(timeout)
        buf, data, capacity = self._shm.buf, self._data_start, self.spec.capacity
        entries: list[int] = []
        offset = 0
        for i, a in enumerate(arrays):
            code = _CODE.get(a.dtype)
            if code is None or a.ndim > _MAX_DIMS:
                raise InputError("arrays", f"array {i}: dtype {a.dtype} / {a.ndim} dims cannot be sent")
            n = a.nbytes
            if offset + n > capacity:
                raise InputError("arrays", f"{offset + n} bytes do not fit the channel's {capacity}")
            entries += (code, a.ndim, *a.shape, *_PAD[a.ndim], offset, n)
            if n:
                c = a if a.flags.c_contiguous else np.ascontiguousarray(a)
                buf[data + offset:data + offset + n] = memoryview(c).cast("B")
            offset += -(-n // _ALIGN) * _ALIGN
        self._seq += 1
        _struct(len(arrays)).pack_into(buf, 8, method, len(arrays), *entries)
        _SEQ.pack_into(buf, 0, self._seq)    # written last: readers trust the step from here
        for wake in self.spec.wakeups:
            wake.release()

    def _wait_acks(self, timeout: float) -> None:
        if self._seq == 0 or min(self._ack_words) == self._seq:
            return
        deadline = time.monotonic() + timeout
        while min(self._ack_words) != self._seq:
            if time.monotonic() > deadline:
                late = [i for i, seq in enumerate(self._ack_words) if seq != self._seq]
                raise GraphrtError(f"step channel: workers {late} did not read step {self._seq} within "
                                   f"{timeout} s (dead or hung)")
            time.sleep(0)

    # ---- reader ----------------------------------------------------------------------
    def receive(self, timeout: float | None = None, copy: bool = True) -> tuple[int, list[np.ndarray]]:
        """Wait for the next step: ``(method, arrays)``. ``copy=False`` returns views of the
        segment, valid until this reader's next ``receive``. Raises :class:`GraphrtError` on
        timeout."""
        if self.reader is None:
            raise GraphrtError("receive() is a worker's; this channel is rank 0's")
        if not self.spec.wakeups[self.reader].acquire(timeout=timeout):
            raise GraphrtError(f"step channel: no step from rank 0 within {timeout} s")
        h, buf = self._header, self._shm.buf
        self._seq = int(h[0])
        method, count = int(h[1]), int(h[2])
        out = []
        for i in range(count):
            base = _FIXED + _PER_ARRAY * i
            code, ndim = int(h[base]), int(h[base + 1])
            shape = tuple(int(d) for d in h[base + 2:base + 2 + ndim])
            view = np.ndarray(shape, _DTYPES[code], buffer=buf, offset=self._data_start + int(h[base + 6]))
            out.append(view.copy() if copy else view)
        if copy:
            self.acknowledge()
        return method, out

    def acknowledge(self) -> None:
        """Tell rank 0 this reader is done with the current step (``receive(copy=False)``)."""
        self._ack_words[self.reader] = self._seq

    # ---- lifetime --------------------------------------------------------------------
    def close(self) -> None:
        """Detach this process from the segment (every process, once)."""
        self._ack_words.release()
        self._header = None   # type: ignore[assignment] - views must go before the buffer
        self._shm.close()

    def unlink(self) -> None:
        """Remove the segment from the system (rank 0, once, after the workers closed)."""
        self._shm.unlink()


__all__ = ["ChannelSpec", "StepChannel"]
