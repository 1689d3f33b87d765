"""The model as XLA runs it: the step function of each kind of model, and the jitted forward
and samplers placed on a mesh.

:class:`XlaPrograms` turns an :class:`XlaModel`, a ``(DecoderConfig, params)`` pair or a
flax nnx module into three ``jax.jit`` functions with explicit shardings -- the forward of
one padded step (the KV cache donated) and the greedy and random samplers -- plus the
weights on the mesh. It compiles nothing: the executor lowers and compiles these per key.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from graphrt.backends.xla import sharding as shd
from graphrt.backends.xla.batch import XlaBatch
from graphrt.backends.xla.sampler import greedy_tokens, sample_tokens, sampled_logprobs, token_logprobs
from graphrt.core.errors import ConfigError, InputError
from graphrt.models.hf_config import DecoderConfig
from graphrt.models.jax.decoder import AttentionMetadata, compute_logits, forward


@dataclasses.dataclass(frozen=True)
class XlaModel:
    """graphrt's JAX reference decoder: its config and params pytree (``jax_loader`` layout)."""

    config: DecoderConfig
    params: dict[str, Any]


def resolve_future_tokens(batch: XlaBatch, future_tokens: jax.Array, future_rows: jax.Array) -> XlaBatch:
    """``batch`` with each request's last scheduled token replaced by ``future_tokens[row]``
    where its ``future_rows`` entry is a row >= 0 (-1: keep the id the host wrote).

    This is how an overlapped engine feeds step n's sampled tokens to step n + 1 without
    waiting for them on the host: ``future_tokens`` is step n's sampler output, still on the
    device. Rows that keep their id scatter out of bounds and are dropped, so padded requests
    (query length 0, sharing their neighbour's end) never touch a real token."""
    num_tokens = batch.input_ids.shape[0]
    ends = batch.query_start_loc[1:]
    where = jnp.where(future_rows >= 0, ends - 1, num_tokens)
    values = future_tokens[jnp.maximum(future_rows, 0)]
    return dataclasses.replace(batch, input_ids=batch.input_ids.at[where].set(values, mode="drop"))


def padded_tokens(sampler: Callable[..., jax.Array], rows: int) -> Callable[..., jax.Array]:
    """``sampler`` with its ``[R]`` tokens padded with zeros to ``[rows]``: one shape for every
    sampler key, so the next step's forward takes them as its future tokens."""
    def sample(*args: Any) -> jax.Array:
        tokens = sampler(*args)
        return jnp.zeros((rows,), jnp.int32).at[:tokens.shape[0]].set(tokens)
    sample.__name__ = getattr(sampler, "__name__", "sample")
    return sample


def _make_step(run_model: Callable[..., Any], decode_query_len: int) -> Callable[..., Any]:
    q = decode_query_len

    def step(weights: Any, kv_cache: jax.Array, batch: XlaBatch, future_tokens: jax.Array,
             future_rows: jax.Array) -> tuple[jax.Array, ...]:
        """Forward of one padded step: (logits at each request's last token, hidden, new KV
        cache) and, with ``q = decode_query_len > 1``, the logits at each request's last ``q``
        positions ``[R, q, V]`` (speculative decoding verifies drafts on them). Requests whose
        ``future_rows`` entry is >= 0 first take their last token from ``future_tokens``
        (:func:`resolve_future_tokens`)."""
        batch = resolve_future_tokens(batch, future_tokens, future_rows)
        meta = AttentionMetadata(batch.slot_mapping, batch.query_start_loc, batch.seq_lens,
                                 batch.block_table)
        ends = batch.query_start_loc[1:]
        if q == 1:
            return run_model(weights, kv_cache, batch, meta, jnp.maximum(ends - 1, 0))
        rows = jnp.maximum(ends[:, None] + jnp.arange(-q, 0), 0).reshape(-1)
        logits, hidden, kv_cache = run_model(weights, kv_cache, batch, meta, rows)
        logits = logits.reshape(ends.shape[0], q, -1)
        return logits[:, -1], hidden, kv_cache, logits
    return step


def model_program(model: Any, block_size: int, decode_query_len: int = 1
                  ) -> tuple[DecoderConfig, Any, Callable[..., Any], Callable[..., jax.Array]]:
    """(decoder config, weights pytree, step function, ``logits(weights, hidden rows)``) for every
    kind of model accepted."""
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], DecoderConfig):
        model = XlaModel(*model)
    if isinstance(model, XlaModel):
        cfg = model.config

        def logits(params: Any, hidden: jax.Array) -> jax.Array:
            return compute_logits(params, hidden, config=cfg)

        def run_model(params: Any, kv_cache: jax.Array, batch: XlaBatch, meta: AttentionMetadata,
                      last: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            hidden, kv_cache = forward(params, kv_cache, batch.input_ids, batch.positions, meta,
                                       config=cfg, block_size=block_size)
            return logits(params, hidden[last]), hidden, kv_cache

        return cfg, model.params, _make_step(run_model, decode_query_len), logits
    try:
        from flax import nnx
    except ImportError:
        nnx = None
    if nnx is not None and isinstance(model, nnx.Module):
        cfg = getattr(model, "config", None)
        if not isinstance(cfg, DecoderConfig):
            raise InputError("model", "an nnx module needs a `config` attribute (a DecoderConfig) for "
                                      "the KV cache layout and the vocabulary size")
        own = getattr(model, "block_size", block_size)
        if own != block_size:
            raise ConfigError(f"the nnx module was built for block_size={own}, the config says {block_size}")
        graphdef, state = nnx.split(model)

        def logits_nnx(state: Any, hidden: jax.Array) -> jax.Array:
            return nnx.merge(graphdef, state).compute_logits(hidden)

        def run_nnx(state: Any, kv_cache: jax.Array, batch: XlaBatch, meta: AttentionMetadata,
                    last: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            module = nnx.merge(graphdef, state)
            hidden, kv_cache = module(kv_cache, batch.input_ids, batch.positions, meta)
            return module.compute_logits(hidden[last]), hidden, kv_cache

        return cfg, state, _make_step(run_nnx, decode_query_len), logits_nnx
    raise InputError("model", f"{type(model).__name__} is not a model the xla backend runs: pass "
                              "XlaBackend.load_model(...)'s XlaModel, a (DecoderConfig, params) pair, "
                              "or a flax nnx.Module with __call__(kv_cache, input_ids, positions, meta) "
                              "and compute_logits(hidden)")


class XlaPrograms:
    """One model's jitted forward and samplers on ``mesh``, and its weights placed there.

    ``forward(weights, kv_cache, batch, future_tokens, future_rows)`` donates the KV cache
    (with ``decode_query_len > 1`` it also returns each request's position logits);
    ``greedy(logits)`` and ``sample(logits, metadata)`` are the samplers, whose tokens come
    padded to ``max_reqs`` rows (the forward's ``future_tokens``). With ``max_logprobs > 0``,
    ``logprobs(logits, tokens)`` is a sampler step's logprobs and ``prompt_logprobs(weights,
    hidden rows, targets)`` those of chosen hidden rows (:mod:`graphrt.backends.xla.sampler`).
    ``own_code`` is False for an nnx module, whose code lives in its graphdef (the on-disk
    executable store cannot fingerprint it).
    """

    def __init__(self, model: Any, block_size: int, mesh: Mesh, decode_query_len: int = 1,
                 max_reqs: int = 1, max_logprobs: int = 0) -> None:
        self.model_config, weights, step, logits = model_program(model, block_size, decode_query_len)
        self.decode_query_len = decode_query_len
        self.max_reqs = int(max_reqs)
        self.mesh = mesh
        self.tp_size = shd.mesh_size(mesh)
        shd.check_tp(self.model_config, self.tp_size)
        self.own_code = isinstance(model, (XlaModel, tuple))
        self.replicated = shd.replicated(mesh)
        self.kv_sharding = shd.kv_cache_sharding(mesh, self.model_config)
        weight_shardings = shd.weight_shardings(weights, mesh, self.model_config)
        self.weights = jax.device_put(weights, weight_shardings)
        self.dtype = jnp.dtype(jax.tree_util.tree_leaves(self.weights)[0].dtype)
        repl = self.replicated
        self.forward = jax.jit(step, donate_argnums=(1,),
                               in_shardings=(weight_shardings, self.kv_sharding, repl, repl, repl),
                               out_shardings=(repl, repl, self.kv_sharding) + ((repl,) if decode_query_len > 1 else ()))
        self.greedy = jax.jit(padded_tokens(greedy_tokens, self.max_reqs), in_shardings=(repl,), out_shardings=repl)
        self.sample = jax.jit(padded_tokens(sample_tokens, self.max_reqs), in_shardings=(repl, repl),
                              out_shardings=repl)
        k = self.max_logprobs = min(max_logprobs, int(self.model_config.vocab_size))
        self.logprobs = jax.jit(sampled_logprobs(k), in_shardings=(repl, repl), out_shardings=repl) if k else None

        def prompt(weights: Any, hidden: jax.Array, targets: jax.Array) -> tuple[jax.Array, ...]:
            return token_logprobs(logits(weights, hidden), targets, k)

        self.prompt_logprobs = (jax.jit(prompt, in_shardings=(weight_shardings, repl, repl), out_shardings=repl)
                                if k else None)

    def kv_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """``[layers, 2, blocks * block_size + 1, kv_heads, head_dim]`` (the last row: trash)."""
        c = self.model_config
        return (c.num_hidden_layers, 2, num_blocks * block_size + 1, c.num_key_value_heads, c.head_dim)

    def zeros_kv_cache(self, shape: tuple[int, ...]) -> jax.Array:
        """A zeroed KV cache of ``shape``, laid out over the mesh as the forward expects it."""
        return jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=self.kv_sharding)()


__all__ = ["XlaModel", "XlaPrograms", "model_program", "padded_tokens", "resolve_future_tokens"]
