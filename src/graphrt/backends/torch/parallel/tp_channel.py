"""Rank 0 to its workers: one step's arrays through shared memory, with a fixed header.

As in nano-vllm, rank 0 writes each call into a shared-memory segment and wakes the workers,
but as raw arrays behind a small fixed header (sequence, method code, per array dtype, shape,
offset) instead of a pickle: one ``memcpy`` per array. :class:`StepChannel`: ``create`` (rank
0), ``attach`` (workers: their start-up handshake), ``wait_ready`` (rank 0), ``send`` /
``receive``, ``close``, ``unlink`` (rank 0). Flow control, the handshake, timeouts and wake-ups:
docs/distributed.md, "The step channel". numpy and the standard library."""

from __future__ import annotations

import functools
import math
import mmap
import multiprocessing as mp
import os
import signal
import struct
import time
import traceback
from collections import abc
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import wait as wait_any
from typing import Any, Mapping, Sequence

import numpy as np

from graphrt.core import defaults
from graphrt.core.errors import ConfigError, GraphrtError, InputError
from graphrt.core.memory_bounds import Need, check_needs, shared_memory_bytes

#: How long a send waits for every reader to have read the previous step (seconds), counted
#: once the readers are ready (their start-up is ``defaults.STEP_CHANNEL_START_TIMEOUT_S``'s).
STEP_CHANNEL_TIMEOUT_S = 30.0
#: ... the most readers one channel takes: each costs a named semaphore (a file in /dev/shm and a
#: mapping of its own), and a channel's readers are one host's tensor-parallel workers -- far
#: fewer than this, which stays far below the semaphores and mappings a process may hold.
STEP_CHANNEL_MAX_READERS = 1024

_DTYPES = (np.int32, np.int64, np.float32, np.float16, np.uint8, np.bool_, np.float64, np.int16)
_CODE = {np.dtype(d): i for i, d in enumerate(_DTYPES)}
ALIGN = 64
#: Header int64 words: seq, method, number of arrays, then per array: code, ndim, 4 dims, offset, nbytes.
HEADER_WORDS, ENTRY_WORDS, _MAX_DIMS = 3, 8, 4
_PAD = [(0,) * (_MAX_DIMS - d) for d in range(_MAX_DIMS + 1)]


def aligned_nbytes(shape: Sequence[int], dtype: Any) -> int:
    """Bytes an array of ``shape`` and ``dtype`` takes in a channel (a multiple of 64; exact
    Python integers, so a huge shape is a huge size, never an int64 wrapped past 2**63)."""
    return -(-math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize // ALIGN) * ALIGN


def check_arrays(arrays: Any) -> None:
    """Refuse ``arrays`` that is not a sequence of numpy arrays (or numpy scalars, 0-d), naming
    the first that is not (:class:`InputError` on ``arrays``), before anything is written."""
    if not isinstance(arrays, (list, tuple)) and not isinstance(arrays, abc.Sequence):
        raise InputError("arrays", f"must be a sequence of numpy arrays, got {type(arrays).__name__}")
    for i, a in enumerate(arrays):
        if not isinstance(a, (np.ndarray, np.generic)):
            raise InputError("arrays", f"array {i}: must be a numpy array, got {type(a).__name__}")


def pack_entries(arrays: Sequence[np.ndarray], capacity: int) -> tuple[list[int], list[int], int]:
    """Check ``arrays`` and lay them out in ``capacity`` data bytes, before anything is written:
    their header entry words (per array: dtype code, ndim, 4 dims, offset, nbytes), each one's
    byte offset, and the bytes used. Raises :class:`InputError` naming what does not fit. The
    step channel and the broadcast channel of launched ranks share this format."""
    check_arrays(arrays)
    entries: list[int] = []
    offsets = []
    offset = 0
    for i, a in enumerate(arrays):
        code = _CODE.get(a.dtype)
        if code is None or a.ndim > _MAX_DIMS:
            raise InputError("arrays", f"array {i}: dtype {a.dtype} / {a.ndim} dims cannot be sent")
        n = a.nbytes
        if offset + n > capacity:
            raise InputError("arrays", f"{offset + n} bytes do not fit the channel's {capacity}")
        entries += (code, a.ndim, *a.shape, *_PAD[a.ndim], offset, n)
        offsets.append(offset)
        offset += -(-n // ALIGN) * ALIGN
    return entries, offsets, offset


def unpack_arrays(header: np.ndarray, buf: Any, data_start: int, copy: bool) -> list[np.ndarray]:
    """The arrays a header describes (their count in word 2, :func:`pack_entries`'s entries
    from word 3), as views of ``buf`` whose data begins at ``data_start``, or copies."""
    out = []
    for i in range(int(header[2])):
        base = HEADER_WORDS + ENTRY_WORDS * i
        code, ndim = int(header[base]), int(header[base + 1])
        shape = tuple(int(d) for d in header[base + 2:base + 2 + ndim])
        view = np.ndarray(shape, _DTYPES[code], buffer=buf, offset=data_start + int(header[base + 6]))
        out.append(view.copy() if copy else view)
    return out


@functools.lru_cache(maxsize=None)
def _struct(count: int) -> struct.Struct:
    """The header after the sequence number for ``count`` arrays: method, count, entries."""
    return struct.Struct(f"<{2 + ENTRY_WORDS * count}q")


@dataclass(frozen=True)
class ChannelSpec:
    """What a worker needs to attach: the segment's name, its layout, and the wake-ups."""

    name: str
    capacity: int
    num_readers: int
    max_arrays: int
    wakeups: tuple[Any, ...]      # one multiprocessing semaphore per reader
    #: Resident buffers: (name, shape, dtype string, offset from the segment's start).
    resident: tuple[tuple[str, tuple[int, ...], str, int], ...] = ()


class StepChannel:
    """One writer (rank 0), ``num_readers`` readers, one step in flight; see the module doc."""

    def __init__(self, shm: shared_memory.SharedMemory, spec: ChannelSpec, reader: int | None) -> None:
        self._shm, self.spec, self.reader = shm, spec, reader
        words, n = HEADER_WORDS + ENTRY_WORDS * spec.max_arrays, spec.num_readers
        self._header = np.ndarray((words,), dtype=np.int64, buffer=shm.buf)
        self._ack_words = shm.buf[words * 8:(words + n) * 8].cast("q")
        #: Per reader, the pid of the process that attached as it (0: none yet): the handshake.
        self._ready_words = shm.buf[(words + n) * 8:(words + 2 * n) * 8].cast("q")
        self._data_start = -(-(words + 2 * n) * 8 // ALIGN) * ALIGN
        self._seq = 0
        #: Rank 0: per reader its process, watched while waiting for the handshake (wait_ready),
        #: and whether every reader has attached (then sends never look again).
        self._processes: Sequence[Any] | None = None
        self._all_ready = False
        #: Per array of the last step (rank 0): see ``_layout``.
        self._slots: list[Any] = []
        #: The resident buffers by name (see the module doc), on every side.
        self.resident: dict[str, np.ndarray] = _resident(shm, spec)

    @classmethod
    def create(cls, num_readers: int, capacity: int = defaults.STEP_CHANNEL_BYTES,
               max_arrays: int = defaults.STEP_CHANNEL_MAX_ARRAYS, ctx: Any = None,
               resident: Mapping[str, tuple[tuple[int, ...], Any]] | None = None) -> "StepChannel":
        """Rank 0: a new segment of ``capacity`` data bytes for ``num_readers`` workers, plus
        the ``resident`` buffers (name to shape and dtype), zeroed.

        Every bound is checked before anything exists: ``num_readers`` at most
        ``STEP_CHANNEL_MAX_READERS``, and the segment's bytes (header, data, resident
        buffers) within the shared memory the system has (:class:`ConfigError` naming the
        argument). A failure after that -- a semaphore or the segment the system refuses --
        leaves nothing behind: the semaphores made so far and the segment are removed."""
        for name, value in (("num_readers", num_readers), ("capacity", capacity), ("max_arrays", max_arrays)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(name, f"must be an integer >= 1, got {value!r}")
        if num_readers > STEP_CHANNEL_MAX_READERS:
            raise ConfigError(f"num_readers: {num_readers} readers, above the {STEP_CHANNEL_MAX_READERS} "
                              "a step channel takes (STEP_CHANNEL_MAX_READERS; one semaphore each)")
        head = (HEADER_WORDS + ENTRY_WORDS * max_arrays + 2 * num_readers) * 8     # + ack and ready words
        start = -(-head // ALIGN) * ALIGN
        offset = start + capacity
        layout, needs = [], [Need("max_arrays", "step channel header", start), Need("capacity", "step data", capacity)]
        for name, shape, dtype in _resident_items(resident):
            nbytes = aligned_nbytes(shape, dtype)
            layout.append((name, shape, np.dtype(dtype).str, offset))
            needs.append(Need("resident", f"resident buffer {name!r}", nbytes))
            offset += nbytes
        check_needs(needs, shared_memory_bytes(), f"shared memory ({defaults.SHARED_MEMORY_DIR} free, at most "
                                                  "physical RAM)")
        wakeups: list[Any] = []
        shm = spec = channel = None
        try:
            ctx = ctx or mp.get_context("spawn")
            for _ in range(num_readers):
                wakeups.append(ctx.Semaphore(0))
            shm = shared_memory.SharedMemory(create=True, size=offset)
            spec = ChannelSpec(shm.name, capacity, num_readers, max_arrays, tuple(wakeups), tuple(layout))
            channel = cls(shm, spec, None)
            channel._header[:] = 0
            for i in range(num_readers):
                channel._ack_words[i] = channel._ready_words[i] = 0
            return channel
        except BaseException as exc:
            # Nothing left behind: the frames of the failure (which may hold the channel and its
            # semaphores) drop their locals, the semaphores go with their last reference (each
            # unlinks its name), and the segment is unlinked.
            traceback.clear_frames(exc.__traceback__)
            made = len(wakeups)
            wakeups.clear()
            spec = channel = None
            _remove_segment(shm)
            if isinstance(exc, OSError):
                what = "wake-up semaphore" if made < num_readers else "shared-memory segment"
                raise GraphrtError(f"step channel: the system refused a {what} ({made} of num_readers="
                                   f"{num_readers} semaphores made, all removed, no segment left): {exc}") from exc
            raise

    @classmethod
    def attach(cls, spec: ChannelSpec, reader: int) -> "StepChannel":
        """A worker: attach to rank 0's segment as reader ``reader`` (0-based), and say so: this
        is the worker's half of the start-up handshake (:meth:`wait_ready`), so a worker
        attaches once it has imported and set up what it needs to read steps."""
        if not 0 <= reader < spec.num_readers:
            raise InputError("reader", f"must be in [0, {spec.num_readers}), got {reader}")
        channel = cls(shared_memory.SharedMemory(name=spec.name), spec, reader)
        channel._ready_words[reader] = os.getpid()
        return channel

    # ---- start-up handshake ----------------------------------------------------------
    def not_ready(self) -> list[int]:
        """The readers no process has attached as yet."""
        return [i for i, pid in enumerate(self._ready_words) if pid == 0]

    def wait_ready(self, processes: Sequence[Any] | None = None,
                   timeout: float = defaults.STEP_CHANNEL_START_TIMEOUT_S) -> None:
        """Rank 0: return once every reader has attached (the start-up handshake), so that a
        step's timeout never includes a worker's start -- a spawned process importing torch
        takes tens of seconds on a loaded machine. ``processes[i]``: reader ``i``'s process (a
        ``multiprocessing`` process: ``exitcode``, ``sentinel``), remembered for later waits
        and watched meanwhile: one that exits before attaching raises :class:`GraphrtError`
        at once, naming it and its exit code. Without processes only the clock runs. A live
        reader not attached after ``timeout`` seconds raises, naming it."""
        if self.reader is not None:
            raise GraphrtError("wait_ready() is rank 0's; this channel was attached as a reader")
        if processes is not None:
            processes = list(processes)
            if len(processes) != self.spec.num_readers:
                raise InputError("processes", f"one per reader ({self.spec.num_readers}), got {len(processes)}")
            self._processes = processes
        processes = self._processes
        deadline = time.monotonic() + timeout
        while True:
            waiting = self.not_ready()
            if not waiting:
                self._all_ready = True
                return
            if processes is not None:
                dead = [(i, processes[i].exitcode) for i in waiting if processes[i].exitcode is not None]
                if dead:
                    raise GraphrtError("step channel: " + "; ".join(
                        f"worker {i} (pid {processes[i].pid}) exited with code {_exit_code(code)} during start-up, "
                        "before it attached" for i, code in dead))
            left = deadline - time.monotonic()
            if left <= 0:
                raise GraphrtError(f"step channel: workers {waiting} did not attach within {timeout} s of start-up "
                                   "(alive but hung, or still starting: STEP_CHANNEL_START_TIMEOUT_S)")
            pause = min(left, defaults.STEP_CHANNEL_START_POLL_S)
            if processes is not None:                  # wakes at once when one exits
                wait_any([processes[i].sentinel for i in waiting], timeout=pause)
            else:
                time.sleep(pause)

    # ---- writer ----------------------------------------------------------------------
    def send(self, method: int, arrays: Sequence[np.ndarray], timeout: float = STEP_CHANNEL_TIMEOUT_S) -> None:
        """Write one step (``method`` code and arrays) and wake every reader."""
        if self.reader is not None:
            raise GraphrtError("send() is rank 0's; this channel was attached as a reader")
        if not isinstance(method, int) or not 0 <= method < 2**63:
            raise InputError("method", f"must be an integer in [0, 2**63), got {method!r}")
        check_arrays(arrays)
        if len(arrays) > self.spec.max_arrays:
            raise InputError("arrays", f"{len(arrays)} arrays, the channel holds {self.spec.max_arrays}")
        self.wait_acks(timeout)
        slots, steady = self._slots, len(self._slots) == len(arrays)
        if steady:                         # last step's dtypes and shapes: its places and header
            for a, (dtype, shape, seg) in zip(arrays, slots):
                if a.shape != shape or a.dtype != dtype:
                    steady = False
                    break
                seg[...] = a
        if not steady:                     # (what was copied is copied again; no reader is reading)
            self._slots = []               # a layout that fails leaves none to reuse
            slots = self._slots = self._layout(method, arrays)
            for a, (_, _, seg) in zip(arrays, slots):
                seg[...] = a
        self._seq += 1
        h = self._header
        h[1] = method
        h[0] = self._seq                   # written last: readers trust the step from here
        for wake in self.spec.wakeups:
            wake.release()

    def _layout(self, method: int, arrays: Sequence[np.ndarray]) -> list[Any]:
        """Check ``arrays``, lay them out in the segment and write their header entries (a
        step whose dtypes and shapes are last step's keeps last step's). Returns per array
        ``(dtype, shape, its place in the segment as an array)``."""
        buf = self._shm.buf
        entries, offsets, _ = pack_entries(arrays, self.spec.capacity)
        slots = [(a.dtype, a.shape, np.ndarray(a.shape, a.dtype, buffer=buf, offset=self._data_start + offset))
                 for a, offset in zip(arrays, offsets)]
        _struct(len(arrays)).pack_into(buf, 8, method, len(arrays), *entries)
        return slots

    def wait_acks(self, timeout: float = STEP_CHANNEL_TIMEOUT_S) -> None:
        """Rank 0: return once every reader acknowledged the last step (it may then write the
        resident buffers); raises :class:`GraphrtError` after ``timeout`` seconds. A reader
        that has not attached yet is waited for first (:meth:`wait_ready`, with the processes
        it was given): ``timeout`` starts once every reader is ready and covers reading only."""
        if self._seq == 0 or min(self._ack_words) == self._seq:
            return
        if not self._all_ready:
            self.wait_ready()              # at once when every reader has attached
        deadline = time.monotonic() + timeout
        while min(self._ack_words) != self._seq:
            if time.monotonic() > deadline:
                late = [i for i, seq in enumerate(self._ack_words) if seq != self._seq]
                raise GraphrtError(f"step channel: workers {late} did not read step {self._seq} within "
                                   f"{timeout} s (dead or hung)")
            os.sched_yield()

    # ---- reader ----------------------------------------------------------------------
    def receive(self, timeout: float | None = None, copy: bool = True,
                spin: float = defaults.STEP_CHANNEL_SPIN_S) -> tuple[int, list[np.ndarray]]:
        """Wait for the next step: ``(method, arrays)``. ``copy=False`` returns views of the
        segment, valid until this reader's next ``receive``. Raises :class:`GraphrtError` on
        timeout. The first ``spin`` seconds of the wait poll the wake-up (``os.sched_yield``
        between polls: ``time.sleep(0)`` would sleep out the timer slack, ~50 us) instead of
        sleeping on it: rank 0's ``release`` of a semaphore nobody
        sleeps on is an atomic add, while waking a sleeping reader is a system call and an
        interrupt to its core."""
        if self.reader is None:
            raise GraphrtError("receive() is a worker's; this channel is rank 0's")
        wake = self.spec.wakeups[self.reader]
        got = wake.acquire(False)
        if not got:
            spin = spin if timeout is None else min(spin, timeout)
            deadline = time.monotonic() + spin
            while not got and time.monotonic() < deadline:
                os.sched_yield()
                got = wake.acquire(False)
            if not got and not wake.acquire(timeout=None if timeout is None else timeout - spin):
                raise GraphrtError(f"step channel: no step from rank 0 within {timeout} s")
        h = self._header
        self._seq = int(h[0])
        method = int(h[1])
        out = unpack_arrays(h, self._shm.buf, self._data_start, copy)
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
        self._ready_words.release()
        self._slots = []
        self.resident = {}                 # (the mapping goes with the last array over it)
        self._header = None   # type: ignore[assignment] - views must go before the buffer
        self._shm.close()

    def unlink(self) -> None:
        """Remove the segment from the system (rank 0, once, after the workers closed)."""
        self._shm.unlink()


def _exit_code(code: int) -> str:
    """An exit code as ``-9 (SIGKILL)`` for a signal, else the number."""
    if code < 0 and -code in signal.valid_signals():
        return f"{code} ({signal.Signals(-code).name})"
    return str(code)


def _resident_items(resident: Mapping[str, tuple[tuple[int, ...], Any]] | None
                    ) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """``create``'s resident layout checked: (name, shape of Python ints, dtype) per buffer, or
    :class:`InputError` naming ``resident`` and the buffer."""
    out = []
    for name, value in (resident or {}).items():
        try:
            shape, dtype = value
            dtype = np.dtype(dtype)
            ok = dtype in _CODE and all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0
                                        for d in shape)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise InputError("resident", f"{name!r}: {value!r} cannot be held (a shape of non-negative int dims "
                                         f"and one of the dtypes {[np.dtype(d).name for d in _DTYPES]})")
        out.append((name, tuple(int(d) for d in shape), dtype))
    return out


def _remove_segment(shm: shared_memory.SharedMemory | None) -> None:
    """Unlink a segment ``create`` made before it failed (closed first where nothing still
    views it; the name goes either way, so /dev/shm holds nothing)."""
    if shm is None:
        return
    try:
        shm.close()
    except BufferError:    # a view survived; the mapping goes with it, the name goes now
        pass
    shm.unlink()


def _resident(shm: shared_memory.SharedMemory, spec: ChannelSpec) -> dict[str, np.ndarray]:
    """Arrays over the spec's resident layout, in a mapping of the segment of their own: it is
    unmapped only once the last of them is gone, so ``close()`` never waits for an executor
    that still holds one (a view of ``shm.buf`` would make ``shm.close()`` fail)."""
    if not spec.resident:
        return {}
    mapping = mmap.mmap(shm._fd, shm.size)     # the descriptor SharedMemory keeps open (POSIX)
    return {name: np.ndarray(shape, np.dtype(dtype), buffer=mapping, offset=offset)
            for name, shape, dtype, offset in spec.resident}


__all__ = ["ALIGN", "ChannelSpec", "ENTRY_WORDS", "HEADER_WORDS", "StepChannel", "aligned_nbytes", "check_arrays",
           "pack_entries", "unpack_arrays"]
