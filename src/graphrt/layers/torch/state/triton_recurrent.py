"""Triton kernels of hybrid models' recurrent layers (docs/hybrid.md), with the reference
kernels' signatures, and the choice between them.

* :func:`triton_causal_conv1d` -- one program per token and channel block (the windows to store
  are gathered in torch, as the reference does).
* :func:`triton_ssd_scan` / :func:`triton_gated_delta_rule` -- one program per request, head and
  feature block, running the recurrence over the request's tokens in order;
  :func:`triton_selective_scan` (Mamba1) and :func:`triton_rg_lru_scan` (RecurrentGemma) -- one
  program per request and channel block, the same way; :func:`triton_lightning_attention`
  (MiniMax) -- one program per request, head and value block, as the gated delta rule. Prefill is
  therefore a sequential scan per request (exact, capturable; not the chunked SSD / WY form of
  the reference kernels, which parallelises long prompts better).

Lengths are read on the device, so they run inside FULL graphs of any step. On CUDA they are
compiled with ``triton.jit``; CPU tensors go through Triton's interpreter (``TRITON_INTERPRET=1``
set before triton is imported: the tests' way), each launch one op that recording graphs replay
(:func:`graphrt.layers.torch.triton_launch.interpreted`). :func:`triton_problem` says why they cannot run
on a device; the choice between them and the reference (``GRAPHRT_RECURRENT``) is
:mod:`graphrt.layers.torch.state.kernels`'.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from graphrt.layers.torch.state.metadata import StateMetadata
from graphrt.layers.torch.triton_launch import interpreted

#: Channels per conv1d program; head features per scan program.
CONV_BLOCK, SCAN_BLOCK = 128, 32


def triton_problem(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device`` (None: they can)."""
    try:
        import triton  # noqa: F401
        import triton.language as tl
    except ImportError as exc:
        return f"triton does not import ({exc})"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return f"tensors on {device.type}: Triton runs on CUDA GPUs, elsewhere only through its interpreter " \
               f"(TRITON_INTERPRET=1)"
    if isinstance(tl.zeros, triton.runtime.jit.JITFunction):
        return "TRITON_INTERPRET=1 was set after triton was imported; set it before the first import"
    return None


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool) -> tuple[Any, ...]:
    from graphrt.layers.torch.state import triton_recurrent_kernels as src

    fns = (src.conv1d_kernel, src.ssd_kernel, src.delta_kernel, src.selective_kernel, src.rg_lru_kernel,
           src.lightning_kernel)
    if interpret:
        return tuple(interpreted(fn) for fn in fns)
    import triton

    return tuple(triton.jit(fn) for fn in fns)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def triton_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, init: torch.Tensor,
                         meta: StateMetadata, activation: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~graphrt.layers.torch.state.mamba_kernels.causal_conv1d` in Triton (SiLU where ``activation``)."""
    from graphrt.layers.torch.state.mamba_kernels import conv_windows

    conv = _kernels(x.device.type != "cuda")[0]
    t, d = x.shape
    k = weight.shape[1]
    out = torch.empty(t, d, dtype=torch.float32, device=x.device)
    xf, w = x.float().contiguous(), weight.float().contiguous()
    init_f = init.float().contiguous()
    conv[(t, -(-d // CONV_BLOCK))](xf, w, bias.float().contiguous() if bias is not None else w, init_f, out,
                                   meta.token_req, meta.token_index, d, K=k, HAS_BIAS=bias is not None,
                                   BLOCK=CONV_BLOCK, ACTIVATION=bool(activation))
    return out.to(x.dtype), conv_windows(xf, init_f, meta, k)


def triton_ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    D: torch.Tensor | None, init: torch.Tensor, meta: StateMetadata,
                    chunk_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~graphrt.layers.torch.state.mamba_kernels.ssd_scan` in Triton (a sequential scan per request)."""
    scan = _kernels(x.device.type != "cuda")[1]
    t, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    rows = meta.starts.shape[0]
    y = torch.zeros(t, h, p, dtype=torch.float32, device=x.device)
    states = torch.zeros(rows, meta.checkpoints, h, p, n, dtype=torch.float32, device=x.device)
    skip = D.float() if D is not None else torch.zeros(h, device=x.device)
    block_p = min(SCAN_BLOCK, _pow2(p))
    scan[(rows, h, -(-p // block_p))](x.float().contiguous(), dt.float().contiguous(), A.float().contiguous(),
                                      B.float().contiguous(), C.float().contiguous(), skip.contiguous(),
                                      init.float().contiguous(), y, states, meta.starts, meta.query_lens, h, g, p, n,
                                      CHECKPOINTS=meta.checkpoints, BLOCK_P=block_p, BLOCK_N=_pow2(n))
    return y, states


def triton_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            init: torch.Tensor, meta: StateMetadata,
                            chunk_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~graphrt.layers.torch.state.gated_delta.gated_delta_rule` in Triton (sequential per request)."""
    from graphrt.layers.torch.state.gated_delta import l2norm

    delta = _kernels(q.device.type != "cuda")[2]
    t, hv, dv = v.shape
    rep = hv // k.shape[1]
    dk = q.shape[-1]
    qf = (l2norm(q.float()).repeat_interleave(rep, dim=1) * dk ** -0.5).contiguous()
    kf = l2norm(k.float()).repeat_interleave(rep, dim=1).contiguous()
    rows = meta.starts.shape[0]
    y = torch.zeros(t, hv, dv, dtype=torch.float32, device=v.device)
    states = torch.zeros(rows, meta.checkpoints, hv, dk, dv, dtype=torch.float32, device=v.device)
    block_v = min(SCAN_BLOCK, _pow2(dv))
    delta[(rows, hv, -(-dv // block_v))](qf, kf, v.float().contiguous(), g.float().contiguous(),
                                         beta.float().contiguous(), init.float().contiguous(), y, states, meta.starts,
                                         meta.query_lens, hv, rep, dk, dv, CHECKPOINTS=meta.checkpoints,
                                         BLOCK_K=_pow2(dk), BLOCK_V=block_v)
    return y, states


def triton_selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          D: torch.Tensor | None, init: torch.Tensor, meta: StateMetadata,
                          chunk_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~graphrt.layers.torch.state.selective_scan.selective_scan` in Triton (a sequential
    scan per request and channel block)."""
    scan = _kernels(x.device.type != "cuda")[3]
    t, d = x.shape
    n = A.shape[1]
    rows = meta.starts.shape[0]
    y = torch.zeros(t, d, dtype=torch.float32, device=x.device)
    states = torch.zeros(rows, meta.checkpoints, d, n, dtype=torch.float32, device=x.device)
    skip = D.float() if D is not None else torch.zeros(d, device=x.device)
    block_d = min(SCAN_BLOCK, _pow2(d))
    scan[(rows, -(-d // block_d))](x.float().contiguous(), dt.float().contiguous(), A.float().contiguous(),
                                   B.float().contiguous(), C.float().contiguous(), skip.contiguous(),
                                   init.float().contiguous(), y, states, meta.starts, meta.query_lens, d, n,
                                   CHECKPOINTS=meta.checkpoints, BLOCK_D=block_d, BLOCK_N=_pow2(n))
    return y, states


def triton_rg_lru_scan(a: torch.Tensor, b: torch.Tensor, init: torch.Tensor,
                       meta: StateMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~graphrt.layers.torch.state.rg_lru.rg_lru_scan` in Triton (a sequential scan per
    request and channel block)."""
    scan = _kernels(a.device.type != "cuda")[4]
    t, d = a.shape
    rows = meta.starts.shape[0]
    h = torch.zeros(t, d, dtype=torch.float32, device=a.device)
    states = torch.zeros(rows, meta.checkpoints, d, dtype=torch.float32, device=a.device)
    block_d = min(CONV_BLOCK, _pow2(d))
    scan[(rows, -(-d // block_d))](a.float().contiguous(), b.float().contiguous(), init.float().contiguous(), h,
                                   states, meta.starts, meta.query_lens, d, CHECKPOINTS=meta.checkpoints,
                                   BLOCK_D=block_d)
    return h, states


def triton_lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                               init: torch.Tensor, meta: StateMetadata,
                               chunk_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~graphrt.layers.torch.state.lightning.lightning_attention` in Triton (a sequential
    scan per request, head and value block)."""
    scan = _kernels(q.device.type != "cuda")[5]
    t, h, dv = v.shape
    dk = q.shape[-1]
    rows = meta.starts.shape[0]
    y = torch.zeros(t, h, dv, dtype=torch.float32, device=v.device)
    states = torch.zeros(rows, meta.checkpoints, h, dk, dv, dtype=torch.float32, device=v.device)
    block_v = min(SCAN_BLOCK, _pow2(dv))
    scan[(rows, h, -(-dv // block_v))](q.float().contiguous(), k.float().contiguous(), v.float().contiguous(),
                                       slope.float().reshape(-1).contiguous(), init.float().contiguous(), y, states,
                                       meta.starts, meta.query_lens, h, dk, dv, CHECKPOINTS=meta.checkpoints,
                                       BLOCK_K=_pow2(dk), BLOCK_V=block_v)
    return y, states


__all__ = ["triton_causal_conv1d", "triton_gated_delta_rule", "triton_lightning_attention", "triton_problem",
           "triton_rg_lru_scan", "triton_selective_scan", "triton_ssd_scan"]
