"""KV cache specs: what each group of attention layers keeps per token slot.

``kv_cache_spec()`` returns a :class:`KVCacheSpec` of :class:`KVCacheGroup` layer groups (KV
heads, K / V head sizes, dtype, sliding window or attention chunk, or MLA's latent). Groups share the runner's one
block table and block size. The cache is sized from :meth:`KVCacheSpec.bytes_per_block`
without torch or JAX; layer shapes are tabled in docs/attention.md, "KV cache specs". The old
``(num_layers, num_kv_heads, head_dim)`` tuple is still accepted (:func:`as_kv_spec`)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any, Collection, Iterable

from graphrt.core import defaults
from graphrt.core.errors import ConfigError

#: Bytes of one element of each KV-cache dtype (core/kv_spec.py sizes the cache with them).
KV_CACHE_DTYPE_BYTES: dict[str, int] = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
                                        "float8_e4m3fn": 1, "float8_e5m2": 1}

def blocks_for(tokens: Any, block_size: int) -> Any:
    """KV blocks that hold ``tokens`` tokens (a ceiling division; ints or arrays alike)."""
    return -(-tokens // block_size)


#: The model method (and the prefix of every field named in an error).
SPEC_FIELD = "kv_cache_spec"


@dataclass(frozen=True)
class KVCacheGroup:
    """Attention layers (indices into ``model.attention_layers()``) sharing one KV layout.

    ``head_size_v`` None: K's. ``dtype`` "auto": the config's ``kv_cache_dtype``, else the
    weights'. ``block_size`` None: the config's (no other value). ``sliding_window`` W > 0: a
    token at p sees p - W + 1 .. p. ``attention_chunk`` C > 0 (chunked local attention, Llama 4's
    ``attention_chunk_size``): a token at p sees (p // C) * C .. p, the tokens of its own chunk of
    the absolute positions (not with a window). ``latent_dim`` > 0: an MLA group (:meth:`mla`).
    ``index_head_size`` Di > 0: indexed sparse attention (DeepSeek-V3.2's DSA): each layer also
    keeps its indexer's key, one ``[rows, Di]`` tensor after K and V (which are then kept apart).
    """

    layers: tuple[int, ...]
    num_kv_heads: int = 0
    head_size: int = 0
    head_size_v: int | None = None
    dtype: Any = "auto"
    block_size: int | None = None
    sliding_window: int = 0
    latent_dim: int = 0
    attention_chunk: int = 0
    index_head_size: int = 0

    @classmethod
    def mla(cls, layers: Iterable[int], latent_dim: int, *, dtype: Any = "auto", block_size: int | None = None,
            sliding_window: int = 0) -> "KVCacheGroup":
        """An MLA group: each layer keeps one ``[rows, latent_dim]`` tensor instead of K and V."""
        return cls(tuple(layers), latent_dim=latent_dim, dtype=dtype, block_size=block_size,
                   sliding_window=sliding_window)

    @property
    def is_mla(self) -> bool:
        return self.latent_dim != 0

    @property
    def v_head_size(self) -> int:
        """V's head size (K's where ``head_size_v`` is None)."""
        return self.head_size if self.head_size_v is None else self.head_size_v

    def layer_shapes(self, rows: int) -> tuple[tuple[int, ...], ...]:
        """The tensor shapes one layer of this group holds for ``rows`` slots (module docstring)."""
        if self.is_mla:
            return ((rows, self.latent_dim),) + (((rows, self.index_head_size),) if self.index_head_size else ())
        if self.index_head_size:
            return ((rows, self.num_kv_heads, self.head_size), (rows, self.num_kv_heads, self.v_head_size),
                    (rows, self.index_head_size))
        if self.v_head_size == self.head_size:
            return ((2, rows, self.num_kv_heads, self.head_size),)
        return ((rows, self.num_kv_heads, self.head_size), (rows, self.num_kv_heads, self.v_head_size))

    def row_bytes(self) -> int:
        """Bytes of one token slot of one layer (a resolved group: ``dtype`` a known name)."""
        elements = self.latent_dim if self.is_mla else self.num_kv_heads * (self.head_size + self.v_head_size)
        return (elements + self.index_head_size) * KV_CACHE_DTYPE_BYTES[self.dtype]

    def storage_key(self) -> tuple[Any, ...]:
        """What the stored tensors depend on: layers of equal keys share one allocation (the
        window, the chunk and the layer indices do not change what is stored)."""
        return (self.latent_dim, self.num_kv_heads, self.head_size, self.v_head_size, self.dtype, self.index_head_size)


@dataclass(frozen=True)
class KVCacheSpec:
    """A model's KV cache: its layer groups, or ``owned_by_model`` (the model allocates it)."""

    groups: tuple[KVCacheGroup, ...] = ()
    owned_by_model: bool = False

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_size: int, **group_fields: Any) -> "KVCacheSpec":
        """One group of every layer (``group_fields``: :class:`KVCacheGroup`'s other fields)."""
        return cls((KVCacheGroup(tuple(range(num_layers)), num_kv_heads, head_size, **group_fields),))

    @classmethod
    def owned(cls, *groups: KVCacheGroup) -> "KVCacheSpec":
        """The model owns its cache: it implements ``kv_cache_bytes_per_block(block_size)`` and
        ``allocate_kv_cache(num_blocks, block_size)`` (block 0 null, a trash row per layer);
        ``groups`` only describe it."""
        return cls(tuple(groups), owned_by_model=True)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def group_of(self, layer: int) -> KVCacheGroup:
        """The group holding attention layer ``layer``."""
        return next(g for g in self.groups if layer in g.layers)

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window in layer order (0: full attention)."""
        return tuple(self.group_of(i).sliding_window for i in range(self.num_layers))

    @property
    def attention_chunks(self) -> tuple[int, ...]:
        """Each layer's attention chunk in layer order (0: not chunked)."""
        return tuple(self.group_of(i).attention_chunk for i in range(self.num_layers))

    def bytes_per_token(self) -> int:
        """Bytes of one token slot over every layer (a resolved spec)."""
        return sum(len(g.layers) * g.row_bytes() for g in self.groups)

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes of one KV block over every layer (a resolved spec)."""
        return int(block_size) * self.bytes_per_token()

    def storage(self) -> list[tuple[KVCacheGroup, tuple[int, ...]]]:
        """One entry per distinct stored layout: a group of that layout and every layer holding
        it, in layer order (one allocation each: a hybrid of sliding and full layers of one
        shape and dtype is still one tensor ``[layers, 2, rows, heads, head_size]``)."""
        layouts: dict[tuple[Any, ...], tuple[KVCacheGroup, list[int]]] = {}
        for group in self.groups:
            layouts.setdefault(group.storage_key(), (group, []))[1].extend(group.layers)
        return [(group, tuple(sorted(layers))) for group, layers in layouts.values()]


def kv_cache_dtype_name(value: Any, field: str = "kv_cache_dtype") -> str:
    """The canonical name of a KV-cache dtype: "auto", "float16", "bfloat16", "float32",
    "float64", "float8_e4m3fn" or "float8_e5m2", from vLLM's ``kv_cache_dtype`` spellings
    ("fp8", "fp8_e4m3", "fp8_e5m2", ...) or a torch / numpy / JAX dtype. Raises
    :class:`ConfigError` naming ``field``."""
    if isinstance(value, str):
        text = value
    elif isinstance(getattr(value, "name", None), str):      # a numpy dtype
        text = value.name
    else:                                                    # numpy / JAX scalar types; torch dtypes
        text = getattr(value, "__name__", None) or str(value)
    name = defaults.KV_CACHE_DTYPE_NAMES.get(text.strip().lower().removeprefix("torch."))
    if name is None:
        raise ConfigError(f"{field}: {value!r} is not a KV cache dtype; one of "
                          f"{sorted(defaults.KV_CACHE_DTYPE_NAMES)} (or a torch / numpy / JAX float dtype)")
    return name


def as_kv_spec(declared: Any) -> KVCacheSpec:
    """A model's ``kv_cache_spec()`` value as a :class:`KVCacheSpec`: a spec as it is, the old
    ``(num_layers, num_kv_heads, head_dim)`` tuple as one group of every layer. Anything else
    is a :class:`ConfigError` naming ``kv_cache_spec``."""
    if isinstance(declared, KVCacheSpec):
        return declared
    if isinstance(declared, (tuple, list)) and len(declared) == 3 and all(is_int(v) for v in declared):
        layers, heads, size = (operator.index(v) for v in declared)
        if layers <= 0:
            raise ConfigError(f"{SPEC_FIELD}: (num_layers, num_kv_heads, head_dim) = {tuple(declared)}: "
                              "num_layers must be > 0")
        return KVCacheSpec.uniform(layers, heads, size)
    raise ConfigError(f"{SPEC_FIELD}: the model returned {declared!r}; return a graphrt.KVCacheSpec "
                      "(or the old (num_layers, num_kv_heads, head_dim) tuple of ints): docs/models.md")


def resolve_kv_spec(declared: Any, *, block_size: int, model_dtype: Any, supported: Collection[str],
                    backend: str, kv_cache_dtype: Any = "auto", num_layers: int | None = None) -> KVCacheSpec:
    """The model's declared spec checked and made concrete: every group's dtype a name in
    ``supported`` (the dtypes ``backend`` holds; "auto" resolved through ``kv_cache_dtype``,
    then ``model_dtype``), its block size the config's ``block_size``, its layers disjoint and,
    where ``num_layers`` (the model's attention layers) is known, covering them. Raises
    :class:`ConfigError` naming the field (``kv_cache_spec.groups[i].head_size``,
    ``kv_cache_dtype``, ...) -- before anything is allocated."""
    spec = as_kv_spec(declared)
    config_dtype = kv_cache_dtype_name(kv_cache_dtype)
    if not spec.groups and not spec.owned_by_model and num_layers != 0:     # (no attention layer: no KV)
        raise ConfigError(f"{SPEC_FIELD}.groups: empty; declare at least one KVCacheGroup "
                          "(or KVCacheSpec.owned() for a cache the model allocates)")
    seen: dict[int, int] = {}
    groups = []
    for i, group in enumerate(spec.groups):
        field = f"{SPEC_FIELD}.groups[{i}]"
        if not isinstance(group, KVCacheGroup):
            raise ConfigError(f"{field}: {group!r} is not a graphrt KVCacheGroup")
        layers = claim_layers(group.layers, SPEC_FIELD, i, seen, num_layers, "attention")
        _check_sizes(group, field)
        if group.block_size is not None and (not is_int(group.block_size) or group.block_size != block_size):
            raise ConfigError(f"{field}.block_size: {group.block_size!r}, but the config's block_size is "
                              f"{block_size}: every layer group shares one block table")
        dtype = _group_dtype(group.dtype, f"{field}.dtype", config_dtype, model_dtype, supported, backend)
        if group.index_head_size and dtype.startswith("float8"):
            raise ConfigError(f"kv_cache_dtype: {dtype}, but {field} keeps an indexer's keys (index_head_size "
                              f"{group.index_head_size}): indexed sparse attention keeps float caches only")
        groups.append(replace(group, layers=layers, dtype=dtype, block_size=int(block_size),
                              sliding_window=int(group.sliding_window), attention_chunk=int(group.attention_chunk)))
    if groups:
        check_covered(seen, num_layers, SPEC_FIELD, "attention layers")
    return KVCacheSpec(tuple(groups), bool(spec.owned_by_model))


def is_int(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return not isinstance(value, bool)


def claim_layers(layers: Any, spec_field: str, i: int, seen: dict[int, int], num_layers: int | None,
                 kind: str) -> tuple[int, ...]:
    """Group ``i``'s layer indices (of ``kind`` layers: "attention", "recurrent") checked -- a
    non-empty sequence of distinct ints in [0, ``num_layers``) -- and claimed in ``seen`` (layer
    -> group): a layer in two groups is a :class:`ConfigError` naming ``spec_field.groups[i].layers``.
    Shared by the KV cache and the recurrent-state specs."""
    field = f"{spec_field}.groups[{i}].layers"
    try:
        values = tuple(layers)
    except TypeError:
        raise ConfigError(f"{field}: {layers!r} is not a sequence of layer indices") from None
    if not values:
        raise ConfigError(f"{field}: empty; a group holds at least one {kind} layer")
    bad = [v for v in values if not is_int(v) or v < 0 or (num_layers is not None and v >= num_layers)]
    if bad:
        bound = "" if num_layers is None else f" < {num_layers} (the model's {kind} layers)"
        raise ConfigError(f"{field}: {bad} are not layer indices >= 0{bound}")
    if len(set(values)) != len(values):
        raise ConfigError(f"{field}: {list(values)} names a layer twice")
    for layer in values:
        if layer in seen:
            raise ConfigError(f"{field}: layer {layer} is also in {spec_field}.groups[{seen[layer]}]")
        seen[layer] = i
    return tuple(operator.index(v) for v in values)


def check_covered(seen: dict[int, int], num_layers: int | None, spec_field: str, what: str) -> None:
    """Where ``num_layers`` is known, every layer is in some group (``seen``), else a
    :class:`ConfigError` naming ``spec_field.groups`` and the missing layers."""
    if num_layers is not None and len(seen) != num_layers:
        missing = sorted(set(range(num_layers)) - set(seen))
        raise ConfigError(f"{spec_field}.groups: the model has {num_layers} {what}; layers {missing} are in no group")


def _check_sizes(group: KVCacheGroup, field: str) -> None:
    """Heads and head sizes > 0 (an MLA group: a latent size > 0 and no heads); a window >= 0."""
    def positive(name: str, value: Any) -> None:
        if not is_int(value) or value <= 0:
            raise ConfigError(f"{field}.{name}: must be an int > 0, got {value!r}")

    if not is_int(group.latent_dim):
        raise ConfigError(f"{field}.latent_dim: must be an int (0: not MLA), got {group.latent_dim!r}")
    if group.is_mla:
        positive("latent_dim", group.latent_dim)
        for name in ("num_kv_heads", "head_size"):
            if getattr(group, name):
                raise ConfigError(f"{field}.{name}: an MLA group (latent_dim {group.latent_dim}) keeps one "
                                  f"latent tensor per layer and no heads; leave {name} 0")
    else:
        positive("num_kv_heads", group.num_kv_heads)
        positive("head_size", group.head_size)
        if group.head_size_v is not None:
            positive("head_size_v", group.head_size_v)
    if not is_int(group.sliding_window) or group.sliding_window < 0:
        raise ConfigError(f"{field}.sliding_window: must be an int >= 0 (0: full attention), "
                          f"got {group.sliding_window!r}")
    if not is_int(group.attention_chunk) or group.attention_chunk < 0:
        raise ConfigError(f"{field}.attention_chunk: must be an int >= 0 (0: not chunked), "
                          f"got {group.attention_chunk!r}")
    if not is_int(group.index_head_size) or group.index_head_size < 0:
        raise ConfigError(f"{field}.index_head_size: must be an int >= 0 (0: no indexer), "
                          f"got {group.index_head_size!r}")
    if group.attention_chunk and group.sliding_window:
        raise ConfigError(f"{field}: sliding_window {group.sliding_window} and attention_chunk "
                          f"{group.attention_chunk}: a layer either slides or attends within its chunk; set one to 0")


def _group_dtype(declared: Any, field: str, config_dtype: str, model_dtype: Any, supported: Collection[str],
                 backend: str) -> str:
    """A group's resolved dtype; the error names where the dtype came from: the group's own
    ``dtype``, the config's ``kv_cache_dtype``, or the weights' ``dtype``."""
    own = kv_cache_dtype_name(declared, field)
    if own != "auto" and config_dtype != "auto" and own != config_dtype:
        raise ConfigError(f"kv_cache_dtype: {config_dtype}, but {field} fixes {own}; leave one of them 'auto'")
    if own != "auto":
        name, source = own, field
    elif config_dtype != "auto":
        name, source = config_dtype, "kv_cache_dtype"
    else:
        name, source = kv_cache_dtype_name(model_dtype, "dtype"), "dtype"
    if name not in supported:
        raise ConfigError(f"{source}: {name} is not a KV cache dtype the {backend} backend holds; one of "
                          f"{sorted(supported)}")
    return name


__all__ = ["KVCacheGroup", "blocks_for", "KVCacheSpec", "SPEC_FIELD", "as_kv_spec", "check_covered", "claim_layers",
           "kv_cache_dtype_name", "resolve_kv_spec"]
