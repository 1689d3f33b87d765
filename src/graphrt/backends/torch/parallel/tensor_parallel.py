"""Tensor parallelism for the torch backends: rank 0's executor, driving its workers.

With ``tensor_parallel_size > 1`` the runner gets a :class:`TensorParallelExecutor`, an ordinary
executor to it: rank 0 prepares and pads each step once, and every lockstep call goes to the
workers first, then to its own :class:`~graphrt.backends.torch.executor.TorchExecutor`. A
``run`` is one int64 row through the step channel (the staging buffers are the channel's).
Sampling is rank 0's. A fault raises :class:`~graphrt.core.errors.GraphrtError` naming the rank
and call and stops every rank. docs/distributed.md, "Tensor-parallel engines"."""

from __future__ import annotations

import functools
import logging
import os
import weakref
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from graphrt.backends.base import Capabilities, Executor, SamplingBatch
from graphrt.backends.torch.parallel import tp_protocol as p
from graphrt.backends.torch.parallel.collective_log import CollectiveLog, agreed, gather_mismatch
from graphrt.backends.torch.executor import TorchEntry, TorchExecutor
from graphrt.backends.torch.parallel.tp_ranks import JoinedRanks, Ranks, SpawnedRanks
from graphrt.config import GraphConfig
from graphrt.core import defaults
from graphrt.core.dispatch import BatchDescriptor, SamplerKey
from graphrt.core.errors import ConfigError, GraphCaptureError, GraphrtError, InputError
from graphrt.core.inputs.fields import ARRAY_FIELDS, FIELD_DTYPES, ModelInputs, buffer_shapes
from graphrt.core.graph_modes import AttentionGraphSupport, RuntimeMode
from graphrt.core.weight_reports import WeightsUpdate
from graphrt.backends.torch.weights import staged_checkpoint

logger = logging.getLogger(__name__)


def model_source(model: Any, dtype: Any, tp_size: int) -> tuple[str, Any]:
    """The checkpoint directory and dtype every rank loads its shard from: a directory, or a
    model graphrt's torch loader built unsharded from one (``graphrt.LLM`` loads it first)."""
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model), dtype or torch.float32
    source = getattr(model, "source_dir", None)
    if source is not None and getattr(model, "tp_size", 1) == 1:
        logger.info("graphrt: tensor_parallel_size=%d: every rank loads its shard from %s (the unsharded "
                    "model passed in is not used)", tp_size, source)
        return source, next(model.parameters()).dtype
    raise ConfigError(f"tensor_parallel_size={tp_size} needs the model as a Hugging Face directory, so "
                      f"that each rank loads only its own shard; got a built {type(model).__name__}")


def start_tensor_parallel(backend: Any, model: Any, config: GraphConfig, dtype: Any = None) -> "TensorParallelExecutor":
    """Start (or, under torchrun, join) ``config.tensor_parallel_size`` ranks of ``model`` on
    ``backend`` (a :class:`~graphrt.backends.torch.backend.TorchBackend`); rank 0 loads its
    shard while the workers start, and returns once every rank has built its executor."""
    tp = config.tensor_parallel_size
    if config.max_loras:
        raise ConfigError(f"max_loras={config.max_loras} with tensor_parallel_size={tp}: LoRA adapters "
                          "run on unsharded models only")
    model_dir, dtype = model_source(model, dtype, tp)
    impl = getattr(model, "model_impl", None) or config.model_impl     # a model built by transformers' loader
    trust = bool(getattr(model, "trust_remote_code", False)) or config.trust_remote_code    # ... of its own code
    cls = type(backend)
    setup = p.WorkerSetup(f"{cls.__module__}:{cls.__qualname__}", backend.device.type, backend.device.index,
                          model_dir, dtype, {**config.model_dump(), "model_impl": impl, "trust_remote_code": trust},
                          tp, defaults.TP_TIMEOUT_S, torch.get_num_threads(), dict(os.environ))
    shapes = buffer_shapes(config.max_num_batched_tokens, config.max_num_seqs, config.max_blocks_per_req)
    resident = {name: (shape, FIELD_DTYPES[name]) for name, shape in shapes.items()}
    ranks: Ranks = JoinedRanks(setup) if dist.is_initialized() else SpawnedRanks(setup, resident)
    try:
        shard = backend.load_model(model_dir, dtype, tp_rank=0, tp_size=tp, model_impl=impl,
                                   trust_remote_code=trust)
        host = ranks.channel.resident or None
        pinned = _pin(host) if host is not None and backend.device.type == "cuda" else None
        local = TorchExecutor(shard, config, backend.device, backend.graph_api(), host_arrays=host)
        if pinned is not None:                  # unpinned when the executor over them goes
            weakref.finalize(local, torch.cuda.cudart().cudaHostUnregister, pinned)
        ranks.connect()
        executor = TensorParallelExecutor(local, ranks)
        executor._agree(0, "start-up (loading the shards)", timeout=defaults.TP_WORKER_START_TIMEOUT_S,
                        fatal=True)
        ranks.ready = True
    except BaseException:
        ranks.close()
        raise
    return executor


def _pin(buffers: dict[str, np.ndarray]) -> int | None:
    """Page-lock the resident buffers for CUDA's host-to-device copies, as the executor's own
    staging buffers are (pinned memory), and return the address registered; where that fails
    they stay pageable, which is slower to copy from but correct (None)."""
    arrays = sorted(buffers.values(), key=lambda a: a.ctypes.data)
    start = arrays[0].ctypes.data
    size = arrays[-1].ctypes.data + arrays[-1].nbytes - start
    err = torch.cuda.cudart().cudaHostRegister(start, size, 0)
    if int(err) != 0:
        logger.warning("tensor parallel: could not pin the step channel's buffers (cudaHostRegister error %s); "
                       "host-to-device copies use pageable memory", err)
        return None
    return start


class TensorParallelExecutor(Executor[TorchEntry]):
    """Rank 0's :class:`TorchExecutor` plus its workers, as one executor (see the module doc)."""

    lora = None

    def __init__(self, local: TorchExecutor, ranks: Ranks) -> None:
        self.local, self.ranks = local, ranks
        self.model = local.model
        if local.config.collectives == "eager":
            if local.config.piecewise_capture == "breakable":
                raise ConfigError("collectives='eager' with piecewise_capture='breakable': only the fx split cuts "
                                  "the forward at its collectives; use piecewise_capture='fx' or 'auto'")
            logger.info("graphrt: collectives='eager': PIECEWISE graphs only, each collective run eagerly between "
                        "pieces (the warm-up report's eager_collectives counts them per step)")
        if local.extra_inputs:
            raise ConfigError(f"the model declares extra inputs {sorted(local.extra_inputs)}: tensor parallelism "
                              "sends graphrt's step fields to the workers only; run it with tensor_parallel_size=1")
        self.vocab_size = local.vocab_size
        self.sampler_buffer_bytes = local.sampler_buffer_bytes     # rank 0's: the one that samples
        self.host_buffers = local.host_buffers
        self.tp_size = ranks.setup.tp_size
        self.steps = 0
        self._key_row = np.zeros(p.KEY_WORDS, dtype=np.int64)
        self._run_row = np.zeros(p.RUN_WORDS, dtype=np.int64)
        #: Whether the step's arrays wait in the channel's resident buffers (spawned workers);
        #: a step padded elsewhere than in them sends its arrays after the row.
        self._resident = bool(ranks.channel.resident)
        self._run_arrays: list[Any] = [self._run_row] + [None] * len(ARRAY_FIELDS)
        self._row_only = [self._run_row]
        self._closer = weakref.finalize(self, ranks.close)
        #: Builds send no collective (stand-ins) where the capture executes them: the CPU
        #: recording graph (collective_log's module doc).
        self._dry_builds = ranks.setup.device_type == "cpu"

    # ---- what stays on rank 0 ----------------------------------------------------------
    @functools.cached_property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        """Rank 0's graphs, attention and PIECEWISE support; steps run synchronously (each waits
        for the workers), with the eager fallback, outside a shared memory pool."""
        local = self.local.capabilities
        # collectives='eager': a FULL graph would hold the collectives, so every graph is
        # PIECEWISE, each collective a break between pieces.
        attention = AttentionGraphSupport.NEVER if self.local.config.collectives == "eager" else local.attention_support
        return Capabilities(has_graphs=local.has_graphs, attention_support=attention,
                            supports_piecewise=local.supports_piecewise, eager_fallback=True, async_execution=False,
                            keyed_host_values=local.keyed_host_values)

    @property
    def kv_cache_resets(self) -> int:  # type: ignore[override]
        return self.local.kv_cache_resets

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes of a block on one rank (its own KV heads): every rank holds the same count."""
        return self.local.kv_cache_bytes_per_block(block_size)

    def sample(self, logits: Any, num_reqs: int, sampling: SamplingBatch, *,
               padded_reqs: int | None = None, entry: Any = None, wait: bool = True, key: Any = None) -> np.ndarray:
        """Rank 0 samples alone: its logits rows are the gathered, full-vocabulary ones (a
        synchronous executor: it always waits)."""
        return self.local.sample(logits, num_reqs, sampling, padded_reqs=padded_reqs, entry=entry, key=key)

    def prepare_penalties(self, *args: Any) -> None:
        """Rank 0 samples alone, so it alone keeps the penalties' token counts."""
        self.local.prepare_penalties(*args)

    def sample_logprobs(self, logits: Any, sampled: Any, num_reqs: int, *, padded_reqs: int | None = None,
                        entry: Any = None, wait: bool = True) -> tuple[np.ndarray, ...]:
        """Rank 0's logprobs graph, on the gathered logits (it always waits)."""
        return self.local.sample_logprobs(logits, sampled, num_reqs, padded_reqs=padded_reqs, entry=entry)

    def prompt_logprobs(self, rows: np.ndarray, targets: np.ndarray, k: int) -> tuple[np.ndarray, ...]:
        """Not under tensor parallelism: the logits of hidden rows need every rank's collective."""
        raise InputError("prompt_logprobs", "not supported with tensor_parallel_size > 1 (computing logits "
                                            "outside a step needs every rank)")

    def device_logits(self, num_rows: int) -> Any:
        return self.local.device_logits(num_rows)

    def hidden_states(self, num_tokens: int) -> np.ndarray:
        return self.local.hidden_states(num_tokens)

    def logits(self, num_reqs: int) -> np.ndarray:
        return self.local.logits(num_reqs)

    def position_logits(self, num_reqs: int) -> np.ndarray:
        return self.local.position_logits(num_reqs)

    def free_request(self, request_id: int) -> None:
        self.local.free_request(request_id)

    def describe_build_failure(self, exc: BaseException) -> str:
        return self.local.describe_build_failure(exc)

    def entry_memory(self, entry: Any) -> dict[str, Any]:
        return self.local.entry_memory(entry)

    # ---- what every rank does ----------------------------------------------------------
    def _send(self, method: int, arrays: list[np.ndarray], doing: Any) -> None:
        """Send one call; a fault raises the error naming the rank and stops every rank."""
        self.ranks.check()
        try:
            self.ranks.send(method, arrays)
        except Exception as exc:  # noqa: BLE001 - a failed send is a fault, named
            raise self._fail(doing, exc) from exc

    def _doing(self, doing: Any) -> str:
        if isinstance(doing, str):
            return doing
        method, key = doing
        if method == p.RUN:
            return f"step {self.steps} (run {key})"
        return f"{p.METHOD_NAMES[method]} {key}"

    def _fail(self, doing: Any, exc: BaseException | None) -> GraphrtError:
        error = self.ranks.fault(self._doing(doing), exc)
        logger.error("graphrt: %s; stopping every tensor-parallel rank", error)
        self.close()
        return error

    def _agree(self, status: int, doing: Any, a: int = 0, b: int = 0, *, timeout: float | None = None,
               fatal: bool = False) -> list[tuple[int, int, int]]:
        """Every rank's ``(status, a, b)`` for the call just made; with ``fatal`` a rank that
        failed is a fault."""
        try:
            self.ranks.wait(self.ranks.agreement.start(status, a, b), timeout)
        except Exception as exc:  # noqa: BLE001 - a worker exited, hung or the group failed
            raise self._fail(doing, exc) from exc
        rows = self.ranks.agreement.rows()
        if fatal and any(row[0] for row in rows):
            failed = [rank for rank, row in enumerate(rows) if row[0]]
            raise self._fail(doing, GraphrtError(f"ranks {failed} failed"))
        return rows

    def _everywhere(self, method: int, words: Sequence[int], doing: str, call: Any) -> Any:
        """Send ``method``, run ``call`` on rank 0, agree; a failure anywhere stops every rank."""
        row = np.asarray(words, dtype=np.int64)
        self._send(method, [row], doing)
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 - rank 0 failed: the workers are told, then stopped
            self._agree(1, doing)
            raise self._fail(doing, exc) from exc
        except BaseException as exc:    # KeyboardInterrupt: the ranks are out of step for good
            self._fail(doing, exc)
            raise
        self._agree(0, doing, *(result if method == p.MEMORY else ()), fatal=True)
        return result

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Rank 0 decided ``num_blocks``; every rank allocates that many blocks of its heads."""
        self._everywhere(p.ALLOCATE, (num_blocks, block_size), f"allocate_kv_cache ({num_blocks} blocks)",
                         lambda: self.local.allocate_kv_cache(num_blocks, block_size))

    def recover_kv_cache(self) -> bool:
        """Nothing to recover after a fault (the next step raises it); else every rank's."""
        if self.ranks.fault_error is not None or self.ranks.closed:
            return False
        return self._everywhere(p.RECOVER, (), "recover_kv_cache", self.local.recover_kv_cache)

    def memory_info(self) -> tuple[int, int] | None:
        """The least free (and total) device memory of any rank."""
        if self.local.memory_info() is None:
            return None
        self._everywhere(p.MEMORY, (), "memory_info", self.local.memory_info)
        rows = self.ranks.agreement.rows()
        return min(row[1] for row in rows), min(row[2] for row in rows)

    def measure_graph_memory(self, jobs: Sequence[tuple[RuntimeMode, Any]]) -> tuple[dict[Any, int], str | None]:
        """Every rank captures the samples (their collectives need all ranks); rank 0's bytes count."""
        words: list[int] = []
        for mode, key in jobs:
            row = self._key_row
            if isinstance(key, SamplerKey):
                row[:] = (p.MODE_CODE[mode], key.num_reqs, -1, key.greedy, key.logprobs, -1)
            else:
                p.encode_key(row, mode, key)
            words += [int(isinstance(key, SamplerKey))] + row.tolist()
        def measure() -> Any:
            with CollectiveLog(dry=self._dry_builds):
                return self.local.measure_graph_memory(jobs)
        return self._everywhere(p.MEASURE, words, "measure_graph_memory", measure)

    def update_weights(self, source: Any, *, check_only: bool = False) -> WeightsUpdate:
        """Every rank refits its shard from one checkpoint (a path as it is, tensors staged in a
        temporary safetensors file): each rank checks first, and only when none refused does each
        write. A rank failing while writing stops every rank (their weights would differ)."""
        with staged_checkpoint(source) as path:
            words = p.encode_text(path)
            checked = self._refit(0, words, path)
            return checked if check_only else self._refit(1, words, path)

    def weight_names(self) -> frozenset[str]:
        return self.local.weight_names()

    def stale_buffers(self, entries: Any) -> dict[Any, list[str]]:
        """Rank 0's graphs (the runner's entries) checked on rank 0; each worker's mirror them."""
        return self.local.stale_buffers(entries)

    def buffer_watch(self) -> Any:
        return self.local.buffer_watch()

    def sleep(self, level: int) -> Any:
        """Not implemented: every rank would release and take back its shard (and recapture the
        same keys where an address moved) together."""
        raise ConfigError(f"sleep(level={level}) under tensor_parallel_size={self.tp_size} is not implemented; "
                          "refit in place (update_weights) works on every rank")

    def _refit(self, write: int, words: list[int], path: str) -> WeightsUpdate:
        """One REFIT call on every rank (``write`` 0: check only)."""
        doing = "update_weights" if write else "update_weights (check)"
        self._send(p.REFIT, [np.asarray([write, *words], dtype=np.int64)], doing)
        try:
            result = self.local.update_weights(path, check_only=not write)
        except Exception as exc:
            self._agree(1, doing)
            if write:                   # part of rank 0's shard may be written: the ranks differ
                raise self._fail(doing, exc) from exc
            raise
        except BaseException as exc:    # KeyboardInterrupt: the ranks are out of step for good
            self._fail(doing, exc)
            raise
        failed = [rank for rank, row in enumerate(self._agree(0, doing)) if row[0]]
        if failed and write:
            raise self._fail(doing, GraphrtError(f"ranks {failed} failed while writing their shards"))
        if failed:
            raise InputError("weights", f"tensor-parallel rank(s) {failed} refused the refit (their log says why); "
                                        "nothing was written")
        return result

    def build(self, mode: RuntimeMode, key: BatchDescriptor | SamplerKey) -> tuple[TorchEntry, int]:
        """Samplers are rank 0's; a forward key is captured on every rank, and fails (runs
        eagerly everywhere) when any rank's capture failed."""
        if isinstance(key, SamplerKey):
            return self.local.build(mode, key)
        p.encode_key(self._key_row, mode, key)
        self._send(p.BUILD, [self._key_row], (p.BUILD, key))
        log = CollectiveLog(dry=self._dry_builds)
        try:
            with log:
                entry, nbytes = self.local.build(mode, key)
        except Exception:
            self._agree(1, (p.BUILD, key))
            raise
        except BaseException as exc:    # KeyboardInterrupt: the ranks are out of step for good
            self._fail((p.BUILD, key), exc)
            raise
        rows = self._agree(0, (p.BUILD, key), log.signature(), len(log.entries))
        if not agreed(rows):            # every rank saw the same rows: each raises the same error
            try:
                error = gather_mismatch(self.ranks.agreement.group, self.tp_size, key, log.entries)
            except Exception as exc:  # noqa: BLE001 - a worker went while the lists were gathered
                raise self._fail((p.BUILD, key), exc) from exc
            logger.error("graphrt: %s", error)
            self.ranks.fault_error = error
            self.ranks.peers_left = True            # every worker raises it too, and exits
            self.close()
            raise error
        failed = [rank for rank, row in enumerate(rows) if row[0]]
        if failed:
            raise GraphCaptureError(f"capturing {key} failed on tensor-parallel rank(s) {failed} (see their "
                                    "log); it runs eagerly on every rank")
        return entry, nbytes

    def run(self, mode: RuntimeMode, key: BatchDescriptor, entry: TorchEntry | None,
            padded: ModelInputs) -> torch.Tensor:
        """Send the padded step to the workers, then run it here; the collectives meet inside."""
        self.steps += 1
        row, arrays = self._run_row, self._run_arrays
        p.encode_key(row, mode, key)
        row[p.RUN_EAGER] = entry is None
        row[p.RUN_NUM_REQS], row[p.RUN_NUM_TOKENS] = padded.num_reqs, padded.num_tokens
        row[p.RUN_MAX_QUERY], row[p.RUN_MAX_SEQ] = padded.max_query_len, padded.max_seq_len
        row[p.RUN_UNIFORM], row[p.RUN_STEP] = padded.uniform_decode, self.steps
        row[p.RUN_PADDED_TOKENS], row[p.RUN_PADDED_REQS] = padded.padded_num_tokens, padded.padded_num_reqs
        host = self.host_buffers
        if self._resident and all(getattr(padded, name).base is host[name] for name in ARRAY_FIELDS):
            arrays = self._row_only            # the step is in the resident buffers already
        else:
            for i, name in enumerate(ARRAY_FIELDS, 1):
                arrays[i] = getattr(padded, name)
        self._send(p.RUN, arrays, (p.RUN, key))
        try:
            logits = self.local.run(mode, key, entry, padded)
            # Every worker copied the step out before its forward met rank 0's in a collective,
            # so this returns at once; the runner may then write the next step into the buffers.
            self.ranks.channel.wait_acks(self.ranks.timeout)
            return logits
        except Exception as exc:  # noqa: BLE001 - a collective failed, or rank 0's forward did
            raise self._fail((p.RUN, key), exc) from exc
        except BaseException as exc:    # KeyboardInterrupt: the ranks are out of step for good
            self._fail((p.RUN, key), exc)
            raise

    def close(self) -> None:
        """Stop the workers, release the channel and the process group (idempotent)."""
        self._closer()


__all__ = ["TensorParallelExecutor", "model_source", "start_tensor_parallel"]
