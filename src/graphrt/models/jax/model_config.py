"""What the XLA backend reads of a JAX model's config: a protocol, checked when a runner is built.

A JAX model brings its own config class (a dataclass, a flax config, any object with these
attributes); graphrt's own :class:`~graphrt.models.hf_config.DecoderConfig` is one. The
backend reads only the shapes it sizes things by -- the vocabulary (logits, samplers, the
token-id bound), the KV cache's layout and the hidden size (memory estimates) -- never the
architecture: that lives in the model's own forward. :func:`check_model_config` names every
member a config lacks before anything is allocated or compiled.

Framework-free: importing it pulls no jax.
"""

from __future__ import annotations

import numbers
from typing import Any, Protocol, runtime_checkable

from graphrt.core.errors import ConfigError

#: Members every config needs: the vocabulary, the hidden size, the KV cache's layout
#: ``[num_hidden_layers, 2, rows, num_key_value_heads, head_dim]``.
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim")
#: Members tensor parallelism reads too (``XlaBackend(tp_size > 1)``: what must divide the mesh).
TENSOR_PARALLEL = ("num_attention_heads", "intermediate_size")
#: Members read where present: ``max_position_embeddings`` bounds ``max_model_len``,
#: ``eos_token_id`` (an int or a sequence) stops ``graphrt.LLM``'s requests, ``dtype`` is the KV
#: cache's dtype (default: the weights' first leaf's), ``intermediate_size`` refines the
#: memory estimate.
OPTIONAL = ("max_position_embeddings", "eos_token_id", "dtype", "intermediate_size")
#: The member a model with recurrent state (``XlaModel(state=...)``, docs/hybrid.md) adds: how
#: many recurrent layers it has (its forward gets their states in layer order).
STATE_LAYERS = "state_layers"


@runtime_checkable
class JaxModelConfig(Protocol):
    """The members of a JAX model's config the XLA backend reads (positive ints); see
    :data:`OPTIONAL` for the ones read where present. For a flax nnx module the config is a
    static attribute, so it must be hashable (a frozen dataclass is)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int


def check_model_config(config: Any, tp_size: int = 1) -> None:
    """Raise :class:`ConfigError` naming every member of :class:`JaxModelConfig` that ``config``
    lacks (with ``tp_size > 1``, also :data:`TENSOR_PARALLEL`'s), or one that is not a positive
    integer."""
    needed = REQUIRED + (TENSOR_PARALLEL if tp_size > 1 else ())
    missing = [name for name in needed if not hasattr(config, name)]
    if config is None or missing:
        what = "no config" if config is None else f"a config ({type(config).__name__}) without {', '.join(missing)}"
        raise ConfigError(f"model.config: the model has {what}; the xla backend reads {', '.join(needed)} "
                          f"(graphrt.models.jax.model_config.JaxModelConfig; graphrt's DecoderConfig has them)")
    for name in needed:
        value = getattr(config, name)
        if name == "num_hidden_layers" and value == 0 and getattr(config, "state_layers", 0):
            continue                # a model of recurrent layers only (a pure Mamba2) keeps no KV
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
            hint = (f" (0 attention layers: a model of recurrent layers only also sets {STATE_LAYERS}, their number; "
                    "docs/hybrid.md)" if name == "num_hidden_layers" and value == 0 else "")
            raise ConfigError(f"model.config.{name}: must be a positive integer, got {value!r}{hint}")


def state_layers_of(config: Any) -> int:
    """The number of recurrent layers of a model with recurrent state: ``config.state_layers``, a
    positive int. A ConfigError naming it where it is missing or not one (before, a raw
    AttributeError deep in the XLA backend)."""
    value = getattr(config, STATE_LAYERS, None)
    if value is None:
        raise ConfigError(f"model.config.{STATE_LAYERS}: the model declares recurrent state (XlaModel(state=...)) "
                          f"but its config ({type(config).__name__}) has no {STATE_LAYERS}: set it to the number of "
                          "recurrent layers, whose states the forward gets in layer order (docs/hybrid.md)")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ConfigError(f"model.config.{STATE_LAYERS}: must be a positive integer (the recurrent layers), "
                          f"got {value!r}")
    return int(value)


__all__ = ["JaxModelConfig", "OPTIONAL", "REQUIRED", "STATE_LAYERS", "TENSOR_PARALLEL", "check_model_config",
           "state_layers_of"]
