"""A stand-in ``torch_npu`` module with ``npu_fused_infer_attention_score`` in plain torch.

Enough of torch_npu's fused inference attention for graphrt's Ascend backend
(``layers/torch/attention/ascend_attention.py``) to run on a CPU: the ``TND`` query layout, a paged KV
cache ``[blocks, block_size, Hkv*D]`` read through ``block_table``, ``sparse_mode`` 3 (causal,
aligned bottom-right) and -- what matters for graphs -- the per-request lengths taken as
**host lists** (``actual_seq_lengths``: cumulative query ends; ``actual_seq_lengths_kv``).
The lists become constant tensors, so a captured recording graph bakes them in exactly as an
ACL graph does; only a task update (``device_fakes.FakeNpu``) changes them. Every call is
checked against the documented contract on the host and logged in ``calls``; the attention
itself is a dense masked softmax over each token's request, zeros for tokens after every
request. Its op sequence does not depend on the lengths (a task update splices as many ops as
the task had).
"""

from __future__ import annotations

import types
from typing import Any

import torch

MASK_SIZE = 2048


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kw: dict[str, Any]) -> None:
    ends, kv = kw["actual_seq_lengths"], kw["actual_seq_lengths_kv"]
    table, bs = kw["block_table"], kw["block_size"]
    assert kw["input_layout"] == "TND" and kw["sparse_mode"] == 3, kw
    assert isinstance(ends, list) and isinstance(kv, list), "the lengths must be host lists"
    assert all(type(x) is int for x in ends + kv), "the lengths must be Python ints"
    assert len(ends) == len(kv) == table.shape[0], (len(ends), len(kv), table.shape)
    assert all(b >= a for a, b in zip([0] + ends, ends)), f"query ends must not decrease: {ends}"
    assert not ends or ends[-1] <= query.shape[0], (ends, query.shape)
    q_lens = [b - a for a, b in zip([0] + ends, ends)]
    assert all(0 <= q <= n <= table.shape[1] * bs for q, n in zip(q_lens, kv)), (q_lens, kv)
    assert query.dim() == 3 and query.shape[1] == kw["num_heads"] and query.is_contiguous()
    assert key.shape == value.shape and key.dim() == 3 and key.shape[1] == bs
    assert key.shape[2] == kw["num_key_value_heads"] * query.shape[2]
    assert table.dtype == torch.int32
    mask = kw["atten_mask"]
    assert mask.shape == (MASK_SIZE, MASK_SIZE) and mask.dtype == torch.bool


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kw: dict[str, Any]) -> torch.Tensor:
    t, hq, d = query.shape
    hkv, bs, table = kw["num_key_value_heads"], kw["block_size"], kw["block_table"]
    ends = torch.tensor(kw["actual_seq_lengths"], dtype=torch.int64)     # baked: host values
    kv = torch.tensor(kw["actual_seq_lengths_kv"], dtype=torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tokens = torch.arange(t)
    req = torch.searchsorted(ends, tokens, right=True)
    covered = req < ends.shape[0]                                        # tokens after every request: none
    req = req.clamp(max=ends.shape[0] - 1)
    pos = kv[req] - (ends[req] - starts[req]) + (tokens - starts[req])  # each query's position
    ctx = torch.arange(table.shape[1] * bs)
    rows = table.long()[req][:, ctx // bs] * bs + ctx % bs               # [T, L] cache rows
    valid = covered[:, None] & (ctx < kv[req][:, None]) & (ctx <= pos[:, None])
    keys = key.reshape(-1, hkv, d)[rows]                                 # [T, L, Hkv, D]
    values = torch.where(valid[:, :, None, None], value.reshape(-1, hkv, d)[rows], 0)
    scores = torch.einsum("tkgd,tlkd->tkgl", query.reshape(t, hkv, hq // hkv, d), keys).float() * kw["scale"]
    m = valid[:, None, None, :]
    probs = torch.where(m, torch.softmax(torch.where(m, scores, float("-inf")), -1), 0.0)
    return torch.einsum("tkgl,tlkd->tkgd", probs.to(values.dtype), values).reshape(t, hq, d).to(query.dtype)


def make_fake_torch_npu() -> types.ModuleType:
    """A fresh stand-in module; ``calls`` logs (kind, actual_seq_lengths, actual_seq_lengths_kv)."""
    module = types.ModuleType("torch_npu")
    module.calls = []

    def fia(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        _check(query, key, value, kw)
        module.calls.append(("op", list(kw["actual_seq_lengths"]), list(kw["actual_seq_lengths_kv"])))
        return _attention(query, key, value, kw), query.new_zeros(1)

    def fia_out(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, workspace: torch.Tensor,
                out: list[torch.Tensor], **kw: Any) -> None:
        _check(query, key, value, kw)
        assert isinstance(workspace, torch.Tensor) and len(out) == 2 and out[0].shape == query.shape
        module.calls.append(("out", list(kw["actual_seq_lengths"]), list(kw["actual_seq_lengths_kv"])))
        out[0].copy_(_attention(query, key, value, kw))

    def workspace(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any) -> torch.Tensor:
        _check(query, key, value, kw)
        module.calls.append(("workspace",))
        return torch.empty(16, dtype=torch.uint8)

    fia.out = fia_out
    module.npu_fused_infer_attention_score = fia
    module._npu_fused_infer_attention_score_get_max_workspace = workspace
    return module
