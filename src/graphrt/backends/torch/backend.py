"""What the torch backends share: loading graphrt's torch reference models and building a
:class:`~graphrt.backends.torch.executor.TorchExecutor` over the backend's device-graph API."""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Hashable

import torch

from graphrt.backends.base import Backend, Executor
from graphrt.backends.torch.executor import TorchExecutor
from graphrt.backends.torch.graphs import DeviceGraphAPI, TorchGraphs
from graphrt.config import GraphConfig
from graphrt.core.cache import GraphCache


class TorchBackend(Backend):
    """A torch device plus, for graph backends, its device-graph API."""

    framework: ClassVar[str] = "torch"
    device_type: ClassVar[str] = "cpu"

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = torch.device(device if device is not None else self.device_type)

    def graph_api(self) -> DeviceGraphAPI | None:
        """The device-graph API; ``None`` runs every step eagerly."""
        return None

    def load_model(self, model_dir: str, dtype: Any = None, *, tp_rank: int = 0, tp_size: int = 1,
                   group: Any = None) -> torch.nn.Module:
        """graphrt's torch decoder from a Hugging Face directory on this backend's device;
        ``tp_size > 1`` loads rank ``tp_rank``'s shard over the process group ``group``
        (``None``: the default group), reading only its slices of the checkpoint. The model
        remembers ``source_dir``: a tensor-parallel executor given it loads the shards from there."""
        from graphrt.models.torch.loader import load_torch_model
        model = load_torch_model(model_dir, dtype=dtype or torch.float32, device=self.device,
                                 tp_rank=tp_rank, tp_size=tp_size, group=group)
        model.source_dir = model_dir
        return model

    def graphs(self, fn: Callable[[Hashable], Any], cache: GraphCache | None = None,
               **options: Any) -> TorchGraphs:
        """``fn(key)`` captured once per key over the caller's buffers (``warmups=`` eager
        runs before each capture)."""
        return TorchGraphs(fn, self.graph_api(), cache, **options)

    def create_executor(self, model: Any, config: GraphConfig, dtype: Any = None) -> Executor:
        """A :class:`TorchExecutor` for ``model``; with ``config.tensor_parallel_size > 1`` the
        ranks are started (or joined, under torchrun) and each loads its shard of ``model`` --
        a directory (read as ``dtype``), or a model this backend loaded from one
        (:mod:`graphrt.backends.torch.tensor_parallel`)."""
        if config.tensor_parallel_size > 1:
            from graphrt.backends.torch.tensor_parallel import start_tensor_parallel
            return start_tensor_parallel(self, model, config, dtype)
        return TorchExecutor(model, config, self.device, self.graph_api())
