"""graphrt.backends.torch.parallel.tp_channel: rank 0 sends a step's arrays to its workers through shared
memory (nano-vllm's shared-memory broadcast, without pickle).

* Any arrays round-trip exactly (hypothesis), in one process and across spawned processes.
* Flow control: rank 0 never overwrites a step a worker has not read; a worker that died
  makes rank 0 raise a GraphrtError naming it within the timeout, not hang.
* Start-up: each worker says it is ready by attaching; the step timeout starts after that
  handshake (a slow start is not a late step), and a worker that dies or hangs before it is
  named (issue 46).
* Nothing is left behind: no segment in /dev/shm, no child process.
* Steady steps reuse last step's layout: over sequences of steps whose arrays stay, change
  in part, change shape or dtype, appear or go, every reader gets exactly the arrays sent
  (copies or views), a reader that attaches later and one that polls or sleeps included.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from graphrt import ConfigError, GraphrtError, InputError
from graphrt.backends.torch.parallel.tp_channel import StepChannel
from support.channel_workers import read_steps
from support.fast_subset import examples

DTYPES = [np.int32, np.int64, np.float32, np.uint8, np.bool_]


def shm_exists(name: str) -> bool:
    return Path("/dev/shm", name.lstrip("/")).exists()


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.sampled_from(DTYPES).flatmap(
    lambda d: hnp.arrays(d, hnp.array_shapes(min_dims=0, max_dims=4, max_side=7))), max_size=6),
    st.integers(0, 2**31))
def test_any_arrays_round_trip_exactly(arrays, method):
    writer = StepChannel.create(1, capacity=1 << 16)
    reader = StepChannel.attach(writer.spec, 0)
    try:
        for _ in range(2):              # a second step reuses the segment
            writer.send(method, arrays)
            got_method, got = reader.receive(timeout=5)
            assert got_method == method and len(got) == len(arrays)
            for a, b in zip(arrays, got):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert a.tobytes() == b.tobytes()
    finally:
        reader.close()
        writer.close()
        writer.unlink()
    assert not shm_exists(writer.spec.name)


def test_rank0_waits_for_every_worker_before_overwriting():
    writer = StepChannel.create(2, capacity=1 << 12)
    readers = [StepChannel.attach(writer.spec, i) for i in range(2)]
    try:
        writer.send(1, [np.arange(4, dtype=np.int32)])
        _, views = readers[0].receive(timeout=1, copy=False)        # not acknowledged yet
        readers[1].receive(timeout=1)
        with pytest.raises(GraphrtError, match=r"workers \[0\] did not read step 1"):
            writer.send(2, [np.zeros(4, dtype=np.int32)], timeout=0.2)
        assert views[0].tolist() == [0, 1, 2, 3]                    # still intact
        del views
        readers[0].acknowledge()
        writer.send(2, [np.zeros(4, dtype=np.int32)], timeout=0.2)
        assert readers[0].receive(timeout=1)[0] == 2
    finally:
        for r in readers:
            r.close()
        writer.close()
        writer.unlink()


@pytest.mark.parametrize("field,kwargs", [("num_readers", dict(num_readers=0)),
                                          ("capacity", dict(num_readers=1, capacity=-5)),
                                          ("max_arrays", dict(num_readers=1, max_arrays=0))])
def test_bad_channel_sizes_are_refused_naming_the_field(field, kwargs):
    with pytest.raises(InputError) as err:
        StepChannel.create(**kwargs)
    assert err.value.field == field


def test_bad_sends_are_refused_and_a_silent_writer_times_out():
    writer = StepChannel.create(1, capacity=64, max_arrays=2)
    reader = StepChannel.attach(writer.spec, 0)
    try:
        with pytest.raises(Exception, match="do not fit"):
            writer.send(0, [np.zeros(100, np.int64)])
        with pytest.raises(Exception, match="holds 2"):
            writer.send(0, [np.zeros(1)] * 3)
        with pytest.raises(Exception, match="cannot be sent"):
            writer.send(0, [np.zeros(2, np.complex64)])
        with pytest.raises(InputError, match="method") as err:
            writer.send(-1, [])
        assert err.value.field == "method"
        with pytest.raises(GraphrtError, match="no step from rank 0"):
            reader.receive(timeout=0.05)
    finally:
        reader.close()
        writer.close()
        writer.unlink()


def test_sends_that_are_not_sequences_of_arrays_are_input_errors():
    """Issue 26: send(1, [[1, 2, 3]]) raised AttributeError: 'list' object has no attribute 'dtype'."""
    writer = StepChannel.create(1, capacity=1 << 12)
    try:
        for arrays, word in (([[1, 2, 3]], "array 0.*list"), ([np.zeros(2), 5], "array 1.*int"),
                             (np.zeros(3), "sequence.*ndarray"), (None, "sequence.*NoneType")):
            with pytest.raises(InputError, match=word) as err:
                writer.send(1, arrays)
            assert err.value.field == "arrays"
        writer.send(1, [np.zeros(2)])                 # a steady step with a list in it is refused too
        with pytest.raises(InputError, match="array 0"):
            writer.send(1, [[1.0, 2.0]])
    finally:
        writer.close()
        writer.unlink()


class _Recorder:
    """What ``StepChannel.create`` makes in /dev/shm -- each segment and each semaphore, by name
    -- and, optionally, where the system refuses: the ``fail_semaphore``-th semaphore, the
    segment, or the resident buffers' mapping. Names are recorded, not /dev/shm compared before
    and after: other processes on the machine make and remove their own entries meanwhile."""

    def __init__(self, monkeypatch, fail: str | None = None, fail_semaphore: int = 2) -> None:
        from graphrt.backends.torch.parallel import tp_channel as sc

        self.names: list[str] = []
        self.spawn, self.fail, self.fail_semaphore, self.made = mp.get_context("spawn"), fail, fail_semaphore, 0
        recorder, real = self, sc.shared_memory.SharedMemory

        class Recorded(real):
            def __init__(self, name=None, create=False, size=0):
                if create and recorder.fail == "segment":
                    raise OSError(12, "Cannot allocate memory")
                super().__init__(name, create, size)
                if create:
                    recorder.names.append(self._name.lstrip("/"))

        def resident(shm, spec, real_resident=sc._resident):
            if recorder.fail == "resident mapping":
                raise OSError(12, "Cannot allocate memory")
            return real_resident(shm, spec)

        monkeypatch.setattr(sc.shared_memory, "SharedMemory", Recorded)
        monkeypatch.setattr(sc, "_resident", resident)

    def Semaphore(self, value: int):  # noqa: N802 - multiprocessing's name
        if self.fail == "semaphore" and self.made == self.fail_semaphore:
            raise OSError(24, "Too many open files")
        self.made += 1
        sem = self.spawn.Semaphore(value)
        self.names.append("sem." + sem._semlock.name.lstrip("/"))
        return sem

    def left(self) -> list[str]:
        """The recorded names still in /dev/shm."""
        return [n for n in self.names if Path("/dev/shm", n).exists()]


@pytest.mark.parametrize("field,kwargs", [
    ("capacity", dict(capacity=2**50)),
    ("resident", dict(resident={"big": ((2**47,), np.int64)})),         # 2**50 bytes
    ("resident", dict(resident={"wide": ((2**40, 2**40), np.uint8)})),  # past int64: no wrap to 0
    ("max_arrays", dict(max_arrays=10**9)),
    ("num_readers", dict(num_readers=10**6)),
])
def test_sizes_past_memory_are_config_errors_before_anything_exists(field, kwargs, monkeypatch):
    """Issue 26: these raised OSError ENOMEM naming no argument, and num_readers=10**6 leaked the
    segment when its semaphores failed."""
    rec = _Recorder(monkeypatch)
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(ConfigError, match=rf"^{field}: .*(bytes|readers)"):
        StepChannel.create(**{"num_readers": 1, "ctx": rec, **kwargs})
    assert rec.names == [] and rec.made == 0                  # nothing was made at all
    assert not [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("psm_")
                and Path("/dev/shm", n).stat().st_size >= 2**40]


@pytest.mark.parametrize("where", ["semaphore", "segment", "resident mapping"])
def test_a_failed_create_leaves_no_segment_and_no_semaphore(where, monkeypatch):
    rec = _Recorder(monkeypatch, fail=where)
    with pytest.raises(GraphrtError, match="all removed, no segment left") as err:
        StepChannel.create(3, capacity=1 << 12, ctx=rec, resident={"x": ((8,), np.int32)})
    assert isinstance(err.value.__cause__, OSError)
    assert rec.made == (2 if where == "semaphore" else 3)
    assert len(rec.names) == rec.made + (where == "resident mapping")   # the segment existed there
    assert rec.left() == [], rec.left()          # no psm_* segment, no sem.mp-* semaphore
    rec.fail = None
    ok = StepChannel.create(3, capacity=1 << 12, ctx=rec)      # the next one works
    ok.close()
    ok.unlink()
    del ok
    assert rec.left() == []


def test_the_start_up_handshake_in_one_process():
    """Each reader says it is ready by attaching; rank 0 waits for every one (naming the
    missing ones at its start-up timeout); the wait is rank 0's only."""
    writer = StepChannel.create(2, capacity=1 << 12)
    readers = []
    try:
        assert writer.not_ready() == [0, 1]
        readers.append(StepChannel.attach(writer.spec, 1))
        assert writer.not_ready() == [0]
        with pytest.raises(GraphrtError, match=r"workers \[0\] did not attach within 0.05 s of start-up"):
            writer.wait_ready(timeout=0.05)
        with pytest.raises(InputError, match="one per reader"):
            writer.wait_ready([object()])
        readers.append(StepChannel.attach(writer.spec, 0))
        writer.wait_ready(timeout=0.05)
        with pytest.raises(GraphrtError, match="rank 0's"):
            readers[0].wait_ready()
    finally:
        for r in readers:
            r.close()
        writer.close()
        writer.unlink()


@pytest.mark.parametrize("target, args, says", [
    pytest.param(os._exit, (3,), r"worker 0 \(pid \d+\) exited with code 3 during start-up, before it attached",
                 id="dies"),
    pytest.param(time.sleep, (60,), r"workers \[0\] did not attach within 1.0 s of start-up \(alive but hung",
                 id="hangs"),
])
def test_a_worker_that_dies_or_hangs_during_start_up_is_named(target, args, says):
    """A worker process that exits before attaching is named at once, by its liveness, not at
    the start-up timeout (600 s here); one alive that never attaches, at the timeout."""
    ctx = mp.get_context("spawn")
    writer = StepChannel.create(1, ctx=ctx)
    worker = ctx.Process(target=target, args=args)
    worker.start()
    timeout = 1.0 if target is time.sleep else 600.0
    start = time.monotonic()
    try:
        with pytest.raises(GraphrtError, match=says):
            writer.wait_ready([worker], timeout=timeout)
        assert time.monotonic() - start < 120
    finally:
        worker.kill()
        worker.join(timeout=60)
        writer.close()
        writer.unlink()
    assert not shm_exists(writer.spec.name) and not mp.active_children()


def test_a_slow_worker_start_is_not_counted_against_a_step():
    """Issue 46: the step timeout included the workers' start (spawning, importing torch: more
    than 20 s on a loaded machine). A worker that takes longer to start than a step's timeout
    still gets every step: the send waits for its handshake first, then the timeout runs."""
    ctx = mp.get_context("spawn")
    writer = StepChannel.create(1, ctx=ctx)
    results = ctx.Queue()
    worker = ctx.Process(target=read_steps, args=(writer.spec, 0, 3, results, 0.5))
    worker.start()
    try:
        for method in range(3):          # no explicit wait_ready: the second send waits for it
            writer.send(method, [np.full(4, method, np.int32)], timeout=0.25)
        got = [results.get(timeout=60) for _ in range(3)]
    finally:
        worker.join(timeout=60)
        writer.close()
        writer.unlink()
    assert got == [(0, m, [4 * m]) for m in range(3)] and worker.exitcode == 0
    assert not shm_exists(writer.spec.name) and not mp.active_children()


def test_spawned_workers_receive_every_step_and_leave_nothing_behind():
    ctx = mp.get_context("spawn")
    writer = StepChannel.create(2, ctx=ctx)
    results = ctx.Queue()
    workers = [ctx.Process(target=read_steps, args=(writer.spec, i, 3, results)) for i in range(2)]
    for w in workers:
        w.start()
    steps = [[np.arange(n, dtype=np.int32), np.full((n, 5), n, dtype=np.int64)] for n in (3, 256, 7)]
    try:
        writer.wait_ready(workers)        # the handshake: the step timeouts start after it
        for method, arrays in enumerate(steps):
            writer.send(method, arrays, timeout=20)
        got = sorted(results.get(timeout=60) for _ in range(6))
    finally:
        for w in workers:
            w.join(timeout=60)
        writer.close()
        writer.unlink()
    want = sorted((r, m, [int(a.sum()) for a in arrays]) for r in range(2) for m, arrays in enumerate(steps))
    assert got == want
    assert all(w.exitcode == 0 for w in workers)
    assert not shm_exists(writer.spec.name) and not mp.active_children()


@pytest.mark.slow
def test_a_dead_worker_is_named_within_the_timeout():
    """A worker known to be alive (after the handshake, having read a step) is killed: the next
    send but one names it within the step timeout."""
    ctx = mp.get_context("spawn")
    writer = StepChannel.create(2, ctx=ctx)
    # A queue per worker: a worker killed just after its put can still hold a shared queue's
    # write lock (its data already readable), and the live worker's next put would wait forever.
    results = [ctx.Queue() for _ in range(2)]
    workers = [ctx.Process(target=read_steps, args=(writer.spec, i, 3, results[i])) for i in range(2)]
    for w in workers:
        w.start()
    alive, dies = workers
    try:
        writer.wait_ready(workers)
        writer.send(0, [np.ones(3, np.int32)], timeout=20)
        assert [q.get(timeout=60)[0] for q in results] == [0, 1]                # both read step 1
        dies.kill()
        dies.join(timeout=60)
        writer.send(1, [np.ones(3, np.int32)], timeout=20)       # step 1 was read by both
        assert results[0].get(timeout=60)[:2] == (0, 1)           # the live worker has step 2
        start = time.monotonic()
        with pytest.raises(GraphrtError, match=r"workers \[1\] did not read step 2 within 1.0 s"):
            writer.send(2, [np.ones(3, np.int32)], timeout=1.0)
        assert 1.0 <= time.monotonic() - start < 30
    finally:
        alive.kill()
        for w in workers:
            w.join(timeout=60)
        writer.close()
        writer.unlink()
    assert dies.exitcode == -9
    assert not shm_exists(writer.spec.name) and not mp.active_children()


def _next_step(data, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The step after ``arrays``: each array kept, changed in a few elements, reshaped,
    retyped or replaced; sometimes one more array or one fewer."""
    out = []
    for a in arrays:
        how = data.draw(st.sampled_from(["same", "same", "partial", "partial", "shape", "dtype", "view"]))
        if how == "same":
            out.append(a)
        elif how == "partial":
            b = a.copy()
            flat = b.reshape(-1)
            if flat.size:
                for i in data.draw(st.lists(st.integers(0, flat.size - 1), max_size=4)):
                    flat[i] = ~flat[i] if b.dtype == np.bool_ else (1 if flat[i] != 1 else 2)
            out.append(b)
        elif how == "shape":
            out.append(data.draw(_big_arrays(a.dtype)))
        elif how == "dtype":
            dtype = data.draw(st.sampled_from([d for d in DTYPES if np.dtype(d) != a.dtype]))
            small = a if a.dtype == np.bool_ else np.nan_to_num(a, nan=0, posinf=1, neginf=-1) % 100
            out.append(small.astype(dtype))
        else:                                        # not contiguous, or not aligned for uint64
            out.append(a[::-1] if a.ndim else a)
    if data.draw(st.booleans()) and len(out) < 5:
        out.append(data.draw(_big_arrays(data.draw(st.sampled_from(DTYPES)))))
    elif data.draw(st.booleans()) and out:
        out.pop(data.draw(st.integers(0, len(out) - 1)))
    return out


def _big_arrays(dtype):
    return hnp.arrays(dtype, hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=12))


@settings(max_examples=examples(40), deadline=None)
@given(st.data())
def test_steps_that_change_in_part_shape_or_dtype_arrive_exactly(data):
    steps = [data.draw(st.lists(st.sampled_from(DTYPES).flatmap(_big_arrays), min_size=1, max_size=4))]
    for _ in range(5):
        steps.append(_next_step(data, steps[-1]))
    writer = StepChannel.create(2, capacity=1 << 17)
    readers = [StepChannel.attach(writer.spec, i) for i in range(2)]
    try:
        for method, arrays in enumerate(steps):
            writer.send(method, arrays)
            for k, reader in enumerate(readers):
                got_method, got = reader.receive(timeout=5, copy=bool(k), spin=0.001 * k)
                assert got_method == method and len(got) == len(arrays)
                for a, b in zip(arrays, got):
                    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
                if not k:
                    reader.acknowledge()
    finally:
        for r in readers:
            r.close()
        writer.close()
        writer.unlink()


def test_a_steady_step_reuses_the_layout_and_a_late_reader_sees_it_all():
    writer = StepChannel.create(1, capacity=1 << 20)
    table = np.arange(256 * 128, dtype=np.int32).reshape(256, 128)
    try:
        reader = StepChannel.attach(writer.spec, 0)
        writer.send(1, [table])
        reader.receive(timeout=5)
        reader.close()
        slots = writer._slots
        table[[3, 200], [0, 127]] = -1
        writer.send(2, [table])                       # same dtype and shape: same layout
        assert writer._slots is slots
        late = StepChannel.attach(writer.spec, 0)     # attached after the first step
        method, got = late.receive(timeout=5)
        assert method == 2 and np.array_equal(got[0], table)
        writer.send(3, [table[:, :64]])               # a new shape: a new layout, strided
        method, got = late.receive(timeout=5)
        assert method == 3 and np.array_equal(got[0], table[:, :64]) and writer._slots is not slots
        late.close()
    finally:
        writer.close()
        writer.unlink()


@pytest.mark.parametrize("device_type, polls", [("cuda", True), ("npu", True), ("cpu", False)])
def test_workers_on_accelerators_poll_and_cpu_workers_sleep(device_type, polls):
    """A worker on an accelerator polls for rank 0's next step (its host core idles while the
    device runs the forward); a CPU worker sleeps at once, leaving the cores to the forwards."""
    from graphrt.backends.torch.parallel.tp_protocol import WorkerSetup
    from graphrt.backends.torch.parallel.tp_worker import Follower
    from graphrt.core import defaults

    setup = WorkerSetup("m:C", device_type, None, "/nowhere", None, {}, 2, 1.0, 1)
    spin = Follower(setup, 1, channel=None, agreement=None).spin
    assert spin == (defaults.TP_WORKER_SPIN_S if polls else defaults.STEP_CHANNEL_SPIN_S)
    assert (spin > 0) == polls


def test_resident_buffers_are_shared_guarded_by_acks_and_outlive_close():
    """Resident buffers: rank 0 writes a step into them and sends only a small row; the reader
    sees the values; ``wait_acks`` returns only once the reader acknowledged, and names it when
    it does not; an array kept past ``close()`` stays valid and nothing is left in /dev/shm."""
    layout = {"ids": ((8,), np.int32), "table": ((4, 3), np.int64)}
    writer = StepChannel.create(1, capacity=256, resident=layout)
    reader = StepChannel.attach(writer.spec, 0)
    assert {k: (v.shape, v.dtype) for k, v in reader.resident.items()} == {
        k: (shape, np.dtype(dtype)) for k, (shape, dtype) in layout.items()}
    for step in range(1, 4):
        writer.wait_acks(timeout=1)
        writer.resident["ids"][:] = np.arange(8) * step
        writer.resident["table"][:] = -step
        writer.send(7, [np.array([step], np.int64)])
        with pytest.raises(GraphrtError, match=r"workers \[0\]"):
            writer.wait_acks(timeout=0.05)       # the reader has not read this step yet
        method, (row,) = reader.receive(timeout=1, copy=False)
        assert (method, int(row[0])) == (7, step)
        assert np.array_equal(reader.resident["ids"], np.arange(8) * step)
        assert (reader.resident["table"] == -step).all()
        reader.acknowledge()
    writer.wait_acks(timeout=1)
    kept = writer.resident["table"]
    reader.close()
    writer.close()
    writer.unlink()
    assert not Path("/dev/shm", writer.spec.name).exists()
    assert (kept == -3).all()
    kept[:] = 5                                  # still mapped, still writable


def test_a_broadcast_channel_holds_the_largest_step_of_a_large_engine():
    """Ranks launched elsewhere broadcast every array: the channel is sized from the config (a
    1024-request engine with 128k-token sequences pads a 32 MiB block table)."""
    from graphrt import GraphConfig
    from graphrt.backends.torch.parallel.tp_protocol import WorkerSetup
    from graphrt.core import defaults
    from graphrt.core.inputs.fields import FIELD_DTYPES, buffer_shapes

    def setup(**kw):
        return WorkerSetup("m:C", "cpu", None, "/nowhere", None, GraphConfig.create(**kw).model_dump(), 2, 1.0, 1)

    assert setup(max_num_seqs=4, max_model_len=64, block_size=4).step_bytes() == defaults.STEP_CHANNEL_BYTES
    big = dict(max_num_seqs=1024, max_model_len=131072, block_size=16, max_num_batched_tokens=8192)
    c = GraphConfig.create(**big)
    shapes = buffer_shapes(c.max_num_batched_tokens, c.max_num_seqs, c.max_blocks_per_req)
    need = sum(int(np.prod(s)) * np.dtype(FIELD_DTYPES[n]).itemsize for n, s in shapes.items())
    assert need > defaults.STEP_CHANNEL_BYTES
    assert setup(**big).step_bytes() >= need


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")
def test_resident_buffers_pin_for_cuda_copies_and_unpin():
    """Rank 0 on cuda page-locks the resident buffers (its staging buffers): tensors over them
    are pinned, a non-blocking host-to-device copy carries the values, and unregistering works."""
    import torch

    from graphrt.backends.torch.parallel.tensor_parallel import _pin

    layout = {"ids": ((4096,), np.int32), "table": ((64, 128), np.int32)}
    channel = StepChannel.create(1, capacity=256, resident=layout)
    try:
        address = _pin(channel.resident)
        assert address is not None
        host = {name: torch.from_numpy(a) for name, a in channel.resident.items()}
        assert all(t.is_pinned() for t in host.values())
        channel.resident["ids"][:] = np.arange(4096)
        channel.resident["table"][:] = 7
        device = {name: t.to("cuda", non_blocking=True) for name, t in host.items()}
        torch.cuda.synchronize()
        assert torch.equal(device["ids"].cpu(), torch.arange(4096, dtype=torch.int32))
        assert bool((device["table"] == 7).all())
        assert int(torch.cuda.cudart().cudaHostUnregister(address)) == 0
    finally:
        channel.close()
        channel.unlink()


@pytest.mark.parametrize("layout", [{"x": ((4, -1), np.int32)}, {"x": ((4,), np.complex64)}, {"x": ((2.5,), np.int32)}])
def test_bad_resident_layouts_are_refused_naming_the_field(layout):
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(InputError, match="resident.*'x'"):
        StepChannel.create(1, resident=layout)
    assert set(os.listdir("/dev/shm")) <= before
