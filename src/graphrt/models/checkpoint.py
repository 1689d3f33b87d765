"""What every loader checks of a checkpoint directory's safetensors files before reading a weight.

Shared by graphrt's torch loader, the Transformers backend and the JAX loader, so that a broken
checkpoint is the same :class:`~graphrt.core.errors.InputError` on each, naming the file and
the key, rather than whatever the library underneath raises (a safetensors error, a numpy
reshape error, a random initialisation):

* :func:`safetensors_files` -- the files a checkpoint consists of (its index's, else ``*.safetensors``);
* :func:`safetensors_header` -- one file's tensor table, checked against the file's size (a
  truncated file names the first tensor whose bytes are missing);
* :func:`tensor_files` -- every tensor name of a checkpoint and the file it is in;
* :func:`non_finite_message` -- the load warning naming the tensors that hold NaN or inf.

Framework-free: reads headers with ``json`` only (the format is an 8-byte little-endian length,
a JSON table of ``{"dtype", "shape", "data_offsets"}`` per tensor, then the data).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Sequence

from graphrt.core.errors import InputError

#: Bytes per element of each safetensors dtype tag (the format's list).
SAFETENSORS_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2,
                        "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
#: The index transformers writes for a sharded checkpoint.
SAFETENSORS_INDEX = "model.safetensors.index.json"
#: At most this many tensor names in one message.
NAMES_SHOWN = 8


def safetensors_files(model_dir: str | os.PathLike) -> list[str]:
    """The safetensors files of ``model_dir``: those its index names (each must exist), else
    every ``*.safetensors`` in it (possibly none). InputError naming the index if it is broken."""
    model_dir = os.fspath(model_dir)
    index = os.path.join(model_dir, SAFETENSORS_INDEX)
    if not os.path.exists(index):
        return sorted(os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InputError(SAFETENSORS_INDEX, f"{index} is not a safetensors index (JSON with a "
                                            f"'weight_map' of tensor -> file): {type(exc).__name__}: {exc}") from None
    for name in names:
        if not os.path.exists(os.path.join(model_dir, name)):
            raise InputError(SAFETENSORS_INDEX, f"{index} names {name!r}, which {model_dir} does not have")
    return [os.path.join(model_dir, n) for n in names]


def safetensors_header(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The tensor table of the safetensors file ``path`` (``__metadata__`` left out), every entry
    checked: a known dtype, a shape of non-negative ints, data offsets that hold exactly the
    shape's bytes and lie inside the file. InputError naming the file, and the tensor where one is
    at fault (a truncated file: the first tensor whose bytes are cut off)."""
    path = os.fspath(path)
    name = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InputError(name, f"{path} has {size} bytes, fewer than a safetensors header's 8-byte length")
        length = int.from_bytes(head, "little")
        if length > size - 8:
            raise InputError(name, f"{path} is truncated: its header says {length} bytes of tensor table, the "
                                   f"file has {size - 8} after the length")
        raw = f.read(length)
    try:
        table = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InputError(name, f"{path} is not a safetensors file: its tensor table is not JSON ({exc})") from None
    if not isinstance(table, dict):
        raise InputError(name, f"{path} is not a safetensors file: its tensor table is a "
                               f"{type(table).__name__}, not a JSON object")
    data = size - 8 - length
    tensors = {key: info for key, info in table.items() if key != "__metadata__"}
    for key, info in sorted(tensors.items(), key=lambda kv: _start(kv[1])):
        _check_entry(path, key, info, data)
    return tensors


def _start(info: Any) -> int:
    """An entry's first data byte, for ordering (malformed entries first, to be named)."""
    try:
        return int(info["data_offsets"][0])
    except (TypeError, KeyError, IndexError, ValueError):
        return -1


def _check_entry(path: str, key: str, info: Any, data: int) -> None:
    """One tensor-table entry of ``path`` well formed, its bytes within the ``data`` bytes."""
    where = f"in {path}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise InputError(key, f"{where}: a tensor entry needs dtype, shape and data_offsets, got {info!r}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in SAFETENSORS_ITEMSIZE:
        raise InputError(key, f"{where}: unknown safetensors dtype {dtype!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                            for d in shape)):
        raise InputError(key, f"{where}: shape {shape!r} is not a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) and not isinstance(o, bool)
                                                                    for o in offsets)):
        raise InputError(key, f"{where}: data_offsets {offsets!r} is not a [begin, end] pair of ints")
    begin, end = offsets
    want = math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]
    if not 0 <= begin <= end or end - begin != want:
        raise InputError(key, f"{where}: data_offsets {offsets} hold {end - begin} bytes, its {dtype} shape "
                              f"{shape} needs {want}")
    if end > data:
        raise InputError(key, f"{where}: the file is truncated: the tensor's bytes [{begin}, {end}) of the data "
                              f"section run past its end ({data} bytes)")


def tensor_files(model_dir: str | os.PathLike) -> dict[str, str]:
    """Every tensor of ``model_dir``'s safetensors files -> the name of the file it is in, each
    file's header checked (:func:`safetensors_header`); a tensor in two files is an InputError."""
    out: dict[str, str] = {}
    for path in safetensors_files(model_dir):
        name = os.path.basename(path)
        for key in safetensors_header(path):
            if key in out:
                raise InputError(key, f"the tensor is in both {out[key]} and {name} of {os.fspath(model_dir)}")
            out[key] = name
    return out


def names_with_files(keys: Sequence[str], files: dict[str, str]) -> str:
    """``keys`` (sorted, at most :data:`NAMES_SHOWN`) each with its file where known."""
    keys = sorted(keys)
    shown = [f"{k} ({files[k]})" if k in files else k for k in keys[:NAMES_SHOWN]]
    more = f" and {len(keys) - NAMES_SHOWN} more" if len(keys) > NAMES_SHOWN else ""
    return ", ".join(shown) + more


def non_finite_message(source: str, bad: Sequence[tuple[str, int, int, int]]) -> str:
    """The load warning for the tensors of ``source`` that hold NaN or inf: ``bad`` is
    ``(name, NaN count, inf count, elements)`` per tensor."""
    shown = ", ".join(f"{name} ({nan} NaN, {inf} inf of {numel})" for name, nan, inf, numel in bad[:NAMES_SHOWN])
    more = f" and {len(bad) - NAMES_SHOWN} more" if len(bad) > NAMES_SHOWN else ""
    return (f"graphrt: {source}: {len(bad)} weight tensor(s) hold NaN or inf values: {shown}{more}; the model "
            "is served as it is, and its logits and logprobs will be NaN wherever they reach")


__all__ = ["NAMES_SHOWN", "SAFETENSORS_INDEX", "SAFETENSORS_ITEMSIZE", "names_with_files", "non_finite_message",
           "safetensors_files", "safetensors_header", "tensor_files"]
