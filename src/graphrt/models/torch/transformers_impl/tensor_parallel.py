"""Tensor parallelism of transformers models from their own plan, over torch.distributed.

:func:`shard_by_plan` applies ``model.tp_plan`` (module-path pattern -> style) to a model every
rank loaded whole: each rank keeps its weight slices and gets forward hooks doing waited
functional collectives, which graphrt's graphs record (transformers' DTensor TP is not used).

Styles (transformers' names; weights ``[out, in]``, expert stacks ``[E, out, in]``):

==========================  ================================================================
``colwise``                  a linear's output rows (and bias) split; its output stays split
``colwise_gather_output``    split as ``colwise``; the output gathered (``colwise_rep`` too)
``packed_colwise``           gate and up halves each split (a fused ``gate_up``; expert stacks)
``packed_rowwise``           an expert stack packed along its last dim: each half's columns split
``rowwise``                  input columns split; output all-reduced, the bias added once
``rowwise_split_input``      the same, taking this rank's slice of a replicated input
``embedding_rowwise``        vocabulary rows split; rows another rank owns embed to 0; all-reduced
``moe_tp_experts``           the experts module's output all-reduced (its stacks split above)
``moe_identity_expert``      the input divided by the ranks (summed back by the experts' reduce)
``all_reduce``               the output all-reduced
replicated styles            nothing (``replicated_with_grad_allreduce``, ``sequence_parallel``,
                             ``local_params``, ``replicate``, ``mla_kv_a_proj``: the forward of all
                             of them is the replicated module's)
==========================  ================================================================

Any other style is a ConfigError naming the entry. Attention must shard on head boundaries or
be replicated: ``loader.py`` compares each layer's heads before and after (``check_head_shards``).
"""

from __future__ import annotations

import contextlib
import re
import threading
from typing import Any, Callable, Iterator

import torch
from torch import nn

from graphrt.core.errors import ConfigError
from graphrt.models.torch.parallel import all_gather_last, all_reduce

#: Styles that leave the module as it is (inference: no gradient, no sequence split).
REPLICATED = frozenset({"replicated_with_grad_allreduce", "sequence_parallel", "local_params", "replicate",
                        "mla_kv_a_proj"})
SUPPORTED = frozenset({"colwise", "colwise_gather_output", "colwise_rep", "packed_colwise", "packed_rowwise", "rowwise",
                       "rowwise_split_input", "rowwise_rep", "embedding_rowwise", "moe_tp_experts",
                       "moe_identity_expert", "all_reduce"}) | REPLICATED


_LOCAL = threading.local()


@contextlib.contextmanager
def without_collectives() -> Iterator[None]:
    """Collectives answer with this rank's own values, shaped as theirs (a sum is the rank's part,
    a gather repeats it): for the probe forwards made while loading, which read shapes and
    module behaviour only, before rank 0 has joined the process group."""
    previous = getattr(_LOCAL, "off", False)
    _LOCAL.off = True
    try:
        yield
    finally:
        _LOCAL.off = previous


class _Comm:
    """This rank's place and the waited functional collectives over ``group`` (None: the default
    group, looked up at the first collective)."""

    def __init__(self, rank: int, size: int, group: Any) -> None:
        self.rank, self.size, self.group = rank, size, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if getattr(_LOCAL, "off", False) else all_reduce(x, self.group)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(_LOCAL, "off", False):
            return torch.cat([x] * self.size, dim=-1)
        return all_gather_last(x, self.group)

    def slice(self, size: int, what: str) -> tuple[int, int]:
        if size % self.size:
            raise ConfigError(f"{what}: {size} does not divide over tensor_parallel_size {self.size}")
        part = size // self.size
        return self.rank * part, part


def plan_matches(plan: dict[str, str], names: list[str]) -> list[tuple[str, str, str]]:
    """``(name, style, pattern)`` for every module or parameter name a plan pattern matches."""
    out = []
    for pattern, style in plan.items():
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")
        out.extend((name, style, pattern) for name in names if regex.match(name))
    return out


def _narrow(param: nn.Parameter, dim: int, comm: _Comm, what: str, packed: int = 1) -> None:
    """Keep this rank's slice of ``param`` along ``dim`` (``packed``: each of that many halves split)."""
    size = param.shape[dim]
    if size % packed:
        raise ConfigError(f"{what}: {size} is not {packed} packed parts")
    parts = param.data.chunk(packed, dim=dim)
    pieces = []
    for part in parts:
        start, length = comm.slice(part.shape[dim], what)
        pieces.append(part.narrow(dim, start, length))
    param.data = torch.cat(pieces, dim=dim).contiguous() if packed > 1 else pieces[0].contiguous()


def _shard_param(owner: nn.Module, pname: str, style: str, comm: _Comm, path: str, done: set[int]) -> None:
    """A plan entry naming a parameter: slice it by ``style``."""
    param = owner._parameters[pname]
    if id(param) in done:
        return
    done.add(id(param))
    nd = param.dim()
    if style in ("colwise", "colwise_rep", "colwise_gather_output"):
        _narrow(param, 0 if nd == 1 else nd - 2, comm, path)
    elif style == "packed_colwise":
        _narrow(param, 0 if nd == 1 else nd - 2, comm, path, packed=2)
    elif style in ("rowwise", "rowwise_split_input", "rowwise_rep", "packed_rowwise"):
        if nd == 1:     # a bias of a summed output: each rank adds its share
            param.data = param.data / comm.size
        else:
            _narrow(param, nd - 1, comm, path, packed=2 if style == "packed_rowwise" else 1)
    else:
        raise ConfigError(f"tp_plan entry {path!r}: style {style!r} on a parameter is not supported by graphrt's "
                          f"transformers backend (supported: {sorted(SUPPORTED)})")


def _post(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (fn(output[0]), *output[1:])
        return fn(output)
    return hook


def _shard_module(module: nn.Module, style: str, comm: _Comm, path: str, done: set[int]) -> None:
    """A plan entry naming a module: slice its weights and hook its collectives by ``style``."""
    if style in REPLICATED:
        return
    if style == "moe_tp_experts" or style == "all_reduce":
        module.register_forward_hook(_post(comm.all_reduce))
        return
    if style == "moe_identity_expert":
        module.register_forward_pre_hook(lambda m, args: (args[0] / comm.size, *args[1:]))
        return
    if style == "embedding_rowwise":
        if not isinstance(module, nn.Embedding):
            raise ConfigError(f"tp_plan entry {path!r}: embedding_rowwise on a {type(module).__name__}")
        start, rows = comm.slice(module.num_embeddings, f"{path}.weight rows")   # a tied head may have sliced it
        if id(module.weight) not in done:
            done.add(id(module.weight))
            module.weight.data = module.weight.data.narrow(0, start, rows).contiguous()
        owned: list[torch.Tensor] = []          # the call's "id is this rank's", from pre- to post-hook

        def embed_in(m: nn.Module, args: Any) -> tuple:
            local = args[0] - start
            owned[:] = [(local >= 0) & (local < rows)]
            return (local.clamp(0, rows - 1), *args[1:])

        def embed_out(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            return comm.all_reduce(torch.where(owned.pop().unsqueeze(-1), out, 0))
        module.register_forward_pre_hook(embed_in)
        module.register_forward_hook(embed_out)
        return
    if not isinstance(module, nn.Linear):
        raise ConfigError(f"tp_plan entry {path!r}: style {style!r} on a {type(module).__name__} is not supported by "
                          "graphrt's transformers backend (linear layers, embeddings and experts modules)")
    if style in ("colwise", "colwise_rep", "colwise_gather_output", "packed_colwise"):
        packed = 2 if style == "packed_colwise" else 1
        for pname in ("weight", "bias"):
            param = module._parameters.get(pname)
            if param is not None and id(param) not in done:
                done.add(id(param))
                _narrow(param, 0, comm, f"{path}.{pname}", packed)
        module.out_features = module.weight.shape[0]
        if style in ("colwise_gather_output", "colwise_rep"):
            if packed > 1:
                raise ConfigError(f"tp_plan entry {path!r}: a gathered packed output is not supported")
            module.register_forward_hook(_post(comm.all_gather_last))
        return
    if style in ("rowwise", "rowwise_split_input", "rowwise_rep"):
        start, cols = comm.slice(module.weight.shape[1], f"{path}.weight columns")
        if id(module.weight) not in done:
            done.add(id(module.weight))
            module.weight.data = module.weight.data.narrow(1, start, cols).contiguous()
        module.in_features = cols
        bias = module._parameters.pop("bias", None)
        module.bias = None
        if bias is not None:
            module.register_buffer("reduced_bias", bias.data, persistent=False)
        if style != "rowwise":
            module.register_forward_pre_hook(lambda m, args: (args[0].narrow(-1, start, cols), *args[1:]))

        def reduce_out(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            out = comm.all_reduce(out)
            extra = getattr(m, "reduced_bias", None)
            return out if extra is None else out + extra
        module.register_forward_hook(reduce_out)
        return
    raise ConfigError(f"tp_plan entry {path!r}: style {style!r} is not supported by graphrt's transformers backend "
                      f"(supported: {sorted(SUPPORTED)})")


def shard_by_plan(model: nn.Module, rank: int, size: int, group: Any = None) -> dict[str, str]:
    """Shard ``model`` (loaded whole) in place for rank ``rank`` of ``size`` by its ``tp_plan``;
    returns what each planned name got. ConfigError naming the entry for a plan graphrt cannot apply
    or a size that does not divide."""
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        raise ConfigError(f"{type(model).__name__} has no tensor-parallel plan (config.base_model_tp_plan is empty): "
                          "graphrt shards transformers models by their own plan; use tensor_parallel_size=1")
    unknown = sorted({s for s in plan.values() if s not in SUPPORTED})
    if unknown:
        raise ConfigError(f"{type(model).__name__}'s tp_plan uses styles {unknown}, which graphrt's transformers "
                          f"backend does not apply (supported: {sorted(SUPPORTED)})")
    comm = _Comm(rank, size, group)
    modules = dict(model.named_modules())
    params = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    done: set[int] = set()
    applied = {}
    for name, style, pattern in plan_matches(plan, list(modules)):
        if name:
            _shard_module(modules[name], style, comm, name, done)
            applied[name] = style
    for name, style, pattern in plan_matches(plan, params):
        owner, _, pname = name.rpartition(".")
        if name not in applied:
            _shard_param(modules[owner], pname, style, comm, name, done)
            applied[name] = style
    return applied


def check_head_shards(full: list[Any], local: list[Any], size: int) -> None:
    """Every attention layer either replicated or split on head boundaries: this rank's query and KV
    heads are the full model's (replicated) or exactly 1/size of them."""
    for f, l in zip(full, local):
        ok = ((l.num_heads, l.num_kv_heads) == (f.num_heads, f.num_kv_heads)
              or (l.num_heads * size, l.num_kv_heads * size) == (f.num_heads, f.num_kv_heads))
        if not ok or (l.head_dim, l.head_dim_v) != (f.head_dim, f.head_dim_v):
            raise ConfigError(f"{f.path}: sharded over {size} ranks it attends with {l.num_heads} query / "
                              f"{l.num_kv_heads} KV heads of {l.head_dim} of the full {f.num_heads} / "
                              f"{f.num_kv_heads} of {f.head_dim}: the plan does not split it on head boundaries")


__all__ = ["REPLICATED", "SUPPORTED", "check_head_shards", "plan_matches", "shard_by_plan", "without_collectives"]
