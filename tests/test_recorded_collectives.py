"""The CPU recording graph records a functional all-reduce and replays it over gloo: every
replay reduces that replay's values (issue 12). A process-group collective is refused at
capture with a message that says what to use instead."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _ranks(rank: int, port: int, results) -> None:
    import torch.distributed._functional_collectives as fc

    from graphrt import GraphCaptureError
    from graphrt.backends.torch.recording_graph import RecordingGraph, recording_graph

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        x, out = torch.zeros(4), torch.zeros(4)
        graph = RecordingGraph()
        x.fill_(rank + 1)
        with recording_graph(graph):
            out.copy_(fc.all_reduce(x * 2, "sum", dist.group.WORLD) + 1)
        got = [out.tolist()]
        for value in (10.0, 100.0, -3.0):
            x.fill_(value * (rank + 1))
            graph.replay()
            got.append(out.tolist())
        refused = ""
        try:
            with recording_graph(RecordingGraph()):
                dist.all_reduce(x)
        except GraphCaptureError as err:
            refused = str(err)
        results.put((rank, got, refused))
    finally:
        dist.destroy_process_group()


def test_a_captured_all_reduce_reduces_each_replays_values():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_ranks, args=(rank, port, results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict((rank, (values, refused)) for rank, values, refused in (results.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=60)
    # ranks hold v and 2v: sum(2 * x) + 1 = 6v + 1 on both
    want = [[6 * v + 1] * 4 for v in (1.0, 10.0, 100.0, -3.0)]
    assert got[0][0] == want and got[1][0] == want
    assert all("_functional_collectives" in refused for _, refused in got.values())
    assert all(p.exitcode == 0 for p in procs)

