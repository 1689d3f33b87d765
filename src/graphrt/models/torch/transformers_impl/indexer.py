"""DeepSeek-V3.2's sparse attention (DSA) through graphrt's paged cache (issue 45).

transformers' DSA attention (``DeepseekV32Attention``, ``GlmMoeDsaAttention``) asks its lightning
indexer for each token's top-k keys over transformers' own cache and mask, then passes them to the
attention function as ``indices``. On graphrt's packed row there is neither: graphrt patches
each indexer instance's ``forward`` (:func:`route_indexers`, logged) to return the step's indexer
projections (:class:`~graphrt.layers.torch.attention.sparse.IndexerInputs`: the query heads and the
key with the model's RoPE applied, each head's weight) instead of indices, and gives the
attention module a placeholder mask (:data:`MASK_PLACEHOLDER`, which only its ``[:, 0]`` slicing
reads). graphrt's layer writes the key into the paged indexer cache and selects and attends on
the device (``layers/torch/attention/sparse.py``).

Checked indexer classes only (:data:`INDEXER_ROPE`: which RoPE layout each applies); any other
indexer is refused with a ConfigError naming it. A layer without an indexer of its own (HY-V4's
and GLM-MoE-DSA's ``indexer_types`` "shared") is handed the earlier layer's return value by the
model itself (``prev_topk_indices``): under graphrt that is the earlier layer's
:class:`IndexerInputs`, by which the probe (``facts.py``) finds the call site whose selection it
reuses. MiniMax-M3's block indexer (:data:`BLOCK_INDEXER_ROPE`) is patched the same way: it
returns a :class:`BlockIndexerInputs`, passed to the attention function as ``block_indices``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from graphrt.core.errors import ConfigError
from graphrt.layers.torch.attention.sparse import BlockIndexerInputs, IndexerInputs

#: Indexer classes graphrt routes: the function of their module that applies their RoPE
#: (DeepSeek-V3.2's, A.X-K2's and HY-V4's indexers rotate the halves, GLM-MoE-DSA's interleaved
#: pairs) and whether the rotated dimensions come last of each head rather than first (HY-V4's
#: "flipped" RoPE). Each scores ``sum_h w_h * relu(q_h . k) * softmax_scale`` (HY-V4 folds the
#: scale into ``w``: the same, the scale being positive).
INDEXER_ROPE: dict[str, tuple[str, bool]] = {
    "DeepseekV32Indexer": ("apply_rotary_pos_emb", False), "AXK2Indexer": ("apply_rotary_pos_emb", False),
    "GlmMoeDsaIndexer": ("apply_rotary_pos_emb_interleave", False), "HYV4Indexer": ("apply_rotary_pos_emb", True)}
#: Block indexer classes graphrt routes (MiniMax-M3's: blocks of keys per KV head, passed to the
#: attention function as ``block_indices``): the function of their module that applies their RoPE.
BLOCK_INDEXER_ROPE: dict[str, str] = {"MiniMaxM3VLIndexer": "apply_rotary_pos_emb"}
#: The attention keywords a routed indexer's inputs arrive in (DSA's, the block indexer's).
INDEX_KWARGS = ("indices", "block_indices")
#: What a DSA attention module gets as its mask under graphrt (it slices ``[:, 0]`` and passes the
#: result on; nothing reads its values).
MASK_PLACEHOLDER = torch.zeros(1, 1, 1, 1, dtype=torch.bool)
#: The attribute a routed indexer keeps its ``(index_topk, index_scale, block size, local blocks)``
#: in (the probe reads it; a DSA indexer's block size is 0).
ROUTED_ATTR = "_graphrt_indexer"


def _indexer_forward(indexer: torch.nn.Module, rope: Any, rope_last: bool):
    """``indexer``'s forward under graphrt: the step's :class:`IndexerInputs`, no selection."""

    def forward(hidden_states: torch.Tensor, q_resid: torch.Tensor, position_embeddings: Any, attention_mask: Any,
                position_ids: Any = None, cache: Any = None, **_: Any) -> IndexerInputs:
        t = hidden_states.shape[1]
        cos, sin = position_embeddings
        dim = indexer.head_dim
        lo, hi = (dim - indexer.qk_rope_head_dim, dim) if rope_last else (0, indexer.qk_rope_head_dim)
        q = indexer.wq_b(q_resid).view(1, t, indexer.n_heads, dim)
        k = indexer.wk(hidden_states)       # the norm in its own dtype (HY-V4 keeps it in float32)
        k = indexer.k_norm(k.to(indexer.k_norm.weight.dtype)).to(hidden_states.dtype).unsqueeze(2)
        q_rot, k_rot = rope(q[..., lo:hi], k[..., lo:hi], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q[..., :lo], q_rot, q[..., hi:]], dim=-1)
        k = torch.cat([k[..., :lo], k_rot, k[..., hi:]], dim=-1)
        weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
        return IndexerInputs(q[0], k[0, :, 0], weights[0] * indexer.n_heads ** -0.5)

    return forward


def _block_indexer_forward(indexer: torch.nn.Module, rope: Any):
    """A block indexer's forward under graphrt: the step's :class:`BlockIndexerInputs`, no selection."""

    def forward(hidden_states: torch.Tensor, position_embeddings: Any, cache: Any = None, position_ids: Any = None,
                **_: Any) -> BlockIndexerInputs:
        t, dim = hidden_states.shape[1], indexer.head_dim
        q = indexer.q_norm(indexer.q_proj(hidden_states).view(1, t, -1, dim)).transpose(1, 2)     # [1, Hi, T, D]
        k = indexer.k_norm(indexer.k_proj(hidden_states).view(1, t, 1, dim)).transpose(1, 2)      # [1, 1, T, D]
        cos, sin = position_embeddings
        q, k = rope(q, k, cos[..., :dim], sin[..., :dim])
        return BlockIndexerInputs(q[0].transpose(0, 1), k[0, 0])

    return forward


def passed_index(kwargs: dict) -> IndexerInputs | BlockIndexerInputs | None:
    """The routed indexer's inputs an attention call carries (:data:`INDEX_KWARGS`), or None."""
    for key in INDEX_KWARGS:
        value = kwargs.get(key)
        if isinstance(value, (IndexerInputs, BlockIndexerInputs)):
            return value
    return None


def _placeholder_mask(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook: the attention module's ``attention_mask`` None -> :data:`MASK_PLACEHOLDER`."""
    if kwargs.get("attention_mask") is None:
        kwargs["attention_mask"] = MASK_PLACEHOLDER
    return args, kwargs


def dsa_attention_modules(hf_model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every attention module of ``hf_model`` with an ``indexer`` attribute (DSA), with its path."""
    return [(name, m) for name, m in hf_model.named_modules() if hasattr(m, "indexer") and hasattr(m, "layer_idx")]


def route_indexers(hf_model: torch.nn.Module) -> list[str]:
    """Patch each DSA attention module's indexer (module docstring); the paths patched. Idempotent."""
    patched = []
    for name, module in dsa_attention_modules(hf_model):
        indexer = module.indexer
        if indexer is None:         # reuses an earlier layer's selection: found by the probe (facts.py)
            continue
        kind = type(indexer).__name__
        if kind in BLOCK_INDEXER_ROPE:
            if getattr(indexer, ROUTED_ATTR, None) is None:
                rope = getattr(sys.modules[type(indexer).__module__], BLOCK_INDEXER_ROPE[kind])
                indexer.forward = _block_indexer_forward(indexer, rope)
                setattr(indexer, ROUTED_ATTR, (int(indexer.topk_blocks), 1.0, int(indexer.block_size),
                                               int(indexer.local_blocks)))
            patched.append(f"{name}.indexer")
            continue
        if kind not in INDEXER_ROPE:
            raise ConfigError(f"{name}.indexer is a {kind}, which graphrt's indexed sparse attention has not checked "
                              f"(it routes {sorted(INDEXER_ROPE) + sorted(BLOCK_INDEXER_ROPE)})")
        if getattr(indexer, ROUTED_ATTR, None) is None:
            rope_name, rope_last = INDEXER_ROPE[kind]
            rope = getattr(sys.modules[type(indexer).__module__], rope_name)
            indexer.forward = _indexer_forward(indexer, rope, rope_last)
            module.register_forward_pre_hook(_placeholder_mask, with_kwargs=True)
            setattr(indexer, ROUTED_ATTR, (int(indexer.index_topk), float(indexer.softmax_scale), 0, 0))
        patched.append(f"{name}.indexer")
    return patched


def index_facts(module: torch.nn.Module, kwargs: dict) -> tuple[int, int, int, float] | None:
    """What a routed DSA layer's attention call says of its own indexer: ``(heads, head size,
    top-k, score scale)`` (a block indexer's top-k counts blocks), or None for a layer without one
    (a layer reusing another's selection gets that layer's :class:`IndexerInputs` and has no indexer)."""
    index = passed_index(kwargs)
    if index is None or getattr(module, "indexer", None) is None:
        return None
    topk, scale = getattr(module.indexer, ROUTED_ATTR)[:2]
    return int(index.q.shape[1]), int(index.q.shape[2]), topk, scale


def index_blocks(module: torch.nn.Module) -> tuple[int, int]:
    """A routed block indexer's ``(block size, local blocks)``; ``(0, 0)`` for any other layer."""
    routed = getattr(getattr(module, "indexer", None), ROUTED_ATTR, None)
    return (int(routed[2]), int(routed[3])) if routed else (0, 0)


__all__ = ["BLOCK_INDEXER_ROPE", "INDEXER_ROPE", "INDEX_KWARGS", "MASK_PLACEHOLDER", "dsa_attention_modules",
           "index_blocks", "index_facts", "passed_index", "route_indexers"]
