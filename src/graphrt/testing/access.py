"""What the properties read and write on the device side, through the executor contract only
(:class:`graphrt.backends.base.Executor`), so a backend of your own is tested by implementing it.

KV slots sit on axis 2 of a 5-d view: graphrt's usual ``[layers, 2, slots + 1, kv_heads,
head_dim]`` cache as it is, a Pallas-layout XLA cache as that reference layout, and a torch
model's several stored layouts (``executor.kv_views()``) as ``[1, 1, slots + 1, features, 1]``.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

_INT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch")


def _to_numpy(value: Any) -> np.ndarray:
    """A device array as a host numpy array of the same dtype (bfloat16 as ml_dtypes / float32)."""
    if _is_torch(value):
        import torch

        t = value.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16).copy()   # bits; see _bits
        return t.numpy().copy()
    return np.array(value, copy=True)


def _bits(value: Any) -> np.ndarray:
    """The array's bits as unsigned integers (NaN equals NaN, -0 differs from 0)."""
    arr = np.ascontiguousarray(_to_numpy(value))
    return arr.view(_INT_OF_SIZE[arr.dtype.itemsize]) if arr.dtype.kind in "fcV" else arr


def _values(value: Any) -> np.ndarray:
    """The array's values as float32 on the host."""
    if _is_torch(value):
        return value.detach().float().cpu().numpy()
    return np.asarray(value).astype(np.float32)


def _torch_layouts(ex: Any) -> list[Any] | None:
    """The executor's stored KV layouts when there is not one standard array, else None."""
    caches = ex.kv_views()
    one_array = len(caches) == 1 and (caches[0].ndim == 5 or not type(caches[0]).__module__.startswith("torch"))
    if not caches or one_array:       # the reference layout, or one XLA array kv_as_rows converts (Pallas pages)
        return None
    return list(caches)


def _by_slot(t: Any) -> Any:
    """A torch layout's tensor with its slot axis first, flattened: ``[slots + 1, features]``
    (slots are axis 2 of ``[layers, 2, rows, ...]``, else axis 1 of ``[layers, rows, ...]``)."""
    axis = 2 if t.dim() == 5 else 1
    return t.movedim(axis, 0).reshape(t.shape[axis], -1)


def _no_kv(runner: Any) -> tuple[int, ...] | None:
    """The empty 5-d view of a model without attention layers (a pure Mamba2: no KV cache, only
    recurrent state), else None: ``[0, 2, slots + 1, 1, 1]``."""
    ex = runner.executor
    if ex.kv_cache is not None or ex.kv_views() or ex.kv_owned_by_model:
        return None
    return (0, 2, runner.num_kv_blocks * runner.config.block_size + 1, 1, 1)


def _kv(runner: Any, empty_dtype: Any, piece: Callable[[Any], Any], whole: Callable[[Any], np.ndarray]) -> np.ndarray:
    """The KV cache in :func:`kv_values`' view: ``piece`` maps each stored torch layout (slots
    first, ``[slots + 1, features]``) and ``whole`` the one standard array to the host form."""
    ex = runner.executor
    empty = _no_kv(runner)
    if empty is not None:
        return np.zeros(empty, empty_dtype)
    layouts = _torch_layouts(ex)
    if layouts is not None:
        import torch

        flat = torch.cat([piece(_by_slot(t.detach())) for t in layouts], dim=1)
        return flat.cpu().numpy()[None, None, :, :, None]
    return ex.kv_as_rows(whole(ex.kv_cache), runner.config.block_size)


def kv_values(runner: Any) -> np.ndarray:
    """The KV cache as float32 ``[layers, 2, slots + 1, kv_heads, head_dim]`` (last row: trash),
    or the 5-d view of another layout (module docstring)."""
    return _kv(runner, np.float32, lambda t: t.float(), _values)


def kv_bits(runner: Any) -> np.ndarray:
    """The KV cache's bits, same shape as :func:`kv_values` (several stored layouts: their bytes
    per slot, ``[1, 1, slots + 1, bytes, 1]``), for byte-exact comparisons."""
    def piece(t: Any) -> Any:
        import torch

        return t.contiguous().view(torch.uint8)

    return _kv(runner, np.uint32, piece, _bits)


def set_kv(runner: Any, values: np.ndarray) -> None:
    """Overwrite the whole KV cache with ``values`` (float32 in :func:`kv_values`' view, cast to
    the cache's dtype), in place for torch; for XLA a new array with the old one's sharding
    (the executables take it)."""
    ex = runner.executor
    if _no_kv(runner) is not None:
        return
    layouts = _torch_layouts(ex)
    if layouts is not None:
        import torch

        flat = torch.from_numpy(np.ascontiguousarray(values[0, 0, :, :, 0], dtype=np.float32))
        start = 0
        with torch.no_grad():
            for t in layouts:
                width = _by_slot(t).shape[1]
                axis = 2 if t.dim() == 5 else 1
                moved = t.movedim(axis, 0)
                moved.copy_(flat[:, start:start + width].reshape(moved.shape).to(t.dtype))
                start += width
        return
    kv = ex.kv_cache
    if _is_torch(kv):
        import torch

        with torch.no_grad():
            kv.copy_(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(kv.dtype))
        return
    import jax
    import jax.numpy as jnp

    values = ex.kv_from_rows(values, runner.config.block_size)
    ex.kv_cache = jax.device_put(jnp.asarray(values, dtype=kv.dtype), kv.sharding)


def kv_dtype(runner: Any) -> str:
    """The KV cache's dtype name (``float32``, ``bfloat16``, ...), for :func:`graphrt.tolerance`;
    with several stored layouts, the narrowest one's."""
    ex = runner.executor
    if _no_kv(runner) is not None:
        return str(ex.state_caches[0].dtype).removeprefix("torch.")
    layouts = _torch_layouts(ex)
    dtype = min((t.dtype for t in layouts), key=lambda d: d.itemsize) if layouts else ex.kv_cache.dtype
    return str(dtype).removeprefix("torch.")


def on_cpu(runner: Any) -> bool:
    """Whether the executor runs on a CPU (same-shape results are then compared bit for bit)."""
    ex = runner.executor
    device = ex.device
    if device is not None:
        return getattr(device, "type", str(device)) == "cpu"
    kv = ex.kv_cache if ex.kv_cache is not None else (list(ex.state_caches) or [None])[0]
    return all(d.platform == "cpu" for d in kv.devices()) if hasattr(kv, "devices") else True


def device_state(runner: Any) -> dict[str, np.ndarray]:
    """Bits of everything a step may write: the KV cache, the host staging buffers and, on torch
    executors, the static device buffers, output buffers and sampler state (its parameter
    buffers, noise and sampled tokens)."""
    ex = runner.executor
    out = {"kv_cache": kv_bits(runner)}
    states = state_bits(runner)
    if states is not None:
        out["state_cache"] = states
    out.update({f"host.{name}": np.array(buf, copy=True) for name, buf in ex.host_buffers.items()})
    out.update({name: _bits(t) for name, t in ex.device_buffers().items()})
    return out


def changed(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> list[str]:
    """Names of :func:`device_state` entries whose bits differ."""
    return [k for k in before if before[k].shape != after[k].shape or not np.array_equal(before[k], after[k])]


def addresses(runner: Any) -> dict[str, int] | None:
    """Device addresses of every buffer a captured graph reads or writes (torch executors), or
    None where the backend has no static buffers (XLA: arrays are immutable, the cache donated)."""
    ex = runner.executor
    buffers = ex.device_buffers()
    caches, states = ex.kv_views(), list(ex.state_caches)
    if not buffers or not (caches or states) or not _is_torch((caches or states)[0]):
        return None
    out = {name.removeprefix("static."): t.data_ptr() for name, t in buffers.items()
           if name not in ("sampler.noise", "sampler.tokens")}
    out.update({f"kv_cache.{i}" if i else "kv_cache": t.data_ptr() for i, t in enumerate(caches)})
    out.update({f"state_cache.{i}": t.data_ptr() for i, t in enumerate(states)})
    return out


# ---- recurrent state (hybrid models, docs/hybrid.md) ---------------------------------------

def _states(runner: Any) -> list[Any]:
    return list(runner.executor.state_caches or [])


def state_values(runner: Any) -> np.ndarray | None:
    """The recurrent-state cache as float32 ``[slots + 1, checkpoints, features]`` (every state
    tensor of every recurrent layer side by side; slot ``slots`` is the trash slot), or None for
    a model without recurrent state."""
    tensors = _states(runner)
    if not tensors:
        return None
    return np.concatenate([_values(t).reshape(t.shape[0], t.shape[1], -1) for t in tensors], axis=2)


def state_bits(runner: Any) -> np.ndarray | None:
    """The state cache's bytes, ``[slots + 1, checkpoints, bytes]`` (None without state)."""
    tensors = _states(runner)
    if not tensors:
        return None
    return np.concatenate([np.ascontiguousarray(_to_numpy(t)).view(np.uint8).reshape(t.shape[0], t.shape[1], -1)
                           for t in tensors], axis=2)


def set_state(runner: Any, values: np.ndarray) -> None:
    """Overwrite the whole state cache with ``values`` (:func:`state_values`' view, cast to each
    tensor's dtype): in place for torch, new arrays for XLA."""
    tensors = _states(runner)
    start = 0
    for i, t in enumerate(tensors):
        width = int(np.prod(t.shape[2:]))
        part = np.ascontiguousarray(values[:, :, start:start + width], dtype=np.float32).reshape(t.shape)
        start += width
        if _is_torch(t):
            import torch

            with torch.no_grad():
                t.copy_(torch.from_numpy(part).to(t.dtype))
        else:
            import jax
            import jax.numpy as jnp

            runner.executor.state_caches[i] = jax.device_put(jnp.asarray(part, dtype=t.dtype), t.sharding)


def build_count(runner: Any) -> int:
    """Captures / compiles the executor has done so far (``executor.build_count``: torch its
    capture report's rows; XLA its compile counter, which also sees compiles no cache lookup caused)."""
    return int(runner.executor.build_count)


__all__ = ["addresses", "build_count", "changed", "device_state", "kv_bits", "kv_dtype", "kv_values",
           "on_cpu", "set_kv", "set_state", "state_bits", "state_values"]
