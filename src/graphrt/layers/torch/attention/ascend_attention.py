"""Ascend: graphrt's paged attention through torch_npu's fused inference attention ("FIA").

The KV write stays graphrt's; FIA reads the paged cache through the block table. It takes the
lengths as host lists, which a graph would bake in, so the backend declares them refreshed and
:meth:`AscendAttentionBackend.before_replay` rebuilds them before every run, re-issuing the
captured op as a graph task (vllm-ascend's parameter update). Verified only with a stand-in
``torch_npu`` over the CPU recording graph: docs/attention.md, "Ascend". Importing this module
needs neither torch_npu nor CANN.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from graphrt.core.attention_decl import FLOAT_KV_DTYPES, device_type
from graphrt.core.errors import ConfigError
from graphrt.core.graph_modes import AttentionGraphSupport
from graphrt.core.graph_tasks import capture_active, graph_task
from graphrt.layers.torch.forward_context import get_forward_context
from graphrt.layers.torch.attention.paged import ATTENTION_ENV, PagedAttention, requested_attention
from graphrt.layers.torch.attention.backend import AttentionBackend, HostValues, StepTensors
from graphrt.layers.torch.attention.kv_quant import is_fp8, quantize_kv, write_kv_rows

#: Ascend fused attention (``torch_npu.npu_fused_infer_attention_score``, layers/torch/attention/ascend_attention.py),
#: as torch_npu documents it: ``sparse_mode`` 3 is the bottom-right-aligned causal mask, passed as a
#: compressed upper-triangular ``[2048, 2048]`` bool mask; paged KV blocks of a multiple of 128 tokens,
#: at most 512; float16 / bfloat16 heads 16-aligned. Checked where the tensors are on an NPU.
ASCEND_FIA_SPARSE_MODE = 3
ASCEND_FIA_MASK_SIZE = 2048
ASCEND_FIA_BLOCK_MULTIPLE = 128
ASCEND_FIA_MAX_BLOCK_SIZE = 512
ASCEND_FIA_HEAD_DIM_MULTIPLE = 16

logger = logging.getLogger(__name__)

#: torch_npu's fused attention op and its workspace query (for the ``.out`` form in graphs).
FIA_OP = "npu_fused_infer_attention_score"
FIA_WORKSPACE = "_npu_fused_infer_attention_score_get_max_workspace"

_LOGGED: set[str] = set()


def import_torch_npu() -> Any:
    """``torch_npu`` (imported on first use; a test may install a stand-in in ``sys.modules``)."""
    return importlib.import_module("torch_npu")


def fia_problem(device: torch.device | str, head_dim: int, dtype: torch.dtype,
                block_size: int | None = None) -> str | None:
    """Why the fused op cannot run graphrt's attention for these, or None. The op's own limits
    (dtype, head size, block size) are checked where the tensors are on an NPU."""
    try:
        npu = import_torch_npu()
    except Exception as exc:  # noqa: BLE001 - any import failure means "cannot run"
        return f"torch_npu does not import ({type(exc).__name__}: {exc})"
    op = getattr(npu, FIA_OP, None)
    if op is None or not hasattr(op, "out") or not hasattr(npu, FIA_WORKSPACE):
        return f"this torch_npu has no {FIA_OP} with its .out form and {FIA_WORKSPACE}"
    if device_type(device) != "npu":
        return None
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it takes float16 or bfloat16 queries, the model's are {dtype}"
    if head_dim % ASCEND_FIA_HEAD_DIM_MULTIPLE:
        return f"head_dim {head_dim} is not a multiple of {ASCEND_FIA_HEAD_DIM_MULTIPLE}"
    if block_size is not None and (block_size % ASCEND_FIA_BLOCK_MULTIPLE
                                   or block_size > ASCEND_FIA_MAX_BLOCK_SIZE):
        return (f"block_size {block_size}: paged blocks must hold a multiple of "
                f"{ASCEND_FIA_BLOCK_MULTIPLE} tokens, at most {ASCEND_FIA_MAX_BLOCK_SIZE}")
    return None


def layers_problem(layers: Sequence[torch.nn.Module]) -> str | None:
    """Why these attention layers cannot run through the fused op, or None."""
    for i, layer in enumerate(layers):
        if not isinstance(layer, PagedAttention):
            return f"attention layer {i} is a {type(layer).__name__}, not graphrt's PagedAttention"
        if layer.sliding_window:
            return f"attention layer {i} has a sliding window ({layer.sliding_window}), which is not wired to the op"
        if getattr(layer, "attention_chunk", 0):
            return f"attention layer {i} attends within chunks ({layer.attention_chunk}), which is not wired to the op"
    return None


def ascend_backend(layers: Sequence[torch.nn.Module], device: torch.device | str, dtype: torch.dtype | None,
                   block_size: int | None = None, requested: str | None = None) -> "AscendAttentionBackend | None":
    """The Ascend backend for graphrt's attention ``layers`` on ``device`` where ``requested``
    (None: ``GRAPHRT_ATTENTION``) selects it and it can run, else None (``auto``: the reason is
    logged once); ``ascend`` where it cannot run raises ``ConfigError`` saying why."""
    choice = requested_attention() if requested is None else requested
    if not (choice == "ascend" or (choice == "auto" and device_type(device) == "npu")):
        return None
    head_dim = next((int(layer.head_dim) for layer in layers if hasattr(layer, "head_dim")), 0)
    problem = layers_problem(layers) or fia_problem(device, head_dim, dtype or torch.float32, block_size)
    if problem is None:
        return AscendAttentionBackend(head_dim)
    if choice == "ascend":
        raise ConfigError(f"{ATTENTION_ENV}=ascend, but torch_npu's fused attention cannot run graphrt's "
                          f"attention here: {problem}")
    if problem not in _LOGGED:
        _LOGGED.add(problem)
        logger.warning("graphrt: attention on %s uses the reference kernel, not torch_npu's fused attention: %s",
                       device, problem)
    return None


@dataclass
class FiaLengths:
    """The host lists the op reads, one entry per (padded) request."""

    query_ends: list[int]   # actual_seq_lengths: cumulative query ends (TND)
    kv_lens: list[int]      # actual_seq_lengths_kv

    @classmethod
    def empty(cls, num_reqs: int) -> "FiaLengths":
        """A padding-only step's: every request empty (what captures and warm-ups run on)."""
        return cls([0] * num_reqs, [0] * num_reqs)


@dataclass
class AscendAttentionMetadata:
    """What :class:`PagedAttention` hands the fused op: through :meth:`attend`."""

    slot_mapping: torch.Tensor   # int64 [T]; negative: a padded token (writes the trash row)
    block_table: torch.Tensor    # int32 [R, B]
    atten_mask: torch.Tensor     # bool [2048, 2048], the compressed causal mask
    block_size: int
    lengths: FiaLengths          # the lists this run issues the op with
    backend: "AscendAttentionBackend"   # where a replay's task update reads the refreshed lists

    def attend(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``layer``'s attention: its backend's kernel (:meth:`AscendAttentionBackend.attend`)."""
        return self.backend.attend(layer, q, k, v)


class AscendAttentionBackend(AttentionBackend):
    """graphrt's attention through ``torch_npu.npu_fused_infer_attention_score`` (module docstring)."""

    name = "ascend-fia"
    graph_support = AttentionGraphSupport.ALWAYS
    refreshed_host_values = ("query_start_loc", "seq_lens", "num_tokens", "num_reqs")
    free_shape_fields = ("atten_mask",)
    kv_cache_dtypes = FLOAT_KV_DTYPES          # the fused op reads no fp8 cache: refused by name

    def __init__(self, head_dim: int | None = None) -> None:
        self.head_dim = head_dim
        self._refreshed: tuple[tuple[int, int], FiaLengths] | None = None
        self._masks: dict[torch.device, torch.Tensor] = {}
        self._workspaces: dict[tuple[int, int], torch.Tensor] = {}

    def before_replay(self, step: StepTensors, host: HostValues) -> None:
        """The step's lists from its padded host arrays, before its run (and its task updates)."""
        r = host.num_reqs
        self._refreshed = ((host.num_tokens, r), FiaLengths(host.query_start_loc[1:r + 1].tolist(),
                                                              host.seq_lens[:r].tolist()))

    def lengths(self, num_tokens: int, num_reqs: int) -> FiaLengths:
        """The lists :meth:`before_replay` refreshed for a step of this shape, else a padding step's."""
        if self._refreshed is not None and self._refreshed[0] == (num_tokens, num_reqs):
            return self._refreshed[1]
        return FiaLengths.empty(num_reqs)

    def mask(self, device: torch.device) -> torch.Tensor:
        """The compressed causal mask ``sparse_mode`` 3 reads (True: masked), made once per device."""
        mask = self._masks.get(device)
        if mask is None:
            n = ASCEND_FIA_MASK_SIZE
            mask = self._masks[device] = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
        return mask

    def workspace(self, npu: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  lengths: FiaLengths, kwargs: dict[str, Any]) -> torch.Tensor:
        """The op's workspace for any lengths at this shape, shared by every layer of a graph."""
        shape = (query.shape[0], len(lengths.kv_lens))
        ws = self._workspaces.get(shape)
        if ws is None:
            ws = self._workspaces[shape] = getattr(npu, FIA_WORKSPACE)(
                query, key, value, actual_seq_lengths=lengths.query_ends,
                actual_seq_lengths_kv=lengths.kv_lens, **kwargs)
        return ws

    def build(self, step: StepTensors, host: HostValues) -> AscendAttentionMetadata:
        """Device views only; the lists are this step's where refreshed (a run follows its
        before_replay), else a padding step's."""
        t, r = step.slot_mapping.shape[0], step.seq_lens.shape[0]
        return self._metadata(step, self.lengths(t, r))

    def build_for_capture(self, step: StepTensors, host: HostValues) -> AscendAttentionMetadata:
        """A capture's (and its warm-up's): the padding step's lists; each replay's task update
        re-issues the op with the refreshed ones."""
        return self._metadata(step, FiaLengths.empty(step.seq_lens.shape[0]))

    def _metadata(self, step: StepTensors, lengths: FiaLengths) -> AscendAttentionMetadata:
        return AscendAttentionMetadata(step.slot_mapping, step.block_table, self.mask(step.block_table.device),
                                       step.block_size, lengths, self)

    def attend(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``layer``'s attention through the fused op (:func:`fused_paged_attention`)."""
        return fused_paged_attention(get_forward_context(), layer, q, k, v)


def fused_paged_attention(meta: AscendAttentionMetadata, layer: PagedAttention, q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Write the step's K/V the graphrt way, then attend through the fused op (module docstring)."""
    cache = layer.kv_cache
    if is_fp8(cache.dtype):
        raise ConfigError(f"torch_npu's fused attention does not read an fp8 KV cache ({cache.dtype}): use "
                          f"kv_cache_dtype='auto' or {ATTENTION_ENV}=reference")
    npu = import_torch_npu()
    t, rows, hkv, d = q.shape[0], cache.shape[1], cache.shape[2], cache.shape[3]
    hq, bs = q.shape[1] // d, meta.block_size
    slots = torch.where(meta.slot_mapping < 0, rows - 1, meta.slot_mapping)        # trash row
    write_kv_rows(cache[0], slots, quantize_kv(k.reshape(t, hkv, d), cache.dtype))
    write_kv_rows(cache[1], slots, quantize_kv(v.reshape(t, hkv, d), cache.dtype))
    key = cache[0][:rows - 1].view(-1, bs, hkv * d)       # [blocks, block_size, Hkv*D]: no trash row
    value = cache[1][:rows - 1].view(-1, bs, hkv * d)
    query = q.reshape(t, hq, d).to(cache.dtype).contiguous()   # the op takes one dtype for Q, K, V
    kwargs = dict(atten_mask=meta.atten_mask, block_table=meta.block_table, input_layout="TND", block_size=bs,
                  num_heads=hq, num_key_value_heads=hkv, scale=float(layer.scale),
                  sparse_mode=ASCEND_FIA_SPARSE_MODE)
    op = getattr(npu, FIA_OP)
    if not capture_active():
        out, _ = op(query, key, value, actual_seq_lengths=meta.lengths.query_ends,
                    actual_seq_lengths_kv=meta.lengths.kv_lens, **kwargs)
        return out.reshape(t, hq * d).to(q.dtype)
    backend, r = meta.backend, meta.block_table.shape[0]
    workspace = backend.workspace(npu, query, key, value, meta.lengths, kwargs)
    out = torch.zeros_like(query)          # padded tokens (after every request) stay 0
    lse = query.new_empty(t)

    def issue(lengths: FiaLengths) -> None:
        op.out(query, key, value, actual_seq_lengths=lengths.query_ends, actual_seq_lengths_kv=lengths.kv_lens,
               workspace=workspace, out=[out, lse], **kwargs)

    with graph_task(lambda: issue(backend.lengths(t, r)), needs_task_update=True):
        issue(meta.lengths)
    return out.reshape(t, hq * d).to(q.dtype)


__all__ = ["AscendAttentionBackend", "AscendAttentionMetadata", "FIA_OP", "FIA_WORKSPACE", "FiaLengths",
           "ascend_backend", "device_type", "fia_problem", "fused_paged_attention", "import_torch_npu", "layers_problem"]
