"""An XLA model's attention, declared as a torch model's is (:mod:`graphrt.core.attention_decl`).

An executable fixes the host values read while traced, like a graph, so a JAX model declares
them with :class:`~graphrt.core.attention_decl.AttentionDeclarations` (``XlaModel(...,
attention_backend=...)``): ``max_seq_len`` keyed or nothing; ``graph_support`` below ``ALWAYS``
and ``refreshed_host_values`` are refused (no Python runs before a call). Undeclared: what
graphrt's chosen kernel declares (its choice returns them:
:class:`~graphrt.layers.jax.paged_attention.XlaPagedAttention`). docs/attention.md, "The same
declarations on XLA"."""

from __future__ import annotations

from typing import Any

from graphrt.core.attention_decl import (AttentionDeclarations, backend_name, check_declarations, check_kv_dtypes,
                                         checked_keyed, least_support)
from graphrt.core.errors import ConfigError
from graphrt.core.graph_modes import AttentionGraphSupport
from graphrt.layers.jax.paged_attention import XlaPagedAttention


def model_attention(model: Any, chosen: AttentionDeclarations) -> Any:
    """``model``'s declared attention (``attention_backend``), else what graphrt's chosen kernel
    declares (``chosen``: :func:`~graphrt.layers.jax.pallas_attention.choose_xla_attention`'s)."""
    own = getattr(model, "attention_backend", None)
    return own if own is not None else chosen


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
