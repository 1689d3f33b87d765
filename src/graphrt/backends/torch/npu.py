"""``npu`` (alias ``acl``): Ascend ACL graphs (``torch.npu.NPUGraph``) over the shared torch graph code.

The ``cuda`` executor with torch_npu's calls, plus **task updates** (an attention op taking host
lengths is captured as a task group and re-issued with the step's lengths before each replay:
:meth:`NpuGraphAPI.pre_replay`) and the **stream budget** (capture sizes cut to
:func:`graphrt.backends.torch.acl.capture_budget`). ``torch_npu`` is imported lazily; a failure
is a :class:`~graphrt.core.errors.BackendUnavailableError` naming the cause. Tested only against
a stand-in ``torch.npu`` over the CPU recording graph (docs/backends.md, "Ascend specifics").
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from typing import Any, ContextManager, Iterator, Sequence

import torch

from graphrt.backends.torch import acl
from graphrt.backends.torch.backend import TorchBackend
from graphrt.backends.torch.device_graphs import DeviceGraphAPI, GraphTask, PreReplayHook
from graphrt.config import GraphConfig
from graphrt.core.dispatch import Dispatcher
from graphrt.core.graph_modes import GraphMode


def import_torch_npu() -> Any:
    """Import torch_npu and return the ``torch.npu`` namespace it installs."""
    importlib.import_module("torch_npu")
    return torch.npu


def torch_npu_problem() -> str | None:
    """Why torch_npu cannot run here (not installed, CANN missing, no device), or None."""
    if importlib.util.find_spec("torch_npu") is None:
        return ("torch_npu is not installed (pip install torch-npu matching this torch; it "
                "needs Huawei's CANN toolkit)")
    try:
        npu = import_torch_npu()
    except Exception as exc:  # noqa: BLE001 - any import failure means "unavailable"
        return (f"torch_npu is installed but failed to import ({type(exc).__name__}: {exc}); "
                "is CANN installed and its set_env.sh sourced?")
    if not npu.is_available():
        return ("torch_npu imported but no Ascend NPU is visible (torch.npu.is_available() is "
                "False: check the driver and ASCEND_RT_VISIBLE_DEVICES)")
    return None


class NpuGraphAPI(DeviceGraphAPI):
    """ACL graphs behind the device-graph API.

    ``npu`` is the namespace providing ``NPUGraph``, ``graph``, ``graph_pool_handle``,
    ``Stream``, ``current_stream``, ``stream``, ``ExternalEvent``,
    ``graph_task_group_begin/end``, ``graph_task_update_begin/end``, ``synchronize``,
    ``memory_reserved`` and ``mem_get_info``: ``torch.npu`` unless a test substitutes a
    stand-in.
    """

    name = "npu"
    pin_memory = True
    compile_backend = None
    graphs_share_memory = True
    asynchronous = True
    task_updates = True

    def __init__(self, device: torch.device | str = "npu", npu: Any = None) -> None:
        self.npu = import_torch_npu() if npu is None else npu
        self.device = torch.device(device)
        self._capture_stream: Any = None
        self._update_stream: Any = None

    def new_graph(self) -> Any:
        return self.npu.NPUGraph()

    def new_event(self) -> Any:
        """A ``torch.npu.Event`` (recorded on the current stream)."""
        return self.npu.Event()

    def new_pool(self) -> Any:
        return self.npu.graph_pool_handle()

    def capture(self, graph: Any, pool: Any) -> ContextManager[Any]:
        if self._capture_stream is None:
            self._capture_stream = self.npu.Stream()
        return self.npu.graph(graph, pool=pool, stream=self._capture_stream)

    def synchronize(self) -> None:
        self.npu.synchronize()

    def memory_in_use(self) -> int:
        return int(self.npu.memory_reserved())

    def memory_info(self) -> tuple[int, int] | None:
        free, total = self.npu.mem_get_info()
        return int(free), int(total)

    def release_memory(self) -> None:
        """``torch.npu.empty_cache`` (where the namespace has it): dropped graph pools go back."""
        self.synchronize()
        empty = getattr(self.npu, "empty_cache", None)
        if empty is not None:
            empty()

    @contextlib.contextmanager
    def task_group(self, hook: PreReplayHook, tasks: list[GraphTask]) -> Iterator[None]:
        """Capture the enclosed op as a task group the graph starts only after ``event``."""
        npu = self.npu
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        yield
        handle = npu.graph_task_group_end(stream)
        tasks.append(GraphTask(hook, handle, event))

    def pre_replay(self, tasks: Sequence[GraphTask]) -> None:
        """Refresh every captured task on the update stream (after the attention's ``before_replay``)."""
        if not tasks:
            return
        npu = self.npu
        if self._update_stream is None:
            self._update_stream = npu.Stream()
        stream = self._update_stream
        stream.wait_stream(npu.current_stream())
        with npu.stream(stream):
            for task in tasks:
                npu.graph_task_update_begin(stream, task.handle)
                task.hook()
                npu.graph_task_update_end(stream)
                task.event.record(stream)


class NpuGraphBackend(TorchBackend):
    """Torch on an Ascend NPU with ACL graphs (registry names ``npu`` and ``acl``)."""

    name = "npu"
    device_type = "npu"

    def __init__(self, device: str | torch.device | None = None, npu: Any = None) -> None:
        self._npu = npu
        if npu is None:
            import_torch_npu()
        super().__init__(device)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return torch_npu_problem()

    def graph_api(self) -> NpuGraphAPI:
        return NpuGraphAPI(self.device, self._npu)

    def dispatcher(self, config: GraphConfig, mode: GraphMode, model: Any,
                   keyed_host_values: Sequence[str] = ()) -> Dispatcher:
        """The graph dispatcher over the capture sizes that fit this model's ACL stream budget
        (a tensor-parallel group, ``tensor_parallel_size > 1``, costs streams too)."""
        keyed = "max_seq_len" in keyed_host_values
        if config.enforce_eager or mode is GraphMode.NONE:
            return config.graph_dispatcher(mode, keyed_context=keyed)
        layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        if layers is None:
            layers = len(model.attention_layers())
        policy = acl.limit_policy(config.capture_policy(), int(layers), tp_size=config.tensor_parallel_size)
        return config.graph_dispatcher(mode, token_buckets=policy, keyed_context=keyed)
