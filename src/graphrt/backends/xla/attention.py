"""An XLA model's attention, declared as a torch model's is (:mod:`graphrt.core.attention_decl`).

An executable fixes the host values read while traced, like a graph, so a JAX model declares
them with :class:`~graphrt.core.attention_decl.AttentionDeclarations` (``XlaModel(...,
attention_backend=...)``): ``max_seq_len`` keyed or nothing; ``graph_support`` below ``ALWAYS``
and ``refreshed_host_values`` are refused (no Python runs before a call). Undeclared:
:class:`XlaPagedAttention`. docs/attention.md, "The same declarations on XLA"."""

from __future__ import annotations

from typing import Any

from graphrt.core.attention_decl import (CONTEXT_VALUE, FLOAT_KV_DTYPES, FP8_KV_DTYPES, AttentionDeclarations,
                                         backend_name, check_declarations, check_kv_dtypes, checked_keyed,
                                         least_support)
from graphrt.core.errors import ConfigError
from graphrt.core.graph_modes import AttentionGraphSupport


class XlaPagedAttention(AttentionDeclarations):
    """graphrt's JAX decoder's attention, and a JAX model's unless it declares its own: it
    attends over every column of the block table it is given, so it keys ``max_seq_len``."""

    name = "jax-paged"
    kv_cache_dtypes = FLOAT_KV_DTYPES + FP8_KV_DTYPES

    def keyed_host_values(self, device: Any, dtype: Any) -> tuple[str, ...]:
        return (CONTEXT_VALUE,)


def model_attention(model: Any) -> Any:
    """``model``'s declared attention (``attention_backend``), else :class:`XlaPagedAttention`."""
    own = getattr(model, "attention_backend", None)
    return own if own is not None else XlaPagedAttention()


def checked_attention(attention: Any, devices: Any, dtype: Any, group_dtypes: list[tuple[int, str]]
                      ) -> tuple[tuple[str, ...], AttentionGraphSupport]:
    """(keyed host values, graph support) of ``attention`` on the xla backend, every declaration
    checked: ConfigError naming the backend and what the xla backend cannot do."""
    check_declarations(attention, refresh=False)
    support = least_support(attention)
    if support < AttentionGraphSupport.ALWAYS:
        raise ConfigError(f"attention backend {backend_name(attention)!r}: graph_support {support.name}, but the xla "
                          "backend runs every step as a compiled executable (no eager or piecewise path): its "
                          "attention must run in any of them (ALWAYS)")
    keyed = checked_keyed(attention, devices, dtype)
    check_kv_dtypes(attention, group_dtypes)
    return keyed, support


__all__ = ["XlaPagedAttention", "checked_attention", "model_attention"]
