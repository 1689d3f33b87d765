"""``xla`` (alias ``jax``): one ahead-of-time compiled XLA executable per bucket.

Its dispatcher is the token x batch-size grid of :class:`~graphrt.backends.xla.buckets.XlaBuckets`
(no eager path), its padder the shared :class:`graphrt.Padder`, its entries in the runner's
:class:`graphrt.GraphCache`; its own parts are :class:`XlaPrograms` and :class:`XlaExecutor`.
This module imports without jax, so the registry can say why the backend is unavailable."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from graphrt.backends.base import Backend
from graphrt.backends.xla.buckets import XlaBuckets
from graphrt.config import GraphConfig
from graphrt.core.cache import GraphCache
from graphrt.core.dispatch import Dispatcher
from graphrt.core.dtypes import model_dtype
from graphrt.core.errors import BackendUnavailableError, ConfigError
from graphrt.core.graph_modes import GraphMode
from graphrt.core.memory_bounds import ModelShape
from graphrt.models.jax.model_config import check_model_config

try:
    import jax
    import jax.numpy as jnp
except ImportError as _exc:  # pragma: no cover - exercised only without jax
    _IMPORT_ERROR: str | None = str(_exc)
else:
    _IMPORT_ERROR = None
    from jax.sharding import Mesh

    from graphrt.backends.xla import sharding as shd
    from graphrt.backends.xla.executor import XlaExecutor
    from graphrt.backends.xla.callable_graphs import XlaGraphs
    from graphrt.backends.xla.programs import XlaModel, XlaPrograms, xla_kv_spec

#: XLA backend: most threads compiling precompile buckets at once (one per CPU core up to
#: this; lowering stays on the caller's thread, XLA's compile releases the GIL). Measured on
#: 2 cores: 15 buckets in 10.1 s with one thread, 5.1 s with two (no gain while other jobs
#: kept the second core busy; see docs/benchmarks.md).
XLA_MAX_COMPILE_WORKERS = 8


def _jax_dtype(dtype: Any, model_dir: str) -> Any:
    """A jnp dtype from a jnp / numpy / torch dtype or a name ("bfloat16", "half", "auto" for the
    checkpoint's; :func:`~graphrt.core.dtypes.model_dtype`); None is float32."""
    from graphrt.models.hf_config import DecoderConfig
    return jnp.dtype(model_dtype(dtype, DecoderConfig.from_dir(model_dir).torch_dtype))


class XlaBackend(Backend):
    """JAX / XLA on the default platform (CPU, GPU, TPU), optionally tensor-parallel.

    ``tp_size`` builds a 1-D mesh over the first devices; ``mesh`` (axis ``"tp"``) is used
    as given. ``dtype`` is the weights' dtype for :meth:`load_model` (default float32).
    ``compile_workers`` threads compile buckets in parallel during :meth:`XlaExecutor.build_many`
    (default: one per CPU core, at most ``XLA_MAX_COMPILE_WORKERS``).
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
        self.compile_workers = compile_workers or min(os.cpu_count() or 1, XLA_MAX_COMPILE_WORKERS)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if _IMPORT_ERROR is not None:
            return f"jax cannot be imported: {_IMPORT_ERROR}"
        return None

    def load_model(self, model_dir: str, dtype: Any = None, *, model_impl: str = "auto",
                   trust_remote_code: bool = False) -> "XlaModel":
        """The JAX reference Llama / Mistral / Qwen3 -- or hybrid Mamba2 / Granite-4-H / Qwen3-Next /
        Mamba / Falcon-Mamba / LFM2 / Jamba / RecurrentGemma / MiniMax / Nemotron-H / Falcon-H1 /
        Zamba2, or Llama 4's text model
        (docs/hybrid.md) -- of a Hugging Face directory (``model_impl`` "auto" or "graphrt";
        "transformers" runs on torch backends only: ConfigError). graphrt's own models run no
        code of the checkpoint: ``trust_remote_code`` changes nothing here."""
        from graphrt.models.hf_config import DecoderConfig
        from graphrt.models.hybrid_config import HybridConfig
        from graphrt.models.llama4_config import Llama4Config
        from graphrt.models.model_impl import resolve_model_impl
        resolve_model_impl(model_dir, model_impl, framework="jax")
        from graphrt.models.jax.loader import load_jax_params
        jdtype = _jax_dtype(dtype if dtype is not None else self.dtype, model_dir)
        hybrid = DecoderConfig.from_dir(model_dir)
        if isinstance(hybrid, HybridConfig):
            from graphrt.models.jax import hybrid as jax_hybrid
            return XlaModel(jax_hybrid.JaxHybridConfig.of(hybrid), jax_hybrid.load_hybrid_params(model_dir, hybrid, jdtype),
                            forward=jax_hybrid.forward, compute_logits=jax_hybrid.compute_logits,
                            state=hybrid.state_spec())
        if isinstance(hybrid, Llama4Config):          # layers of their own kinds: a flat-params model
            from graphrt.models.jax import llama4
            return XlaModel(hybrid, llama4.load_llama4_params(model_dir, jdtype), forward=llama4.forward,
                            compute_logits=llama4.compute_logits)
        config, params = load_jax_params(model_dir, jdtype)
        return XlaModel(config, params)

    def model_shape(self, model: Any, config: GraphConfig) -> ModelShape | None:
        """The shape of an :class:`XlaModel` or a ``(DecoderConfig, params)`` pair, the whole
        model's (its shards together), its config checked first (``ConfigError`` naming a member
        it lacks: :func:`~graphrt.models.jax.model_config.check_model_config`), its KV cache spec
        resolved for ``config`` (a ConfigError naming the field otherwise: ``kv_cache_dtype``,
        ...); None for anything else (an nnx module's config is checked when its executor is
        made)."""
        pair = (model.config, model.params) if isinstance(model, XlaModel) else model
        if not (isinstance(pair, tuple) and len(pair) == 2 and hasattr(pair[0], "num_key_value_heads")):
            return None
        cfg, params = pair
        check_model_config(cfg, self.tp_size)
        leaves = jax.tree_util.tree_leaves(params)
        own = getattr(cfg, "dtype", None)          # the config's KV cache dtype, else the weights'
        dtype = jnp.dtype(own if own is not None else leaves[0].dtype if leaves else jnp.float32)
        spec = xla_kv_spec(cfg, dtype, config)
        return ModelShape(spec.bytes_per_block(config.block_size), spec.bytes_per_token(), dtype.itemsize,
                          cfg.hidden_size, int(getattr(cfg, "intermediate_size", 0)), cfg.vocab_size)

    def device_memory_bytes(self) -> int | None:
        """This process's mesh devices' memory together (``memory_stats()['bytes_limit']``); None
        where a device does not say (the CPU: its memory is the host's). Across ``jax.distributed``
        processes only the addressable devices answer, and each process holds its own share."""
        total = 0
        for device in self.mesh.local_devices:         # this process's (multi-controller: its share)
            stats = device.memory_stats() if hasattr(device, "memory_stats") else None
            if not stats or "bytes_limit" not in stats:
                return None
            total += int(stats["bytes_limit"])
        return total

    def graphs(self, fn: Callable[..., Any], cache: GraphCache | None = None, **options: Any) -> "XlaGraphs":
        """``fn`` compiled ahead of time once per key (``donate_argnums=`` as for ``jax.jit``)."""
        return XlaGraphs(fn, cache, **options)

    def dispatcher(self, config: GraphConfig, mode: GraphMode, model: Any,
                   keyed_host_values: Sequence[str] = ()) -> Dispatcher:
        """The token x batch-size grid (:class:`XlaBuckets`): decode by batch size, mixed steps
        at the largest batch size; no eager path, so every covered shape has an executable. Keys
        get context buckets where the attention keys ``max_seq_len`` (graphrt's decoder does)."""
        return XlaBuckets.from_config(config).dispatcher(context="max_seq_len" in keyed_host_values)

    def for_tensor_parallel(self, tp: int) -> "XlaBackend":
        """This backend for ``tensor_parallel_size=tp``: itself where ``tp`` is 1 or its mesh has ``tp`` devices,
        a backend over the first ``tp`` devices (every process's, under jax.distributed) where it
        was made with the default single device; else a :class:`ConfigError` naming both. Across
        processes only process 0 builds the engine (the others run
        :func:`graphrt.backends.xla.follower.serve`), and the mesh must span every process."""
        backend = self
        if tp == 1:
            return self                 # unset: the backend's own mesh (XlaBackend(tp_size=N): SPMD across processes)
        if tp != self.tp_size:
            if self.tp_size != 1:
                raise ConfigError(f"tensor_parallel_size={tp}, but the xla backend's mesh has {self.tp_size} "
                                  "devices: pass the same size to both, or only one of them")
            backend = XlaBackend(tp_size=tp, dtype=self.dtype, compile_workers=self.compile_workers)
        processes = jax.process_count()
        if tp > 1 and processes > 1:
            if jax.process_index() != 0:
                raise ConfigError(f"tensor_parallel_size={tp} across {processes} jax.distributed processes: only "
                                  f"process 0 builds the engine; process {jax.process_index()} runs "
                                  "graphrt.backends.xla.follower.serve() (docs/distributed.md)")
            spanned = {d.process_index for d in backend.mesh.devices.flat}
            if len(spanned) != processes:
                raise ConfigError(f"tensor_parallel_size={tp}: the mesh spans processes {sorted(spanned)} of "
                                  f"{processes}; give every jax.distributed process devices in it (tp = all "
                                  "processes' devices)")
        return backend

    def open_lockstep(self, model_dir: str, config: GraphConfig, dtype: Any, sampler_seed: int) -> "XlaExecutor":
        """Load ``model_dir`` over the mesh and make its executor, as every process of a job led
        by process 0 does, in the same order (the loads place the weights on every process's
        devices). ``sampler_seed``: the random sampler's host seed, the same on every process."""
        model = self.load_model(model_dir, dtype, model_impl=config.model_impl,
                                trust_remote_code=config.trust_remote_code)
        return self._executor(model, config, sampler_seed)

    def create_executor(self, model: Any, config: GraphConfig, dtype: Any = None) -> "XlaExecutor":
        """An executor for an :class:`XlaModel` (graphrt's decoder, or a model's own forward and
        config), a ``(DecoderConfig, params)`` pair or an nnx module (``dtype`` unused: the model
        is loaded already, sharded by its mesh). With ``tensor_parallel_size > 1`` the model is a
        directory (or a model loaded from one); across ``jax.distributed`` processes this is
        process 0, whose executor then leads the others (:mod:`graphrt.backends.xla.lockstep`).
        LoRA (``max_loras > 0``) is refused with :class:`ConfigError`."""
        tp = config.tensor_parallel_size
        if tp > 1:
            from graphrt.backends.xla import lockstep
            if tp != self.tp_size:
                raise ConfigError(f"tensor_parallel_size={tp}, but the xla backend's mesh has {self.tp_size} "
                                  "devices (XlaBackend.for_tensor_parallel makes the matching backend)")
            self.for_tensor_parallel(tp)                 # process 0 only; the mesh spans every process
            if jax.process_count() > 1:
                if not isinstance(model, (str, os.PathLike)):
                    raise ConfigError(f"tensor_parallel_size={tp} across jax.distributed processes needs the model "
                                      f"as a Hugging Face directory (every process loads it); got {type(model).__name__}")
                self._check_lora(config)
                leader, seed = lockstep.start_leader(config, os.fspath(model), dtype, tp)
                executor = self.open_lockstep(os.fspath(model), config, dtype, seed)
                lockstep.lead(executor, leader)
                return executor
            if isinstance(model, (str, os.PathLike)):
                model = self.load_model(os.fspath(model), dtype, model_impl=config.model_impl,
                                        trust_remote_code=config.trust_remote_code)
        return self._executor(model, config, None)

    @staticmethod
    def _check_lora(config: GraphConfig) -> None:
        if config.max_loras > 0:
            raise ConfigError(f"max_loras={config.max_loras}: the xla backend has no LoRA support (its "
                              "executables take no adapter tables and the JAX reference model has no "
                              "LoRA-capable layer); use a torch backend (cuda, npu, cpu, eager) or max_loras=0")

    def _executor(self, model: Any, config: GraphConfig, sampler_seed: int | None) -> "XlaExecutor":
        self._check_lora(config)
        buckets = XlaBuckets.from_config(config)
        programs = XlaPrograms(model, config.block_size, self.mesh, config.decode_query_len,
                               max_reqs=buckets.max_reqs, config=config, max_logprobs=config.max_logprobs)
        return XlaExecutor(programs, config, buckets, compile_workers=self.compile_workers,
                           sampler_seed=sampler_seed, model=model)


__all__ = ["XlaBackend"]
