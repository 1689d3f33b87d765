"""What the torch backends share: loading graphrt's torch reference models and building a
:class:`~graphrt.backends.torch.executor.TorchExecutor` over the backend's device-graph API."""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Hashable

import torch

from graphrt.backends.base import Backend, Executor
from graphrt.backends.torch.capture.callable_graphs import TorchGraphs
from graphrt.backends.torch.executor import TorchExecutor
from graphrt.backends.torch.device_graphs import DeviceGraphAPI
from graphrt.backends.torch.kv_cache import TorchKVCache, model_kv_spec
from graphrt.config import GraphConfig
from graphrt.core.cache import GraphCache
from graphrt.core.dtypes import model_dtype
from graphrt.core.memory_bounds import ModelShape


class TorchBackend(Backend):
    """A torch device plus, for graph backends, its device-graph API."""

    framework: ClassVar[str] = "torch"
    device_type: ClassVar[str] = "cpu"

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = torch.device(device if device is not None else self.device_type)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None: torch runs on the CPU wherever graphrt imports it (device backends override)."""
        return None

    def graph_api(self) -> DeviceGraphAPI | None:
        """The device-graph API; ``None`` runs every step eagerly."""
        return None

    def load_model(self, model_dir: str, dtype: Any = None, *, tp_rank: int = 0, tp_size: int = 1,
                   group: Any = None, model_impl: str = "auto", trust_remote_code: bool = False) -> torch.nn.Module:
        """graphrt's torch decoder from a Hugging Face directory, or by ``model_impl``
        transformers' model over graphrt's attention, on this backend's device, its weights in
        ``dtype`` (a torch dtype or a name, :func:`~graphrt.core.dtypes.model_dtype`; default
        float32). ``tp_size > 1`` loads rank ``tp_rank``'s shard over ``group`` (None: the default
        group). The model remembers ``source_dir`` for a tensor-parallel executor's workers.
        ``trust_remote_code``: transformers' model may run the checkpoint's own code (its auto_map)."""
        from graphrt.models.model_impl import checkpoint_limits, resolve_model_impl
        name = model_dtype(dtype, checkpoint_limits(model_dir)[1] or "float32")   # "bf16", "auto", torch.half...
        kwargs: dict[str, Any] = {}
        if resolve_model_impl(model_dir, model_impl) == "transformers":
            from graphrt.models.torch.transformers_impl.loader import load_transformers_model as load
            kwargs["trust_remote_code"] = trust_remote_code
        else:
            from graphrt.models.torch.loader import load_torch_model as load
        model = load(model_dir, dtype=getattr(torch, name), device=self.device, tp_rank=tp_rank, tp_size=tp_size,
                     group=group, **kwargs)
        model.source_dir = model_dir
        return model

    def check_model(self, model: Any) -> None:
        """graphrt's torch model protocol (backends/torch/model_protocol.py), checked."""
        from graphrt.backends.torch.model_protocol import check_torch_model
        check_torch_model(model, self.name)

    def model_shape(self, model: Any, config: GraphConfig) -> ModelShape | None:
        """The shape of a model that follows docs/models.md (its KV cache spec, resolved and
        checked for ``config``: a bad one raises ConfigError here, before any allocation;
        ``config``'s widths, its parameters' element size; LoRA: the ``lora_target_modules``
        linears); None for a path or under tensor parallelism (the ranks load their own shards
        from a directory; a built model is refused there) or a model without parameters or a
        ``config``."""
        cfg = getattr(model, "config", None)
        if not isinstance(model, torch.nn.Module) or config.tensor_parallel_size > 1:
            return None
        spec = model_kv_spec(model, config, self.name)
        param = next(model.parameters(), None)
        if param is None or cfg is None:
            return None
        per_block = TorchKVCache(model, config, self.device, self.name, spec).bytes_per_block(config.block_size)
        row = 0 if spec.owned_by_model else spec.bytes_per_token()
        targets = set(getattr(model, "lora_target_modules", ()))
        lora = sum(child.in_features + child.out_features for module in model.modules()
                   for name, child in module.named_children() if name in targets and isinstance(child, torch.nn.Linear))
        return ModelShape(int(per_block), int(row), param.element_size(), int(cfg.hidden_size),
                          int(getattr(cfg, "intermediate_size", 0)), int(cfg.vocab_size), lora)

    def device_memory_bytes(self) -> int | None:
        """The device's total memory (its graph API's, else torch.cuda's); None on the CPU."""
        if self.device.type == "cpu":
            return None
        api = self.graph_api()
        info = api.memory_info() if api is not None else None
        if info is None and self.device.type == "cuda":
            info = torch.cuda.mem_get_info(self.device)
        return None if info is None else int(info[1])

    def graphs(self, fn: Callable[[Hashable], Any], cache: GraphCache | None = None,
               **options: Any) -> TorchGraphs:
        """``fn(key)`` captured once per key over the caller's buffers (``warmups=`` eager
        runs before each capture; ``attention_layers=`` the modules a PIECEWISE build breaks
        at), every call counted in ``cache`` (:class:`TorchGraphs`)."""
        return TorchGraphs(fn, self.graph_api(), cache, **options)

    def create_executor(self, model: Any, config: GraphConfig, dtype: Any = None) -> Executor:
        """A :class:`TorchExecutor` for ``model``; with ``config.tensor_parallel_size > 1`` the
        ranks are started (or joined, under torchrun) and each loads its shard of ``model`` --
        a directory (read as ``dtype``), or a model this backend loaded from one
        (:mod:`graphrt.backends.torch.parallel.tensor_parallel`)."""
        if config.tensor_parallel_size > 1:
            from graphrt.backends.torch.parallel.tensor_parallel import start_tensor_parallel
            return start_tensor_parallel(self, model, config, dtype)
        return TorchExecutor(model, config, self.device, self.graph_api())
