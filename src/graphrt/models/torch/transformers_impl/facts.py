"""What each attention layer of a transformers model needs from graphrt's paged attention.

:func:`layer_facts` reads them once at load, from the config and one probe forward in which the
attention function answers zeros and records each call: heads and head sizes (this rank's),
``scaling``, ``sliding_window``, ``softcap``, sinks; the config adds each ``chunked_attention``
layer's chunk (``attention_chunk_size``, Llama 4) and a NoPE layer's query temperature (Llama 4's
``attn_temperature_tuning``, which graphrt applies from each token's own position); a DSA layer's
indexer (``indexer.py``). Each *call* is a call site with a KV cache of its own, keyed by its
order within the forward: a module that attends twice (differential attention, a block shared by
several layers, a stack run in loops) gets one per call. A mask the model builds itself is read
(:func:`mask_window_of`): causal, with or without a sliding window, runs; any other is refused
naming what it does. A layer disagreeing with ``layer_types``, an unknown keyword or a layer
without ``layer_idx`` is refused with a :class:`ConfigError` naming the module path.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from graphrt.core.errors import ConfigError
from graphrt.layers.torch.attention.sparse import BlockIndexerInputs, IndexerInputs
from graphrt.models.torch.transformers_impl.indexer import (INDEX_KWARGS, MASK_PLACEHOLDER, index_blocks, index_facts,
                                                            passed_index, route_indexers)
from graphrt.models.torch.transformers_impl.interface import handling

#: Keywords a transformers layer passes that change nothing for a causal paged attention
#: (or that graphrt applies itself: scaling, sliding_window, softcap, s_aux).
HARMLESS_KWARGS = frozenset({"dropout", "scaling", "sliding_window", "softcap", "s_aux", "position_ids",
                             "output_attentions", "use_cache", "cache_position", "position_embeddings",
                             "past_key_values", "past_key_value", "layer_idx", "is_causal", "head_mask",
                             "attention_type", "output_hidden_states", "return_dict"})
#: Keywords that are harmless when None (cross-attention inputs of a decoder used on its own).
NONE_KWARGS = frozenset({"encoder_hidden_states", "encoder_attention_mask", "token_type_ids",
                         "block_indices"})     # MiniMax-M3's dense layers pass no block selection
#: ``layer_types`` entries of full and of sliding-window attention.
FULL_TYPES = frozenset({"full_attention", "global_attention", "attention"})
SLIDING_TYPES = frozenset({"sliding_attention", "local_attention", "sliding_window_attention"})
#: ``layer_types`` entries of chunked local attention (a token sees its own chunk of the positions).
CHUNKED_TYPES = frozenset({"chunked_attention"})
#: ``layer_types`` entries of indexed sparse attention (DSA; MiniMax-M3's block-sparse layers),
#: served where the indexers are routed.
INDEXED_TYPES = frozenset({"indexed_attention", "minimax_m3_sparse"})
#: Where :func:`own_temperature` keeps a module's query temperature it turned off.
TEMPERATURE_ATTR = "_graphrt_temperature"
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


def _csa(m: torch.nn.Module) -> str:
    return (f"compressed sparse attention, which needs a cache graphrt's KV spec has no kind for: compressed KV "
            f"entries, one per {m.compress_rate} tokens (a softmax-gated sum over an overlapping window of "
            f"{2 * m.compress_rate} tokens, RoPE at the window's position), written by a compressor kernel when a "
            "request's window closes, with per-request compressor state (the open window's tokens, the previous "
            "window's half); a lightning indexer over its own compressed keys with a device top-k "
            f"({m.indexer.index_topk}) of the entries; and a kernel attending over the sliding window's raw keys "
            "plus the selected entries, with sinks")


def _hca(m: torch.nn.Module) -> str:
    return (f"heavily compressed attention, which needs a cache graphrt's KV spec has no kind for: compressed KV "
            f"entries, one per {m.compress_rate} tokens (a softmax-gated sum over each non-overlapping window), "
            "written by a compressor kernel when a request's window closes, with per-request compressor state (the "
            "open window's tokens); and a kernel attending over the sliding window's raw keys plus every compressed "
            "entry before the token, with sinks")


def _cca(m: torch.nn.Module) -> str:
    return ("compressed convolutional attention (CCA), which needs a per-request state kind graphrt's state seam "
            f"lacks: the last {m.conv_kernel_size} rows of the concatenated q|k projections (a depthwise causal "
            f"convolution of {m.depthwise_kernel_size} taps, then a grouped one of {m.grouped_kernel_size} taps "
            "mixing each head's channels) and the previous token's delayed value projection (half of each value "
            "head is the previous token's); and a kernel running both convolutions and the one-token delay over "
            "packed ragged steps (reset at position 0) before the paged attention")


#: Stock attention-side classes of layer kinds graphrt does not run -> what it lacks for them
#: (named in the refusal: a missing kernel or cache kind, not a missing route).
MISSING_ATTENTION_KERNELS = {"DeepseekV4CSACompressor": _csa, "DeepseekV4HCACompressor": _hca,
                             "ZayaCCAProjection": _cca}


@dataclass(frozen=True)
class LayerFacts:
    """One attention call site as graphrt's paged attention runs it (this rank's heads):
    ``layer_idx`` is the module's; ``call``: the site's order within the forward (its KV cache)."""

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
    call: int = 0
    module_id: int = 0        # id() of the calling module: each forward's calls are checked against it

    attention_chunk: int = 0
    #: Llama 4's NoPE-layer query temperature ``(floor_scale, attn_scale)``, or None.
    temperature: tuple[float, float] | None = None
    #: A DSA layer's indexer ``(heads, head size, top-k, score scale)`` (indexer.py), or None.
    index: tuple[int, int, int, float] | None = None
    #: A DSA layer without an indexer (``indexer_types`` "shared"): the call site whose selection
    #: of the step it reuses (the one whose indexer inputs the model handed it), else -1.
    index_from: int = -1
    #: A block indexer's ``(block size, local blocks)`` (MiniMax-M3: ``index`` counts blocks), else (0, 0).
    index_block: tuple[int, int] = (0, 0)


def mask_window_of(path: str, mask: Any, tokens: int) -> int | None:
    """The sliding window a mask the model built itself (the probe's ``tokens`` queries and keys)
    shows: None for a causal mask (no window visible), ``w`` for causal plus a window of ``w``.
    Any other mask is a ConfigError naming what it does that graphrt's paged attention cannot:
    a bias added to the scores, keys after the query, per-head masks, chunks, other patterns."""
    head = (f"{path} builds an attention mask of its own ({type(mask).__name__} "
            f"{tuple(getattr(mask, 'shape', ()))})")
    tail = "; graphrt's paged attention applies causal masks with or without a sliding window only"
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or tuple(mask.shape[-2:]) != (tokens, tokens):
        raise ConfigError(f"{head} that is no [.., queries, keys] tensor graphrt can read{tail}")
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        if bool(((mask != 0) & ~blocked).any()):
            raise ConfigError(f"{head}, adding a bias to the scores: values other than 0 and -inf where it lets a "
                              f"query see a key (a learned or dynamic per-key bias, not a mask){tail}")
        allowed = ~blocked
    allowed = allowed.reshape(-1, tokens, tokens)
    if bool((allowed != allowed[:1]).any()):
        raise ConfigError(f"{head}, differing between heads or rows of the batch{tail}")
    allowed = allowed[0].cpu()
    pos = torch.arange(tokens)
    causal = pos[None, :] <= pos[:, None]
    if bool((allowed & ~causal).any()):
        raise ConfigError(f"{head} that lets queries see later keys (not causal){tail}")
    if bool(torch.equal(allowed, causal)):
        return None
    distance = pos[:, None] - pos[None, :]
    for window in range(1, tokens):
        if torch.equal(allowed, causal & (distance < window)):
            return window
    for chunk in range(1, tokens):
        if torch.equal(allowed, causal & ((pos[:, None] // chunk) == (pos[None, :] // chunk))):
            raise ConfigError(f"{head}: chunked attention, chunks of {chunk} tokens (a query sees only the keys of "
                              f"its own chunk){tail}")
    raise ConfigError(f"{head} that hides keys a causal mask shows, in no sliding-window pattern{tail}")


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
        elif kind in FULL_TYPES or kind in HYBRID_TYPES or kind in CHUNKED_TYPES or kind in INDEXED_TYPES:
            windows[i] = 0
        else:
            windows[i] = -1           # a kind graphrt's attention does not run (chunked, linear, ...)
    return windows


def config_chunks(config: Any) -> dict[int, int]:
    """Each ``chunked_attention`` layer's chunk (``attention_chunk_size``); a chunked layer
    without a positive chunk is a ConfigError naming the field."""
    types = getattr(config, "layer_types", None) or ()
    chunked = [i for i, kind in enumerate(types) if kind in CHUNKED_TYPES]
    if not chunked:
        return {}
    chunk = getattr(config, "attention_chunk_size", None)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
        raise ConfigError(f"attention_chunk_size: {chunk!r}, but layer_types has chunked_attention layers "
                          f"{chunked}; it must be a positive int")
    return {i: chunk for i in chunked}


def temperature_of(module: torch.nn.Module) -> tuple[float, float] | None:
    """Llama 4's query temperature of a NoPE layer (``attn_temperature_tuning`` and not
    ``use_rope``): ``(floor_scale, attn_scale)``, else None. transformers computes it from
    ``arange(tokens)`` plus its own cache's length, which on graphrt's packed row is not each
    token's position: graphrt turns it off on the module and applies it itself."""
    own = getattr(module, TEMPERATURE_ATTR, None)
    if own is not None:                                   # turned off by graphrt already (own_temperature)
        return own
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return None
    return float(module.floor_scale), float(module.attn_scale)


def own_temperature(hf_model: torch.nn.Module, facts: list[LayerFacts]) -> list[str]:
    """Turn transformers' query temperature off on each layer whose facts carry one (graphrt's
    :class:`~graphrt.models.torch.transformers_impl.layer.HFPagedAttention` applies it per token
    position instead); the module paths patched."""
    patched = []
    for f in facts:
        if f.temperature is not None:
            module = hf_model.get_submodule(f.path)
            setattr(module, TEMPERATURE_ATTR, f.temperature)
            module.attn_temperature_tuning = False
            patched.append(f.path)
    return patched


def _is_placeholder(mask: Any) -> bool:
    """Whether ``mask`` is the DSA placeholder (indexer.py) or a slice of it: it holds nothing."""
    return mask is MASK_PLACEHOLDER or (isinstance(mask, torch.Tensor) and mask.device == MASK_PLACEHOLDER.device
                                        and mask.untyped_storage().data_ptr()
                                        == MASK_PLACEHOLDER.untyped_storage().data_ptr())


class _Probe:
    """The attention handler of the probe forward: record each call, answer zeros."""

    def __init__(self, paths: dict[int, str]) -> None:
        self.paths = paths
        self.calls: list[dict[str, Any]] = []          # in call order: one per call site

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 mask: Any, kwargs: dict) -> tuple[torch.Tensor, None]:
        path = self.paths.get(id(module), type(module).__name__)
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int):
            raise ConfigError(f"{path} ({type(module).__name__}) has no integer layer_idx: graphrt finds each "
                              "attention layer's KV cache by it")
        index = index_facts(module, kwargs)
        index_from = self._selection_source(path, module, passed_index(kwargs)) if index is None else -1
        unknown = sorted(k for k in set(kwargs) - HARMLESS_KWARGS if not (k in NONE_KWARGS and kwargs[k] is None)
                         and not (k in INDEX_KWARGS and (index is not None or index_from >= 0)))
        if unknown:
            raise ConfigError(f"{path} passes attention keywords graphrt's paged attention does not apply: {unknown}")
        # A DSA layer's placeholder mask (indexer.py) is graphrt's own, not the model's.
        own_mask = mask is not None and not (index is not None and _is_placeholder(mask))
        mask_window = mask_window_of(path, mask, int(query.shape[2])) if own_mask else None
        if kwargs.get("is_causal", True) is False or getattr(module, "is_causal", True) is False:
            raise ConfigError(f"{path} attends bidirectionally (is_causal=False): graphrt's paged attention is causal")
        if query.dim() != 4 or query.shape[0] != 1 or key.shape[-1] != query.shape[-1]:
            raise ConfigError(f"{path}: query {tuple(query.shape)} / key {tuple(key.shape)} are not "
                              "[1, heads, tokens, head_dim] with one head size")
        heads, kv_heads = int(query.shape[1]), int(key.shape[1])
        if kv_heads == 0 or heads % kv_heads:
            raise ConfigError(f"{path}: {heads} query heads are not a multiple of {kv_heads} KV heads")
        if isinstance(passed_index(kwargs), BlockIndexerInputs) and index is not None and index[0] != kv_heads:
            raise ConfigError(f"{path}: its block indexer has {index[0]} heads for {kv_heads} KV heads; graphrt's "
                              "block-sparse attention selects per KV head (index_n_heads = num_key_value_heads)")
        scaling = kwargs.get("scaling", getattr(module, "scaling", None))
        sinks = kwargs.get("s_aux")
        self.calls.append(dict(layer_idx=idx, module_id=id(module), path=path, heads=heads, kv_heads=kv_heads, head_dim=int(query.shape[-1]),
                               head_dim_v=int(value.shape[-1]),
                               scale=float(scaling) if scaling is not None else query.shape[-1] ** -0.5,
                               window=kwargs.get("sliding_window") or mask_window, softcap=kwargs.get("softcap"),
                               sinks=sinks is not None, temperature=temperature_of(module), index=index,
                               index_from=index_from, index_block=index_blocks(module) if index else (0, 0),
                               indices=passed_index(kwargs) if index is not None else None))
        t = query.shape[2]
        return query.new_zeros(1, t, heads, int(value.shape[-1])), None

    def _selection_source(self, path: str, module: torch.nn.Module, indices: Any) -> int:
        """The call site whose indexer inputs a layer without an indexer of its own was handed
        (the earlier layer's selection it reuses), or -1 where it was handed none."""
        if not isinstance(indices, (IndexerInputs, BlockIndexerInputs)) or getattr(module, "indexer", True) is not None:
            return -1
        for site in range(len(self.calls) - 1, -1, -1):
            if self.calls[site]["indices"] is indices:
                return site
        raise ConfigError(f"{path} reuses a top-k selection (indexer_types 'shared') whose indexer graphrt did not "
                          "see called earlier in the forward")


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
    object in several layers has no one layer to be numbered by: refused naming its paths."""
    patched: list[str] = []
    seen: dict[int, str] = {}
    for path, module in hf_model.named_modules(remove_duplicate=False):
        if type(module).__name__ in CALLER_NUMBERED:
            if id(module) in seen:
                raise ConfigError(f"{seen[id(module)]} and {path} are one {type(module).__name__} object in two decoder "
                                  "layers, and it takes its layer from its caller: graphrt numbers such a module by the "
                                  "layer holding it; give each layer an instance of its own (over tied weights, as "
                                  "transformers builds Zamba2)")
            seen[id(module)] = path
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
    """Probe ``base`` (the decoder body of ``hf_model``) once and return its attention call sites
    in call order, checked against the config (module docstring). ``recurrent``: the
    ``layer_types`` kinds of recurrent layers whose mixers graphrt routes (``recurrent.py``, a
    ``hybrid`` kind among them where those layers attend too); any other kind that is not
    attention or a feed-forward layer is refused."""
    config = text_config(hf_model.config)
    probe = _Probe(module_paths(hf_model))
    device = next(hf_model.parameters()).device
    vocab = int(config.vocab_size)
    ids = (torch.arange(PROBE_TOKENS, device=device) * 7 + 3) % vocab
    indexed = INDEXED_TYPES if route_indexers(hf_model) else frozenset()
    served = FULL_TYPES | SLIDING_TYPES | CHUNKED_TYPES | FEED_FORWARD_TYPES | indexed | recurrent
    kinds = sorted({k for k in (getattr(config, "layer_types", None) or ()) if k not in served})
    if kinds:
        lacking = _lacking(hf_model, config, kinds)
        if lacking:
            raise ConfigError(f"{type(hf_model).__name__}: layer_types has {kinds} layers, for which graphrt lacks "
                              f"a kernel: {lacking}")
        raise ConfigError(f"{type(hf_model).__name__}: layer_types has {kinds} layers, which graphrt's paged attention "
                          "does not run (it runs full, sliding-window and chunked causal attention, and routes the "
                          "recurrent mixers of docs/hybrid.md to its own kernels; other recurrent, convolutional and "
                          "sparse layers are not this backend's)")
    chunks = config_chunks(config)
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
    _refuse_shared_past(config)
    windows = config_windows(config, len(probe.calls))
    facts = []
    for site, call in enumerate(probe.calls):
        idx = call["layer_idx"]
        window = _window(call, windows, idx)
        kinds = getattr(config, "layer_types", None) or ()
        if idx < len(kinds) and kinds[idx] in INDEXED_TYPES and call["index"] is None and call["index_from"] < 0:
            raise ConfigError(f"{call['path']}: layer_types[{idx}] is indexed_attention, but its attention call "
                              "carries no routed indexer's inputs (transformers_impl/indexer.py)")
        if (call["index"] is not None or call["index_from"] >= 0) and (window or chunks.get(idx, 0)):
            raise ConfigError(f"{call['path']}: an indexed sparse attention layer with a sliding window or chunk "
                              f"({window or chunks[idx]}); graphrt's sparse kernel selects over causal context only")
        softcap = float(call["softcap"] or 0.0)
        if softcap < 0 or not math.isfinite(softcap) or not math.isfinite(call["scale"]):
            raise ConfigError(f"{call['path']}: softcap {call['softcap']} / scaling {call['scale']} must be finite")
        facts.append(LayerFacts(idx, call["path"], call["heads"], call["kv_heads"], call["head_dim"],
                                call["head_dim_v"], call["scale"], window, softcap, call["sinks"], site,
                                call["module_id"], attention_chunk=chunks.get(idx, 0),
                                temperature=call["temperature"], index=call["index"],
                                index_from=call["index_from"], index_block=call["index_block"]))
    return facts


def _lacking(hf_model: torch.nn.Module, config: Any, kinds: list[str]) -> str:
    """What graphrt lacks for the layers of ``kinds`` (:data:`MISSING_ATTENTION_KERNELS`, the first
    such module of each class), '; '-joined; '' when it knows none."""
    types = getattr(config, "layer_types", None) or ()
    found: dict[str, str] = {}
    for name, module in hf_model.named_modules():
        cls = type(module).__name__
        layer = layer_of_path(name)
        if cls in MISSING_ATTENTION_KERNELS and cls not in found and layer is not None and layer < len(types) \
                and types[layer] in kinds:
            found[cls] = f"{name} ({cls}, layer_types[{layer}] {types[layer]!r}) is {MISSING_ATTENTION_KERNELS[cls](module)}"
    return "; ".join(found.values())


#: Config settings under which a repeated call attends over *another* call's cached past (not its
#: own): graphrt keeps a KV cache per call site, so it would compute something else.
SHARED_PAST = {("recurrent_kv_cache_mode", "last_loop"): "its earlier recurrent loops attend over the last "
                                                          "loop's cached keys and values instead of their own"}


def _refuse_shared_past(config: Any) -> None:
    for (key, value), what in SHARED_PAST.items():
        if getattr(config, key, None) == value:
            raise ConfigError(f"{type(config).__name__}: {key}={value!r}: {what}; graphrt keeps one KV cache per "
                              "attention call (what a full forward computes); load it with another "
                              f"{key} (e.g. 'per_loop')")


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


__all__ = ["CALLER_NUMBERED", "CHUNKED_TYPES", "FEED_FORWARD_TYPES", "FULL_TYPES", "HARMLESS_KWARGS",
           "HYBRID_TYPES", "INDEXED_TYPES", "LayerFacts", "MISSING_ATTENTION_KERNELS", "SHARED_PAST", "SLIDING_TYPES", "config_chunks",
           "config_windows", "innermost_module", "layer_facts", "layer_of_path", "mask_window_of", "module_paths",
           "number_attention_by_layer", "own_temperature", "position_offset", "temperature_of", "text_config"]
