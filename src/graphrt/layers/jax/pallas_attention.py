"""Pallas ragged paged attention (TPU) for graphrt's JAX decoder: its cache layout, KV write and call.

With the Pallas path on, the decoder's KV cache is one array in the kernel's page layout::

    kv_cache: [num_layers * (num_blocks + 1), block_size, 2 * num_kv_heads, head_dim]

Layer ``l`` owns pages ``l * (num_blocks + 1) ..``, its last the trash page; K and V interleave on
the head axis (``2h`` K, ``2h + 1`` V). Block tables are offset by the layer's first page, so no
step copies the cache. Tests substitute the kernel (:data:`KERNEL_OVERRIDE`). See docs/xla.md,
"On a TPU".
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from graphrt.core import defaults
from graphrt.core.attention_decl import AttentionDeclarations, requested_kernel
from graphrt.core.errors import ConfigError
from graphrt.layers.jax.paged_attention import FP8_KV_DTYPES, XlaPagedAttention, quantize_kv

#: The JAX decoder's choices under ``GRAPHRT_ATTENTION``.
XLA_ATTENTION_CHOICES = ("auto", "reference", "pallas")
#: The Pallas ragged paged attention kernel needs head_dim a multiple of the TPU lane width.
PALLAS_HEAD_DIM_MULTIPLE = 128
#: Activation dtypes the Pallas kernel accumulates from (it folds float32 / bfloat16 rows only).
PALLAS_Q_DTYPES = ("float32", "bfloat16")

logger = logging.getLogger(__name__)

#: A callable with ``ragged_paged_attention``'s signature that :func:`choose_xla_attention` hands
#: the decoder instead of the TPU kernel, on any platform (tests: the pure-JAX reference). None: the kernel.
KERNEL_OVERRIDE: Callable[..., jax.Array] | None = None


@dataclasses.dataclass(frozen=True)
class PallasAttention:
    """The decoder's ``attention`` argument for the Pallas page layout: ``kernel`` is ``"pallas"``
    (the TPU kernel) or a callable with its signature (tests: its pure-JAX reference)."""

    kernel: Any = "pallas"

    def trash_row(self, kv_cache: jax.Array, num_layers: int, block_size: int) -> int:
        """The row of each layer that padded tokens write (:func:`trash_row`)."""
        return trash_row(kv_cache, num_layers, block_size)

    def layer_attention(self, config: Any, block_size: int, kv_scales: tuple[float, float]) -> Callable[..., Any]:
        """:func:`write_and_attend` bound to this kernel and the model's windows and sizes."""
        return functools.partial(write_and_attend, attention=self.kernel,
                                 windows=tuple(getattr(config, "sliding_windows", ())), block_size=block_size,
                                 num_layers=config.num_hidden_layers, kv_scales=kv_scales)


class XlaAttentionChoice(NamedTuple):
    """The JAX decoder's attention: ``kernel`` ``"pallas"`` or ``"reference"``, the decoder's
    ``attention`` argument (None: the reference; a :class:`PallasAttention`), why, and what the
    chosen kernel declares (``declarations``: what the executables key, the KV dtypes it takes;
    a model's own attention declares for itself)."""

    kernel: str
    attention: PallasAttention | None
    reason: str
    declarations: AttentionDeclarations


def kernel_import_problem() -> str | None:
    """Why the Pallas ragged paged attention module does not import here, or None."""
    try:
        importlib.import_module("jax.experimental.pallas.ops.tpu.ragged_paged_attention")
    except Exception as exc:  # noqa: BLE001 - any import failure means the kernel is unavailable
        return f"jax.experimental.pallas.ops.tpu.ragged_paged_attention does not import ({exc})"
    return None


def pallas_problem(config: Any, devices: Sequence[Any], dtype: Any, kv_dtype: Any, *, own_decoder: bool,
                   tp_size: int, override: bool = False) -> str | None:
    """Why the Pallas path cannot run this model here, or None. With ``override`` (a kernel of the
    test hook) only the layout checks apply, not the TPU kernel's platform and tiling ones."""
    if not own_decoder:
        return "the model has a forward of its own (the Pallas path is graphrt's decoder's)"
    if tp_size != 1:
        return f"tp_size={tp_size}: the Pallas path runs on one device (its kernel is not partitioned)"
    if override:
        return None
    platforms = sorted({d.platform for d in devices})
    if platforms != ["tpu"]:
        return f"the devices are {'/'.join(platforms)}; the Pallas kernel runs on TPUs only"
    problem = kernel_import_problem()
    if problem is not None:
        return problem
    if config.head_dim % PALLAS_HEAD_DIM_MULTIPLE:
        return f"head_dim={config.head_dim} is not a multiple of {PALLAS_HEAD_DIM_MULTIPLE}"
    if jnp.dtype(dtype).name not in PALLAS_Q_DTYPES:
        return f"activations in {jnp.dtype(dtype).name}; the kernel takes {'/'.join(PALLAS_Q_DTYPES)}"
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel

    try:
        kernel.get_min_heads_per_blk(config.num_attention_heads, 2 * config.num_key_value_heads,
                                     jnp.dtype(dtype), jnp.dtype(kv_dtype))
    except ValueError as exc:
        return f"{config.num_key_value_heads} KV heads in {jnp.dtype(kv_dtype).name} do not tile: {exc}"
    return None


def choose_xla_attention(config: Any, devices: Sequence[Any], dtype: Any, kv_dtype: Any, *,
                         own_decoder: bool, tp_size: int) -> XlaAttentionChoice:
    """The decoder's attention under ``GRAPHRT_ATTENTION``: ``auto`` (or unset) takes Pallas
    where it can run (TPUs, the module imports, the shapes tile), ``reference`` never, and
    ``pallas`` always, raising ``ConfigError`` with the reason where it cannot run."""
    env = defaults.ATTENTION_ENV
    choice = requested_kernel(XLA_ATTENTION_CHOICES, "graphrt's JAX decoder")
    if choice == "reference":
        return XlaAttentionChoice("reference", None, f"{env}=reference", XlaPagedAttention())
    override = KERNEL_OVERRIDE
    problem = pallas_problem(config, devices, dtype, kv_dtype, own_decoder=own_decoder, tp_size=tp_size,
                             override=override is not None)
    if problem is None:
        return XlaAttentionChoice("pallas", PallasAttention("pallas" if override is None else override),
                                  f"{env}={choice}: Pallas ragged paged attention runs", XlaPagedAttention())
    if choice == "pallas":
        raise ConfigError(f"{env}=pallas, but Pallas ragged paged attention cannot run: {problem}")
    if any(d.platform == "tpu" for d in devices):
        logger.warning("graphrt's JAX decoder on TPU attends with its reference, not Pallas: %s", problem)
    return XlaAttentionChoice("reference", None, problem, XlaPagedAttention())


def pages_per_layer(num_blocks: int) -> int:
    """Pages of one layer in the Pallas layout: its blocks and a trash page."""
    return num_blocks + 1


def pallas_kv_shape(config: Any, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """``[layers * (num_blocks + 1), block_size, 2 * kv_heads, head_dim]`` (module docstring)."""
    return (config.num_hidden_layers * pages_per_layer(num_blocks), block_size,
            2 * config.num_key_value_heads, config.head_dim)


def layer_pages(kv_cache: jax.Array, num_layers: int, block_size: int) -> int:
    """Pages per layer of a Pallas-layout cache; a ``ConfigError`` when its shape is not one."""
    pages, rows = divmod(kv_cache.shape[0], num_layers)
    if kv_cache.ndim != 4 or rows or pages < 2 or kv_cache.shape[1] != block_size:
        raise ConfigError(f"a Pallas-layout KV cache is [layers * (blocks + 1), {block_size}, 2 * kv_heads, "
                          f"head_dim] for {num_layers} layers; got {tuple(kv_cache.shape)}")
    return pages


def trash_row(kv_cache: jax.Array, num_layers: int, block_size: int) -> int:
    """The row (of a layer's ``pages * block_size``) that padded tokens write: the trash page's first."""
    return (layer_pages(kv_cache, num_layers, block_size) - 1) * block_size


def pages_to_rows(pages: np.ndarray, num_layers: int, block_size: int) -> np.ndarray:
    """A Pallas-layout cache (host array) in the reference layout ``[layers, 2, blocks *
    block_size + 1, kv_heads, head_dim]``, for tools that address KV slots."""
    per_layer = pages.shape[0] // num_layers
    heads = pages.shape[2] // 2
    rows = pages.reshape(num_layers, per_layer * block_size, heads, 2, pages.shape[3]).transpose(0, 3, 1, 2, 4)
    real = (per_layer - 1) * block_size
    return np.concatenate([rows[:, :, :real], rows[:, :, real:real + 1]], axis=2)


def rows_to_pages(rows: np.ndarray, pages_shape: tuple[int, ...], num_layers: int, block_size: int) -> np.ndarray:
    """:func:`pages_to_rows` inverted: reference-layout ``rows`` as a Pallas-layout host array of
    ``pages_shape`` (the trash page's other rows, never written or read, zero)."""
    per_layer = pages_shape[0] // num_layers
    real = (per_layer - 1) * block_size
    heads, head_dim = pages_shape[2] // 2, pages_shape[3]
    full = np.zeros((num_layers, 2, per_layer * block_size, heads, head_dim), rows.dtype)
    full[:, :, :real + 1] = rows
    return full.transpose(0, 2, 3, 1, 4).reshape(pages_shape)


def write_kv(kv_cache: jax.Array, k: jax.Array, v: jax.Array, layer_idx: jax.Array, write_rows: jax.Array,
             block_size: int, num_layers: int, kv_scales: tuple[float, float]) -> jax.Array:
    """Scatter this step's ``k`` / ``v`` [T, Hkv, D] into layer ``layer_idx``'s rows ``write_rows``
    (K and V interleaved on the head axis), quantized as the reference stores them."""
    num_tokens, num_kv_heads, head_dim = k.shape
    kv = jnp.stack([quantize_kv(k, kv_cache.dtype, kv_scales[0]), quantize_kv(v, kv_cache.dtype, kv_scales[1])],
                   axis=2).reshape(num_tokens, 2 * num_kv_heads, head_dim)
    page = layer_idx * layer_pages(kv_cache, num_layers, block_size) + write_rows // block_size
    return kv_cache.at[page, write_rows % block_size].set(kv)


def _kernel(attention: Any) -> Callable[..., jax.Array]:
    if callable(attention):
        return attention
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    return ragged_paged_attention


def kernel_block_sizes(q_dtype: Any, kv_dtype: Any, num_q_heads: int, num_combined_kv_heads: int, head_dim: int,
                       page_size: int, num_tokens: int, pages_per_seq: int) -> dict[str, int]:
    """The TPU kernel's ``num_kv_pages_per_block`` and ``num_queries_per_block``: jax's tuned sizes
    for the chip, with the KV pages per block halved until the kernel's double-buffered KV block
    takes at most :data:`~graphrt.core.defaults.PALLAS_KV_VMEM_BYTES` (jax's untuned default,
    128 pages of 16 tokens, overran v5e's 16 MiB scoped VMEM at 8 KV heads of 128: the program
    did not compile). Read when the program is traced, on the chip it is traced for."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.tuned_block_sizes import get_tuned_block_sizes

    q_heads_blk, kv_heads_blk = rpa.get_min_heads_per_blk(num_q_heads, num_combined_kv_heads, q_dtype, kv_dtype)
    pages, queries = get_tuned_block_sizes(q_dtype, kv_dtype, q_heads_blk, kv_heads_blk // 2, head_dim, page_size,
                                           num_tokens, pages_per_seq)
    per_page = 2 * page_size * kv_heads_blk * head_dim * jnp.dtype(kv_dtype).itemsize    # two buffers
    while pages > 1 and pages * per_page > defaults.PALLAS_KV_VMEM_BYTES:
        pages //= 2
    return {"num_kv_pages_per_block": int(pages), "num_queries_per_block": int(queries)}


def attend(q: jax.Array, kv_cache: jax.Array, layer_idx: jax.Array, window: Any, meta: Any, *,
           attention: Any, windows: tuple[int, ...], block_size: int, num_layers: int,
           kv_scales: tuple[float, float]) -> jax.Array:
    """The kernel's attention of ``q`` [T, Hq, D] over layer ``layer_idx`` of the Pallas-layout cache.

    The kernel's window is static, so layers with different ``windows`` pick theirs with
    ``lax.switch`` on the traced ``window``. Padding tokens get zeros, as from the reference.
    """
    num_tokens, _, head_dim = q.shape
    kernel = _kernel(attention)
    fp8 = kv_cache.dtype in FP8_KV_DTYPES
    k_scale, v_scale = (float(kv_scales[0]), float(kv_scales[1])) if fp8 else (None, None)
    qsl = meta.query_start_loc.astype(jnp.int32)
    q_lens = qsl[1:] - qsl[:-1]
    # The kernel walks its first num_seqs requests: up to the last one with queries (padded
    # requests, with none, come last; a real one with none in between only contributes nothing).
    num_seqs = jnp.max(jnp.where(q_lens > 0, jnp.arange(1, q_lens.shape[0] + 1, dtype=jnp.int32), 0))
    page_indices = (meta.block_table.astype(jnp.int32)
                    + layer_idx.astype(jnp.int32) * layer_pages(kv_cache, num_layers, block_size))
    operands = (q, kv_cache, meta.seq_lens.astype(jnp.int32), page_indices, qsl, num_seqs.reshape(1))
    # The TPU kernel's block sizes, fitted to VMEM (a stand-in kernel, tests', takes none).
    sizes = {} if callable(attention) else kernel_block_sizes(
        q.dtype, kv_cache.dtype, q.shape[1], kv_cache.shape[2], head_dim, kv_cache.shape[1], num_tokens,
        page_indices.shape[1])

    def run(sliding: int, *args: jax.Array) -> jax.Array:
        return kernel(*args, sm_scale=head_dim ** -0.5, sliding_window=sliding or None,
                      k_scale=k_scale, v_scale=v_scale, **sizes)

    distinct = sorted({int(w) for w in windows} or {0})
    if len(distinct) == 1 or window is None:
        out = run(distinct[0] if window is not None else 0, *operands)
    else:
        branch = jnp.argmax(jnp.asarray(distinct, jnp.int32) == window)
        out = jax.lax.switch(branch, [functools.partial(run, w) for w in distinct], *operands)
    real = jnp.arange(num_tokens, dtype=jnp.int32) < qsl[-1]
    return jnp.where(real[:, None, None], out, jnp.zeros((), out.dtype))


def write_and_attend(q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: jax.Array, layer_idx: jax.Array,
                     window: Any, positions: jax.Array, meta: Any, write_rows: jax.Array, *, attention: Any,
                     windows: tuple[int, ...], block_size: int, num_layers: int,
                     kv_scales: tuple[float, float]) -> tuple[jax.Array, jax.Array]:
    """One layer's KV write then attention in the Pallas layout: (attention [T, Hq, D], new cache).
    ``positions`` are implied by ``seq_lens`` and ``query_start_loc`` (module docstring)."""
    del positions
    kv_cache = write_kv(kv_cache, k, v, layer_idx, write_rows, block_size, num_layers, kv_scales)
    out = attend(q, kv_cache, layer_idx, window, meta, attention=attention, windows=windows,
                 block_size=block_size, num_layers=num_layers, kv_scales=kv_scales)
    return out, kv_cache


__all__ = ["attend", "choose_xla_attention", "kernel_block_sizes", "kernel_import_problem", "KERNEL_OVERRIDE",
           "pages_per_layer", "pages_to_rows", "pallas_kv_shape", "pallas_problem", "PallasAttention", "rows_to_pages",
           "trash_row", "write_and_attend", "write_kv", "XlaAttentionChoice"]
