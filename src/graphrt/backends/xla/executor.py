"""The XLA executor: host staging buffers, the donated KV cache, building executables per key,
and running a padded step and its sampler.

Builds lower a key's program (:mod:`graphrt.backends.xla.programs`) and compile it
(:meth:`XlaExecutor.build_many` on a thread pool: XLA's compile releases the GIL); the compile
bookkeeping is :class:`~graphrt.backends.xla.compile_ledger.CompileLedger`'s. No eager escape:
anything above the largest buckets is an ``InputError``. The hot path does no eager ``jnp``
work: numpy copies of the padded rows, one call each for forward and sampler, one token copy."""

from __future__ import annotations

import functools
import logging
from typing import Any, Hashable, Sequence

import jax
import numpy as np

from graphrt.backends.base import Built, Capabilities, Executor, SamplingBatch
from graphrt.backends.xla import multi_controller as mc
from graphrt.backends.xla import extra_inputs as xla_extra, sharding as shd
from graphrt.backends.xla.abstract_inputs import abstract_inputs
from graphrt.backends.xla.batch import BATCH_FIELDS, XlaBatch, describe_change
from graphrt.backends.xla.buckets import XlaBuckets
from graphrt.backends.xla.compile import enable_persistent_cache, install_listeners, thread_counts
from graphrt.backends.xla.compile_ledger import CompileLedger
from graphrt.backends.xla.entries import XlaEntry
from graphrt.backends.xla.executables import executable_store
from graphrt.backends.xla.lockstep import Leader, lockstep
from graphrt.backends.xla.precompile import lower, precompile
from graphrt.backends.xla.programs import XlaPrograms
from graphrt.backends.xla.prompt_logprobs import PromptLogprobs
from graphrt.backends.xla.sampling_rows import SamplingRows
from graphrt.backends.xla.weights import XlaWeights
from graphrt.config import GraphConfig
from graphrt.core import defaults
from graphrt.core.cache import describe_key
from graphrt.core.dispatch import BatchDescriptor, SamplerKey, sampler_key
from graphrt.core.errors import ConfigError, GraphrtError, InputError, KVCacheLostError
from graphrt.core.inputs.fields import ModelInputs, buffer_shapes
from graphrt.core.graph_modes import RuntimeMode
from graphrt.core.kv_spec import blocks_for
from graphrt.core.weight_reports import SleepReport, WakeReport, WeightsUpdate, check_level

logger = logging.getLogger(__name__)

#: The calling thread's compile counters, read directly on the hot path (one attribute load).
_compiles = thread_counts()

_I32 = np.dtype(np.int32)


def _check_padded(entry: XlaEntry, padded: Any) -> None:
    """Every padded array has the dtype and shape ``entry``'s executable was compiled for (numpy
    only; the block table as narrowed to the key's context), else :class:`InputError` naming it."""
    for name, shape in zip(BATCH_FIELDS, entry.shapes):
        arr = getattr(padded, name)
        if name == "block_table" and isinstance(arr, np.ndarray) and arr.ndim == 2:
            arr = arr[:, :shape[1]]
        if not isinstance(arr, np.ndarray) or arr.dtype != _I32 or arr.shape != shape:
            got = XlaBatch(**{f: None if getattr(padded, f) is None else np.asarray(getattr(padded, f))
                              for f in BATCH_FIELDS},
                           num_tokens=entry.spec.num_tokens, num_reqs=entry.spec.num_reqs,
                           uniform_decode=entry.spec.uniform_decode)
            raise InputError(name, f"{describe_change(entry.spec, got)} (executable for {entry.key})")


class XlaExecutor(Executor[XlaEntry]):
    """Host staging buffers, the donated KV cache and the compiled executables of one model."""


    #: Multi-controller XLA led by process 0 (backends/xla/lockstep.py): the leader that
    #: publishes each ``@lockstep`` call to the other processes before it runs here; None: alone.
    leader: Leader | None = None

    def __init__(self, programs: XlaPrograms, config: GraphConfig, buckets: XlaBuckets, *,
                 compile_workers: int = 1, sampler_seed: int | None = None, model: Any = None) -> None:
        install_listeners()
        if config.compilation_cache_dir:
            enable_persistent_cache(config.compilation_cache_dir)
        self.config = config
        self.programs = programs
        #: The attention's declarations (backends/xla/attention.py): what the keys hold, what runs.
        #: Executables are dispatched (the host waits only for tokens) and always needed (no eager path).
        self.capabilities = Capabilities(has_graphs=True, attention_support=programs.attention_support,
                                         supports_piecewise=False, eager_fallback=False, async_execution=True,
                                         device_runs_ahead=True, keyed_host_values=programs.keyed_host_values)
        self.mesh = programs.mesh
        self.tp_size = programs.tp_size
        self.compile_workers = max(1, int(compile_workers))
        #: Multi-controller (several jax.distributed processes): each compile's collectives checked
        #: across the processes, and (each process scheduling for itself) each step's agreement;
        #: led by process 0 (``sampler_seed`` given) the steps come from it and cannot differ.
        self._processes = mc.process_count()
        self._steps = mc.StepAgreement() if self._processes > 1 and sampler_seed is None else None
        self.model = model
        self.model_config = programs.model_config
        self.vocab_size = int(self.model_config.vocab_size)
        self.weights = programs.weights
        self.dtype = programs.dtype
        self._width = config.max_blocks_per_req
        # Sized for the largest key of the grid: a decode key (b, b) or a mixed key (t, largest b).
        max_t, max_r = buckets.max_tokens, buckets.max_reqs
        # One staging buffer per field (core's shape table), int32 as every executable takes them.
        self.host_buffers = {name: np.zeros(shape, np.int32)
                             for name, shape in buffer_shapes(max_t, max_r, self._width).items()}
        #: The model's declared extra inputs and their staging buffers (the runner writes them).
        self.extra_inputs = programs.extra_inputs
        self.extra_buffers = xla_extra.staging_buffers(self.extra_inputs, max_t, max_r)
        if config.collectives == "eager":
            raise ConfigError("collectives='eager': the xla backend compiles each step as one program, the "
                              "collectives SPMD partitioning inserts scheduled by XLA inside it; splitting that "
                              "program at its collectives is not built. Use collectives='captured' (XLA's own "
                              "collectives), or a torch backend for eager collectives")
        if config.enable_penalties:
            raise ConfigError("enable_penalties: the xla backend has no penalised sampler (repetition / presence / "
                              "frequency penalties run on the torch backends)")
        if programs.max_reqs < max_r:
            raise ConfigError(f"the xla programs pad sampled tokens to {programs.max_reqs} rows; the "
                              f"config's largest batch is {max_r} (build XlaPrograms with max_reqs={max_r})")
        if config.max_logprobs and programs.max_logprobs != min(config.max_logprobs, self.vocab_size):
            raise ConfigError(f"max_logprobs={config.max_logprobs}, but the xla programs compute "
                              f"{programs.max_logprobs} (build XlaPrograms with max_logprobs={config.max_logprobs})")
        #: No future tokens: every request keeps its host id (``run(future=None)``).
        self._no_future = jax.device_put(np.zeros(programs.max_reqs, np.int32), programs.replicated)
        self._no_future_rows = np.full(max_r, -1, np.int32)
        #: The random sampler's host rows, generator and seeded requests' step counters.
        self.sampling_rows = SamplingRows(max_r, self.vocab_size, sampler_seed)
        #: Planned and compiled keys, the compile counters, strict mode and the on-disk store.
        self.compiles = CompileLedger(strict=config.strict, vocab_size=self.vocab_size,
                                      table_width=self._width, store=executable_store(programs, config))
        self.kv_cache: jax.Array | None = None
        #: A hybrid model's recurrent-state arrays (docs/hybrid.md; allocated with the KV cache,
        #: donated with it each step), its slots and their memory; empty / None without state.
        self.state_caches: list[jax.Array] = []
        self.num_state_slots = programs.state_memory.num_slots if programs.state_spec is not None else None
        self.state_memory = programs.state_memory if programs.state_spec is not None else None
        self._last_logits: jax.Array | None = None
        self._last_positions: jax.Array | None = None
        self._with_positions = programs.decode_query_len > 1   # the forward also returns position logits
        self._last_hidden: jax.Array | None = None
        #: The largest temp bytes of a forward (False) and of a sampler (True) compiled so far.
        self._largest_temp = {False: 0, True: 0}

    @functools.cached_property
    def refit(self) -> XlaWeights:
        """In-place refit and sleep / wake of ``weights`` (backends/xla/weights.py), made on first use."""
        return XlaWeights(self.model_config, self.weights, self.programs.own_code)

    @functools.cached_property
    def prompt(self) -> PromptLogprobs:
        """Prompt logprobs' program (compiled once; backends/xla/prompt_logprobs.py), made on first use."""
        return PromptLogprobs(self.programs, self.compiles)

    @property
    def scratch_bytes(self) -> int:
        """Temp memory of the largest forward plus the largest sampler compiled (measured samples
        included): XLA allocates it per run, so the graph-memory budget counts it once."""
        return sum(self._largest_temp.values())

    def _note_temp(self, entries: Any) -> None:
        for entry in entries:
            sampler = isinstance(entry.key, SamplerKey)
            self._largest_temp[sampler] = max(self._largest_temp[sampler], entry.temp_bytes)

    @property
    def build_count(self) -> int:
        """Compiles counted in ``compiles.stats``, including those no cache lookup caused."""
        return int(self.compiles.stats.compiles)

    def kv_as_rows(self, host: np.ndarray, block_size: int) -> np.ndarray:
        """A Pallas page-layout cache (TPUs) as the reference layout it stands for."""
        return self.programs.kv_as_rows(host, block_size)

    def kv_from_rows(self, values: np.ndarray, block_size: int) -> np.ndarray:
        return self.programs.kv_from_rows(values, self.kv_cache.shape, block_size)

    # ---- KV cache --------------------------------------------------------------------
    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block takes on each device (the KV cache spec's, in its dtype; KV heads split
        over the mesh when they divide)."""
        c, spec = self.model_config, self.programs.kv_spec
        total = spec.bytes_per_block(block_size) if spec is not None else (
            2 * c.num_hidden_layers * block_size * c.num_key_value_heads * c.head_dim * self.dtype.itemsize)
        return total // self.tp_size if shd.kv_heads_sharded(c, self.tp_size) else total

    @lockstep
    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """A zeroed cache ``[layers, 2, blocks * block_size + 1, kv_heads, head_dim]`` in the KV
        cache spec's dtype (every layer group, sliding or not, in one array); the last row is the
        trash row padded tokens write into. With Pallas attention the cache is in the kernel's page
        layout instead (``programs.kv_shape``). A new shape drops compiled executables."""
        if block_size != self.config.block_size:
            raise ConfigError(f"block_size {block_size} differs from the config's {self.config.block_size}")
        shape = self.programs.kv_shape(num_blocks, block_size)
        self.compiles.set_kv_shape(shape)
        self.kv_cache = self.programs.zeros_kv_cache(shape)
        self.state_caches = self.programs.zeros_states()
        self._kv_shape = shape

    @lockstep
    def recover_kv_cache(self) -> bool:
        """After a failed step: if the KV cache was consumed (donated to a call that then
        failed), deleted or holds an execution error, re-create it zeroed and return True.
        Blocks on the cache, so it is for failure paths only, never the hot path."""
        if not (self._kv_cache_lost(self.kv_cache) or any(self._kv_cache_lost(s) for s in self.state_caches)):
            return False
        self._reset_kv_cache()
        return True

    @staticmethod
    def _kv_cache_lost(kv: jax.Array | None) -> bool:
        if kv is None:
            return False        # never allocated: nothing to recover
        if kv.is_deleted():
            return True
        try:
            kv.block_until_ready()  # an asynchronous execution error surfaces here
        except Exception:  # noqa: BLE001 - any error means the buffer is unusable
            return True
        return False

    def _reset_kv_cache(self) -> None:
        """A zeroed cache of the allocated shape in place of a lost one (executables stay valid)."""
        self.kv_cache = None
        self._last_logits = self._last_hidden = self._last_positions = None
        self.kv_cache = self.programs.zeros_kv_cache(self._kv_shape)
        self.state_caches = self.programs.zeros_states()      # donated with it: gone too
        self.kv_cache_resets += 1
        logger.warning("graphrt: the xla KV cache was lost in a failed step and re-created zeroed; "
                       "every request's computed KV is gone")

    def memory_info(self) -> tuple[int, int] | None:
        stats = [d.memory_stats() for d in self.mesh.local_devices]      # addressable ones only
        if not all(s and "bytes_limit" in s for s in stats):
            return None
        free = min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
        return int(free), int(min(s["bytes_limit"] for s in stats))

    def entry_memory(self, entry: Any) -> dict[str, int]:
        """XLA's memory analysis of a built entry: temp, alias and code bytes."""
        return entry.memory() if isinstance(entry, XlaEntry) else {}

    @lockstep
    def measure_graph_memory(self, jobs: Sequence[tuple[RuntimeMode, Hashable]]) -> tuple[dict[Any, int], str | None]:
        """Before the KV cache is sized: compile ``jobs`` against a throwaway
        ``defaults.SAMPLE_KV_BLOCKS``-block cache (abstract: nothing is allocated) and return each
        executable's code bytes (warm-up's ``bytes``), the largest temp bytes noted for
        :attr:`scratch_bytes`. They hold at any cache size: no executable's temp memory grows
        with the number of blocks (docs/xla.md, "Memory"). The executables are dropped; the
        executor's compile ledger does not count them."""
        kv = jax.ShapeDtypeStruct(self.programs.kv_shape(defaults.SAMPLE_KV_BLOCKS, self.config.block_size),
                                  self.programs.kv_dtype)
        states = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in self.programs.state_shapes()]

        def inputs(mode: RuntimeMode, key: Hashable) -> tuple[Any, Any, tuple[Any, ...]]:
            return abstract_inputs(self.programs, mode, key, kv, states, self.extra_inputs, self._table_width)
        ledger = CompileLedger(strict=False, vocab_size=self.vocab_size, table_width=self._width)
        built = precompile(list(dict.fromkeys(jobs)), inputs, ledger, self.compile_workers, progress=False)
        self._note_temp(built.values())
        return {key: built[key].nbytes for _, key in jobs}, None

    # ---- weights and memory (backends/xla/weights.py) ----------------------------------------
    @lockstep
    def update_weights(self, source: Any, *, check_only: bool = False) -> WeightsUpdate:
        """New parameter buffers of the same shapes, dtypes and shardings in place of the refit's:
        the executables take them as arguments, so nothing recompiles."""
        weights, result = self.refit.update(self.weights, source, check_only=check_only)
        self.weights = self.programs.weights = weights
        return result

    def weight_names(self) -> frozenset[str]:
        return self.refit.names()

    @lockstep
    def sleep(self, level: int) -> SleepReport:
        """Delete the weights (kept on the host at level 1) and the KV and state caches; the
        executables stay, waiting for the same shapes at :meth:`wake`."""
        level = check_level(level)
        if self.refit.asleep:
            raise GraphrtError("sleep: already asleep; wake() first")
        report = self.refit.sleep(level, self.weights, [self.kv_cache, *self.state_caches])
        self.kv_cache, self.state_caches = None, []
        self._last_logits = self._last_hidden = self._last_positions = None
        return report

    @lockstep
    def wake(self) -> WakeReport:
        """Weights back on their shardings (zeros after level 2), the caches re-created zeroed:
        the executables take them as arguments, so nothing recompiles and nothing moved."""
        self.weights, report = self.refit.wake()
        self.programs.weights = self.weights
        self.kv_cache = self.programs.zeros_kv_cache(self._kv_shape)
        self.state_caches = self.programs.zeros_states()
        return report

    # ---- build -------------------------------------------------------------------------
    @lockstep
    def build(self, mode: RuntimeMode, key: BatchDescriptor | SamplerKey) -> tuple[XlaEntry, int]:
        """Compile the forward for a :class:`BatchDescriptor`, or the sampler for
        ``SamplerKey(num_reqs, greedy)``; returns (entry, bytes) for the caller to keep (the
        runner's caches). Stored on disk: loaded. After warm-up a build is unplanned (strict
        mode: raises)."""
        self.compiles.before_build(key)
        jitted, spec, args = self._abstract_inputs(mode, key)
        entry = self.compiles.load(key, spec)
        if entry is None:
            lowered, seconds = lower(jitted, args)
            entry = self.compiles.compile(key, lowered, spec, seconds)
        if self._processes > 1:
            mc.check_built([entry])
        self._note_temp([entry])
        return entry, entry.nbytes

    @lockstep
    def expect_builds(self, jobs: Sequence[tuple[RuntimeMode, Hashable]]) -> None:
        """Background warm-up will build ``jobs`` one at a time: they are planned (warm-up reopens
        until they are compiled; :meth:`CompileLedger.plan`)."""
        self.compiles.plan(key for _, key in jobs)

    @lockstep
    def build_many(self, jobs: Sequence[tuple[RuntimeMode, Hashable]], *, workers: int | None = None,
                   progress: bool = False) -> list[Built[XlaEntry]]:
        """Warm-up: plan and compile ``jobs``, lowered one after another here and compiled by
        ``workers`` threads; one :class:`Built` per job, in order.

        ``jobs`` become the planned keys (:meth:`CompileLedger.plan`). XLA's compile releases
        the GIL, so on a multi-core host the compiles overlap (each entry records its own
        lowering and compile seconds). ``progress`` shows a bar.
        """
        workers = max(1, workers or self.compile_workers)
        self.compiles.plan(key for _, key in jobs)
        built = precompile(list(dict.fromkeys(jobs)), self._abstract_inputs, self.compiles, workers, progress)
        if self._processes > 1:                 # in the jobs' order: the same on every process
            mc.check_built(built[key] for key in dict.fromkeys(key for _, key in jobs))
        self._note_temp(built.values())
        return [Built(built[key], built[key].nbytes, built[key].build_seconds) for _, key in jobs]

    def program(self, mode: RuntimeMode, key: Hashable) -> tuple[Any, Any, tuple[Any, ...]]:
        """(jitted function, spec, abstract arguments) of ``key`` as this executor compiles it,
        against its allocated KV cache: what :func:`graphrt.backends.xla.export.export_programs`
        exports."""
        return self._abstract_inputs(mode, key)

    def _abstract_inputs(self, mode: RuntimeMode, key: Hashable) -> tuple[Any, Any, tuple[Any, ...]]:
        """(jitted function, spec, abstract arguments) of ``key`` (:func:`abstract_inputs`)."""
        return abstract_inputs(self.programs, mode, key, self.kv_cache, self.state_caches, self.extra_inputs,
                               self._table_width)

    # ---- run ---------------------------------------------------------------------------
    @staticmethod
    def _missing(entry: Any, key: Hashable) -> GraphrtError:
        """The error of a run without ``key``'s executable: there is no eager path."""
        return GraphrtError(f"no executable for {describe_key(key)}: the xla backend runs nothing eagerly; "
                            "pass the entry build() returned (the runner's caches hold them)")

    def _table_width(self, key: BatchDescriptor) -> int:
        """Block-table columns of ``key``'s executable: those its context bucket fills."""
        if key.max_seq_len is None:
            return self._width
        return min(self._width, max(blocks_for(key.max_seq_len, self.config.block_size), 1))

    @lockstep
    def run(self, mode: RuntimeMode, key: BatchDescriptor, entry: XlaEntry | None,
            padded: ModelInputs, future: tuple[np.ndarray, jax.Array] | None = None) -> jax.Array:
        """Run the executable for ``key`` on the padded step; returns device logits ``[R_pad, V]``.

        Takes host copies of the padded rows (JAX's C++ argument path; copies because CPU JAX
        reads numpy arguments asynchronously while the runner rewrites them). The KV cache is
        donated and replaced. ``future``: ``(rows [R] int32, tokens)``, the requests whose last
        token is ``tokens[row]`` of a previous step still on the device (-1: none), resolved
        inside the executable. Declared extra inputs go in as their staging buffers' rows.
        """
        if not isinstance(entry, XlaEntry):
            raise self._missing(entry, key)
        _check_padded(entry, padded)
        if self._steps is not None:
            self._steps.check(key, padded)
        spec = entry.spec
        batch = XlaBatch(padded.input_ids.copy(), padded.positions.copy(), padded.slot_mapping.copy(),
                         padded.query_start_loc.copy(), padded.seq_lens.copy(), padded.state_slots.copy(),
                         padded.block_table[:, :entry.shapes[-1][1]].copy(),
                         spec.num_tokens, spec.num_reqs, spec.uniform_decode)
        rows, tokens = self._no_future_rows[:spec.num_reqs].copy(), self._no_future
        if future is not None:
            real, tokens = future
            rows[:len(real)] = real
            if isinstance(tokens, np.ndarray):     # a step that waited: its tokens are on the host
                tokens = np.pad(tokens.astype(np.int32), (0, self.programs.max_reqs - len(tokens)))
        extra = (xla_extra.padded_args(self.extra_inputs, self.extra_buffers, spec.num_tokens, spec.num_reqs)
                 if self.extra_inputs else ())
        before = _compiles.compiles
        kv = self.kv_cache
        stateful = self.programs.state_spec is not None
        try:
            out = entry.executable(self.weights, (kv, tuple(self.state_caches)) if stateful else kv, batch, tokens,
                                   rows, *extra)
            if self._with_positions:
                logits, hidden, cache, self._last_positions = out
            else:
                logits, hidden, cache = out
            if stateful:
                self.kv_cache, states = cache
                self.state_caches = list(states)
            else:
                self.kv_cache = cache
        except BaseException as exc:
            self._after_failed_run(kv, exc)
            raise
        if _compiles.compiles != before:
            self.compiles.compiled_while_running(before, key, "forward")
        self._last_logits, self._last_hidden = logits, hidden
        return logits

    def _after_failed_run(self, kv: jax.Array | None, exc: BaseException) -> None:
        """The executable raised: if it had consumed the donated cache, re-create the cache and
        raise :class:`KVCacheLostError` (``exc`` as its cause; a ``KeyboardInterrupt`` or other
        non-``Exception`` is re-raised as it is, after the cache is re-created)."""
        if not self._kv_cache_lost(kv):
            return              # raised before consuming anything: the cache is intact
        self._reset_kv_cache()
        if isinstance(exc, Exception):
            raise KVCacheLostError(f"the step failed after the KV cache was donated to it "
                                   f"({type(exc).__name__}: {exc}); the cache was re-created zeroed, so "
                                   f"the KV of every request computed so far is lost and must be "
                                   f"recomputed") from exc

    # ---- sample ------------------------------------------------------------------------
    @lockstep
    def sample(self, logits: Any, num_reqs: int, sampling: SamplingBatch, *,
               padded_reqs: int | None = None, entry: XlaEntry | None = None,
               wait: bool = True, key: SamplerKey | None = None) -> np.ndarray | jax.Array:
        """One token id per real request (int64), from the compiled greedy or random sampler.

        ``entry`` is the runner's sampler entry for ``SamplerKey(padded_reqs, all_greedy)`` (required:
        there is no eager sampler). ``wait=False`` returns the sampler's device output instead,
        without waiting for it: ``[max_reqs]`` int32, the real requests' tokens first
        (:meth:`fetch_tokens` reads them; the next forward can take it as its future tokens).
        """
        key = entry.key if isinstance(entry, XlaEntry) else key or sampler_key(
            sampling, int(logits.shape[0]) if padded_reqs is None else int(padded_reqs), self.vocab_size)
        rows = key.num_reqs
        if logits.shape != (rows, self.vocab_size):
            raise InputError("logits", f"shape {tuple(logits.shape)}; the sampler for {rows} rows "
                                       f"expects ({rows}, {self.vocab_size})")
        if not isinstance(entry, XlaEntry):
            raise self._missing(entry, key)
        args = (logits,) if key.greedy else (logits, self.sampling_rows.metadata(num_reqs, rows, sampling))
        before = _compiles.compiles
        tokens = entry.executable(*args)
        if _compiles.compiles != before:
            self.compiles.compiled_while_running(before, key, "sampler")
        return np.asarray(tokens)[:num_reqs].astype(np.int64) if wait else tokens

    @staticmethod
    def fetch_tokens(tokens: jax.Array, num_reqs: int) -> np.ndarray:
        """The first ``num_reqs`` tokens of a sampler's device output, on the host (int64);
        waits for the device (an asynchronous execution error surfaces here)."""
        return np.asarray(tokens)[:num_reqs].astype(np.int64)

    @lockstep
    def sample_logprobs(self, logits: Any, sampled: Any, num_reqs: int, *, padded_reqs: int | None = None,
                        entry: XlaEntry | None = None, wait: bool = True) -> Any:
        """The logprobs executable (``entry``, required) on the logits rows and the sampler's device
        output ``sampled``: host arrays of the real rows, or with ``wait=False`` the device arrays."""
        if not isinstance(entry, XlaEntry):
            raise self._missing(entry, SamplerKey(int(logits.shape[0]), False, True))
        before = _compiles.compiles
        out = entry.executable(logits, sampled)
        if _compiles.compiles != before:
            self.compiles.compiled_while_running(before, entry.key, "logprobs")
        return self.fetch_logprobs(out, num_reqs) if wait else out

    @staticmethod
    def fetch_logprobs(handle: Sequence[jax.Array], num_reqs: int) -> tuple[np.ndarray, ...]:
        """``(logprob, rank, top logprobs, top ids)`` of the first ``num_reqs`` rows, on the host."""
        return tuple(np.asarray(a)[:num_reqs] for a in handle)

    @lockstep
    def prompt_logprobs(self, rows: np.ndarray, targets: np.ndarray, k: int) -> tuple[np.ndarray, ...]:
        """Logprobs of ``targets`` at the last forward's hidden rows ``rows`` (:class:`PromptLogprobs`)."""
        return self.prompt(self._last_hidden, rows, targets)

    def device_logits(self, num_rows: int) -> jax.Array:
        """The last forward's logits, the jax array itself (its padded rows; no host copy)."""
        return self._last_logits

    @lockstep
    def free_request(self, request_id: int) -> None:
        self.sampling_rows.free(request_id)

    def close(self) -> None:
        """Led by process 0: tell the other processes' :func:`~graphrt.backends.xla.follower.serve`
        to return (idempotent); alone: nothing to release."""
        if self.leader is not None:
            self.leader.close()

    # ---- introspection -----------------------------------------------------------------
    def hidden_states(self, num_tokens: int) -> np.ndarray:
        return np.asarray(self._last_hidden, dtype=np.float32)[:num_tokens]

    def logits(self, num_reqs: int) -> np.ndarray:
        return np.asarray(self._last_logits)[:num_reqs]

    def position_logits(self, num_reqs: int) -> np.ndarray:
        if not self._with_positions:
            raise GraphrtError("position logits need num_speculative_tokens > 0")
        return np.asarray(self._last_positions)[:num_reqs]


__all__ = ["XlaExecutor"]
