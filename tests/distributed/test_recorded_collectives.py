"""The CPU recording graph records a functional all-reduce and replays it over gloo: every
replay reduces that replay's values (issue 12). A process-group collective is refused at
capture with a message that says what to use instead."""

from __future__ import annotations

import torch
import torch.distributed as dist

from support.gloo_ranks import run_ranks


def _ranks(rank: int) -> tuple[list[list[float]], str]:
    """Capture ``all_reduce(2x) + 1`` on this rank, replay it with new values; then try a
    process-group collective under capture."""
    import torch.distributed._functional_collectives as fc

    from graphrt import GraphCaptureError
    from graphrt.backends.torch.recording_graph import RecordingGraph, recording_graph

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
    return got, refused


def test_a_captured_all_reduce_reduces_each_replays_values():
    got = run_ranks(_ranks)
    # ranks hold v and 2v: sum(2 * x) + 1 = 6v + 1 on both
    want = [[6 * v + 1] * 4 for v in (1.0, 10.0, 100.0, -3.0)]
    assert got[0][0] == want and got[1][0] == want
    assert all("_functional_collectives" in refused for _, refused in got.values())
