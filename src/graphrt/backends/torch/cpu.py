"""``cpu``: a real graph backend for machines with no accelerator.

Capture records the aten ops on static buffers (:mod:`graphrt.backends.torch.recording_graph`);
replay re-executes them on the same storage. It reproduces what makes device graphs hard (baked
Python values, static addresses, no host sync while capturing), so graph tests run in CI."""

from __future__ import annotations

from typing import Any, ContextManager

from graphrt.backends.torch import recording_graph as rg
from graphrt.backends.torch.backend import TorchBackend
from graphrt.backends.torch.device_graphs import DeviceGraphAPI


class CpuGraphAPI(DeviceGraphAPI):
    """The recording graph behind the device-graph API."""

    name = "cpu"
    #: Inductor's CPU kernels are C++ the recorder cannot see (replay would skip them), so
    #: ``compile_model`` uses AOTAutograd's aten graphs here: the same functionalised,
    #: static per-bucket compiles of the pieces, recorded op by op.
    compile_backend = "aot_eager"
    #: Recorded graphs hold host memory only; collecting first frees nothing they need.
    collect_before_capture = False

    def __init__(self) -> None:
        self._pools: list[rg.RecordingPool] = []

    def new_graph(self) -> rg.RecordingGraph:
        return rg.RecordingGraph()

    def capture(self, graph: rg.RecordingGraph, pool: Any) -> ContextManager[Any]:
        return rg.recording_graph(graph, pool=pool)

    def new_pool(self) -> rg.RecordingPool:
        pool = rg.graph_pool_handle()
        self._pools.append(pool)
        return pool

    def memory_in_use(self) -> int:
        return sum(p.captured_bytes for p in self._pools)


class CpuGraphBackend(TorchBackend):
    """Torch on the CPU with recorded graphs."""

    name = "cpu"

    def graph_api(self) -> CpuGraphAPI:
        return CpuGraphAPI()
