"""What the properties read and write on the device side, for torch and XLA executors alike.

Every helper takes a :class:`~graphrt.ModelRunner` and works on both kinds of executor
graphrt ships: torch (``executor.kv_cache`` a ``torch.Tensor``; static buffers in
``executor.static``) and XLA (``executor.kv_cache`` a ``jax.Array``; no static device
buffers). torch and jax are imported only when a runner of that framework is seen.
A backend of your own that keeps its KV cache elsewhere needs only :func:`kv_values`,
:func:`set_kv` and :func:`kv_bits` adapted.

The properties address KV slots on axis 2 of a 5-d view. graphrt's usual cache is that view
(``[layers, 2, slots + 1, kv_heads, head_dim]``); other layouts are shown in one:
a Pallas-layout XLA cache (TPUs) as the reference layout it stands for, and a torch model
with several stored layouts (K / V of other head sizes, MLA, mixed dtypes:
``executor.kv_caches``) as ``[1, 1, slots + 1, features, 1]``, every layout's values of a
slot side by side.
"""

from __future__ import annotations

from typing import Any

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
    """A torch executor's stored KV layouts when there is not one standard tensor, else None."""
    caches = getattr(ex, "kv_caches", None)
    if not caches or (len(caches) == 1 and caches[0].dim() == 5):
        return None
    return list(caches)


def _by_slot(t: Any) -> Any:
    """A torch layout's tensor with its slot axis first, flattened: ``[slots + 1, features]``
    (slots are axis 2 of ``[layers, 2, rows, ...]``, else axis 1 of ``[layers, rows, ...]``)."""
    axis = 2 if t.dim() == 5 else 1
    return t.movedim(axis, 0).reshape(t.shape[axis], -1)


def _pallas(ex: Any) -> Any:
    """The XLA programs when graphrt's decoder keeps its cache in the Pallas page layout, else None."""
    programs = getattr(ex, "programs", None)
    choice = getattr(programs, "attention", None)
    return programs if getattr(choice, "kernel", None) == "pallas" else None


def _pallas_rows(runner: Any, pages: np.ndarray) -> np.ndarray:
    from graphrt.models.jax.pallas_attention import pages_to_rows

    return pages_to_rows(pages, runner.executor.model_config.num_hidden_layers, runner.config.block_size)


def _no_kv(runner: Any) -> tuple[int, ...] | None:
    """The empty 5-d view of a model without attention layers (a pure Mamba2: no KV cache, only
    recurrent state), else None: ``[0, 2, slots + 1, 1, 1]``."""
    ex = runner.executor
    if ex.kv_cache is not None or getattr(ex, "kv_caches", None) or getattr(ex, "state_caches", None) is None:
        return None
    if getattr(getattr(ex, "kv", None), "spec", None) is not None and ex.kv.spec.owned_by_model:
        return None
    return (0, 2, runner.num_kv_blocks * runner.config.block_size + 1, 1, 1)


def kv_values(runner: Any) -> np.ndarray:
    """The KV cache as float32 ``[layers, 2, slots + 1, kv_heads, head_dim]`` (last row: trash),
    or the 5-d view of another layout (module docstring)."""
    ex = runner.executor
    empty = _no_kv(runner)
    if empty is not None:
        return np.zeros(empty, np.float32)
    layouts = _torch_layouts(ex)
    if layouts is not None:
        import torch

        flat = torch.cat([_by_slot(t).float() for t in layouts], dim=1)
        return flat.cpu().numpy()[None, None, :, :, None]
    if _pallas(ex) is not None:
        return _pallas_rows(runner, _values(ex.kv_cache))
    return _values(ex.kv_cache)


def kv_bits(runner: Any) -> np.ndarray:
    """The KV cache's bits, same shape as :func:`kv_values` (several stored layouts: their bytes
    per slot, ``[1, 1, slots + 1, bytes, 1]``), for byte-exact comparisons."""
    ex = runner.executor
    empty = _no_kv(runner)
    if empty is not None:
        return np.zeros(empty, np.uint32)
    layouts = _torch_layouts(ex)
    if layouts is not None:
        import torch

        flat = torch.cat([_by_slot(t.detach()).contiguous().view(torch.uint8) for t in layouts], dim=1)
        return flat.cpu().numpy()[None, None, :, :, None]
    if _pallas(ex) is not None:
        return _pallas_rows(runner, _bits(ex.kv_cache))
    return _bits(ex.kv_cache)


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

    if _pallas(ex) is not None:
        from graphrt.models.jax.pallas_attention import rows_to_pages

        values = rows_to_pages(np.asarray(values, np.float32), kv.shape, ex.model_config.num_hidden_layers,
                               runner.config.block_size)
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
    device = getattr(ex, "device", None)
    if device is not None:
        return getattr(device, "type", str(device)) == "cpu"
    kv = ex.kv_cache if ex.kv_cache is not None else (getattr(ex, "state_caches", None) or [None])[0]
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
    static = getattr(ex, "static", None)
    if static is not None:
        out.update({f"static.{name}": _bits(t) for name, t in static.items()})
    for name in ("hidden_out", "logits_out"):
        if getattr(ex, name, None) is not None:
            out[name] = _bits(getattr(ex, name))
    sampler = getattr(ex, "sampler", None)
    for name, t in (getattr(sampler, "static", None) or {}).items():
        out[f"sampler.{name}"] = _bits(t)
    for name in ("noise", "tokens"):              # the sampler's noise and sampled-token buffers
        if getattr(sampler, name, None) is not None:
            out[f"sampler.{name}"] = _bits(getattr(sampler, name))
    return out


def changed(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> list[str]:
    """Names of :func:`device_state` entries whose bits differ."""
    return [k for k in before if before[k].shape != after[k].shape or not np.array_equal(before[k], after[k])]


def addresses(runner: Any) -> dict[str, int] | None:
    """Device addresses of every buffer a captured graph reads or writes (torch executors), or
    None where the backend has no static buffers (XLA: arrays are immutable, the cache donated)."""
    ex = runner.executor
    static = getattr(ex, "static", None)
    caches = getattr(ex, "kv_caches", None) or ([ex.kv_cache] if ex.kv_cache is not None else [])
    states = list(getattr(ex, "state_caches", None) or [])
    if static is None or not (caches or states) or not _is_torch((caches or states)[0]):
        return None
    out_states = {f"state_cache.{i}": t.data_ptr() for i, t in enumerate(states)}
    out = {name: t.data_ptr() for name, t in static.items()}
    sampler = getattr(ex, "sampler", None)
    out.update({f"sampler.{k}": t.data_ptr() for k, t in (getattr(sampler, "static", None) or {}).items()})
    out.update({f"kv_cache.{i}" if i else "kv_cache": t.data_ptr() for i, t in enumerate(caches)})
    for name in ("hidden_out", "logits_out"):
        out[name] = getattr(ex, name).data_ptr()
    out.update(out_states)
    return out


# ---- recurrent state (hybrid models, docs/hybrid.md) ---------------------------------------

def _states(runner: Any) -> list[Any]:
    return list(getattr(runner.executor, "state_caches", None) or [])


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
    """Captures / compiles the executor has done so far (torch: its capture report; XLA: its
    compile counter, which also sees compiles no cache lookup caused)."""
    ex = runner.executor
    compiles = getattr(ex, "compiles", None)
    if compiles is not None and hasattr(compiles, "compile_count"):
        return int(compiles.compile_count)
    return len(getattr(ex, "capture_report", ()))


__all__ = ["addresses", "build_count", "changed", "device_state", "kv_bits", "kv_dtype", "kv_values",
           "on_cpu", "set_kv", "set_state", "state_bits", "state_values"]
