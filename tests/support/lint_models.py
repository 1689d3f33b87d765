"""Models with planted capture hazards for ``graphrt lint`` (tests/kit/test_lint.py), loadable by name
(``graphrt lint support.lint_models:moe_model``): graphrt's tiny reference Qwen3 with one MLP swapped for
a mixture of experts whose router reads its top expert with ``.item()`` and whose dispatch
gathers each expert's rows with ``nonzero``, and a norm that scales by a Python step counter."""

from __future__ import annotations

import torch
from torch import nn

from graphrt.models.torch.loader import load_torch_model
from support.hf_models import tiny_hf_model_dir


class Router(nn.Module):
    """Top-1 routing; the host read is the planted hazard."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        top = self.gate(x).argmax(-1)
        busiest = int(torch.bincount(top, minlength=self.gate.out_features).argmax().item())   # host sync
        return top, busiest


class MoE(nn.Module):
    """Experts that each run on the rows routed to them (a data-dependent shape)."""

    def __init__(self, hidden: int, experts: int = 2) -> None:
        super().__init__()
        self.router = Router(hidden, experts)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, _ = self.router(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (top == e).nonzero().squeeze(-1)
            out.index_add_(0, rows, expert(x.index_select(0, rows)))
        return out


class CountingNorm(nn.Module):
    """A norm that scales by how many forwards ran: a Python number a graph would bake in."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x) * (1.0 + 1e-6 * self.calls)


def moe_model() -> nn.Module:
    model = load_torch_model(tiny_hf_model_dir("qwen3"))
    layer = model.model.layers[1]
    layer.mlp = MoE(model.config.hidden_size)
    model.model.layers[0].post_attention_layernorm = CountingNorm(model.model.layers[0].post_attention_layernorm)
    return model
