"""The Triton kernels behind :mod:`graphrt.layers.torch.attention.triton_attention` (read that first).

They are plain functions here, not decorated: ``triton_attention`` wraps each one with
``triton.jit`` for CUDA tensors or with Triton's interpreter for CPU tensors, on first use,
so whether a kernel is compiled or interpreted follows the tensors' device rather than the
environment at import time. No kernel calls another ``@triton.jit`` function of ours (the
interpreter and the compiler resolve those differently); the shared steps are written out.

Layout reminders: ``q``/``out`` are ``[T, Hq * D]`` rows; ``cache_k``/``cache_v`` are the two
halves of ``kv_cache`` (``[rows, Hkv, D]``, row stride ``stride_row``); query head ``h`` reads
KV head ``h // GROUPS``. Scores are kept in the log2 domain (``qk_scale`` includes log2(e)),
so the softmax uses ``exp2``.
"""

from __future__ import annotations

import triton.language as tl


def kv_store_kernel(src_k, src_v, stride_src_k, stride_src_v, cache_k, cache_v, stride_row,
                    slot_mapping, trash_row, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """Copy token ``program_id(0)``'s K and V rows (``WIDTH`` elements, already in the cache's
    dtype and viewed as integers, so the copy is bit-exact) into its slot; a negative slot
    writes the trash row. ``program_id(1)`` picks a ``BLOCK``-wide chunk of the row."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < WIDTH
    slot = tl.load(slot_mapping + token).to(tl.int64)
    row = tl.where(slot < 0, trash_row, slot).to(tl.int64)
    src = token.to(tl.int64)
    k = tl.load(src_k + src * stride_src_k + cols, mask=inside)
    v = tl.load(src_v + src * stride_src_v + cols, mask=inside)
    tl.store(cache_k + row * stride_row + cols, k, mask=inside)
    tl.store(cache_v + row * stride_row + cols, v, mask=inside)


def attention_kernel(q, stride_q, cache_k, cache_v, stride_row, out, stride_out, part_acc, part_ml,
                     query_start_loc, seq_lens, block_table, stride_table,
                     num_tokens, num_reqs, num_blocks, table_width, qk_scale, out_scale, window,
                     num_splits, search_steps,
                     GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr,
                     WINDOWED: tl.constexpr):
    """One program: ``BLOCK_Q`` consecutive query tokens of one request x the ``GROUPS`` query
    heads of KV head ``program_id(1)`` (``BLOCK_M = BLOCK_Q * GROUPS_PAD`` rows of one
    ``tl.dot``), over split ``program_id(2)`` of ``num_splits`` of the request's KV tiles.

    Request ``r``'s tiles are numbered from ``query_start_loc[r] // BLOCK_Q + r`` (strictly
    increasing in ``r``, and leaving room for ``ceil(len_r / BLOCK_Q)`` tiles); the program finds
    its request by binary search over that number, with ``r = num_reqs`` standing for the
    padded tokens after the last request (they attend to nothing and get zeros). A program
    past its request's last token, or a split past its last KV tile, stores zeros / an empty
    partial and reads no KV.
    """
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # -- the request: largest r in [0, num_reqs] with tile_start(r) <= pid ----------------
    lo = pid * 0
    hi = lo + num_reqs + 1
    for _ in range(search_steps):  # ceil(log2(num_reqs + 1)) halvings
        mid = (lo + hi) // 2
        ok = tl.load(query_start_loc + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    req = lo
    real = req < num_reqs
    q_first = tl.load(query_start_loc + req)
    q_end = tl.where(real, tl.load(query_start_loc + tl.minimum(req + 1, num_reqs)), num_tokens)
    seq_len = tl.where(real, tl.load(seq_lens + tl.minimum(req, num_reqs - 1)), 0)
    tok0 = q_first + (pid - (q_first // BLOCK_Q + req)) * BLOCK_Q
    n_tok = tl.minimum(q_end - tok0, BLOCK_Q)  # <= 0: this program has no token

    # -- rows: (token i, query head g of this KV head) --------------------------------------
    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // GROUPS_PAD
    grp = rows % GROUPS_PAD
    row_ok = (rows // GROUPS_PAD < n_tok) & (grp < GROUPS)
    head = kv_head * GROUPS + grp
    pos = seq_len - (q_end - tok)  # each row's token position within its request
    dims = tl.arange(0, HEAD_DIM)
    q_ptrs = q + tok.to(tl.int64)[:, None] * stride_q + (head * HEAD_DIM)[:, None] + dims[None, :]
    q_tile = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)

    # -- the KV range of this program: [kv_lo, kv_hi), then its split's share of tiles -----
    last_pos = seq_len - (q_end - (tok0 + n_tok - 1))
    kv_hi = tl.minimum(tl.minimum(last_pos + 1, seq_len), table_width * BLOCK_SIZE)
    kv_hi = tl.maximum(tl.where(n_tok > 0, kv_hi, 0), 0)
    if WINDOWED:
        kv_lo = tl.maximum(seq_len - (q_end - tok0) - window + 1, 0)
    else:
        kv_lo = kv_hi * 0
    tile_lo = kv_lo // TILE_N
    tile_hi = (kv_hi + TILE_N - 1) // TILE_N
    per_split = (tl.maximum(tile_hi - tile_lo, 0) + num_splits - 1) // num_splits
    tile_begin = tile_lo + split * per_split
    tile_end = tl.minimum(tile_begin + per_split, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs = tl.arange(0, TILE_N)
    table_row = block_table + req.to(tl.int64) * stride_table
    head_off = kv_head * HEAD_DIM
    for tile in range(tile_begin, tile_end):
        kpos = tile * TILE_N + offs
        in_ctx = (kpos >= kv_lo) & (kpos < kv_hi)
        block = tl.load(table_row + kpos // BLOCK_SIZE, mask=in_ctx, other=0)
        block = tl.minimum(tl.maximum(block, 0), num_blocks - 1)  # never read outside the cache
        kv_row = block.to(tl.int64) * BLOCK_SIZE + kpos % BLOCK_SIZE
        kv_ptrs = kv_row[:, None] * stride_row + head_off + dims[None, :]
        k = tl.load(cache_k + kv_ptrs, mask=in_ctx[:, None], other=0.0).to(DOT_DTYPE)
        if IEEE:
            s = tl.dot(q_tile, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q_tile, tl.trans(k))
        keep = in_ctx[None, :] & (kpos[None, :] <= pos[:, None])
        if WINDOWED:
            keep = keep & (kpos[None, :] > pos[:, None] - window)
        s = tl.where(keep, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no NaN
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(s - m_base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_v + kv_ptrs, mask=in_ctx[:, None], other=0.0).to(DOT_DTYPE)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v)
        m_i = m_new

    if num_splits == 1:
        scale = out_scale / tl.where(l_i > 0.0, l_i, 1.0)  # no key at all: acc is 0, so is the row
        o_ptrs = out + tok.to(tl.int64)[:, None] * stride_out + (head * HEAD_DIM)[:, None] + dims[None, :]
        tl.store(o_ptrs, (acc * scale[:, None]).to(out.dtype.element_ty), mask=row_ok[:, None])
    else:
        num_heads = tl.num_programs(1) * GROUPS
        part = (split * num_tokens + tok.to(tl.int64)) * num_heads + head
        tl.store(part_acc + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml + part * 2, m_i, mask=row_ok)
        tl.store(part_ml + part * 2 + 1, l_i, mask=row_ok)


def combine_kernel(part_acc, part_ml, out, stride_out, num_tokens, num_splits, out_scale,
                   HEAD_DIM: tl.constexpr):
    """Merge the ``num_splits`` partial softmaxes of token ``program_id(0)``, query head
    ``program_id(1)``: rescale each to the running max, add, divide once at the end."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    m_run = tl.full([], float("-inf"), tl.float32)
    l_run = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for split in range(num_splits):
        part = (split * num_tokens + token.to(tl.int64)) * tl.num_programs(1) + head
        m = tl.load(part_ml + part * 2)
        m_new = tl.maximum(m_run, m)
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # empty so far: weights 0, no NaN
        old = tl.exp2(m_run - m_base)
        new = tl.exp2(m - m_base)
        l_run = l_run * old + tl.load(part_ml + part * 2 + 1) * new
        acc = acc * old + tl.load(part_acc + part * HEAD_DIM + dims) * new
        m_run = m_new
    o = acc * (out_scale / tl.where(l_run > 0.0, l_run, 1.0))
    tl.store(out + token.to(tl.int64) * stride_out + head * HEAD_DIM + dims, o.to(out.dtype.element_ty))
