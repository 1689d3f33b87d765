"""In-place weight refit of a torch model: checkpoint tensors copied into the parameters the
captured graphs read, never re-bound (docs/api.md, "Reinforcement-learning rollouts").

:class:`TorchWeights` resolves each incoming name as graphrt's loader does (packed q/k/v and
gate/up names into their fused parameter and shard, the tied head and old rotary buffers skipped,
a tensor-parallel rank's rows or columns through the parameter's ``weight_loader``); a model of
another kind (transformers', a model of one's own) takes its own parameter names. Every tensor is
checked before the first byte is copied -- a name with no parameter, a shape the loader refuses,
a dtype that does not cast -- so a refused refit writes nothing. The shape check runs each
parameter's own loader on ``meta`` tensors: the loader's rules exactly, and no memory.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from graphrt.core.errors import InputError
from graphrt.core.weight_reports import WeightsUpdate
from graphrt.models.checkpoint import NAMES_SHOWN, safetensors_files, safetensors_header, tensor_files
from graphrt.models.torch.loader import checkpoint_target, expected_targets

#: safetensors dtype tags as torch dtypes.
SAFETENSORS_TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}

#: A refit's tensors: a checkpoint (a directory of ``*.safetensors`` or one such file), a mapping
#: or an iterable of ``(name, tensor)`` in the checkpoint's names (torch tensors or numpy arrays).
WeightSource = Any


@dataclass(frozen=True)
class Incoming:
    """One tensor of a refit: its checkpoint name, shape and dtype, and where to read it (the
    tensor itself, or an open safetensors file holding ``name``, read only when written)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: Any

    def sliced(self) -> Any:
        """What a ``weight_loader`` takes: the tensor, or the file's lazy slice (a tensor-parallel
        rank reads only its rows or columns)."""
        return self.source if isinstance(self.source, torch.Tensor) else self.source.get_slice(self.name)

    def tensor(self) -> torch.Tensor:
        return self.source if isinstance(self.source, torch.Tensor) else self.source.get_tensor(self.name)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The safetensors files of a refit's checkpoint: a directory's (its index's, else every
    ``*.safetensors``; every header checked), or one ``.safetensors`` file. InputError naming the
    path otherwise."""
    path = os.fspath(path)
    if os.path.isdir(path):
        files = safetensors_files(path)
        if not files:
            raise InputError("weights", f"{path} has no *.safetensors files")
        tensor_files(path)              # every header checked (a truncated file names its tensor)
        return files
    if os.path.isfile(path) and path.endswith(".safetensors"):
        safetensors_header(path)
        return [path]
    raise InputError("weights", f"{path!r} is neither a checkpoint directory nor a .safetensors file")


@contextlib.contextmanager
def incoming(source: WeightSource) -> Iterator[list[Incoming]]:
    """The refit's tensors as :class:`Incoming`, files open while the caller reads them."""
    if isinstance(source, (str, os.PathLike)):
        with contextlib.ExitStack() as stack:
            items = []
            for path in checkpoint_files(source):
                try:
                    f = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
                    for key in f.keys():
                        piece = f.get_slice(key)
                        dtype = SAFETENSORS_TORCH_DTYPES.get(piece.get_dtype())
                        if dtype is None:
                            raise InputError(key, f"in {path}: safetensors dtype {piece.get_dtype()} is not supported")
                        items.append(Incoming(key, tuple(piece.get_shape()), dtype, f))
                except SafetensorError as exc:
                    raise InputError("weights", f"{path} cannot be read as safetensors: {exc}") from None
            yield items
        return
    pairs = source.items() if isinstance(source, Mapping) else source
    try:
        pairs = list(pairs)
    except TypeError:
        raise InputError("weights", f"a checkpoint path, a mapping or an iterable of (name, tensor), got "
                                    f"{type(source).__name__}") from None
    items = []
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise InputError(f"weights[{i}]", f"a (name, tensor) pair, got {type(pair).__name__}")
        name, value = pair
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(np.ascontiguousarray(value))
        if not isinstance(value, torch.Tensor):
            raise InputError(name, f"a torch tensor or numpy array, got {type(value).__name__}")
        items.append(Incoming(name, tuple(value.shape), value.dtype, value.detach()))
    yield items


@contextlib.contextmanager
def staged_checkpoint(source: WeightSource) -> Iterator[str]:
    """A path every tensor-parallel rank can read ``source`` from: a checkpoint path as it is;
    tensors written to a temporary safetensors file (in shared memory where there is some),
    removed afterwards."""
    if isinstance(source, (str, os.PathLike)):
        yield os.fspath(source)
        return
    from safetensors.torch import save_file

    with incoming(source) as items:
        seen: set[int] = set()
        tensors = {}
        for item in items:
            t = item.tensor().contiguous()
            ptr = t.untyped_storage().data_ptr()
            tensors[item.name] = t.clone() if ptr in seen else t     # safetensors refuses shared storage
            seen.add(ptr)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="graphrt-refit-", dir=shm) as tmp:
        path = os.path.join(tmp, "weights.safetensors")
        save_file(tensors, path)
        del tensors
        yield path


def _write(loader: Callable[..., None] | None, param: torch.Tensor, value: Any, shard: Any) -> None:
    """Copy ``value`` into ``param`` (or its shard) the loader's way; whole where it has none."""
    if loader is None:
        if tuple(value.shape) != tuple(param.shape):
            raise InputError("loaded_weight", f"tensor has shape {tuple(value.shape)}, the model expects "
                                              f"{tuple(param.shape)}")
        param.copy_(value)
    elif shard is None:
        loader(param, value)
    else:
        loader(param, value, shard)


@dataclass(frozen=True)
class _Write:
    """One checked tensor of a refit and where it goes."""

    item: Incoming
    param: torch.Tensor
    label: str                  # the weight name filled: "param" or "param[shard]"
    shard: Any
    loader: Callable[..., None] | None


class TorchWeights:
    """Refits ``model``'s parameters in place (module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        #: graphrt's own models: checkpoint names resolved as its loader does.
        self.own_names = hasattr(model, "packed_modules_mapping") and hasattr(model, "config")

    def names(self) -> frozenset[str]:
        """Every weight a full refit fills: ``param`` or ``param[shard]`` for a fused parameter."""
        if self.own_names:
            return frozenset(_label(name, shard) for name, shard in expected_targets(self.model))
        return frozenset(name for name, _ in self.model.named_parameters())

    def update(self, source: WeightSource, *, check_only: bool = False) -> WeightsUpdate:
        """Check every tensor of ``source``, then (unless ``check_only``) copy each into its
        parameter; a refused refit is one InputError naming every bad tensor, nothing written."""
        t0 = time.perf_counter()
        with incoming(source) as items:
            writes, skipped = self.plan(items)
            if check_only:
                return WeightsUpdate(0, 0, time.perf_counter() - t0, frozenset(), tuple(skipped))
            with torch.no_grad():
                for w in writes:
                    _write(w.loader, w.param, w.item.sliced() if w.loader is not None else w.item.tensor(), w.shard)
        return WeightsUpdate(len(writes), sum(w.item.nbytes for w in writes), time.perf_counter() - t0,
                             frozenset(w.label for w in writes), tuple(skipped))

    def plan(self, items: Iterable[Incoming]) -> tuple[list[_Write], list[str]]:
        """The writes of a refit, every tensor checked (module docstring), and the names that
        fill nothing by design; InputError listing every problem otherwise."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        writes: list[_Write] = []
        skipped: list[str] = []
        problems: list[tuple[str, str]] = []
        seen: set[str] = set()
        for item in items:
            if item.name in seen:
                problems.append((item.name, "given twice"))
                continue
            seen.add(item.name)
            found = self._target(item, params)
            if isinstance(found, str):
                problems.append((item.name, found))
            elif found is None:
                skipped.append(item.name)
            else:
                name, shard = found
                param = params[name]
                why = self._check(item, param, shard)
                if why is not None:
                    problems.append((item.name, why))
                else:
                    writes.append(_Write(item, param, _label(name, shard), shard, getattr(param, "weight_loader", None)))
        if problems:
            shown = "; ".join(f"{name!r} {why}" for name, why in problems[:NAMES_SHOWN])
            more = f" (and {len(problems) - NAMES_SHOWN} more)" if len(problems) > NAMES_SHOWN else ""
            raise InputError(problems[0][0], f"the refit was refused and nothing was written: {len(problems)} "
                                             f"tensor(s) do not fit {type(self.model).__name__}: {shown}{more}")
        return writes, skipped

    def _target(self, item: Incoming, params: dict[str, torch.Tensor]) -> tuple[str, Any] | str | None:
        """``(parameter, shard)`` of ``item``, None when it fills nothing by design, or why it is refused."""
        if not self.own_names:
            for name in (item.name, f"hf.{item.name}"):     # transformers' model sits under ``hf``
                if name in params:
                    return name, None
            return f"has no parameter in {type(self.model).__name__}"
        target = checkpoint_target(self.model, item.name)
        if target.kv_scale is not None:
            return self._kv_scale(item, *target.kv_scale)
        if target.param is None:
            return None
        if target.param not in params:
            return f"has no parameter in {type(self.model).__name__} (no {target.param!r})"
        return target.param, target.shard_id

    def _kv_scale(self, item: Incoming, layer: int, which: str) -> str | None:
        """An fp8 KV scale: graphs bake it in as a number, so only its current value is taken."""
        layers = self.model.attention_layers()
        if layer >= len(layers) or int(np.prod(item.shape, dtype=np.int64)) != 1:
            return f"is a KV scale of layer {layer}, not one number of one of the {len(layers)} layers"
        value = float(item.tensor().float().reshape(()))
        attn = layers[layer]
        now = [getattr(attn, f"{w}_scale", 1.0) for w in ("k", "v") if w in which or which == "kv"]
        if all(v == value for v in now):
            return None
        return (f"changes an fp8 KV scale ({now} -> {value}): captured graphs read it as a number; a new scale "
                "needs a new engine")

    @staticmethod
    def _check(item: Incoming, param: torch.Tensor, shard: Any) -> str | None:
        """Why ``item`` cannot be written into ``param`` (its dtype, or its shape by the
        parameter's own loader on meta tensors), or None."""
        if not casts(item.dtype, param.dtype):
            return f"has dtype {item.dtype}, which does not cast to the parameter's {param.dtype}"
        meta_param = torch.empty(param.shape, dtype=param.dtype, device="meta")
        meta_value = torch.empty(item.shape, dtype=param.dtype, device="meta")
        try:
            with torch.no_grad():
                _write(getattr(param, "weight_loader", None), meta_param, meta_value, shard)
        except InputError as err:
            return f"has shape {item.shape}: {err}"
        except (RuntimeError, ValueError, IndexError, TypeError) as err:
            return f"has shape {item.shape}, which the parameter's loader refuses ({type(err).__name__}: {err})"
        return None


def casts(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a refit copies ``src`` values into a ``dst`` parameter: torch's cast rules, within
    one kind (floating point into floating point: integers into float weights are quantized
    values, not weights, and are refused)."""
    return torch.can_cast(src, dst) and src.is_floating_point == dst.is_floating_point


def _label(name: str, shard: Any) -> str:
    return name if shard is None else f"{name}[{shard}]"


__all__ = ["Incoming", "SAFETENSORS_TORCH_DTYPES", "TorchWeights", "WeightSource", "checkpoint_files", "incoming",
           "staged_checkpoint"]
