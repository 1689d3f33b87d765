"""Serialized XLA executables on disk: a restart skips lowering as well as compiling.

JAX's persistent cache skips the compile, but every bucket is still traced and lowered to find
its key. This store keeps each compiled executable under a fingerprint of everything that
shapes it (graphrt / jax / jaxlib versions, devices and mesh, the traced modules' source, the
model config, weights' and KV cache's shapes, dtypes and shardings, shape-setting config fields,
declared extra inputs) and the bucket key. A file that fails to load is rebuilt; writes are
atomic; an executable XLA cannot serialize is not cached."""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any, Hashable, Iterable

import jax

from graphrt.backends.xla import batch as xla_batch, extra_inputs as xla_extra, sampler as xla_sampler
from graphrt.backends.xla import sharding as shd
from graphrt.backends.xla.programs import XlaPrograms
from graphrt.config import GraphConfig
from graphrt.core import __version__
from graphrt.models.jax import decoder as jax_decoder
from graphrt.layers.jax import pallas_attention

logger = logging.getLogger(__name__)

#: Sub-directory of ``compilation_cache_dir`` holding graphrt's serialized executables.
SUBDIR = "graphrt-executables"


def _source_digest(modules: Iterable[Any]) -> str:
    h = hashlib.sha256()
    for module in modules:
        path = getattr(module, "__file__", None)
        h.update(str(getattr(module, "__name__", module)).encode())
        if path and os.path.exists(path):
            h.update(Path(path).read_bytes())
    return h.hexdigest()


def _abstract(tree: Any) -> Any:
    """Arrays as shape, dtype and sharding (their values are arguments, not code); every
    other leaf (a config, a block size) by its full ``repr``, values included."""
    def leaf(x: Any) -> str:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            return repr(x)
        spec = getattr(getattr(x, "sharding", None), "spec", None)
        return f"{tuple(x.shape)}:{x.dtype}:{spec}"
    return jax.tree_util.tree_map(leaf, tree)


def executor_fingerprint(*, modules: Iterable[Any], devices: Iterable[Any], mesh_axes: Any,
                         parts: Iterable[Any]) -> str:
    """A digest of everything that shapes an executor's executables (see the module doc)."""
    import jaxlib

    devs = [f"{d.platform}:{getattr(d, 'device_kind', '')}:{d.id}" for d in devices]
    h = hashlib.sha256()
    for part in (__version__, jax.__version__, jaxlib.__version__, devs, mesh_axes,
                 _source_digest(modules), *(_abstract(p) for p in parts)):
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()


class ExecutableCache:
    """Compiled executables by (fingerprint, key) under ``directory``."""

    def __init__(self, directory: str | os.PathLike, fingerprint: str,
                 execution_devices: list[Any]) -> None:
        self.root = Path(directory) / SUBDIR / fingerprint[:32]
        self.root.mkdir(parents=True, exist_ok=True)
        self._devices = execution_devices

    def _path(self, key: Hashable) -> Path:
        return self.root / (hashlib.sha256(repr(key).encode()).hexdigest()[:32] + ".xla")

    def load(self, key: Hashable) -> Any | None:
        """The deserialized executable for ``key``, or ``None`` (absent or unreadable)."""
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self._path(key)
        if not path.exists():
            return None
        try:
            stored_key, payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            if stored_key != repr(key):
                return None
            return deserialize_and_load(payload, in_tree, out_tree,
                                        execution_devices=self._devices)
        except Exception as exc:  # noqa: BLE001 - a bad file costs a rebuild, never a wrong result
            logger.warning("graphrt: ignoring unreadable cached executable %s (%s)", path, exc)
            return None

    def store(self, key: Hashable, compiled: Any) -> None:
        """Write ``compiled`` for ``key`` atomically; a failure is logged, not raised."""
        from jax.experimental.serialize_executable import serialize

        try:
            payload, in_tree, out_tree = serialize(compiled)
            data = pickle.dumps((repr(key), payload, in_tree, out_tree))
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))
        except Exception as exc:  # noqa: BLE001 - caching is an optimisation
            logger.info("graphrt: the executable of %s is not cached (a restart lowers it again): %s",
                        key, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def executable_store(programs: XlaPrograms, config: GraphConfig) -> ExecutableCache | None:
    """With ``compilation_cache_dir``, the on-disk store of graphrt's own model's executables.

    Not for nnx modules: their code lives in the graphdef, which the fingerprint cannot
    see, so a changed module with the same parameter shapes could load a stale executable.
    """
    if not config.compilation_cache_dir or not programs.own_code:
        return None
    mesh = programs.mesh
    fingerprint = executor_fingerprint(
        modules=(jax_decoder, pallas_attention, xla_batch, xla_sampler, shd, sys.modules[XlaPrograms.__module__]),
        devices=list(mesh.devices.flat), mesh_axes=(mesh.axis_names, mesh.devices.shape),
        parts=(programs.model_config, programs.weights, str(programs.kv_dtype), config.block_size,
               config.max_blocks_per_req, int(programs.model_config.vocab_size), programs.decode_query_len,
               programs.max_reqs, programs.max_logprobs, xla_extra.fingerprint(programs.extra_inputs)))
    return ExecutableCache(config.compilation_cache_dir, fingerprint, list(mesh.devices.flat))
