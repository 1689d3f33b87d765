"""An attention backend that plans on the host from a step's data (transformers' #45323 in
small): its ``before_replay`` scales the attention output by the step's longest sequence, as a
Python number (a graph bakes it) or written into a device tensor. The planted bug of
graphs/test_complete_keys.py, also run through the kit by kit/test_planted_bugs.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from graphrt.backends.torch.cpu import CpuGraphBackend
from graphrt.layers.torch.attention.backend import PagedAttentionBackend
from support.hf_models import tiny_hf_model_dir


class PlannedBackend(PagedAttentionBackend):
    """graphrt's attention plus a plan made on the host before every run from the step's longest
    sequence (``host.seq_lens``): as a Python scalar (baked into a graph) or written into a device
    tensor the graph reads. ``declared``: it declares ``seq_lens`` refreshed."""

    name = "planned-paged"

    def __init__(self, head_dim: int, declared: bool) -> None:
        super().__init__(head_dim)
        self.refreshed_host_values = ("seq_lens",) if declared else ()
        self.plan = {"scale": 1.0, "tensor": torch.ones(())}

    def before_replay(self, step: Any, host: Any) -> None:
        self.plan["scale"] = 1.0 + int(np.max(host.seq_lens, initial=0)) / 64.0
        self.plan["tensor"].fill_(self.plan["scale"])


def planned_model(device_value: bool, declared: bool = False) -> torch.nn.Module:
    """The reference Qwen3 whose attention output is scaled by the plan of its
    :class:`PlannedBackend`: the Python number, or the device tensor (``device_value``)."""
    model = CpuGraphBackend().load_model(str(tiny_hf_model_dir("qwen3")))
    backend = model.attention_backend = PlannedBackend(model.config.head_dim, declared)
    plan = backend.plan

    for layer in model.attention_layers():
        def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _orig: Any = layer.forward) -> torch.Tensor:
            out = _orig(q, k, v)
            return out * (plan["tensor"] if device_value else plan["scale"])
        layer.forward = forward
    return model
