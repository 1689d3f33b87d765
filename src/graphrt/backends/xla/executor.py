"""``xla`` (alias ``jax``): one ahead-of-time compiled XLA executable per bucket.

The forward and the sampler are jitted separately (as sglang-jax does) and compiled with
``jit(...).lower(...).compile()`` for every key the runner's XLA dispatcher can return:
mixed / prefill steps at (the next token bucket, a fixed batch size), decode steps at (the
next batch-size bucket, as many tokens). The KV cache is donated, so each step updates it
in place. There is no eager escape: the largest buckets cover ``max_num_batched_tokens`` and
``max_num_seqs`` (config validation), and anything larger is an ``InputError``.

Compiles are counted through ``jax.monitoring`` (:mod:`graphrt.backends.xla.compile`). Once
every planned key is compiled (after warm-up), a compile -- a build of a new key, or one
caught while a step runs -- is unplanned: strict mode raises ``CacheMissError`` naming the
shape and the field that differs (pytree structure, dtype or shape), otherwise it is logged
and counted in ``unplanned_compiles``. The hot path does no eager ``jnp`` work: numpy checks
and copies of the padded host rows, one executable call each for the forward and the sampler,
one host copy of the tokens.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable, Hashable, Sequence

import numpy as np
from tqdm.auto import tqdm

from graphrt.core import defaults
from graphrt.backends.base import Backend, Executor, SamplingBatch
from graphrt.core.cache import GraphCache, describe_key
from graphrt.config import GraphConfig
from graphrt.core.dispatch import AttentionGraphSupport, BatchDescriptor, Dispatcher, GraphMode, RuntimeMode, SamplerKey
from graphrt.core.errors import BackendUnavailableError, CacheMissError, ConfigError, GraphrtError, InputError
from graphrt.core.fields import ModelInputs

try:
    import jax
    import jax.numpy as jnp
except ImportError as _exc:  # pragma: no cover - exercised only without jax
    jax = None
    _IMPORT_ERROR: str | None = str(_exc)
else:
    _IMPORT_ERROR = None
    from jax.sharding import Mesh

    from graphrt.backends.xla import sharding as shd
    from graphrt.backends.xla.batch import (BATCH_FIELDS, SAMPLING_FIELDS, SamplingMetadata, XlaBatch,
                                            batch_spec, describe_change, sampling_spec)
    from graphrt.backends.xla import batch as xla_batch, sampler as xla_sampler
    from graphrt.backends.xla.executables import ExecutableCache, executor_fingerprint
    from graphrt.backends.xla.graphs import XlaGraphs
    from graphrt.backends.xla.compile import (enable_persistent_cache, install_listeners,
                                              thread_cache_hits, thread_compiles, thread_counts,
                                              thread_last_compiled)
    from graphrt.backends.xla.sampler import greedy_tokens, sample_tokens
    from graphrt.models.hf_config import DecoderConfig
    from graphrt.models.jax import decoder as jax_decoder
    from graphrt.models.jax.decoder import AttentionMetadata, compute_logits, forward

    #: The calling thread's compile counters, read directly on the hot path (one attribute load).
    _compiles = thread_counts()

logger = logging.getLogger(__name__)

_I32 = np.dtype(np.int32)
_U32_MASK = 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class XlaModel:
    """graphrt's JAX reference decoder: its config and params pytree (``jax_loader`` layout)."""

    config: "DecoderConfig"
    params: dict[str, Any]


@dataclasses.dataclass
class XlaEntry:
    """One compiled executable with what it expects and what it cost."""

    executable: Any                      # jax.stages.Compiled
    key: Hashable
    spec: Any                            # abstract inputs: XlaBatch / SamplingMetadata / None (greedy)
    shapes: tuple[tuple[int, ...], ...]  # forward keys: the shape of each BATCH_FIELDS entry
    lower_seconds: float
    compile_seconds: float
    nbytes: int
    persistent_cache_hit: bool

    @property
    def build_seconds(self) -> float:
        """Lowering plus compiling, on the thread that did each."""
        return self.lower_seconds + self.compile_seconds

    def report(self) -> dict[str, Any]:
        """One row of the per-bucket timing report."""
        return {"key": describe_key(self.key), "lower_s": round(self.lower_seconds, 4),
                "compile_s": round(self.compile_seconds, 4), "bytes": self.nbytes,
                "persistent_cache_hit": self.persistent_cache_hit}


def _as_array(value: Any) -> Any:
    """``None`` stays ``None`` (a structure change), anything else becomes an ndarray."""
    return None if value is None else np.asarray(value)


def _spec_shapes(spec: Any) -> tuple[tuple[int, ...], ...]:
    """Forward specs: the shape of each batch field (checked before every call)."""
    return (tuple(tuple(getattr(spec, f).shape) for f in BATCH_FIELDS)
            if isinstance(spec, XlaBatch) else ())


def _is_sampler_key(key: Hashable) -> bool:
    return isinstance(key, SamplerKey)


def _jax_dtype(dtype: Any) -> Any:
    """A jnp dtype from a jnp / numpy dtype or scalar type, its name, or a torch dtype."""
    if dtype is None:
        return jnp.dtype(jnp.float32)
    try:
        return jnp.dtype(dtype)
    except TypeError:
        return jnp.dtype(str(dtype).removeprefix("torch."))


class XlaBackend(Backend):
    """JAX / XLA on the default platform (CPU, GPU, TPU), optionally tensor-parallel.

    ``tp_size`` builds a 1-D mesh over the first devices; ``mesh`` (axis ``"tp"``) is used
    as given. ``dtype`` is the weights' dtype for :meth:`load_model` (default float32).
    ``compile_workers`` threads compile buckets in parallel during :meth:`XlaExecutor.build_many`
    (default: one per CPU core, at most ``defaults.XLA_MAX_COMPILE_WORKERS``).
    """

    name = "xla"
    framework = "jax"

    def __init__(self, tp_size: int = 1, mesh: "Mesh | None" = None, dtype: Any = None,
                 compile_workers: int | None = None) -> None:
        if _IMPORT_ERROR is not None:
            raise BackendUnavailableError(f"the xla backend needs jax: {_IMPORT_ERROR}")
        self.mesh = mesh if mesh is not None else shd.make_mesh(tp_size)
        self.tp_size = shd.mesh_size(self.mesh)
        self.dtype = dtype
        self.compile_workers = compile_workers or min(os.cpu_count() or 1, defaults.XLA_MAX_COMPILE_WORKERS)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if _IMPORT_ERROR is not None:
            return f"jax cannot be imported: {_IMPORT_ERROR}"
        return None

    def load_model(self, model_dir: str, dtype: Any = None) -> XlaModel:
        """The JAX reference Llama / Qwen3 of a Hugging Face directory."""
        from graphrt.models.jax.loader import load_jax_params
        config, params = load_jax_params(model_dir, _jax_dtype(dtype if dtype is not None else self.dtype))
        return XlaModel(config, params)

    def graphs(self, fn: Callable[..., Any], cache: GraphCache | None = None, **options: Any) -> XlaGraphs:
        """``fn`` compiled ahead of time once per key (``donate_argnums=`` as for ``jax.jit``)."""
        return XlaGraphs(fn, cache, **options)

    def dispatcher(self, config: GraphConfig, mode: GraphMode, model: Any) -> Dispatcher:
        """The token x batch-size grid: decode by batch size, mixed steps at the largest batch
        size; no eager path, so every covered shape has an executable."""
        return config.xla_dispatcher()

    def create_executor(self, model: Any, config: GraphConfig) -> "XlaExecutor":
        """An executor for an :class:`XlaModel`, a ``(DecoderConfig, params)`` pair or an nnx module."""
        return XlaExecutor(model, config, mesh=self.mesh, compile_workers=self.compile_workers)


def _model_program(model: Any, block_size: int) -> tuple["DecoderConfig", Any, Callable[..., Any]]:
    """(decoder config, weights pytree, step function) for every kind of model accepted."""
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], DecoderConfig):
        model = XlaModel(*model)
    if isinstance(model, XlaModel):
        cfg = model.config

        def run_model(params: Any, kv_cache: jax.Array, batch: XlaBatch, meta: AttentionMetadata,
                      last: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            hidden, kv_cache = forward(params, kv_cache, batch.input_ids, batch.positions, meta,
                                       config=cfg, block_size=block_size)
            return compute_logits(params, hidden[last], config=cfg), hidden, kv_cache

        return cfg, model.params, _make_step(run_model)
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

        def run_nnx(state: Any, kv_cache: jax.Array, batch: XlaBatch, meta: AttentionMetadata,
                    last: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            module = nnx.merge(graphdef, state)
            hidden, kv_cache = module(kv_cache, batch.input_ids, batch.positions, meta)
            return module.compute_logits(hidden[last]), hidden, kv_cache

        return cfg, state, _make_step(run_nnx)
    raise InputError("model", f"{type(model).__name__} is not a model the xla backend runs: pass "
                              "XlaBackend.load_model(...)'s XlaModel, a (DecoderConfig, params) pair, "
                              "or a flax nnx.Module with __call__(kv_cache, input_ids, positions, meta) "
                              "and compute_logits(hidden)")


def _make_step(run_model: Callable[..., Any]) -> Callable[..., Any]:
    def step(weights: Any, kv_cache: jax.Array, batch: XlaBatch) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Forward of one padded step: (logits at each request's last token, hidden, new KV cache)."""
        meta = AttentionMetadata(batch.slot_mapping, batch.query_start_loc, batch.seq_lens,
                                 batch.block_table)
        last = jnp.maximum(batch.query_start_loc[1:] - 1, 0)
        return run_model(weights, kv_cache, batch, meta, last)
    return step


def _executable_bytes(compiled: Any) -> int:
    """Device bytes an executable holds beyond its arguments (code and scratch), where XLA says."""
    try:
        stats = compiled.memory_analysis()
        return int(stats.generated_code_size_in_bytes + stats.temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - some platforms do not implement memory analysis
        return 0


class XlaExecutor(Executor):
    """Compiled executables, the donated KV cache and host staging buffers of one model."""

    has_graphs = True
    attention_support = AttentionGraphSupport.ALWAYS
    supports_piecewise = False
    eager_fallback = False

    def __init__(self, model: Any, config: GraphConfig, *, mesh: "Mesh", compile_workers: int = 1) -> None:
        install_listeners()
        if config.compilation_cache_dir:
            enable_persistent_cache(config.compilation_cache_dir)
        self.config = config
        self.mesh = mesh
        self.tp_size = shd.mesh_size(mesh)
        self.compile_workers = max(1, int(compile_workers))
        self.model_config, weights, step = _model_program(model, config.block_size)
        shd.check_tp(self.model_config, self.tp_size)
        self.vocab_size = int(self.model_config.vocab_size)
        self._repl = shd.replicated(mesh)
        self._kv_sharding = shd.kv_cache_sharding(mesh, self.model_config)
        self._weight_shardings = shd.weight_shardings(weights, mesh, self.model_config)
        self.weights = jax.device_put(weights, self._weight_shardings)
        self.dtype = jnp.dtype(jax.tree_util.tree_leaves(self.weights)[0].dtype)

        forward_keys = [key for _, key in config.xla_dispatcher().keys()]
        sampler_reqs = sorted({k.num_reqs for k in forward_keys}, reverse=True)
        #: Every key warm-up compiles; once all exist, any further compile is unplanned.
        self.planned_keys: list[Hashable] = forward_keys + [
            SamplerKey(r, greedy) for r in sampler_reqs for greedy in (True, False)]
        max_t = max(k.num_tokens for k in forward_keys)
        max_r = max(k.num_reqs for k in forward_keys)
        width = config.max_blocks_per_req
        self._width = width
        shapes = {"input_ids": (max_t,), "positions": (max_t,), "slot_mapping": (max_t,),
                  "query_start_loc": (max_r + 1,), "seq_lens": (max_r,),
                  "num_computed_tokens": (max_r,), "block_table": (max_r, width)}
        self.host_buffers = {name: np.zeros(shape, np.int32) for name, shape in shapes.items()}
        self._samp_host = {"temperature": np.zeros(max_r, np.float32),
                           "top_k": np.zeros(max_r, np.int32), "top_p": np.ones(max_r, np.float32),
                           "seeds": np.zeros((max_r, 2), np.uint32), "steps": np.zeros(max_r, np.uint32)}

        self._forward_jit = jax.jit(step, donate_argnums=(1,),
                                    in_shardings=(self._weight_shardings, self._kv_sharding, self._repl),
                                    out_shardings=(self._repl, self._repl, self._kv_sharding))
        self._greedy_jit = jax.jit(greedy_tokens, in_shardings=(self._repl,), out_shardings=self._repl)
        self._sample_jit = jax.jit(sample_tokens, in_shardings=(self._repl, self._repl),
                                   out_shardings=self._repl)
        self._exec_cache = self._executable_cache(model, config)
        self._entries: dict[Hashable, XlaEntry] = {}
        self._lock = threading.Lock()
        self._sealed = False
        self.kv_cache: jax.Array | None = None
        #: Backend compiles this executor caused (builds, and any caught while running).
        self.compile_count = 0
        #: Compiles after warm-up (strict mode raises instead).
        self.unplanned_compiles = 0
        self._rng = np.random.default_rng(defaults.XLA_SAMPLER_HOST_SEED)
        self._seed_steps: dict[int, int] = {}
        self._last_logits: jax.Array | None = None
        self._last_hidden: jax.Array | None = None

    def _executable_cache(self, model: Any, config: GraphConfig) -> "ExecutableCache | None":
        """With ``compilation_cache_dir``, serialized executables of graphrt's own JAX model.

        Not for nnx modules: their code lives in the graphdef, which the fingerprint cannot
        see, so a changed module with the same parameter shapes could load a stale executable.
        """
        if not config.compilation_cache_dir or not isinstance(model, (XlaModel, tuple)):
            return None
        import sys
        fingerprint = executor_fingerprint(
            modules=(jax_decoder, xla_batch, xla_sampler, shd, sys.modules[__name__]),
            devices=list(self.mesh.devices.flat), mesh_axes=(self.mesh.axis_names, self.mesh.devices.shape),
            parts=(self.model_config, self.weights, config.block_size, self._width, self.vocab_size))
        return ExecutableCache(config.compilation_cache_dir, fingerprint, list(self.mesh.devices.flat))

    # ---- KV cache --------------------------------------------------------------------
    def _kv_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        c = self.model_config
        return (c.num_hidden_layers, 2, num_blocks * block_size + 1, c.num_key_value_heads, c.head_dim)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block takes on each device (KV heads split over the mesh when they divide)."""
        c = self.model_config
        total = (2 * c.num_hidden_layers * block_size * c.num_key_value_heads * c.head_dim
                 * self.dtype.itemsize)
        return total // self.tp_size if shd.kv_heads_sharded(c, self.tp_size) else total

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """A zeroed cache ``[layers, 2, blocks * block_size + 1, kv_heads, head_dim]``; the last
        row is the trash row padded tokens write into. A new shape drops compiled executables."""
        if block_size != self.config.block_size:
            raise ConfigError(f"block_size {block_size} differs from the config's {self.config.block_size}")
        shape = self._kv_shape(num_blocks, block_size)
        if self.kv_cache is not None and self.kv_cache.shape != shape:
            self._entries.clear()
            self._sealed = False
        self.kv_cache = jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=self._kv_sharding)()

    def memory_info(self) -> tuple[int, int] | None:
        stats = [d.memory_stats() for d in self.mesh.devices.flat]
        if not all(s and "bytes_limit" in s for s in stats):
            return None
        free = min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
        return int(free), int(min(s["bytes_limit"] for s in stats))

    # ---- warm-up state ---------------------------------------------------------------
    @property
    def sealed(self) -> bool:
        """Whether warm-up is over: every planned key is compiled (or :meth:`seal` was called)."""
        if not self._sealed and all(k in self._entries for k in self.planned_keys):
            self._sealed = True
        return self._sealed

    def seal(self) -> None:
        """Declare warm-up over even if some planned keys were never compiled."""
        self._sealed = True

    @property
    def compile_report(self) -> list[dict[str, Any]]:
        """Per compiled key: lowering and compile seconds, bytes, persistent-cache hit."""
        return [e.report() for e in self._entries.values()]

    # ---- build -------------------------------------------------------------------------
    def build(self, mode: RuntimeMode, key: BatchDescriptor | SamplerKey) -> tuple[XlaEntry, int]:
        """Compile the forward for a :class:`BatchDescriptor`, or the sampler for
        ``SamplerKey(num_reqs, greedy)``; returns (entry, bytes). Already compiled: returned as is."""
        entry = self._entries.get(key) or self._load_cached(mode, key)
        if entry is None:
            entry = self._compile(key, *self._lower(mode, key))
        return entry, entry.nbytes

    def build_seconds(self, entry: Any) -> float | None:
        return entry.build_seconds

    def build_many(self, jobs: Sequence[tuple[RuntimeMode, Hashable]], *, workers: int | None = None,
                   progress: bool = False) -> list[XlaEntry]:
        """Compile many keys: lowered one after another here, compiled by ``workers`` threads.

        XLA's compile releases the GIL, so on a multi-core host the compiles overlap (each
        entry still records its own lowering and compile seconds). ``progress`` shows a bar.
        Keys already compiled are returned as they are. Returns entries in the order of ``jobs``.
        """
        workers = max(1, workers or self.compile_workers)
        todo = list(dict.fromkeys((mode, key) for mode, key in jobs if key not in self._entries))
        start = time.perf_counter()
        bar = tqdm(total=len(todo), desc=f"graphrt xla precompile ({workers} threads)", unit="bucket",
                   disable=not progress or not todo, leave=False)
        with bar, concurrent.futures.ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix="graphrt-xla-compile") as pool:
            futures = []
            for mode, key in todo:
                if self._load_cached(mode, key) is not None:
                    bar.set_postfix_str(f"loaded {describe_key(key)}")
                    bar.update()
                    continue
                bar.set_postfix_str(f"lowering {describe_key(key)}")
                futures.append(pool.submit(self._compile, key, *self._lower(mode, key)))
            for fut in concurrent.futures.as_completed(futures):
                bar.set_postfix_str(f"compiled {describe_key(fut.result().key)}")
                bar.update()
        if todo:
            built = [self._entries[key] for _, key in todo]
            logger.info("graphrt: xla precompiled %d executables in %.2f s with %d thread(s): lowering "
                        "%.2f s, compiling %.2f s, %d loaded from the persistent cache", len(built),
                        time.perf_counter() - start, workers, sum(e.lower_seconds for e in built),
                        sum(e.compile_seconds for e in built), sum(e.persistent_cache_hit for e in built))
        return [self._entries[key] for _, key in jobs]

    def _abstract_inputs(self, mode: RuntimeMode, key: Hashable) -> tuple[Any, Any, tuple[Any, ...]]:
        """(jitted function, spec, abstract arguments) of ``key``; strict mode refuses a key
        that warm-up did not plan once warm-up is over."""
        if self.sealed:
            self._unplanned(key, self.explain_miss(key))
        if _is_sampler_key(key):
            num_reqs, greedy = key.num_reqs, key.greedy
            logits = jax.ShapeDtypeStruct((num_reqs, self.vocab_size), jnp.float32)
            if greedy:
                return self._greedy_jit, None, (logits,)
            spec = sampling_spec(num_reqs)
            return self._sample_jit, spec, (logits, spec)
        if mode is not RuntimeMode.FULL or not isinstance(key, BatchDescriptor) or key.num_reqs is None:
            raise GraphrtError(f"the xla backend compiles whole forwards (FULL keys with a request "
                               f"count); got {mode.value} {key}")
        if self.kv_cache is None:
            raise GraphrtError("allocate_kv_cache before building executables (they are compiled "
                               "for the KV cache's shape)")
        spec = batch_spec(key.num_tokens, key.num_reqs, key.uniform_decode, self._width)
        kv = jax.ShapeDtypeStruct(self.kv_cache.shape, self.kv_cache.dtype)
        return self._forward_jit, spec, (self.weights, kv, spec)

    def _lower(self, mode: RuntimeMode, key: Hashable) -> tuple[Any, Any, float]:
        """(lowered computation, abstract inputs, seconds) for ``key``."""
        jitted, spec, args = self._abstract_inputs(mode, key)
        t0 = time.perf_counter()
        lowered = jitted.lower(*args)
        return lowered, spec, time.perf_counter() - t0

    def _cache_key(self, key: Hashable) -> tuple[Any, ...]:
        """The executable cache's key: the bucket and the KV cache's shape."""
        return (key, tuple(self.kv_cache.shape) if self.kv_cache is not None else None)

    def _load_cached(self, mode: RuntimeMode, key: Hashable) -> XlaEntry | None:
        """The entry for ``key`` from the executable cache, skipping lowering; None on a miss."""
        if self._exec_cache is None:
            return None
        _, spec, _ = self._abstract_inputs(mode, key)
        t0 = time.perf_counter()
        compiled = self._exec_cache.load(self._cache_key(key))
        if compiled is None:
            return None
        entry = XlaEntry(compiled, key, spec, _spec_shapes(spec), 0.0, time.perf_counter() - t0,
                         _executable_bytes(compiled), True)
        with self._lock:
            self._entries[key] = entry
        logger.debug("graphrt: xla loaded %s from the executable cache", describe_key(key))
        return entry

    def _compile(self, key: Hashable, lowered: Any, spec: Any, lower_seconds: float) -> XlaEntry:
        compiles, hits = thread_compiles(), thread_cache_hits()
        t0 = time.perf_counter()
        compiled = lowered.compile()
        seconds = time.perf_counter() - t0
        entry = XlaEntry(compiled, key, spec, _spec_shapes(spec), lower_seconds, seconds,
                         _executable_bytes(compiled), thread_cache_hits() > hits)
        if self._exec_cache is not None:
            self._exec_cache.store(self._cache_key(key), compiled)
        with self._lock:
            self.compile_count += thread_compiles() - compiles
            self._entries[key] = entry
        logger.debug("graphrt: xla compiled %s in %.3f s (lowering %.3f s)%s", describe_key(key), seconds,
                     lower_seconds, " from the persistent cache" if entry.persistent_cache_hit else "")
        return entry

    def explain_miss(self, key: Hashable) -> str:
        """Which compiled key is nearest to ``key`` and which input field differs from it."""
        if _is_sampler_key(key):
            same = [k for k in self._entries if _is_sampler_key(k) and k.greedy == key.greedy]
            if not same:
                return f"no {'greedy' if key.greedy else 'random'} sampler was compiled during warm-up"
            near = min(same, key=lambda k: abs(k.num_reqs - key.num_reqs))
            return (f"shape: field 'logits' is ({key.num_reqs}, {self.vocab_size}); the nearest compiled "
                    f"sampler expects ({near.num_reqs}, {self.vocab_size})")
        forward_keys = [k for k in self._entries if isinstance(k, BatchDescriptor)]
        planned = f"{len(forward_keys)} forward buckets were compiled during warm-up"
        if not isinstance(key, BatchDescriptor) or key.num_reqs is None or not forward_keys:
            return f"{key} was never compiled; {planned}"
        near = min(forward_keys, key=lambda k: (k.uniform_decode != key.uniform_decode,
                                                abs(k.num_tokens - key.num_tokens),
                                                abs(k.num_reqs - key.num_reqs)))
        diff = describe_change(self._entries[near].spec,
                               batch_spec(key.num_tokens, key.num_reqs, key.uniform_decode, self._width))
        return f"{key} was never compiled ({planned}); versus the nearest, {near}: {diff}"

    def _unplanned(self, key: Hashable, reason: str) -> None:
        """A compile after warm-up: raise in strict mode, else log and count it."""
        if self.config.strict:
            raise CacheMissError(key, reason)
        with self._lock:
            self.unplanned_compiles += 1
        logger.warning("graphrt: unplanned XLA compile after warm-up: %s", reason)

    def _check_compiles(self, before: int, key: Hashable, what: str) -> None:
        n = thread_compiles() - before
        with self._lock:
            self.compile_count += n
        if self.sealed:
            self._unplanned(key, f"{n} XLA compile(s) (last: {thread_last_compiled()}) while running the "
                                 f"precompiled {what} for {describe_key(key)}: something on the hot path was "
                                 "not precompiled (an eager jax op, or an argument whose pytree structure, "
                                 "dtype or shape differs from warm-up)")

    # ---- run ---------------------------------------------------------------------------
    def _entry(self, mode: RuntimeMode, key: Hashable, entry: Any) -> XlaEntry:
        if isinstance(entry, XlaEntry):
            return entry
        found = self._entries.get(key)
        return found if found is not None else self.build(mode, key)[0]

    def _check_inputs(self, entry: XlaEntry, padded: ModelInputs) -> None:
        """Every padded array has the dtype and shape the executable was compiled for (numpy only)."""
        for name, shape in zip(BATCH_FIELDS, entry.shapes):
            arr = getattr(padded, name)
            if not isinstance(arr, np.ndarray) or arr.dtype != _I32 or arr.shape != shape:
                got = XlaBatch(**{f: _as_array(getattr(padded, f)) for f in BATCH_FIELDS},
                               num_tokens=entry.spec.num_tokens, num_reqs=entry.spec.num_reqs,
                               uniform_decode=entry.spec.uniform_decode)
                raise InputError(name, f"{describe_change(entry.spec, got)} (executable for {entry.key})")

    def run(self, mode: RuntimeMode, key: BatchDescriptor, entry: Any, padded: ModelInputs) -> jax.Array:
        """Run the executable for ``key`` on the padded step; returns device logits ``[R_pad, V]``.

        The executable gets host copies of the padded rows and transfers them itself (JAX's
        C++ argument path: a quarter of the cost of a Python ``jax.device_put`` of six arrays).
        Copies, because on CPU JAX aliases numpy arguments and reads them asynchronously, while
        the runner rewrites its host buffers on the next step. The KV cache is donated and
        replaced by the executable's updated one.
        """
        entry = self._entry(mode, key, entry)
        self._check_inputs(entry, padded)
        spec = entry.spec
        batch = XlaBatch(padded.input_ids.copy(), padded.positions.copy(), padded.slot_mapping.copy(),
                         padded.query_start_loc.copy(), padded.seq_lens.copy(), padded.block_table.copy(),
                         spec.num_tokens, spec.num_reqs, spec.uniform_decode)
        before = _compiles.compiles
        logits, hidden, self.kv_cache = entry.executable(self.weights, self.kv_cache, batch)
        if _compiles.compiles != before:
            self._check_compiles(before, key, "forward")
        self._last_logits, self._last_hidden = logits, hidden
        return logits

    # ---- sample ------------------------------------------------------------------------
    def sample(self, logits: Any, num_reqs: int, sampling: SamplingBatch, *,
               padded_reqs: int | None = None, entry: Any = None) -> np.ndarray:
        """One token id per real request (int64), from the compiled greedy or random sampler.

        ``entry`` is the runner's sampler entry for ``SamplerKey(padded_reqs, all_greedy)``;
        without one, the executor finds (or compiles) it.
        """
        if isinstance(entry, XlaEntry):
            key = entry.key
            rows, greedy = key.num_reqs, key.greedy
        else:
            rows = int(logits.shape[0]) if padded_reqs is None else int(padded_reqs)
            greedy = sampling.all_greedy
            key = SamplerKey(rows, greedy)
            entry = self._entry(RuntimeMode.FULL, key, entry)
        if logits.shape != (rows, self.vocab_size):
            raise InputError("logits", f"shape {tuple(logits.shape)}; the sampler for {rows} rows "
                                       f"expects ({rows}, {self.vocab_size})")
        args = (logits,) if greedy else (logits, self.sampling_metadata(num_reqs, rows, sampling))
        before = _compiles.compiles
        tokens = np.asarray(entry.executable(*args))
        if _compiles.compiles != before:
            self._check_compiles(before, key, "sampler")
        return tokens[:num_reqs].astype(np.int64)

    def sampling_metadata(self, num_reqs: int, rows: int, sampling: SamplingBatch) -> SamplingMetadata:
        """The sampling metadata of one step, as host copies the executable transfers: padded
        rows greedy, unseeded rows keyed from the host generator, seeded rows by their seed and
        their own step counter (which this advances)."""
        h, n = self._samp_host, num_reqs
        h["temperature"][:n] = sampling.temperature
        h["temperature"][n:rows] = 0.0
        h["top_k"][:n] = sampling.top_k
        h["top_k"][n:rows] = self.vocab_size
        h["top_p"][:n] = sampling.top_p
        h["top_p"][n:rows] = 1.0
        seeds, steps = h["seeds"], h["steps"]
        seeds[:n] = self._rng.integers(0, 2**32, size=(n, 2), dtype=np.uint32)
        seeds[n:rows] = 0
        steps[:rows] = 0
        for i, seed in enumerate(sampling.seeds):
            if seed is None:
                continue
            rid = sampling.request_ids[i]
            step = self._seed_steps.get(rid, 0)
            self._seed_steps[rid] = step + 1
            seed = int(seed)
            seeds[i, 0], seeds[i, 1], steps[i] = seed & _U32_MASK, (seed >> 32) & _U32_MASK, step
        return SamplingMetadata(*(h[f][:rows].copy() for f in SAMPLING_FIELDS))

    def free_request(self, request_id: int) -> None:
        self._seed_steps.pop(request_id, None)

    # ---- introspection -----------------------------------------------------------------
    def hidden_states(self, num_tokens: int) -> np.ndarray:
        return np.asarray(self._last_hidden, dtype=np.float32)[:num_tokens]

    def logits(self, num_reqs: int) -> np.ndarray:
        return np.asarray(self._last_logits)[:num_reqs]


__all__ = ["XlaBackend", "XlaExecutor", "XlaEntry", "XlaModel"]
