"""An XLA model's attention, declared as a torch model's is (:mod:`graphrt.core.attention_decl`).

An executable is compiled per key: a host value read while it was traced is fixed in it, as a
host value read while a device graph is captured is. So a JAX model's attention declares the
same things a torch attention backend does, with the same class
(:class:`~graphrt.core.attention_decl.AttentionDeclarations`), as ``XlaModel(...,
attention_backend=...)`` or an nnx module's ``attention_backend`` attribute:

* ``keyed_host_values``: ``max_seq_len`` (**context narrowing**: the keys get context buckets
  and each executable's block table is its bucket's width) or nothing (the kernel reads every
  length on the device: one executable per token / batch padding serves any context);
* ``graph_support``: an executable runs every step, so anything below ``ALWAYS`` is refused;
* ``refreshed_host_values``: refused (an executable takes the step's arrays as arguments and
  runs no Python before a call);
* ``kv_cache_dtypes``: the KV-cache dtypes the kernel reads and writes.

Without a declaration a model gets :class:`XlaPagedAttention`, what graphrt's JAX decoder (its
reference kernel and Pallas) declares: context narrowing, any KV dtype the xla backend holds.
"""

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
