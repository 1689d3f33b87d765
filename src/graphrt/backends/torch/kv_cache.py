"""The torch executor's KV cache, allocated per the model's KV cache spec (core/kv_spec.py).

:func:`model_kv_spec` reads and checks ``model.kv_cache_spec()`` (ConfigError naming the field
before any allocation). :class:`TorchKVCache` allocates one zeroed tensor per stored layout and
sets each attention layer's ``layer.kv_cache`` (a tensor, or ``(k, v)`` where K and V head
sizes differ). A model that owns its cache allocates it itself."""

from __future__ import annotations

from typing import Any

import torch

from graphrt.core.errors import ConfigError
from graphrt.core.kv_spec import SPEC_FIELD, KVCacheSpec, resolve_kv_spec
from graphrt.core.numerics import dtype_name
from graphrt.layers.torch.attention.paged import PagedAttention

#: The KV-cache dtypes torch holds, by canonical name (fp8 on every device through byte views:
#: layers/torch/attention/kv_quant.py).
TORCH_KV_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
#: What a model that owns its cache implements (docs/models.md).
OWNER_METHODS = ("kv_cache_bytes_per_block", "allocate_kv_cache")


def model_kv_spec(model: torch.nn.Module, config: Any, backend: str) -> KVCacheSpec:
    """``model``'s KV cache spec, resolved for ``config`` (block size, ``kv_cache_dtype``) and
    checked (core/kv_spec.py); ``backend`` names the backend in errors."""
    declare = getattr(model, SPEC_FIELD, None)
    if not callable(declare):
        raise ConfigError(f"{SPEC_FIELD}: {type(model).__name__} has no {SPEC_FIELD}() method; return a "
                          "graphrt.KVCacheSpec from it (docs/models.md)")
    layers = model.attention_layers() if callable(getattr(model, "attention_layers", None)) else None
    param = next(model.parameters(), None)
    declared = declare()
    spec = resolve_kv_spec(declared, block_size=config.block_size, kv_cache_dtype=config.kv_cache_dtype,
                           model_dtype=dtype_name(param.dtype) if param is not None else "float32",
                           supported=TORCH_KV_DTYPES, backend=backend,
                           num_layers=None if layers is None else len(layers))
    if spec.owned_by_model:
        missing = [name for name in OWNER_METHODS if not callable(getattr(model, name, None))]
        if missing:
            raise ConfigError(f"{SPEC_FIELD}: the model owns its KV cache (KVCacheSpec.owned()) but has no "
                              f"{', '.join(name + '()' for name in missing)}: implement "
                              "kv_cache_bytes_per_block(block_size) and allocate_kv_cache(num_blocks, block_size)")
    elif layers is None:
        raise ConfigError(f"attention_layers: {type(model).__name__} has no attention_layers() method, so its KV "
                          "cache cannot be assigned; return the attention modules in layer order (docs/models.md)")
    else:
        check_against_layers(spec, layers, windows=isinstance(declared, KVCacheSpec))  # a tuple declares no window
    return spec


def _int(layer: Any, *names: str) -> int | None:
    """The first of ``names`` that ``layer`` has as an int (not a bool), else None."""
    for name in names:
        value = getattr(layer, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def layer_kv_shape(layer: Any) -> dict[str, int]:
    """What an attention layer says it stores per token slot, where it says it: ``num_kv_heads``,
    ``head_size`` (``head_size`` or ``head_dim``), ``head_size_v`` (``head_size_v`` or
    ``v_head_dim``; a ``PagedAttention`` that names neither stores K and V of one size), ``latent_dim``
    (MLA: a layer that reads one latent row per token says so with ``latent_dim``, whatever
    heads it has), ``sliding_window``, ``attention_chunk``, ``index_head_size`` (a DSA indexer's key)."""
    shape = {"num_kv_heads": _int(layer, "num_kv_heads"), "head_size": _int(layer, "head_size", "head_dim"),
             "head_size_v": _int(layer, "head_size_v", "v_head_dim"), "latent_dim": _int(layer, "latent_dim"),
             "sliding_window": _int(layer, "sliding_window"), "attention_chunk": _int(layer, "attention_chunk"),
             "index_head_size": _int(layer, "index_head_size")}
    if isinstance(layer, PagedAttention) and shape["head_size_v"] is None:
        shape["head_size_v"] = shape["head_size"]
    return {name: value for name, value in shape.items() if value is not None}


def check_against_layers(spec: KVCacheSpec, layers: list[Any], *, windows: bool = True) -> None:
    """Every group agrees with the layers it names, where a layer says what it stores
    (:func:`layer_kv_shape`): KV heads, K and V head sizes, MLA (a latent, no heads) versus
    paged heads, and (``windows``) the sliding window. A ConfigError names the group's field,
    the layer and both values -- before anything is allocated (a lying spec would make every
    capture fail and the first step die on a shape error)."""
    for i, group in enumerate(spec.groups):
        field = f"{SPEC_FIELD}.groups[{i}]"
        for index in group.layers:
            layer = layers[index]
            own, kind = layer_kv_shape(layer), type(layer).__name__
            where = f"attention layer {index} ({kind})"
            if group.is_mla:
                heads = {k: v for k, v in own.items() if k in ("num_kv_heads", "head_size") and v}
                if "latent_dim" not in own and (heads or isinstance(layer, PagedAttention)):
                    raise ConfigError(f"{field}.latent_dim: {group.latent_dim} (an MLA group: one latent tensor per "
                                      f"layer, no heads), but {where} attends over paged KV heads "
                                      f"({', '.join(f'{k} {v}' for k, v in heads.items())}); declare a KVCacheGroup "
                                      "with its heads and head sizes (or give a layer that reads a latent row its "
                                      "latent_dim)")
                expected = {"latent_dim": group.latent_dim}
            else:
                if own.get("latent_dim"):
                    raise ConfigError(f"{field}: a group of KV heads ({group.num_kv_heads} x {group.head_size}), but "
                                      f"{where} is MLA (latent_dim {own['latent_dim']}); declare it with "
                                      "KVCacheGroup.mla")
                expected = {"num_kv_heads": group.num_kv_heads, "head_size": group.head_size,
                            "head_size_v": group.v_head_size}
            expected["index_head_size"] = group.index_head_size
            if windows:
                expected["sliding_window"] = group.sliding_window
                expected["attention_chunk"] = group.attention_chunk
            for name, value in expected.items():
                if name in own and own[name] != value:
                    noun = "slides over" if name == "sliding_window" else f"has {name}"
                    raise ConfigError(f"{field}.{name}: {value}, but {where} {noun} {own[name]}")


class TorchKVCache:
    """Allocates a model's KV cache per its spec on ``device`` and assigns the layers. The spec is
    read on first use (:func:`model_kv_spec` for ``config``; preflight has checked it already),
    or given as ``spec``."""

    def __init__(self, model: torch.nn.Module, config: Any, device: torch.device, backend: str,
                 spec: KVCacheSpec | None = None) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.backend = backend
        self._spec = spec

    @property
    def spec(self) -> KVCacheSpec:
        """The model's resolved KV cache spec."""
        if self._spec is None:
            self._spec = model_kv_spec(self.model, self.config, self.backend)
        return self._spec

    def _groups(self) -> tuple[Any, ...]:
        """The spec's groups; none for a model without ``kv_cache_spec()`` (allocating names it)."""
        return self.spec.groups if callable(getattr(self.model, SPEC_FIELD, None)) else ()

    def group_dtypes(self) -> list[tuple[int, str]]:
        """(group index, canonical dtype) of every group: what the attention must read and write."""
        return [(i, group.dtype) for i, group in enumerate(self._groups())]

    def kv_dtype(self) -> torch.dtype | None:
        """The torch dtype of the first group's cache (the kernel is chosen for it); None where
        there is no group (a model owning its cache may declare none)."""
        groups = self._groups()
        return TORCH_KV_DTYPES[groups[0].dtype] if groups else None

    def kv_dtypes(self) -> tuple[torch.dtype, ...]:
        """The torch dtype of every group's cache (empty where the model owns an undeclared cache)."""
        return tuple(TORCH_KV_DTYPES[group.dtype] for group in self._groups())

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes of one block over every layer: the spec's, or the model's own where it owns the cache."""
        if self.spec.owned_by_model:
            return int(self.model.kv_cache_bytes_per_block(block_size))
        return self.spec.bytes_per_block(block_size)

    def allocate(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        """Zeroed tensors of ``num_blocks * block_size + 1`` rows per layer (block 0 is the null
        block, the last row the trash row), one per stored layout; each attention layer gets its
        view. Returns the tensors (none where the model owns its cache: it allocated it)."""
        if self.spec.owned_by_model:
            self.model.allocate_kv_cache(num_blocks, block_size)
            return []
        rows = num_blocks * block_size + 1
        layers = self.model.attention_layers()
        tensors: list[torch.Tensor] = []
        for group, ids in self.spec.storage():
            dtype = TORCH_KV_DTYPES[group.dtype]
            parts = [torch.zeros(len(ids), *shape, dtype=dtype, device=self.device)
                     for shape in group.layer_shapes(rows)]
            tensors.extend(parts)
            for j, layer in enumerate(ids):
                views = tuple(part[j] for part in parts)
                layers[layer].kv_cache = views[0] if len(views) == 1 else views
        return tensors

    def release(self) -> None:
        """Drop the layers' views (the executor drops the tensors)."""
        if self._spec is not None and not self._spec.owned_by_model:
            for layer in self.model.attention_layers():
                layer.kv_cache = None


__all__ = ["OWNER_METHODS", "TORCH_KV_DTYPES", "TorchKVCache", "check_against_layers", "layer_kv_shape",
           "model_kv_spec"]
