"""A transformers causal LM as a graphrt torch model (docs/models.md's protocol).

:class:`TransformersForCausalLM` wraps a loaded ``*ForCausalLM`` whose config routes attention to
graphrt (``interface.py``): ``forward`` runs the decoder body on one packed row, each attention
call reaching its call site's :class:`HFPagedAttention` (one per call, by order: facts.py);
``compute_logits`` runs the model's own head over a stand-in body, so soft-capping and logit
scales are transformers' own. A known capture
blocker (``graph_blocker``) raises :class:`GraphCaptureError` when a capture reaches the forward;
other capture failures are re-raised naming the module they came from.
See docs/transformers-models.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from graphrt.core.errors import ConfigError, GraphCaptureError
from graphrt.core.graph_tasks import capture_active
from graphrt.core.kv_spec import KVCacheGroup, KVCacheSpec
from graphrt.core.state_spec import StateSpec
from graphrt.models.torch.transformers_impl.experts import unrouted_note
from graphrt.models.torch.transformers_impl.facts import LayerFacts, innermost_module, module_paths, text_config
from graphrt.models.torch.transformers_impl.indexer import passed_index
from graphrt.models.torch.transformers_impl.interface import handling
from graphrt.layers.torch.attention.sparse import IndexedPagedBackend
from graphrt.models.torch.transformers_impl.layer import HFPagedAttention, ReferencePagedBackend
from graphrt.models.torch.transformers_impl.recurrent import RoutedMixer, state_spec_of


class _BodyOutput:
    """What the stand-in body returns: ``last_hidden_state`` (also item 0); all else None."""

    def __init__(self, hidden: torch.Tensor | None) -> None:
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None

    def __getitem__(self, key: Any) -> Any:
        if key in (0, "last_hidden_state"):
            return self.last_hidden_state
        if isinstance(key, slice):
            return (self.last_hidden_state,)[key]
        return None

    def to_tuple(self) -> tuple[torch.Tensor | None]:
        return (self.last_hidden_state,)


class _Body(nn.Module):
    """Stands in for the decoder body while the model's head runs: any call of it, or of any of
    its attributes (``self.model.decoder(...)``), returns the given hidden states; a number the
    real ``body`` holds (Falcon-H1's ``lm_head_multiplier``, read by its head) is the body's."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None
        self._numbers = {k: v for k, v in vars(body).items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith("_")}

    def forward(self, *args: Any, **kwargs: Any) -> _BodyOutput:
        return _BodyOutput(self.hidden)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
            numbers = self.__dict__["_numbers"]
            return numbers[name] if name in numbers else self


class _CallSites:
    """The attention handler of one forward: its ``i``-th attention call to the ``i``-th call
    site's paged attention (each site its own KV cache, facts.py), checked to come from the
    module the probe saw there. One per forward, so forwards on two threads count apart."""

    def __init__(self, sites: tuple[tuple[int, str, HFPagedAttention], ...]) -> None:
        self.sites = sites
        self.next = 0

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 mask: Any, kwargs: dict) -> tuple[torch.Tensor, None]:
        i = self.next
        if i >= len(self.sites) or self.sites[i][0] != id(module):
            want = self.sites[i][1] if i < len(self.sites) else "no call"
            raise ConfigError(f"attention call {i} of this forward came from another module than at load ({want}): "
                              "graphrt keys each call's KV cache by its order within the forward, which must "
                              "not change from step to step")
        self.next = i + 1
        layer = self.sites[i][2]
        t = query.shape[2]
        q = query[0].transpose(0, 1).reshape(t, -1)
        k = key[0].transpose(0, 1).reshape(t, -1)
        v = value[0].transpose(0, 1).reshape(t, -1)
        if layer.index_head_size or layer.index_from >= 0:
            out = layer(q, k, v, kwargs.get("s_aux") if layer.sinks else None, index=passed_index(kwargs))
        else:
            out = layer(q, k, v, kwargs.get("s_aux")) if layer.sinks else layer(q, k, v)
        return out.view(1, t, layer.num_heads, layer.head_dim_v), None


@dataclass(frozen=True)
class RuntimeConfig:
    """What graphrt's runner reads of a model's ``config``, from the transformers config ``hf``;
    ``intermediate_size``: the widest layer's; ``eos_token_id``: generation config's, else hf's."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    max_position_embeddings: int | None
    eos_token_id: Any
    model_type: str
    hf: Any

    @classmethod
    def of(cls, hf_model: nn.Module) -> "RuntimeConfig":
        config = text_config(hf_model.config)
        width = getattr(config, "intermediate_size", 0) or 0
        width = max(width) if isinstance(width, (list, tuple)) else width
        generation = getattr(hf_model, "generation_config", None)
        eos = getattr(generation, "eos_token_id", None)
        if eos is None:
            eos = getattr(config, "eos_token_id", None)
        return cls(int(config.vocab_size), int(config.hidden_size), int(width), int(config.num_hidden_layers),
                   getattr(config, "max_position_embeddings", None), eos, str(config.model_type), config)


def body_name(hf_model: nn.Module) -> str:
    """The attribute of ``hf_model`` holding its decoder body: ``base_model_prefix`` where that is
    a child, else its one child that is a transformers model."""
    prefix = getattr(hf_model, "base_model_prefix", "")
    if isinstance(hf_model._modules.get(prefix), nn.Module):
        return prefix
    from transformers import PreTrainedModel

    names = [n for n, child in hf_model.named_children() if isinstance(child, PreTrainedModel)]
    if len(names) != 1:
        raise ConfigError(f"{type(hf_model).__name__}: cannot tell its decoder body (base_model_prefix "
                          f"{prefix!r} is no child; transformers children: {names})")
    return names[0]


def body_of(hf_model: nn.Module) -> nn.Module:
    """``hf_model``'s decoder body (the child :func:`body_name` names)."""
    return hf_model.get_submodule(body_name(hf_model))


class TransformersForCausalLM(nn.Module):
    """A transformers ``*ForCausalLM`` under graphrt's runner (module docstring).

    ``hf_model``: loaded with ``attn_implementation="graphrt"``; ``facts``: its layers;
    ``graph_blocker``: why no graph can hold its forward, or None; ``tp_rank`` / ``tp_size``: this
    rank's shard; ``routed``: the recurrent mixers routed into ``hf_model``, in layer order."""

    #: Which implementation this is (``models/model_impl.py``): tensor-parallel ranks load the same.
    model_impl = "transformers"

    def __init__(self, hf_model: nn.Module, facts: list[LayerFacts], graph_blocker: str | None = None,
                 tp_rank: int = 0, tp_size: int = 1, position_offset: int = 0,
                 routed: list[RoutedMixer] | None = None) -> None:
        super().__init__()
        self.hf = hf_model
        self.config = RuntimeConfig.of(hf_model)
        self.facts = tuple(facts)
        self.graph_blocker = graph_blocker
        self.tp_rank, self.tp_size = tp_rank, tp_size
        #: Added to graphrt's positions: the ``position_ids`` the model numbers tokens with (facts.py).
        self.position_offset = int(position_offset)
        self.paged = nn.ModuleList(HFPagedAttention(f.num_heads, f.num_kv_heads, f.head_dim, f.scale,
                                                    f.sliding_window, f.softcap, f.sinks, f.head_dim_v,
                                                    f.attention_chunk, f.temperature, f.index, f.index_from,
                                                    f.index_block)
                                   for f in facts)
        for layer in self.paged:
            if layer.index_from >= 0:          # indexer_types "shared": the earlier call site's selection
                layer.share_selection_of(self.paged[layer.index_from])
        self._sites = tuple((f.module_id, f.path, layer) for f, layer in zip(facts, self.paged))
        self._body_name = body_name(hf_model)
        self._stand_in = _Body(hf_model._modules[self._body_name])
        if any(layer.index_head_size or layer.index_from >= 0 for layer in self.paged):
            #: DSA: indexed layers run graphrt's sparse kernel, the others the extended reference one
            self.attention_backend = IndexedPagedBackend(facts[0].head_dim)
        elif any(layer.extended for layer in self.paged):
            #: soft-capping, sinks or a V head size of its own: graphrt's reference algorithm, extended
            self.attention_backend = ReferencePagedBackend(facts[0].head_dim)
        self._paths: dict[int, str] | None = None
        self._routed = tuple(routed or ())      # submodules of hf_model already: not registered twice

    @property
    def body(self) -> nn.Module:
        """The decoder body (``hf_model.model`` / ``.transformer`` / ...): embeddings, layers, norm."""
        return self.hf._modules[self._body_name]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` -> hidden ``[T, hidden]``; metadata from the forward context."""
        if isinstance(input_ids, torch.fx.Proxy):
            raise TypeError("a transformers model is not traced with torch.fx (its forward branches on Python "
                            "values); its PIECEWISE graphs are captured breaking at each attention call")
        if self.graph_blocker is not None and capture_active():
            raise GraphCaptureError(self.graph_blocker)
        try:
            with handling(_CallSites(self._sites)):
                position_ids = positions[None].long()
                if self.position_offset:
                    position_ids = position_ids + self.position_offset
                out = self.body(input_ids=input_ids[None].long(), position_ids=position_ids, use_cache=False)
        except GraphCaptureError as exc:
            where = self._where(exc)
            if where is None:
                raise
            raise GraphCaptureError(f"{exc} [in {where}]{unrouted_note(where)}") from exc
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        return hidden[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden]`` -> float32 logits ``[N, vocab]``: the model's own head over ``hidden``."""
        body = self.hf._modules[self._body_name]
        self._stand_in.hidden = hidden[None]
        self.hf._modules[self._body_name] = self._stand_in
        try:
            ids = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
            out = self.hf(input_ids=ids, use_cache=False)
        finally:
            self.hf._modules[self._body_name] = body
            self._stand_in.hidden = None
        return out.logits[0].float()

    def attention_layers(self) -> list[HFPagedAttention]:
        """graphrt's paged layer of each attention call site, in call order (facts.py)."""
        return list(self.paged)

    def kv_cache_spec(self) -> KVCacheSpec:
        """One group per KV layout (heads, K / V head sizes, sliding window, attention chunk), this
        rank's heads."""
        groups: dict[tuple[int, int, int, int, int], list[int]] = {}
        for i, f in enumerate(self.facts):
            key = (f.num_kv_heads, f.head_dim, f.head_dim_v, f.sliding_window, f.attention_chunk,
                   f.index[1] if f.index else 0)
            groups.setdefault(key, []).append(i)
        return KVCacheSpec(tuple(KVCacheGroup(tuple(layers), heads, d, None if dv == d else dv, sliding_window=w,
                                              attention_chunk=c, index_head_size=di)
                                 for (heads, d, dv, w, c, di), layers in groups.items()))

    def state_layers(self) -> list[nn.Module]:
        """graphrt's module of each routed recurrent mixer, in layer order (each gets ``state_cache``)."""
        return [wrapper.mixer for wrapper in self._routed]

    def state_spec(self) -> StateSpec:
        """The routed mixers' per-request states (empty for a model without recurrent layers)."""
        return state_spec_of(list(self._routed))

    def _where(self, exc: BaseException) -> str | None:
        """The innermost transformers module whose method the traceback of ``exc`` passes through."""
        if self._paths is None:
            self._paths = module_paths(self.hf)
        return innermost_module(exc, self._paths)


__all__ = ["RuntimeConfig", "TransformersForCausalLM", "body_name"]
