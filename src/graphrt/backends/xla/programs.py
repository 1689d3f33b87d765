"""The model as XLA runs it: each kind of model's step function, and the jitted forward and
samplers placed on a mesh. :class:`XlaPrograms` compiles nothing: the executor lowers and
compiles them per key."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from graphrt.backends.xla import sharding as shd
from graphrt.backends.xla.attention import checked_attention, model_attention
from graphrt.backends.xla.batch import XlaBatch, batch_spec
from graphrt.backends.xla.extra_inputs import abstract_args, model_extra_specs
from graphrt.backends.xla.sampler import greedy_tokens, sample_tokens, sampled_logprobs, token_logprobs
from graphrt.core.errors import ConfigError, InputError
from graphrt.core.inputs.extra_inputs import ExtraInput
from graphrt.core.kv_spec import KVCacheSpec, resolve_kv_spec
from graphrt.core.state_spec import StateSpec, resolve_state_spec, state_array_names, state_memory
from graphrt.models.hf_config import DecoderConfig, decoder_kv_spec
from graphrt.models.jax import decoder as jax_decoder
from graphrt.layers.jax.paged_attention import AttentionMetadata
from graphrt.models.jax.model_config import check_model_config, state_layers_of
from graphrt.layers.jax.pallas_attention import choose_xla_attention, pages_to_rows, pallas_kv_shape, rows_to_pages
from graphrt.layers.jax.recurrent import naming_states

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class XlaModel:
    """A JAX model as the xla backend runs it: a config, a params pytree and two pure functions.

    ``forward(params, kv_cache, input_ids, positions, meta, *, config, block_size) -> (hidden
    [T, H], kv_cache)`` over the paged cache ``[layers, 2, blocks * block_size + 1, kv_heads,
    head_dim]`` (negative slots: the trash row), and ``compute_logits(params, hidden, *, config)
    -> float32 [N, V]``; both None runs graphrt's decoder. ``config`` has the members of
    :class:`~graphrt.models.jax.model_config.JaxModelConfig`. ``extra_inputs``: declared per-step
    arrays, passed as ``extra=``. ``attention_backend``: its declarations (None: graphrt's).
    docs/xla.md.
    """

    config: Any
    params: Any
    forward: Callable[..., Any] | None = None
    compute_logits: Callable[..., Any] | None = None
    extra_inputs: Mapping[str, ExtraInput] | None = None
    attention_backend: Any = None
    #: A hybrid model's recurrent state (docs/hybrid.md): its forward then takes a cache pytree
    #: ``(kv, states)`` and the keywords ``state_slots``, ``uniform``, ``num_slots``, ``checkpoints``.
    state: StateSpec | None = None

    @property
    def own_code(self) -> bool:
        """Whether it runs graphrt's decoder (code the on-disk executable store fingerprints)."""
        return self.forward is None and self.compute_logits is None


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
             future_rows: jax.Array, *extras: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
        """Forward of one padded step: (logits at each request's last token, hidden, new KV
        cache) and, with ``q = decode_query_len > 1``, the logits at each request's last ``q``
        positions ``[R, q, V]`` (speculative decoding verifies drafts on them). Requests whose
        ``future_rows`` entry is >= 0 first take their last token from ``future_tokens``
        (:func:`resolve_future_tokens`). ``extras``: the declared extra inputs' padded rows (one
        dict), only when the model declares them (otherwise the signature is as it was)."""
        extra = extras[0] if extras else {}
        batch = resolve_future_tokens(batch, future_tokens, future_rows)
        meta = AttentionMetadata(batch.slot_mapping, batch.query_start_loc, batch.seq_lens,
                                 batch.block_table)
        ends = batch.query_start_loc[1:]
        if q == 1:
            return run_model(weights, kv_cache, batch, meta, jnp.maximum(ends - 1, 0), extra)
        rows = jnp.maximum(ends[:, None] + jnp.arange(-q, 0), 0).reshape(-1)
        logits, hidden, kv_cache = run_model(weights, kv_cache, batch, meta, rows, extra)
        logits = logits.reshape(ends.shape[0], q, -1)
        return logits[:, -1], hidden, kv_cache, logits
    return step


def _functions(model: XlaModel) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``model``'s forward and compute_logits: its own, or graphrt's decoder's (DecoderConfig)."""
    if model.forward is not None and model.compute_logits is not None:
        return model.forward, model.compute_logits
    if model.forward is not None or model.compute_logits is not None:
        raise InputError("model", "XlaModel takes both forward and compute_logits (a model of its own), "
                                  "or neither (graphrt's decoder)")
    if not isinstance(model.config, DecoderConfig):
        raise InputError("model", f"XlaModel without forward / compute_logits runs graphrt's Llama / Qwen3 "
                                  f"decoder, which reads a DecoderConfig, not a {type(model.config).__name__}; "
                                  "a model of its own passes XlaModel(config, params, forward=..., "
                                  "compute_logits=...) (docs/xla.md)")
    return jax_decoder.forward, jax_decoder.compute_logits


def model_program(model: Any, block_size: int, decode_query_len: int = 1, tp_size: int = 1,
                  attention: Any = None, num_state_slots: int = 0) -> tuple[Any, Any, Callable[..., Any],
                                                                             Callable[..., jax.Array]]:
    """(model config, weights pytree, step function, ``logits(weights, hidden rows)``) for every
    kind of model accepted; the config checked (:func:`check_model_config`, naming any member
    it lacks). ``attention`` is graphrt's decoder's (``decoder.forward``'s argument). The model's
    forward gets ``extra=`` only when it declares extra inputs (:func:`model_extra_specs`)."""
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], DecoderConfig):
        model = XlaModel(*model)
    declares = bool(model_extra_specs(model))
    if isinstance(model, XlaModel):
        cfg = model.config
        check_model_config(cfg, tp_size)
        forward, compute_logits = _functions(model)
        if model.own_code and attention is not None:
            forward = functools.partial(forward, attention=attention)

        def logits(params: Any, hidden: jax.Array) -> jax.Array:
            return compute_logits(params, hidden, config=cfg)

        state = ({"num_slots": num_state_slots, "checkpoints": decode_query_len} if model.state is not None
                 else None)

        def run_model(params: Any, kv_cache: jax.Array, batch: XlaBatch, meta: AttentionMetadata,
                      last: jax.Array, extra: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
            more = {"extra": extra} if declares else {}
            names = contextlib.nullcontext()
            if state is not None:        # the cache is (kv, states); the step's slots and form
                more.update(state, state_slots=batch.state_slots,
                            uniform=decode_query_len if batch.uniform_decode else 0)
                names = naming_states(kv_cache[1], state_array_names(model.state))   # for write_states' errors
            with names:
                hidden, kv_cache = forward(params, kv_cache, batch.input_ids, batch.positions, meta,
                                           config=cfg, block_size=block_size, **more)
            return logits(params, hidden[last]), hidden, kv_cache

        return cfg, model.params, _make_step(run_model, decode_query_len), logits
    try:
        from flax import nnx
    except ImportError:
        nnx = None
    if nnx is not None and isinstance(model, nnx.Module):
        cfg = getattr(model, "config", None)
        check_model_config(cfg, tp_size)      # its `config`: the KV cache layout, the vocabulary
        own = getattr(model, "block_size", block_size)
        if own != block_size:
            raise ConfigError(f"the nnx module was built for block_size={own}, the config says {block_size}")
        graphdef, state = nnx.split(model)

        def logits_nnx(state: Any, hidden: jax.Array) -> jax.Array:
            return nnx.merge(graphdef, state).compute_logits(hidden)

        def run_nnx(state: Any, kv_cache: jax.Array, batch: XlaBatch, meta: AttentionMetadata,
                    last: jax.Array, extra: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
            module = nnx.merge(graphdef, state)
            hidden, kv_cache = module(kv_cache, batch.input_ids, batch.positions, meta,
                                      **({"extra": extra} if declares else {}))
            return module.compute_logits(hidden[last]), hidden, kv_cache

        return cfg, state, _make_step(run_nnx, decode_query_len), logits_nnx
    raise InputError("model", f"{type(model).__name__} is not a model the xla backend runs: pass "
                              "XlaBackend.load_model(...)'s XlaModel, a (DecoderConfig, params) pair, "
                              "XlaModel(config, params, forward=..., compute_logits=...) for a model of "
                              "its own, or a flax nnx.Module with __call__(kv_cache, input_ids, positions, "
                              "meta[, extra=]) and compute_logits(hidden)")


def xla_kv_dtypes() -> tuple[str, ...]:
    """The KV-cache dtypes the xla backend holds (float64 only with ``jax_enable_x64``)."""
    wide = ("float64",) if jax.config.jax_enable_x64 else ()
    return (*wide, "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def xla_kv_spec(model_config: Any, weights_dtype: Any, config: Any) -> KVCacheSpec:
    """The JAX decoder's KV cache spec (one group per sliding window, one cache array) resolved
    for ``config`` (block size, ``kv_cache_dtype``): a ConfigError naming the field otherwise."""
    return resolve_kv_spec(decoder_kv_spec(model_config), block_size=config.block_size,
                           kv_cache_dtype=config.kv_cache_dtype, model_dtype=jnp.dtype(weights_dtype),
                           supported=xla_kv_dtypes(), backend="xla", num_layers=model_config.num_hidden_layers)


class XlaPrograms:
    """One model's jitted forward and samplers on ``mesh``, and its weights placed there.

    ``forward(weights, kv_cache, batch, future_tokens, future_rows[, extra])`` donates the KV
    cache (with ``decode_query_len > 1`` it also returns position logits); ``greedy`` and
    ``sample`` return tokens padded to ``max_reqs``; with ``max_logprobs > 0``, ``logprobs`` and
    ``prompt_logprobs``. ``own_code`` is False for an nnx module (its code is in its graphdef,
    which the executable store cannot fingerprint). ``attention`` says whether Pallas ragged
    paged attention runs (TPUs; the cache in page layout, :meth:`kv_shape`) and why.
    """

    def __init__(self, model: Any, block_size: int, mesh: Mesh, decode_query_len: int = 1,
                 max_reqs: int = 1, config: Any = None, max_logprobs: int = 0) -> None:
        self.mesh = mesh
        self.tp_size = shd.mesh_size(mesh)
        #: A hybrid model's recurrent state (docs/hybrid.md), resolved; None without.
        self.state_spec = None
        slots = config.max_num_seqs if config is not None else 1
        self.model_config, weights, step, logits = model_program(model, block_size, decode_query_len,
                                                                 self.tp_size, num_state_slots=slots)
        own_decoder = isinstance(model, tuple) or (isinstance(model, XlaModel) and model.own_code)
        self.extra_inputs = model_extra_specs(model)
        self.decode_query_len = decode_query_len
        self.max_reqs = int(max_reqs)
        shd.check_tp(self.model_config, self.tp_size)
        self.own_code = own_decoder
        self.replicated = shd.replicated(mesh)
        self.kv_sharding = shd.kv_cache_sharding(mesh, self.model_config)
        weight_shardings = shd.weight_shardings(weights, mesh, self.model_config)
        self.weights = shd.place(weights, weight_shardings)     # abstract weights stay abstract
        # The weights' dtype, or the model config's ``dtype`` where it has one: the KV cache's
        # unless the spec (``kv_cache_dtype``) says otherwise.
        own = getattr(self.model_config, "dtype", None)
        self.dtype = jnp.dtype(jax.tree_util.tree_leaves(self.weights)[0].dtype if own is None else own)
        self.kv_spec = None if config is None else xla_kv_spec(self.model_config, self.dtype, config)
        self.kv_dtype = (self.dtype if self.kv_spec is None or not self.kv_spec.groups
                         else jnp.dtype(self.kv_spec.groups[0].dtype))
        declared = getattr(model, "state", None)
        if declared is not None:
            if self.tp_size > 1:
                raise ConfigError("tensor_parallel_size: graphrt's hybrid models run on one device on xla; "
                                  "sharding recurrent layers is not implemented")
            self.state_spec = resolve_state_spec(declared, model_dtype=self.dtype, supported=xla_kv_dtypes(),
                                                 backend="xla", num_layers=state_layers_of(self.model_config))
            self.state_memory = state_memory(self.state_spec, max_num_seqs=slots, decode_query_len=decode_query_len)
        #: Graphrt's decoder's attention (GRAPHRT_ATTENTION): Pallas stores the cache in its page layout.
        self.attention = choose_xla_attention(self.model_config, list(mesh.devices.flat), self.dtype, self.kv_dtype,
                                              own_decoder=own_decoder, tp_size=self.tp_size)
        if self.attention.kernel == "pallas":
            _, _, step, _ = model_program(model, block_size, decode_query_len, self.tp_size,
                                          attention=self.attention.attention)
        #: The model's declared attention (the seam's declarations, shared with torch), checked:
        #: what the executables key (``max_seq_len``: context buckets) and run.
        self.attention_backend = model_attention(model, self.attention.declarations)
        groups = [] if self.kv_spec is None else [(i, g.dtype) for i, g in enumerate(self.kv_spec.groups)]
        self.keyed_host_values, self.attention_support = checked_attention(
            self.attention_backend, list(mesh.devices.flat), self.dtype, groups)
        repl = self.replicated
        #: The KV cache's sharding and layout (``sharding.kv_cache_format``): the forward's and the allocation's.
        self.kv_format = shd.kv_cache_format(self.kv_sharding, len(self.kv_shape(1, block_size)))
        cache_sharding = self.kv_format
        if self.state_spec is not None:         # the cache pytree (kv, states), states replicated
            cache_sharding = (self.kv_format, tuple(repl for _ in self.state_shapes()))
        self.forward = jax.jit(step, donate_argnums=(1,),
                               in_shardings=(weight_shardings, cache_sharding, repl, repl, repl)
                               + ((repl,) if self.extra_inputs else ()),
                               out_shardings=(repl, repl, cache_sharding) + ((repl,) if decode_query_len > 1 else ()))
        if self.state_spec is not None:
            self.check_state_writes(block_size)
        self.greedy = jax.jit(padded_tokens(greedy_tokens, self.max_reqs), in_shardings=(repl,), out_shardings=repl)
        self.sample = jax.jit(padded_tokens(sample_tokens, self.max_reqs), in_shardings=(repl, repl),
                              out_shardings=repl)
        #: The random sampler exact for a top_k past its candidates (SamplerKey.wide_top_k).
        self.sample_wide = jax.jit(padded_tokens(functools.partial(sample_tokens, wide=True), self.max_reqs),
                                   in_shardings=(repl, repl), out_shardings=repl)
        k = self.max_logprobs = min(max_logprobs, int(self.model_config.vocab_size))
        self.logprobs = jax.jit(sampled_logprobs(k), in_shardings=(repl, repl), out_shardings=repl) if k else None

        def prompt(weights: Any, hidden: jax.Array, targets: jax.Array) -> tuple[jax.Array, ...]:
            return token_logprobs(logits(weights, hidden), targets, k)

        self.prompt_logprobs = (jax.jit(prompt, in_shardings=(weight_shardings, repl, repl), out_shardings=repl)
                                if k else None)

    def check_state_writes(self, block_size: int) -> None:
        """Trace the forward once, abstractly (``jax.eval_shape``: nothing compiled or run), on a
        step of 2 tokens of 1 request over the spec's state arrays: a layer that writes states of
        another per-request shape than the spec declares (``write_states``) is a ConfigError
        naming the group, the tensor and both shapes now, when the runner is built, not at the
        first compile or step. A trace that fails otherwise is left to the compile, which
        raises it where it always did."""
        kv = jax.ShapeDtypeStruct(self.kv_shape(1, block_size), self.kv_dtype)
        states = tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in self.state_shapes())
        future = (jax.ShapeDtypeStruct((self.max_reqs,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
        try:
            jax.eval_shape(self.forward, self.weights, (kv, states), batch_spec(2, 1, False, 1), *future,
                           *abstract_args(self.extra_inputs, 2, 1))
        except ConfigError:
            raise
        except Exception as exc:        # noqa: BLE001 -- not a state shape: the compile raises it
            logger.debug("xla: the state-shape probe's trace failed (%s); the first compile reports it", exc)

    def kv_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """``[layers, 2, blocks * block_size + 1, kv_heads, head_dim]`` (the last row: trash), or
        with Pallas attention its page layout (:func:`pallas_kv_shape`)."""
        c = self.model_config
        if self.attention.kernel == "pallas":
            return pallas_kv_shape(c, num_blocks, block_size)
        return (c.num_hidden_layers, 2, num_blocks * block_size + 1, c.num_key_value_heads, c.head_dim)

    def kv_as_rows(self, host: Any, block_size: int) -> Any:
        """A host copy of the cache (:meth:`kv_shape`) in the reference layout: as it is, or with
        Pallas attention its pages as rows."""
        if self.attention.kernel != "pallas":
            return host
        return pages_to_rows(host, self.model_config.num_hidden_layers, block_size)

    def kv_from_rows(self, values: Any, shape: tuple[int, ...], block_size: int) -> Any:
        """The inverse of :meth:`kv_as_rows` for a cache of ``shape``."""
        if self.attention.kernel != "pallas":
            return values
        return rows_to_pages(np.asarray(values, np.float32), shape, self.model_config.num_hidden_layers, block_size)

    def state_shapes(self) -> list[tuple[tuple[int, ...], Any]]:
        """(shape, dtype) of each recurrent layer's state arrays, in layer order:
        ``[slots + 1, checkpoints, *shape]`` (the last slot: the trash slot)."""
        spec, mem = self.state_spec, getattr(self, "state_memory", None)
        if spec is None:
            return []
        return [((mem.num_slots + 1, mem.checkpoints, *t.shape), jnp.dtype(t.dtype))
                for layer in range(spec.num_layers) for t in spec.layer_tensors(layer)]

    def zeros_states(self) -> list[jax.Array]:
        """Zeroed state arrays (:meth:`state_shapes`), replicated."""
        return [jax.jit(lambda s=shape, d=dtype: jnp.zeros(s, d), out_shardings=self.replicated)()
                for shape, dtype in self.state_shapes()]

    def zeros_kv_cache(self, shape: tuple[int, ...]) -> jax.Array:
        """A zeroed KV cache of ``shape``, laid out over the mesh as the forward expects it."""
        return jax.jit(lambda: jnp.zeros(shape, self.kv_dtype), out_shardings=self.kv_format)()


__all__ = ["XlaModel", "XlaPrograms", "model_program", "padded_tokens", "resolve_future_tokens", "xla_kv_dtypes",
           "xla_kv_spec"]
