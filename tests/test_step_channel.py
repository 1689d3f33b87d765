"""graphrt.core.step_channel: rank 0 sends a step's arrays to its workers through shared
memory (seed 004's shared-memory broadcast, without pickle).

* Any arrays round-trip exactly (hypothesis), in one process and across spawned processes.
* Flow control: rank 0 never overwrites a step a worker has not read; a worker that died
  makes rank 0 raise a GraphrtError naming it within the timeout, not hang.
* Nothing is left behind: no segment in /dev/shm, no child process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from graphrt import GraphrtError, InputError
from graphrt.core.step_channel import StepChannel

DTYPES = [np.int32, np.int64, np.float32, np.uint8, np.bool_]


def shm_exists(name: str) -> bool:
    return Path("/dev/shm", name.lstrip("/")).exists()


@settings(max_examples=60, deadline=None)
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


def _worker(spec, reader: int, steps: int, results) -> None:
    channel = StepChannel.attach(spec, reader)
    try:
        for _ in range(steps):
            method, arrays = channel.receive(timeout=20)
            results.put((reader, method, [int(a.astype(np.int64).sum()) for a in arrays]))
    finally:
        channel.close()


def test_spawned_workers_receive_every_step_and_leave_nothing_behind():
    ctx = mp.get_context("spawn")
    writer = StepChannel.create(2, ctx=ctx)
    results = ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(writer.spec, i, 3, results)) for i in range(2)]
    for w in workers:
        w.start()
    steps = [[np.arange(n, dtype=np.int32), np.full((n, 5), n, dtype=np.int64)] for n in (3, 256, 7)]
    try:
        for method, arrays in enumerate(steps):
            writer.send(method, arrays, timeout=20)
        got = sorted(results.get(timeout=20) for _ in range(6))
    finally:
        for w in workers:
            w.join(timeout=20)
        writer.close()
        writer.unlink()
    want = sorted((r, m, [int(a.sum()) for a in arrays]) for r in range(2) for m, arrays in enumerate(steps))
    assert got == want
    assert all(w.exitcode == 0 for w in workers)
    assert not shm_exists(writer.spec.name) and not mp.active_children()


def test_a_dead_worker_is_named_within_the_timeout():
    ctx = mp.get_context("spawn")
    writer = StepChannel.create(2, ctx=ctx)
    results = ctx.Queue()
    alive = ctx.Process(target=_worker, args=(writer.spec, 0, 3, results))
    dies = ctx.Process(target=_worker, args=(writer.spec, 1, 1, results))    # reads one step, exits
    for w in (alive, dies):
        w.start()
    try:
        writer.send(0, [np.ones(3, np.int32)], timeout=20)
        writer.send(1, [np.ones(3, np.int32)], timeout=20)
        dies.join(timeout=20)
        with pytest.raises(GraphrtError, match=r"workers \[1\] did not read step 2"):
            writer.send(2, [np.ones(3, np.int32)], timeout=1.0)
    finally:
        alive.kill()
        for w in (alive, dies):
            w.join(timeout=20)
        writer.close()
        writer.unlink()
    assert not shm_exists(writer.spec.name) and os.getpid() and not mp.active_children()
