"""What every backend provides, and what the ModelRunner asks of it.

A *backend* (registry name -> class) says whether it can run here and builds an
*executor* for a model. The executor owns the device side of a step: static buffers,
the KV cache, building (capturing or compiling) the entry for a key, and running a
padded step. The ModelRunner does everything host-side (prepare, dispatch, pad, stats)
the same way for every backend.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Generic, Hashable, Iterable, Mapping, Protocol, Sequence, TypeVar

import numpy as np

from graphrt.config import GraphConfig
from graphrt.core.cache import GraphCache
from graphrt.core.dispatch import BatchDescriptor, Dispatcher, SamplerKey
from graphrt.core.errors import ConfigError, GraphrtError, InputError
from graphrt.core.inputs.fields import ModelInputs
from graphrt.core.graph_modes import AttentionGraphSupport, GraphMode, RuntimeMode
from graphrt.core.memory_bounds import ModelShape
from graphrt.core.sampling.batch import SamplingBatch  # defined in core (numpy only), importable from here
from graphrt.core.weight_reports import SleepReport, WakeReport, WeightsUpdate


#: What one backend builds per key: a captured graph, a compiled executable, ...
EntryT = TypeVar("EntryT")


@dataclass(frozen=True)
class Built(Generic[EntryT]):
    """One entry :meth:`Executor.build_many` built ahead: the entry, the bytes it holds and the
    seconds it took (timed by the executor: its builds overlap, so the runner cannot)."""

    entry: EntryT
    nbytes: int
    seconds: float


class LoraSlots(abc.ABC):
    """An executor's LoRA adapters (``GraphConfig.max_loras > 0``): ``max_loras`` slots of
    persistent stacked weights that captured graphs read, and the staging buffers of a step's
    LoRA tables (``host_buffers``: ``lora_index`` per token, ``lora_groups`` per active adapter;
    graphrt.core.lora writes them, the executor copies them with the step)."""

    max_loras: int
    host_buffers: Mapping[str, np.ndarray]
    #: bool per slot: whether an adapter is loaded there (the runner refuses steps naming an empty slot).
    loaded: np.ndarray

    @abc.abstractmethod
    def targets(self) -> dict[str, tuple[int, int]]:
        """The LoRA-capable modules by name, each as ``(in_features, out_features)``."""

    @abc.abstractmethod
    def load(self, slot: int, weights: Mapping[str, tuple[Any, Any]], scale: float = 1.0) -> None:
        """Copy an adapter into ``slot`` (never reallocating: captured graphs see it)."""

    @abc.abstractmethod
    def remove(self, slot: int) -> bool:
        """Empty ``slot``; False when it held nothing."""


class BufferWatch(Protocol):
    """Tells the runner before each step, without a call, whether the live-buffer check is due:
    ``due`` is true from an event after which a buffer the built entries read may have moved
    (a parameter re-bound, a cache allocated again) until the next
    :meth:`Executor.stale_buffers` (:meth:`Executor.buffer_watch`)."""

    due: bool


@dataclass(frozen=True)
class Capabilities:
    """What an executor can do, as one record (:attr:`Executor.capabilities`, the only place it
    is declared); the defaults are a plain synchronous executor's."""

    #: Whether this executor captures or compiles anything (False: every step is eager).
    has_graphs: bool = True
    #: What the model's attention can run inside FULL graphs.
    attention_support: AttentionGraphSupport = AttentionGraphSupport.ALWAYS
    #: Whether PIECEWISE graphs (split at attention) are available.
    supports_piecewise: bool = False
    #: Whether a step may run without a built entry: eagerly above the largest bucket, or
    #: when its capture failed. False (XLA): every step needs its executable, so the runner
    #: compiles a missing key (forward or sampler) on demand and a failed build raises.
    eager_fallback: bool = True
    #: Whether :meth:`Executor.run` and :meth:`Executor.sample` return before the device finishes
    #: (XLA): such an executor resolves ``run(..., future=)`` on the device and honours
    #: ``sample(..., wait=False)``; the runner resolves future tokens on the host for the others
    #: (core/future_tokens.py).
    async_execution: bool = False
    #: Whether the device keeps working after ``run`` and ``sample`` return (XLA, CUDA, Ascend),
    #: so that overlapping steps hides the host's share: ``graphrt.LLM`` overlaps by default only
    #: then. The CPU graph backend launches asynchronously but finishes on return.
    device_runs_ahead: bool = False
    #: The step's host values its attention reads and its keys must hold (the seam's declaration,
    #: docs/attention.md): ``("max_seq_len",)`` for kernels that attend over a context length
    #: fixed when the graph is built (graphrt's reference kernels); () for kernels that read
    #: every length on the device (Triton).
    keyed_host_values: tuple[str, ...] = ()
    #: Whether the entries it builds share one memory pool that reuses freed blocks (a device
    #: caching allocator), so that an entry built after a larger one adds only what it keeps;
    #: the graph-memory estimate does not draw a line through such entries' bytes.
    graphs_share_memory: bool = False


class Executor(abc.ABC, Generic[EntryT]):
    """The device side of a ModelRunner, building and running entries of type ``EntryT``
    (``TorchExecutor``: captured graphs; ``XlaExecutor``: compiled executables).

    This class is the whole contract: the runner, warm-up, graph memory and
    ``graphrt.testing`` use an executor only through the members declared here
    (``tests/project/test_executor_contract.py`` checks it); callers read what it can do from
    :attr:`capabilities`, the one record of it."""

    #: What this executor can do (:class:`Capabilities`; each class sets its own).
    capabilities: Capabilities = Capabilities()
    #: Bytes of buffers the sampler entries share, allocated with the executor outside every
    #: entry (the torch sampler's noise and workspace); the warm-up report shows them.
    sampler_buffer_bytes: int = 0
    #: Bytes the built entries need only while one of them runs, beyond what each holds (XLA: the
    #: temp memory of an execution, allocated per run: the largest forward's plus the largest
    #: sampler's); counted once in the graph-memory budget. 0 where every entry holds its own.
    scratch_bytes: int = 0

    #: The model the executor runs (rank 0's shard under tensor parallelism).
    model: Any
    vocab_size: int
    host_buffers: Mapping[str, np.ndarray]
    #: How many times :meth:`recover_kv_cache` re-created a lost KV cache.
    kv_cache_resets: int = 0
    #: LoRA adapter slots where ``max_loras > 0`` and this executor supports them, else None.
    lora: LoraSlots | None = None
    #: The extra inputs the model declares (``core.inputs.extra_inputs.ExtraInput`` by name) and their
    #: host staging buffers, which the runner writes each step; empty where there are none.
    extra_inputs: Mapping[str, Any] = {}
    extra_buffers: Mapping[str, np.ndarray] = {}
    #: A hybrid model's recurrent-state slots (one per running request; docs/hybrid.md) and their
    #: memory (``core.state_spec.StateMemory``); None for a model without recurrent state.
    num_state_slots: int | None = None
    state_memory: Any = None

    #: Where the model's weights and the KV cache live, and their element type (``torch.device``
    #: / ``torch.dtype``, or jax's); what ``graphrt.testing`` reads to build comparable inputs.
    device: Any = None
    dtype: Any = None

    #: The devices of a sharded executor (a ``jax.sharding.Mesh``); None on a single device.
    mesh: Any = None
    #: The KV cache as one array ``[layers, 2, slots + 1, kv_heads, head_dim]`` (torch tensor or
    #: jax array) where the model stores one standard layout, else None (:meth:`kv_views`).
    kv_cache: Any = None
    #: A hybrid model's recurrent-state arrays, ``[slots + 1, checkpoints, ...]`` each (docs/hybrid.md).
    state_caches: Sequence[Any] = ()
    #: Whether the model allocates and holds its KV cache itself (a ``KVCacheSpec.owned_by_model``).
    kv_owned_by_model: bool = False

    @property
    def build_count(self) -> int:
        """How many entries this executor has built (captured or compiled) so far: warm-up's and
        on-demand builds alike (XLA: every compile its counters saw). Default: not counted, 0."""
        return 0

    def input_ptrs(self) -> dict[str, int]:
        """The device addresses of the static input buffers a built entry reads, by name (a
        replay reads them in place: they must never move). Default: none, {} (an executor whose
        entries take their inputs as arguments, XLA)."""
        return {}

    def kv_views(self) -> list[Any]:
        """The stored KV layouts, one array each (several where K and V of other sizes, MLA or
        mixed dtypes are stored apart); what tests compare and corrupt. Default: :attr:`kv_cache`."""
        return [] if self.kv_cache is None else [self.kv_cache]

    def kv_as_rows(self, host: np.ndarray, block_size: int) -> np.ndarray:
        """A host copy of :attr:`kv_cache` in the reference layout ``[layers, 2, slots + 1, ...]``
        (an XLA cache in the Pallas page layout converts). Default: it is that layout."""
        return host

    def kv_from_rows(self, values: np.ndarray, block_size: int) -> np.ndarray:
        """The inverse of :meth:`kv_as_rows`: reference-layout ``values`` in the stored layout."""
        return values

    def device_buffers(self) -> dict[str, Any]:
        """Every device buffer a step writes besides the KV and state caches, by name (static
        inputs, outputs, the sampler's state): what a test checks a refused step left alone.
        Default: none, {} (XLA: immutable arrays, nothing written in place)."""
        return {}

    @abc.abstractmethod
    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one KV block takes over all layers."""

    @abc.abstractmethod
    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the KV cache (block 0 is the null block, never given to a request)."""

    @abc.abstractmethod
    def build(self, mode: RuntimeMode, key: BatchDescriptor | SamplerKey) -> tuple[EntryT, int]:
        """Capture / compile the entry for ``key``; returns (entry, bytes it holds)."""

    def build_many(self, jobs: Sequence[tuple[RuntimeMode, BatchDescriptor | SamplerKey]], *,
                   progress: bool = False) -> list[Built[EntryT]] | None:
        """Warm-up's plan: build every key of ``jobs`` up front, where that is faster than one at
        a time (XLA compiles in parallel), and return one :class:`Built` per job, in order; the
        runner stores them. An executor that keeps compile bookkeeping of its own (XLA: which
        compiles are unplanned) takes ``jobs`` as its planned keys. Default: None, this
        executor builds one key at a time and the runner calls :meth:`build` per job."""
        return None

    def expect_builds(self, jobs: Sequence[tuple[RuntimeMode, BatchDescriptor | SamplerKey]]) -> None:
        """Background warm-up (or a traffic re-fit) will :meth:`build` these keys, one at a time
        between steps: an executor with compile bookkeeping of its own (XLA) takes them as
        planned, so building them is no unplanned compile. Default: nothing to record."""

    @abc.abstractmethod
    def run(self, mode: RuntimeMode, key: BatchDescriptor, entry: EntryT | None, padded: ModelInputs,
            future: Any = None) -> Any:
        """Run one padded step (replay ``entry``, or eagerly when it is None: ``eager_fallback``
        executors only, the others need the entry); returns logits rows.
        ``future`` (``async_execution`` executors only; None otherwise): ``(rows, tokens)`` of
        the previous step, whose tokens replace each such request's last input id on the device."""

    @abc.abstractmethod
    def sample(self, logits: Any, num_reqs: int, sampling: SamplingBatch, *,
               padded_reqs: int | None = None, entry: EntryT | None = None, wait: bool = True,
               key: SamplerKey | None = None) -> Any:
        """One token id per real request (int64): the sampler ``entry`` built for ``key`` (None:
        ``sampler_key(sampling, padded_reqs, vocab_size)``, which the runner passes) replayed /
        called on the first ``padded_reqs`` logits rows, or the sampler run eagerly when ``entry``
        is None (``eager_fallback`` executors only; for the others the runner builds it first). With
        ``wait=False`` (``async_execution`` executors) the device's tokens, for
        :meth:`fetch_tokens`; synchronous executors always return the host tokens."""

    def fetch_tokens(self, tokens: Any, num_reqs: int) -> np.ndarray:
        """The first ``num_reqs`` of :meth:`sample`'s ``wait=False`` output, on the host (int64),
        waiting for the device. Default (synchronous executors): they are already there."""
        return np.asarray(tokens)[:num_reqs]

    def sample_logprobs(self, logits: Any, sampled: Any, num_reqs: int, *, padded_reqs: int | None = None,
                        entry: EntryT | None = None, wait: bool = True) -> Any:
        """Run the logprobs graph ``entry`` (``SamplerKey(padded_reqs, False, logprobs=True)``; None:
        eagerly, ``eager_fallback`` executors only) right after :meth:`sample`, on the logits rows
        it read and ``sampled`` (what it returned): per real row the sampled token's logprob, its
        rank and the ``max_logprobs`` top logprobs with their ids, as host arrays; with
        ``wait=False`` (``async_execution``) a handle for :meth:`fetch_logprobs`."""
        raise GraphrtError(f"{type(self).__name__} computes no logprobs")

    def fetch_logprobs(self, handle: Any, num_reqs: int) -> tuple[np.ndarray, ...]:
        """The host arrays of a ``sample_logprobs(wait=False)`` handle, waiting for the device.
        Default (synchronous executors): the handle is those arrays."""
        return handle

    def prompt_logprobs(self, rows: np.ndarray, targets: np.ndarray, k: int) -> tuple[np.ndarray, ...]:
        """Logprobs at the last forward's token rows ``rows`` (int64) of the tokens ``targets``, and
        the ``k`` top logprobs there: host arrays ``(logprob, rank, top logprobs, top ids)``."""
        raise GraphrtError(f"{type(self).__name__} computes no prompt logprobs")

    def device_logits(self, num_rows: int) -> Any:
        """The last step's logits rows on the device, without a host copy (valid until the next
        step). Default: the host copy of :meth:`logits`."""
        return self.logits(num_rows)

    def close(self) -> None:
        """Release what the executor started (tensor-parallel workers, their shared memory).
        Idempotent; default: nothing to release."""

    @abc.abstractmethod
    def hidden_states(self, num_tokens: int) -> np.ndarray:
        """The last step's hidden states of the first ``num_tokens`` rows (tests, debugging)."""

    @abc.abstractmethod
    def logits(self, num_reqs: int) -> np.ndarray:
        """The last step's logits of the first ``num_reqs`` requests (tests, debugging)."""

    @abc.abstractmethod
    def position_logits(self, num_reqs: int) -> np.ndarray:
        """With ``num_speculative_tokens = k > 0``: the last step's logits at each of the first
        ``num_reqs`` requests' last ``1 + k`` scheduled positions, ``[num_reqs, 1 + k, V]``
        (what draft verification compares; rows before a request's first scheduled token are
        unspecified). Raises :class:`GraphrtError` when ``k == 0``."""

    def free_request(self, request_id: int) -> None:
        """Forget per-request state (seeded generators) of a finished request."""

    def recover_kv_cache(self) -> bool:
        """After a failed step: re-create the KV cache if the failure lost it (XLA: the step
        had consumed the donated cache) and return True; every request's KV is then gone.
        Default: a failed step cannot lose the cache (it is written in place)."""
        return False

    def prepare_penalties(self, sampling: SamplingBatch, token_ids: np.ndarray, req_rows: np.ndarray,
                          num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray, rows: int) -> None:
        """Before a step whose batch has penalties runs: plan its token counts (the runner's
        checked arrays; ``rows`` padded sampler rows). Backends without penalties refuse it."""
        raise InputError("repetition_penalty", f"{type(self).__name__} has no penalised sampler: repetition, "
                                               "presence and frequency penalties run on the torch backends")

    def describe_build_failure(self, exc: BaseException) -> str:
        """Why :meth:`build` failed and what to change, for the eager-fallback warning."""
        return f"{type(exc).__name__}: {exc}"

    def memory_info(self) -> tuple[int, int] | None:
        """(free, total) device bytes where the device can say, for KV cache sizing."""
        return None

    # ---- weights and memory (graphrt/runner_weights.py drives these) -------------------------
    def update_weights(self, source: Any, *, check_only: bool = False) -> WeightsUpdate:
        """Copy new weights into the storage every built entry reads, without rebuilding any:
        ``source`` is a checkpoint (a directory of safetensors or one file), a mapping or an
        iterable of ``(name, tensor)`` in the checkpoint's names, all or part of them. Every
        tensor is checked before the first is written (an unknown name, a wrong shape, a dtype
        that does not cast: one InputError naming them, nothing written); ``check_only`` stops
        there. Default: this executor cannot (ConfigError)."""
        raise ConfigError(f"{type(self).__name__} cannot refit weights in place")

    def weight_names(self) -> frozenset[str]:
        """The names :meth:`update_weights` reports as ``filled``: every weight a full refit
        writes (what a level-2 sleep drops). Default: none."""
        return frozenset()

    def sleep(self, level: int) -> SleepReport:
        """Give memory back: level 1 keeps the weights in host memory, level 2 drops them; both
        drop the KV and state caches. Nothing may run until :meth:`wake`. Default: cannot."""
        raise ConfigError(f"{type(self).__name__} cannot sleep")

    def wake(self) -> WakeReport:
        """Take the memory back: the same buffers (weights restored, caches zeroed), naming those
        that came back at another address (``moved``: the entries reading them are stale)."""
        raise ConfigError(f"{type(self).__name__} cannot sleep")

    def buffer_watch(self) -> BufferWatch | None:
        """What tells the runner, before each step, that the live-buffer check is due (asked once,
        at setup: the runner reads its ``due`` per step, with no call); None where nothing can move
        under the built entries. Default: None (entries take their buffers as arguments)."""
        return None

    def stale_buffers(self, entries: Iterable[tuple[Hashable, Any]]) -> dict[Hashable, list[str]]:
        """For each ``(cache key, entry)`` whose captured buffers (parameters, caches, LoRA slots,
        workspaces) moved or were re-bound since it was built, what moved. Default: nothing can
        (entries that take their buffers as arguments, XLA)."""
        return {}

    def entry_memory(self, entry: Any) -> dict[str, Any]:
        """What one built entry takes beside its ``bytes``, for the warm-up report: what the
        backend's compiler says (XLA: ``temp_bytes``, ``alias_bytes``, ``code_bytes``), or the
        collectives it runs eagerly per step (torch, ``collectives="eager"``: ``eager_collectives``);
        empty where there is nothing to say (captured graphs are measured, not analysed)."""
        return {}

    def measure_graph_memory(self, jobs: Sequence[tuple[RuntimeMode, BatchDescriptor | SamplerKey]]
                             ) -> tuple[dict[Any, int], str | None]:
        """Before the KV cache is allocated: build ``jobs`` in order (largest first) into a
        throwaway pool, return the bytes each added (by key, in that order) and free them all;
        or ``({}, why not)`` where this executor cannot (then nothing is deducted from the KV
        budget for graphs, and the runner logs the reason). Default: it cannot."""
        return {}, f"{type(self).__name__} cannot build entries before its KV cache exists"


class Backend(abc.ABC):
    """A registry entry: a device / framework pairing that can build executors."""

    name: ClassVar[str]
    framework: ClassVar[str]   # "torch" or "jax"

    @classmethod
    @abc.abstractmethod
    def unavailable_reason(cls) -> str | None:
        """``None`` when this backend can run here, else why not (one sentence)."""

    @abc.abstractmethod
    def load_model(self, model_dir: str, dtype: Any = None, *, model_impl: str = "auto",
                   trust_remote_code: bool = False) -> Any:
        """Load a Hugging Face directory for this framework: graphrt's reference model, or with
        ``model_impl`` (``models/model_impl.py``) transformers' model where the backend runs it
        (running the checkpoint's own code only with ``trust_remote_code``)."""

    def check_model(self, model: Any) -> None:
        """Refuse, before anything is allocated, a model this backend cannot run: a missing or
        ill-typed member of its framework's model protocol named with what to implement, or a
        model of another framework (ConfigError). Default: no check."""

    def for_tensor_parallel(self, tp: int) -> "Backend":
        """This backend for ``tensor_parallel_size=tp`` (the torch backends start or join their
        ranks in :meth:`create_executor`: themselves; xla: a backend over a ``tp``-device mesh)."""
        return self

    @abc.abstractmethod
    def create_executor(self, model: Any, config: Any, dtype: Any = None) -> Executor:
        """The executor that runs ``model`` under ``config`` on this backend's device; ``dtype``
        (checked by ``backends.preflight``) is what tensor-parallel ranks load their shards in,
        where ``model`` is still a directory. Backends that load no shards ignore it."""

    def graphs(self, fn: Callable[..., Any], cache: GraphCache | None = None, **options: Any) -> Any:
        """``fn`` captured / compiled once per key and run per step: the piece an engine with
        its own model runner takes instead of the ModelRunner (``TorchGraphs`` on the torch
        backends, ``XlaGraphs`` on XLA; docs/api.md)."""
        raise NotImplementedError(f"backend {self.name} does not wrap callables")

    def model_shape(self, model: Any, config: GraphConfig) -> ModelShape | None:
        """What ``model``'s allocations scale with under ``config`` (KV bytes per block from its
        KV cache spec, widths, element size, LoRA-capable features), read before the executor
        allocates anything, so that a bad KV cache spec or a size past memory is a ConfigError
        first (backends/preflight.py). Default: None, the backend cannot tell; then only the
        host tables are checked."""
        return None

    def device_memory_bytes(self) -> int | None:
        """Total memory of the device this backend allocates on; None when that is the host's
        RAM (default)."""
        return None

    def dispatcher(self, config: GraphConfig, mode: GraphMode, model: Any,
                   keyed_host_values: Sequence[str] = ()) -> Dispatcher:
        """This backend's bucket policy, as the one dispatcher that owns its graph keys;
        ``keyed_host_values``: what the executor's attention reads as host values and keys on
        (its ``keyed_host_values``: ``max_seq_len`` gives the keys context buckets).

        Default: vLLM-style capture sizes (``config.capture_policy()``), eager above the
        largest. The ACL backend caps the sizes to its stream budget; XLA uses a token x
        batch-size grid and never runs eagerly."""
        return config.graph_dispatcher(mode, keyed_context="max_seq_len" in keyed_host_values)

    def __repr__(self) -> str:
        return f"<graphrt backend {self.name}>"
