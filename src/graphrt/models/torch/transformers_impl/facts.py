"""What each attention layer of a transformers model needs from graphrt's paged attention.

:func:`layer_facts` reads them once at load, from the config and one probe forward in which the
attention function answers zeros and records each call: heads and head sizes (this rank's),
``scaling``, ``sliding_window``, ``softcap``, sinks. A layer disagreeing with ``layer_types``, a
mask of the model's own, an unknown keyword, a layer without ``layer_idx`` or called twice is
refused with a :class:`ConfigError` naming the module path.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from graphrt.core.errors import ConfigError
from graphrt.models.torch.transformers_impl.interface import handling

#: Keywords a transformers layer passes that change nothing for a causal paged attention
#: (or that graphrt applies itself: scaling, sliding_window, softcap, s_aux).
HARMLESS_KWARGS = frozenset({"dropout", "scaling", "sliding_window", "softcap", "s_aux", "position_ids",
                             "output_attentions", "use_cache", "cache_position", "position_embeddings",
                             "past_key_values", "past_key_value", "layer_idx", "is_causal", "head_mask",
                             "attention_type", "output_hidden_states", "return_dict"})
#: Keywords that are harmless when None (cross-attention inputs of a decoder used on its own).
NONE_KWARGS = frozenset({"encoder_hidden_states", "encoder_attention_mask", "token_type_ids"})
#: ``layer_types`` entries of full and of sliding-window attention.
FULL_TYPES = frozenset({"full_attention", "global_attention", "attention"})
SLIDING_TYPES = frozenset({"sliding_attention", "local_attention", "sliding_window_attention"})
#: ``layer_types`` entries of layers holding full attention beside a recurrent mixer (Falcon-H1's,
#: Zamba2's ``hybrid``): attention layers where graphrt routes their mixer (``recurrent.py``).
HYBRID_TYPES = frozenset({"hybrid"})
#: ``layer_types`` entries of layers that neither attend nor keep state (Nemotron-H's ``mlp`` / ``moe``).
FEED_FORWARD_TYPES = frozenset({"mlp", "moe"})
#: Attention classes that take their layer from the caller (``layer_idx=-1`` on the module):
#: :func:`number_attention_by_layer` numbers them by the decoder layer holding them.
CALLER_NUMBERED = frozenset({"Zamba2Attention"})
#: Tokens of the probe forward.
PROBE_TOKENS = 5


@dataclass(frozen=True)
class LayerFacts:
    """One attention layer as graphrt's paged attention runs it (this rank's heads)."""

    layer_idx: int
    path: str                 # the transformers module's path, for errors
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    scale: float
    sliding_window: int = 0
    softcap: float = 0.0
    sinks: bool = False


def text_config(config: Any) -> Any:
    """The decoder's own config (a multimodal model's text config, else the config itself)."""
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if callable(getter) else config


def config_windows(config: Any, num_layers: int) -> dict[int, int] | None:
    """Each layer's sliding window by ``layer_types`` (0: full), or None where the config has none."""
    types = getattr(config, "layer_types", None)
    if not types:
        return None
    window = int(getattr(config, "sliding_window", 0) or 0)
    windows = {}
    for i, kind in enumerate(types):
        if kind in SLIDING_TYPES:
            windows[i] = window
        elif kind in FULL_TYPES | HYBRID_TYPES:
            windows[i] = 0
        else:
            windows[i] = -1           # a kind graphrt's attention does not run (chunked, linear, ...)
    return windows


class _Probe:
    """The attention handler of the probe forward: record each call, answer zeros."""

    def __init__(self, paths: dict[int, str]) -> None:
        self.paths = paths
        self.calls: dict[int, dict[str, Any]] = {}

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 mask: Any, kwargs: dict) -> tuple[torch.Tensor, None]:
        path = self.paths.get(id(module), type(module).__name__)
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int):
            raise ConfigError(f"{path} ({type(module).__name__}) has no integer layer_idx: graphrt finds each "
                              "attention layer's KV cache by it")
        if idx in self.calls:
            raise ConfigError(f"{path}: layer_idx {idx} attends twice in one forward (shared or repeated "
                              "layers): each call needs its own KV cache")
        unknown = sorted(k for k in set(kwargs) - HARMLESS_KWARGS if not (k in NONE_KWARGS and kwargs[k] is None))
        if unknown:
            raise ConfigError(f"{path} passes attention keywords graphrt's paged attention does not apply: {unknown}")
        if mask is not None:
            raise ConfigError(f"{path} builds an attention mask of its own ({type(mask).__name__} "
                              f"{tuple(getattr(mask, 'shape', ()))}): graphrt's paged attention applies causal "
                              "masks and sliding windows only")
        if kwargs.get("is_causal", True) is False or getattr(module, "is_causal", True) is False:
            raise ConfigError(f"{path} attends bidirectionally (is_causal=False): graphrt's paged attention is causal")
        if query.dim() != 4 or query.shape[0] != 1 or key.shape[-1] != query.shape[-1]:
            raise ConfigError(f"{path}: query {tuple(query.shape)} / key {tuple(key.shape)} are not "
                              "[1, heads, tokens, head_dim] with one head size")
        heads, kv_heads = int(query.shape[1]), int(key.shape[1])
        if kv_heads == 0 or heads % kv_heads:
            raise ConfigError(f"{path}: {heads} query heads are not a multiple of {kv_heads} KV heads")
        scaling = kwargs.get("scaling", getattr(module, "scaling", None))
        sinks = kwargs.get("s_aux")
        self.calls[idx] = dict(path=path, heads=heads, kv_heads=kv_heads, head_dim=int(query.shape[-1]),
                               head_dim_v=int(value.shape[-1]),
                               scale=float(scaling) if scaling is not None else query.shape[-1] ** -0.5,
                               window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"),
                               sinks=sinks is not None)
        t = query.shape[2]
        return query.new_zeros(1, t, heads, int(value.shape[-1])), None


def layer_of_path(path: str) -> int | None:
    """The decoder layer index in a module path (``model.layers.3.mamba`` -> 3), or None."""
    parts = path.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def number_attention_by_layer(hf_model: torch.nn.Module) -> list[str]:
    """Give each attention module of :data:`CALLER_NUMBERED` the index of the decoder layer that
    holds it as its ``layer_idx`` (graphrt keys a layer's KV cache by it); the paths patched.

    Zamba2's shared attention blocks (one block's weights used by several layers, each layer an
    instance of its own over the tied parameters) say ``layer_idx=-1`` and take the layer from their
    caller; numbered by their layer, each use gets a KV cache of its own. A module that is truly one
    object in several layers is numbered once and then refused by the probe (it attends twice)."""
    patched = []
    for path, module in hf_model.named_modules():
        if type(module).__name__ in CALLER_NUMBERED:
            layer = layer_of_path(path)
            if layer is None:
                raise ConfigError(f"{path} ({type(module).__name__}) takes its layer from its caller, and graphrt "
                                  "cannot tell its decoder layer (no 'layers.<i>' in its path) to key its KV cache by")
            module.layer_idx = layer
            patched.append(path)
    return patched


def module_paths(model: torch.nn.Module) -> dict[int, str]:
    """``id(module) -> its qualified name`` for every submodule of ``model``."""
    return {id(m): name or type(m).__name__ for name, m in model.named_modules()}


def innermost_module(exc: BaseException, paths: dict[int, str]) -> str | None:
    """Where in a model ``exc`` was raised: the innermost module of ``paths`` whose method its
    traceback passes through (``"path (Class)"``) and the innermost line of transformers' code
    (``"at modeling_x.py:N"``)."""
    found = line = None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in paths:
            found = f"{paths[id(owner)]} ({type(owner).__name__})"
        if f"{os.sep}transformers{os.sep}" in frame.f_code.co_filename:
            line = f"{os.path.basename(frame.f_code.co_filename)}:{tb.tb_lineno}"
        tb = tb.tb_next
    if found is None:
        return None
    return found if line is None else f"{found} at {line}"


def layer_facts(hf_model: torch.nn.Module, base: torch.nn.Module,
                recurrent: frozenset[str] = frozenset()) -> list[LayerFacts]:
    """Probe ``base`` (the decoder body of ``hf_model``) once and return its attention layers in
    ``layer_idx`` order, checked against the config (module docstring). ``recurrent``: the
    ``layer_types`` kinds of recurrent layers whose mixers graphrt routes (``recurrent.py``, a
    ``hybrid`` kind among them where those layers attend too); any other kind that is not
    attention or a feed-forward layer is refused."""
    config = text_config(hf_model.config)
    probe = _Probe(module_paths(hf_model))
    device = next(hf_model.parameters()).device
    vocab = int(config.vocab_size)
    ids = (torch.arange(PROBE_TOKENS, device=device) * 7 + 3) % vocab
    runs = FULL_TYPES | SLIDING_TYPES | FEED_FORWARD_TYPES | recurrent
    kinds = sorted({k for k in (getattr(config, "layer_types", None) or ()) if k not in runs})
    if kinds:
        raise ConfigError(f"{type(hf_model).__name__}: layer_types has {kinds} layers, which graphrt's paged attention "
                          "does not run (it runs full and sliding-window causal attention, and routes the recurrent "
                          "mixers of docs/hybrid.md to its own kernels; other recurrent, convolutional, chunked and "
                          "sparse layers are not this backend's)")
    try:
        with torch.no_grad(), handling(probe):
            base(input_ids=ids[None], position_ids=torch.arange(PROBE_TOKENS, device=device)[None], use_cache=False)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - named with the module it came from
        where = innermost_module(exc, probe.paths)
        raise ConfigError(f"{type(hf_model).__name__} cannot run on one packed row without transformers' own cache "
                          f"and mask: {type(exc).__name__}: {exc}" + (f" [in {where}]" if where else "")) from exc
    if not probe.calls and recurrent:
        return []                       # every layer recurrent: no KV cache
    if not probe.calls:
        raise ConfigError(f"{type(hf_model).__name__} never called its attention implementation: its attention "
                          "does not go through transformers' AttentionInterface")
    windows = config_windows(config, len(probe.calls))
    facts = []
    for idx in sorted(probe.calls):
        call = probe.calls[idx]
        window = _window(call, windows, idx)
        softcap = float(call["softcap"] or 0.0)
        if softcap < 0 or not math.isfinite(softcap) or not math.isfinite(call["scale"]):
            raise ConfigError(f"{call['path']}: softcap {call['softcap']} / scaling {call['scale']} must be finite")
        facts.append(LayerFacts(idx, call["path"], call["heads"], call["kv_heads"], call["head_dim"],
                                call["head_dim_v"], call["scale"], window, softcap, call["sinks"]))
    return facts


def position_offset(hf_model: torch.nn.Module, base: torch.nn.Module) -> int:
    """What to add to graphrt's positions to get the ``position_ids`` the model gives itself: 0
    for most, ``padding_idx + 1`` for RoBERTa-like embeddings; read from probe forwards. A model
    whose positions are no offset of graphrt's is refused (ConfigError)."""
    config = text_config(hf_model.config)
    device = next(hf_model.parameters()).device
    pad = getattr(config, "pad_token_id", None)
    ids = (torch.arange(PROBE_TOKENS, device=device) * 7 + 3) % int(config.vocab_size)
    if isinstance(pad, int):
        ids = torch.where(ids == pad, (ids + 1) % int(config.vocab_size), ids)
    probe = _Probe(module_paths(hf_model))

    def run(positions: torch.Tensor | None) -> torch.Tensor:
        probe.calls.clear()
        with torch.no_grad(), handling(probe):
            out = base(input_ids=ids[None], position_ids=positions, use_cache=False)
        return out[0] if isinstance(out, tuple) else out.last_hidden_state

    own = run(None)
    candidates = [0, 1, 2] + ([pad + 1] if isinstance(pad, int) and pad + 1 > 2 else [])
    for offset in candidates:
        if _same(run(torch.arange(PROBE_TOKENS, device=device)[None] + offset), own):
            return offset
    raise ConfigError(f"{type(hf_model).__name__} numbers positions its own way (position_ids=None is no offset of "
                      f"0, 1, 2 ... among {candidates}): graphrt gives each token its position in its request")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN where the other is NaN (a model with NaN weights probes as any other;
    its loader has named them)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


def _window(call: dict[str, Any], windows: dict[int, int] | None, idx: int) -> int:
    """The layer's sliding window: the one it passes, which ``layer_types`` must agree with."""
    passed = int(call["window"] or 0)
    if windows is None:
        return passed
    declared = windows.get(idx)
    if declared == -1:
        raise ConfigError(f"{call['path']}: layer_types[{idx}] is an attention kind graphrt's paged attention "
                          "does not run (full or sliding-window causal attention only)")
    if declared is None:
        return passed
    if passed and passed != declared:
        raise ConfigError(f"{call['path']} passes sliding_window={passed}, but layer_types / sliding_window "
                          f"of the config say {declared or 'full attention'}")
    return declared


__all__ = ["CALLER_NUMBERED", "FEED_FORWARD_TYPES", "FULL_TYPES", "HARMLESS_KWARGS", "HYBRID_TYPES", "LayerFacts",
           "SLIDING_TYPES", "config_windows", "innermost_module", "layer_facts", "layer_of_path", "module_paths",
           "number_attention_by_layer", "position_offset", "text_config"]
