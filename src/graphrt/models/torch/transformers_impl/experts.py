"""Experts modules with a forward of their own, routed onto graphrt's capturable grouped path.

Most transformers MoE classes run their experts through transformers' experts interface
(``moe.py``). A few keep a forward of their own that reads the routing on the host, which no graph
can hold: ``DbrxExperts`` and ``LongcatFlashExperts`` loop over the experts a step hit (found with
``nonzero`` and read with ``.item()`` / 0-dim indexing), JetMoE's gating (``JetMoeTopKGating``,
used by its experts MLP ``JetMoeMoE`` and its mixture of attention heads ``JetMoeMoA``) reads the
tokens per expert with ``.tolist()``.

The rule: **an experts module whose weights have a known layout is routed; any other is refused
with the host sync named.** :func:`route_experts` replaces the forward (per instance: the
parameters, their names and any tensor-parallel hooks stay) of each module in :data:`LAYOUTS` whose
weights pass the layout's shape check with graphrt's grouped path over *views* of its own weights
(no copy): the (token, slot) pairs sorted by expert on the device, group ends by ``searchsorted``
(no host sync, static shapes), one grouped matmul per projection (``experts="grouped_mm"``, the
default, where :func:`grouped_mm_runs`; ``"batched_mm"`` and elsewhere: each pair's expert matrix
gathered, then one batched matmul), rows of zero-computation experts (LongCat-Flash's identity
experts) passed through, each pair weighted, the slots summed. ``experts="eager"`` keeps the module's own loop and its model runs eagerly
(:func:`routing_blocker` names the host sync). An experts module of any other class keeps its
forward; when a capture reaches a host sync in it, the capture error (op, module, line) gets this
rule appended (:func:`unrouted_note`).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

#: The experts implementations this path runs (``moe.EXPERTS_CHOICES`` less ``"eager"``).
ROUTED_IMPLS = ("grouped_mm", "batched_mm")
#: Ends of class names that mark a module as part of a MoE's experts or routing (for the note).
EXPERTS_NAME_ENDS = ("Expert", "Experts", "ExpertGLU", "Gating", "Router", "MoE", "MoA")


def grouped_mm_runs(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes these on the device with no host sync: on CPU any
    float dtype; on other devices bfloat16 (other dtypes may fall back to a loop that reads the
    group ends on the host). Otherwise the batched matmul runs instead."""
    if not hasattr(torch.nn.functional, "grouped_mm"):
        return False
    return rows.device.type == "cpu" or weight.dtype == torch.bfloat16


@dataclass(frozen=True)
class Groups:
    """A step's (token, slot) pairs sorted by expert, as a grouped matmul takes them.

    ``order [S]``: the pair of each sorted row; ``expert [S]``: its expert; ``ends [E]`` (int32):
    where each expert's rows end; ``routed [S, 1]``: the row's expert holds weights (not a
    zero-computation expert, whose ids follow the weighted ones); ``slots``: pairs per token."""

    order: torch.Tensor
    expert: torch.Tensor
    ends: torch.Tensor
    routed: torch.Tensor
    slots: int
    num_experts: int
    impl: str

    @classmethod
    def of(cls, index: torch.Tensor, num_experts: int, impl: str) -> "Groups":
        """The pairs of ``index [T, K]`` (each token's ``K`` experts) over ``num_experts`` weighted experts."""
        expert, order = torch.sort(index.reshape(-1), stable=True)
        bounds = torch.arange(1, num_experts + 1, device=index.device, dtype=expert.dtype)
        ends = torch.searchsorted(expert, bounds).to(torch.int32)
        return cls(order, expert, ends, (expert < num_experts)[:, None], int(index.shape[-1]), num_experts, impl)

    def rows(self, per_token: torch.Tensor) -> torch.Tensor:
        """``per_token [T, D]`` as the sorted rows ``[S, D]`` (each token once per slot)."""
        return per_token[torch.div(self.order, self.slots, rounding_mode="floor")]

    def pair_rows(self, per_pair: torch.Tensor) -> torch.Tensor:
        """``per_pair [T * K, D]`` (token-major) as the sorted rows ``[S, D]``."""
        return per_pair[self.order]

    def unsort(self, rows: torch.Tensor) -> torch.Tensor:
        """Sorted rows ``[S, D]`` back in token-major pair order ``[T * K, D]``."""
        return torch.empty_like(rows).index_copy_(0, self.order, rows)

    def linear(self, rows: torch.Tensor, weight: torch.Tensor, transposed: bool = False) -> torch.Tensor:
        """Each sorted row times its expert's matrix: ``weight [E, out, in]`` (``[E, in, out]`` when
        ``transposed``) -> ``[S, out]``; rows of zero-computation experts are 0."""
        w = weight if transposed else weight.transpose(-2, -1)            # [E, in, out], a view
        x = rows.to(w.dtype)
        if self.impl == "grouped_mm" and grouped_mm_runs(x, w):
            out = torch.nn.functional.grouped_mm(x, w, offs=self.ends)   # rows past ends[-1] are not written
        else:
            out = torch.bmm(x[:, None, :], w[self.expert.clamp(max=self.num_experts - 1)])[:, 0]
        return torch.where(self.routed, out, 0)


@dataclass(frozen=True)
class GluWeights:
    """Views of a gated experts MLP's weights: ``up [E, I, H]`` with ``gate`` beside it, or
    ``up [E, 2I, H]`` holding gate then up when ``gate`` is None; ``down [E, H, I]`` (``[E, I, H]``
    when ``down_transposed``); ``act``: the gate's activation."""

    gate: torch.Tensor | None
    up: torch.Tensor
    down: torch.Tensor
    down_transposed: bool
    act: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, rows: torch.Tensor, groups: Groups) -> torch.Tensor:
        """The experts MLP of each sorted row ``[S, H]`` -> ``[S, H]`` (0 for zero-computation rows)."""
        if self.gate is None:
            gate, up = groups.linear(rows, self.up).chunk(2, dim=-1)
        else:
            gate, up = groups.linear(rows, self.gate), groups.linear(rows, self.up)
        return groups.linear(self.act(gate) * up, self.down, self.down_transposed)


def grouped_experts(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, mlp: GluWeights,
                    num_experts: int, impl: str,
                    identity: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``hidden [T, H]`` through each token's experts ``index [T, K]`` weighted by ``weights [T, K]``
    and summed -> ``[T, H]``. Ids ``>= num_experts`` are zero-computation experts: ``identity``."""
    groups = Groups.of(index, num_experts, impl)
    rows = groups.rows(hidden)
    out = mlp(rows, groups)
    if identity is not None:
        out = torch.where(groups.routed, out, identity(rows).to(out.dtype))
    out = out * weights.reshape(-1)[groups.order, None]
    return groups.unsort(out).view(hidden.shape[0], groups.slots, -1).sum(1).to(hidden.dtype)


# ---- the known layouts ----------------------------------------------------------------------------

def _dbrx(module: nn.Module) -> GluWeights | None:
    """``DbrxExperts``: ``mlp.w1`` (gate), ``mlp.v1`` (up) and ``mlp.w2`` (down, applied as
    ``x @ w2``), each ``[E * I, H]``."""
    glu, e = module.mlp, int(module.num_experts)
    w1, v1, w2 = glu.w1, glu.v1, glu.w2
    if not (w1.dim() == 2 and w1.shape == v1.shape == w2.shape and w1.shape[0] % e == 0):
        return None
    shape = (e, w1.shape[0] // e, w1.shape[1])
    return GluWeights(w1.view(shape), v1.view(shape), w2.view(shape), True, glu.activation_fn)


def _longcat(module: nn.Module) -> GluWeights | None:
    """``LongcatFlashExperts``: ``gate_up_proj [E + Z, 2I, H]`` (gate then up; only the first ``E``
    are used), ``down_proj [E, H, I]``; ids ``>= E`` are its ``Z`` identity experts."""
    e, up, down = int(module.num_routed_experts), module.gate_up_proj, module.down_proj
    if up is None or down is None:
        return None
    if not (up.dim() == down.dim() == 3 and up.shape[0] >= e == down.shape[0]
            and up.shape[1] == 2 * down.shape[2] and up.shape[2] == down.shape[1]):
        return None
    return GluWeights(None, up[:e], down, False, module.act_fn)


def _jetmoe(module: nn.Module) -> GluWeights | None:
    """``JetMoeMoE`` / ``JetMoeMoA``: ``input_linear.weight [E, out, H]`` (the MLP's: gate then up)
    and ``output_linear.weight [E, H, in]``."""
    up, down = module.input_linear.weight, module.output_linear.weight
    if not (up.dim() == down.dim() == 3 and up.shape[0] == down.shape[0] == module.router.num_experts
            and up.shape[2] == down.shape[1]):
        return None
    if up.shape[1] != (2 if hasattr(module, "activation") else 1) * down.shape[2]:   # the MLP's is gated
        return None
    return GluWeights(None, up, down, False, getattr(module, "activation", torch.nn.Identity()))


def _dbrx_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    out = grouped_experts(flat, top_k_index, top_k_weights, _dbrx(self), int(self.num_experts), self._graphrt_impl)
    return out.view(hidden_states.shape[0], -1, flat.shape[-1])


def _longcat_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    return grouped_experts(hidden_states, top_k_index, top_k_weights, _longcat(self), int(self.num_routed_experts),
                           self._graphrt_impl, identity=self.identity_expert)


def _jetmoe_route(router: nn.Module, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """JetMoE's gating on the device: (experts ``[T, K]``, gates ``[T, K]``, logits ``[T, E]``)."""
    logits = router.layer(flat).float()
    top, index = logits.topk(router.top_k, dim=1)
    return index, torch.softmax(top, dim=1).type_as(flat), logits


def _jetmoe_mlp_forward(self: nn.Module, layer_input: torch.Tensor) -> torch.Tensor:
    flat = layer_input.reshape(-1, layer_input.shape[-1])
    index, gates, _ = _jetmoe_route(self.router, flat)
    out = grouped_experts(flat, index, gates, _jetmoe(self), int(self.router.num_experts), self._graphrt_impl)
    return (out + self.bias).view(layer_input.shape)


def _jetmoa_map(self: nn.Module, layer_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """JetMoE's query experts: ``[B, L, H]`` -> ``[B, L, K, D]`` (each token's K projections)."""
    flat = layer_input.reshape(-1, layer_input.shape[-1])
    index, gates, logits = _jetmoe_route(self.router, flat)
    groups = Groups.of(index, int(self.router.num_experts), self._graphrt_impl)
    queries = groups.unsort(groups.linear(groups.rows(flat), self.input_linear.weight))
    return queries.view(*layer_input.shape[:-1], groups.slots, -1), logits, (groups, gates)


def _jetmoa_reduce(self: nn.Module, layer_input: torch.Tensor, topo_info: Any) -> torch.Tensor:
    """JetMoE's output experts: ``[B, L, K, D]`` -> ``[B, L, H]``, gated, summed, plus the bias."""
    groups, gates = topo_info
    b, length, k, d = layer_input.shape
    out = groups.linear(groups.pair_rows(layer_input.reshape(-1, d)), self.output_linear.weight)
    out = groups.unsort(out * gates.reshape(-1)[groups.order, None]).view(b * length, k, -1).sum(1)
    return (out.to(layer_input.dtype) + self.bias).view(b, length, -1)


@dataclass(frozen=True)
class Layout:
    """A known experts class: its weights' views (None: not this layout), the methods graphrt
    gives it, and the host sync of its own forward (for refusals)."""

    weights: Callable[[nn.Module], GluWeights | None]
    methods: dict[str, Callable[..., Any]]
    host_sync: str


#: transformers' experts classes outside the experts interface whose layout graphrt knows.
LAYOUTS: dict[str, Layout] = {
    "DbrxExperts": Layout(_dbrx, {"forward": _dbrx_forward},
                          "nonzero() over the routing mask and 0-dim indexing per expert hit (.item())"),
    "LongcatFlashExperts": Layout(_longcat, {"forward": _longcat_forward},
                                  "nonzero() over the routing mask and .item() per expert hit"),
    "JetMoeMoE": Layout(_jetmoe, {"forward": _jetmoe_mlp_forward},
                        "JetMoeTopKGating's .tolist() of the tokens per expert"),
    "JetMoeMoA": Layout(_jetmoe, {"map": _jetmoa_map, "reduce": _jetmoa_reduce},
                        "JetMoeTopKGating's .tolist() of the tokens per expert"),
}


def _known(module: nn.Module) -> Layout | None:
    cls = type(module)
    if not cls.__module__.startswith("transformers.models."):
        return None                       # a checkpoint's own class of the same name: its code, not these
    return LAYOUTS.get(cls.__name__)


def route_experts(hf_model: nn.Module, impl: str) -> list[str]:
    """Give each experts module of a known layout graphrt's grouped forward (``impl``: one of
    :data:`ROUTED_IMPLS`; ``"eager"`` routes nothing); returns the routed module paths."""
    if impl not in ROUTED_IMPLS:
        return []
    routed = []
    for path, module in hf_model.named_modules():
        layout = _known(module)
        if layout is None or layout.weights(module) is None:
            continue
        module._graphrt_impl = impl
        for name, fn in layout.methods.items():
            setattr(module, name, types.MethodType(fn, module))
        routed.append(path)
    return routed


def routing_blocker(hf_model: nn.Module) -> str | None:
    """Why a known experts class keeps ``hf_model`` out of graphs (left on its own forward:
    ``experts="eager"`` or weights of another layout), naming its host sync; else None."""
    for path, module in hf_model.named_modules():
        layout = _known(module)
        if layout is None or getattr(module, "_graphrt_impl", None) is not None:
            continue
        why = ("experts='eager' keeps its own forward" if layout.weights(module) is not None else
               "its weights are not in the layout graphrt re-views for it (shapes "
               f"{ {n: tuple(p.shape) for n, p in module.named_parameters()} })")
        return (f"MoE experts {path} ({type(module).__name__}): {why}, which reads the routing on the host "
                f"({layout.host_sync}) -- a host sync no graph can hold; load with experts='grouped_mm' (the default) "
                "or 'batched_mm' for graphs; this model runs eagerly")
    return None


def unrouted_note(where: str) -> str:
    """The rule, for a capture error raised in ``where`` (``"path (Class) at file:line"``) when
    that module is part of a MoE's experts or routing; else ``""``."""
    cls = where.split(" (", 1)[1].split(")", 1)[0] if " (" in where else ""
    if not cls.endswith(EXPERTS_NAME_ENDS):
        return ""
    return (f"; {cls} is an experts module graphrt does not route: graphrt runs experts modules of a known "
            f"weight layout on its capturable grouped path (transformers' experts interface, {', '.join(LAYOUTS)}) "
            "and refuses any other whose forward syncs with the host")


__all__ = ["EXPERTS_NAME_ENDS", "GluWeights", "Groups", "LAYOUTS", "Layout", "ROUTED_IMPLS", "grouped_experts",
           "grouped_mm_runs", "route_experts", "routing_blocker", "unrouted_note"]
