"""What a ModelRunner (and graphrt.LLM) refuses before it allocates anything.

Settings that used to fail late (deep in loading, at the first prefill) are a
:class:`ConfigError` naming the field here: :func:`check_before_loading` (a backend that shards
for ``tensor_parallel_size > 1``, a known ``dtype``, a ``model_impl`` for the directory,
``max_model_len`` within ``max_position_embeddings``, a ``compilation_cache_dir`` this process
can write: :func:`check_cache_dir`); :func:`check_memory`, after loading (the
bytes each setting implies, :func:`runner_needs`, against host RAM and device memory); and
:func:`engine_host_needs` (graphrt.LLM's tables). The counts are lower bounds: enough to refuse
what can never fit, not an estimate of the process."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from graphrt.backends.xla.buckets import XlaBuckets
from graphrt.config import GraphConfig
from graphrt.core import defaults
from graphrt.core.dtypes import model_dtype
from graphrt.core.errors import ConfigError
from graphrt.core.inputs.fields import FIELD_DTYPES, FIELDS, REQUEST_FIELDS, TOKEN_FIELDS
from graphrt.core.graph_modes import GraphMode
from graphrt.core.memory_bounds import Need, check_needs, physical_memory_bytes
from graphrt.models.hf_config import model_max_len
from graphrt.models.model_impl import checkpoint_limits, resolve_model_impl

#: Bytes per token / request row of the step's staging buffers (core/inputs/fields.py's table).
_TOKEN_BYTES = sum(np.dtype(FIELD_DTYPES[name]).itemsize for name in TOKEN_FIELDS)
_REQUEST_BYTES = sum(np.dtype(FIELD_DTYPES[name]).itemsize for name in REQUEST_FIELDS if not FIELDS[name].per_block)
_BLOCK_BYTES = np.dtype(FIELD_DTYPES["block_table"]).itemsize
#: Host copies of the staging buffers: the input preparer's and the executor's.
_HOST_COPIES = 2


def check_before_loading(backend: Any, model: Any, config: GraphConfig, dtype: Any) -> Any:
    """Before ``model`` (a directory or a loaded model) is loaded: a backend that can shard it
    where ``tensor_parallel_size > 1``, ``max_model_len`` within the model's positions, and
    ``dtype`` as its canonical name (returned; None stays None, "auto" stays "auto" for a model
    already loaded). Raises :class:`ConfigError` naming the field."""
    tp = config.tensor_parallel_size
    if tp > 1 and backend.framework != "torch":
        raise ConfigError(f"tensor_parallel_size={tp}: backend {backend.name} does not shard (torch ones do)")
    if config.compilation_cache_dir:
        check_cache_dir(config.compilation_cache_dir)
    path = os.fspath(model) if isinstance(model, (str, os.PathLike)) else None
    if path is not None:    # which implementation loads it (model_impl), refused here if none can
        resolve_model_impl(path, config.model_impl, backend.framework)
    positions, checkpoint_dtype = checkpoint_limits(path) if path is not None else (model_max_len(model), None)
    config.check_model_len(positions)
    if dtype is None:
        return None
    return model_dtype(dtype, (checkpoint_dtype or "float32") if path is not None else None)


def check_cache_dir(directory: str | os.PathLike) -> Path:
    """``compilation_cache_dir`` as a directory this process can write, created when missing:
    proved by writing a file in it (permission bits say nothing for root, nor for a read-only or
    virtual file system), so the XLA caches and the capture plan never fail later on a thread
    or in ``close()``. Raises :class:`ConfigError` naming the field, the path and why."""
    path = Path(os.path.expanduser(os.fspath(directory)))
    fix = "give a directory this process can create and write, or leave compilation_cache_dir unset"
    step = "cannot be created"
    try:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"compilation_cache_dir: {path} exists and is not a directory; {fix}")
        path.mkdir(parents=True, exist_ok=True)
        step = "cannot be written (creating a file in it failed)"
        fd, probe = tempfile.mkstemp(dir=path, prefix=".graphrt-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"compilation_cache_dir: {path} {step}: {exc.strerror or exc}; {fix}") from None
    return path


def _table_field(config: GraphConfig) -> str:
    """The field a block / token table's size is out of line in: max_model_len or max_num_seqs
    (whichever is further above its default)."""
    return ("max_model_len" if config.max_model_len / defaults.DEFAULT_MAX_MODEL_LEN
            >= config.max_num_seqs / defaults.DEFAULT_MAX_NUM_SEQS else "max_num_seqs")


def _host_tables(config: GraphConfig, rows: int, tokens: int) -> list[Need]:
    """The staging buffers' host copies: block tables and request rows, token rows."""
    width = config.max_blocks_per_req
    return [Need(_table_field(config), f"block tables ({rows} requests x {width} blocks, {_HOST_COPIES} host copies)",
                 _HOST_COPIES * rows * (width * _BLOCK_BYTES + _REQUEST_BYTES)),
            Need("max_num_batched_tokens", f"token staging buffers ({tokens} tokens, {_HOST_COPIES} host copies)",
                 _HOST_COPIES * tokens * _TOKEN_BYTES)]


def _largest_graph(config: GraphConfig, xla: bool) -> tuple[int, str]:
    """Tokens of the largest graph / executable warm-up builds, and the field that set them."""
    if xla:
        field = "precompile_token_paddings" if config.precompile_token_paddings else "max_num_batched_tokens"
        return XlaBuckets.from_config(config).tokens.max_size, field
    if config.enforce_eager or config.mode is GraphMode.NONE:
        return 0, ""
    largest = config.capture_policy().max_size
    for field in ("cudagraph_capture_sizes", "max_cudagraph_capture_size"):
        if getattr(config, field) is not None:
            return largest, field
    return largest, "max_num_seqs" if config.default_capture_tokens <= config.max_num_batched_tokens \
        else "max_num_batched_tokens"


def runner_needs(backend: Any, model: Any, config: GraphConfig, *, num_kv_blocks: int | None,
                 kv_cache_memory: int | None) -> tuple[list[Need], list[Need]]:
    """(host needs, device needs) of a ModelRunner of ``model`` on ``backend``: no device needs
    where the backend cannot read the model's shape (``Backend.model_shape``)."""
    cfg, xla = config, backend.framework == "jax"
    grid = XlaBuckets.from_config(cfg) if xla else None
    rows = grid.max_reqs if grid is not None else cfg.max_num_seqs
    steps = cfg.max_num_batched_tokens
    tokens = max(steps, grid.tokens.max_size) if grid is not None else steps
    host = _host_tables(cfg, rows, tokens)
    shape = backend.model_shape(model, cfg)     # the KV cache spec checked here: a bad one is a ConfigError
    if shape is None:
        return host, []
    q, item = cfg.decode_query_len, shape.itemsize
    largest, field = _largest_graph(cfg, xla)
    device = [Need("max_num_batched_tokens", "static token buffers and hidden states",
                   tokens * (_TOKEN_BYTES + shape.hidden_size * item)),
              Need("max_num_seqs", "logits buffers", rows * shape.vocab_size * 4 * (1 + (q if q > 1 else 0)))]
    if largest:
        device.append(Need(field, f"activations of the largest graph ({largest} tokens)",
                           largest * shape.activation_bytes_per_token))
    if steps > largest:
        device.append(Need("max_num_batched_tokens", f"activations of an eager step of {steps} tokens",
                           steps * shape.activation_bytes_per_token))
    if num_kv_blocks is not None:
        device.append(Need("num_kv_blocks", f"KV cache ({num_kv_blocks} blocks of {cfg.block_size} tokens)",
                           shape.kv_cache_bytes(num_kv_blocks)))
    elif kv_cache_memory is not None:
        device.append(Need("kv_cache_memory", "KV cache budget", int(kv_cache_memory)))
    if cfg.max_loras:
        lora = ("max_lora_rank" if cfg.max_lora_rank / defaults.DEFAULT_MAX_LORA_RANK >= cfg.max_loras
                else "max_loras")
        slots = cfg.max_loras * cfg.max_lora_rank * shape.lora_features * item
        product = max(largest, steps) * cfg.max_loras * cfg.max_lora_rank * item   # a step's [adapters, tokens, rank]
        device.append(Need(lora, f"LoRA slots of rank {cfg.max_lora_rank} and a step's adapter products",
                           slots + product))
    return host, device


def check_memory(backend: Any, model: Any, config: GraphConfig, *, num_kv_blocks: int | None = None,
                 kv_cache_memory: int | None = None) -> None:
    """Refuse a runner whose allocations cannot fit: host needs against physical RAM, device
    needs against the device's memory (with the host's where the device is the host), before
    the executor allocates anything. Raises :class:`ConfigError` naming the field and the bytes."""
    host, device = runner_needs(backend, model, config, num_kv_blocks=num_kv_blocks,
                                kv_cache_memory=kv_cache_memory)
    ram, memory = physical_memory_bytes(), backend.device_memory_bytes()
    if memory is None:
        check_needs(host + device, ram, f"host RAM ({backend.name} allocates in it)")
        return
    check_needs(host, ram, "host RAM")
    rows, width = config.max_num_seqs, config.max_blocks_per_req
    device.append(Need(_table_field(config), "block table (device copy)", rows * width * _BLOCK_BYTES))
    check_needs(device, memory, f"{backend.name} device memory")


def engine_host_needs(config: GraphConfig) -> list[Need]:
    """What graphrt.LLM holds on the host for ``config`` before its runner exists: the runner's
    staging tables and the engine's own token table (a token id per position of every request)
    and block table."""
    rows, width = config.max_num_seqs, config.max_blocks_per_req
    tables = rows * (config.max_model_len + width) * np.dtype(np.int32).itemsize
    return _host_tables(config, rows, config.max_num_batched_tokens) + [
        Need(_table_field(config), f"the engine's token and block tables ({rows} requests x "
                                   f"{config.max_model_len} tokens)", tables)]


def check_engine(config: GraphConfig) -> None:
    """graphrt.LLM, before it loads anything: its host tables within physical RAM."""
    check_needs(engine_host_needs(config), physical_memory_bytes(), "host RAM")


__all__ = ["check_before_loading", "check_cache_dir", "check_engine", "check_memory", "engine_host_needs", "runner_needs"]
