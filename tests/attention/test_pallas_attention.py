"""The Pallas ragged paged attention path of graphrt's JAX decoder (pallas_attention.py).

No TPU here: every CPU test runs graphrt's Pallas layout, KV write and kernel glue with jax's
pure-JAX ``ref_ragged_paged_attention`` (the kernel's signature and page layout) in the kernel's
place, through a host callback (the reference loops over sequences in Python, so it cannot be
traced). What the CPU tests establish is that graphrt feeds the kernel the right layout and
metadata, and (exporting for TPU) that the real kernel lowers in the decoder without a copy of the
cache; that the TPU kernel itself agrees with its reference is the TPU test's (skipped here).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
rpa = pytest.importorskip("jax.experimental.pallas.ops.tpu.ragged_paged_attention")
from hypothesis import HealthCheck, Phase, given, settings, strategies as st  # noqa: E402

import graphrt  # noqa: E402
from graphrt import SamplingParams  # noqa: E402
from graphrt.core.errors import ConfigError  # noqa: E402
from graphrt.layers.jax import pallas_attention as pa  # noqa: E402
from graphrt.layers.jax.paged_attention import AttentionMetadata, paged_attention, quantize_kv  # noqa: E402
from graphrt.models.jax.decoder import compute_logits, forward, init_kv_cache  # noqa: E402
from graphrt.models.jax.loader import load_jax_params  # noqa: E402
from support.hf_models import SLIDING, random_prompts, tiny_hf_model_dir  # noqa: E402
from support.parity import assert_close_across_reductions, assert_same_tokens  # noqa: E402
from support.fast_subset import examples  # noqa: E402

LAYERS, WIDTH, T, R = 2, 4, 24, 4      # layers, block-table width, padded tokens and requests
ON_TPU = jax.devices()[0].platform == "tpu"


@functools.lru_cache(maxsize=None)
def _sequence_reference(q_len: int, kv_len: int, options: tuple):
    """``ref_ragged_paged_attention`` on one sequence of ``q_len`` queries over ``kv_len`` keys,
    jitted with those lengths as constants (it slices by them; the pages and the page row stay
    arguments). The reference computes each sequence alone and concatenates them, so calling it
    per sequence is the same computation; one small compile per (q_len, kv_len), shared by every
    layer, step and test that meets it, instead of one eager compile per op (~10x faster)."""
    lengths = [np.asarray(v, np.int32) for v in ([kv_len], [0, q_len], [1])]
    return jax.jit(lambda q, pages, row: rpa.ref_ragged_paged_attention(
        q, pages, lengths[0], row, lengths[1], lengths[2], **dict(options)))


def _host_reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    kv_lens, page_indices, cu_q_lens = (np.asarray(a) for a in (kv_lens, page_indices, cu_q_lens))
    q, pages, key = np.asarray(q), jnp.asarray(kv_pages), tuple(sorted(options.items()))
    out = np.zeros(q.shape, q.dtype)            # rows past cu_q_lens[num_seqs]: the reference stops there
    for i in range(int(np.asarray(num_seqs)[0])):
        start, end = int(cu_q_lens[i]), int(cu_q_lens[i + 1])
        if end > start:
            out[start:end] = np.asarray(_sequence_reference(end - start, int(kv_lens[i]), key)(
                jnp.asarray(q[start:end]), pages, jnp.asarray(page_indices[i:i + 1])))
    return out


def reference_kernel(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """``ref_ragged_paged_attention`` with the kernel's signature, traceable (a host callback)."""
    return jax.pure_callback(functools.partial(_host_reference, **options), jax.ShapeDtypeStruct(q.shape, q.dtype),
                             q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)


def to_reference_layout(cache: np.ndarray, block_size: int) -> np.ndarray:
    """A Pallas-layout cache as ``[layers, 2, blocks * block_size, kv_heads, head_dim]`` (trash pages dropped)."""
    pages, bs, heads2, d = cache.shape
    per_layer = pages // LAYERS
    rows = cache.reshape(LAYERS, per_layer * bs, heads2, d)[:, :(per_layer - 1) * bs]
    return np.stack([rows[:, :, 0::2], rows[:, :, 1::2]], axis=1)


def from_reference_layout(cache: np.ndarray, block_size: int, trash: np.ndarray) -> np.ndarray:
    """The inverse of :func:`to_reference_layout`, each layer's trash page filled from ``trash``."""
    layers, _, rows, hkv, d = cache.shape
    inter = np.stack([cache[:, 0], cache[:, 1]], axis=3).reshape(layers, rows, 2 * hkv, d)
    inter = np.concatenate([inter, trash.reshape(layers, block_size, 2 * hkv, d)], axis=1)
    return inter.reshape(layers * (rows // block_size + 1), block_size, 2 * hkv, d)


@st.composite
def steps(draw):
    """(block size, kv heads, group, window, [(computed, scheduled)], seed): a mixed step of up to
    3 requests (decodes and prefill chunks), the rest of its T tokens and R requests padding."""
    bs = draw(st.sampled_from([16, 32]))
    reqs, budget = [], T - draw(st.integers(0, 4))
    for _ in range(draw(st.integers(1, R - 1))):
        if budget < 1:
            break
        computed = draw(st.integers(0, WIDTH * bs - 1))
        most = min(WIDTH * bs - computed, budget)
        scheduled = 1 if draw(st.booleans()) and computed else draw(st.integers(1, most))
        reqs.append((computed, scheduled))
        budget -= scheduled
    return (bs, draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([0, 7, 40])),
            reqs, draw(st.integers(0, 2**31 - 1)))


def build_step(bs, reqs, seed):
    """Host arrays of one step: metadata, positions, real slots and the block count."""
    rng = np.random.default_rng(seed)
    num_blocks = 1 + R * WIDTH + 1
    order = list(rng.permutation(np.arange(1, num_blocks)))
    table = np.zeros((R, WIDTH), np.int32)
    slots, pos, qsl, lens = [], [], [0], []
    for r, (computed, scheduled) in enumerate(reqs):
        n = computed + scheduled
        blocks = [order.pop() for _ in range(-(-n // bs))]
        table[r, :len(blocks)] = blocks
        for p in range(computed, n):
            slots.append(blocks[p // bs] * bs + p % bs)
            pos.append(p)
        qsl.append(len(slots))
        lens.append(n)
    real = len(slots)
    slots += [-1] * (T - real)
    pos += [0] * (T - real)
    qsl += [qsl[-1]] * (R - len(reqs))
    lens += [0] * (R - len(reqs))
    meta = AttentionMetadata(jnp.asarray(slots, jnp.int32), jnp.asarray(qsl, jnp.int32), jnp.asarray(lens, jnp.int32),
                             jnp.asarray(table))
    return meta, jnp.asarray(pos, jnp.int32), real, num_blocks


@functools.partial(jax.jit, static_argnames=("block_size", "window", "kv_scales"))
def _reference_layer(cache, q, k, v, positions, meta, *, block_size, window, kv_scales):
    rows = jnp.where(meta.slot_mapping < 0, cache.shape[2] - 1, meta.slot_mapping)
    cache = cache.at[1, 0, rows].set(quantize_kv(k, cache.dtype, kv_scales[0]))
    cache = cache.at[1, 1, rows].set(quantize_kv(v, cache.dtype, kv_scales[1]))
    return paged_attention(q, cache[1, 0], cache[1, 1], positions, meta, block_size, window, kv_scales), cache


@functools.partial(jax.jit, static_argnames=("block_size", "window", "kv_scales"))
def _pallas_layer(cache, q, k, v, positions, meta, *, block_size, window, kv_scales):
    trash = pa.trash_row(cache, LAYERS, block_size)
    rows = jnp.where(meta.slot_mapping < 0, trash, meta.slot_mapping)
    # Layer 1 of a hybrid model (layer 0 full): its window is traced, picked by lax.switch.
    return pa.write_and_attend(q, k, v, cache, jnp.int32(1), jnp.int32(window) if window else None, positions, meta,
                               rows, attention=reference_kernel, windows=(0, window), block_size=block_size,
                               num_layers=LAYERS, kv_scales=kv_scales)


def check_layer(bs, hkv, group, window, reqs, seed, kv_dtype=jnp.float32, kv_scales=(1.0, 1.0), d=16):
    """Layer 1's write and attention in both layouts from the same random cache: outputs within the
    reduction tolerance, padded tokens zeros, every KV row the same bytes, no foreign row written."""
    meta, positions, real, num_blocks = build_step(bs, reqs, seed)
    rng = np.random.default_rng(seed + 1)
    q, k, v = (jnp.asarray(rng.standard_normal((T, h, d)), jnp.float32) for h in (hkv * group, hkv, hkv))
    context = quantize_kv(jnp.asarray(rng.standard_normal((LAYERS, 2, num_blocks * bs + 1, hkv, d)), jnp.float32),
                          kv_dtype)
    trash = np.asarray(quantize_kv(jnp.asarray(rng.standard_normal((LAYERS, bs, 2 * hkv, d))), kv_dtype))
    before = from_reference_layout(np.asarray(context)[:, :, :-1], bs, trash)
    want, ref_cache = _reference_layer(context, q, k, v, positions, meta, block_size=bs, window=window,
                                       kv_scales=kv_scales)
    got, cache = _pallas_layer(jnp.asarray(before), q, k, v, positions, meta, block_size=bs, window=window,
                               kv_scales=kv_scales)
    want, got = np.asarray(want, np.float32), np.asarray(got, np.float32)
    longest = max(c + s for c, s in reqs)
    assert_close_across_reductions(got[:real], want[:real], width=max(d, longest), err_msg=str((reqs, window)))
    assert not got[real:].any(), "padded tokens must get zeros"
    after = np.asarray(cache)
    as_reference = to_reference_layout(after, bs)
    np.testing.assert_array_equal(as_reference.view(np.uint8), np.asarray(ref_cache)[:, :, :-1].view(np.uint8))
    # KV isolation, exact: only layer 1's real slots and its trash row may change.
    flat_before = before.reshape(LAYERS, -1, 2 * hkv, d).view(np.uint8)
    flat_after = after.reshape(LAYERS, -1, 2 * hkv, d).view(np.uint8)
    changed = {(int(layer), int(row)) for layer, row in zip(*np.nonzero((flat_after != flat_before).any(axis=(2, 3))))}
    allowed = {(1, int(s)) for s in np.asarray(meta.slot_mapping)[:real]} | {(1, num_blocks * bs)}
    assert changed <= allowed, sorted(changed - allowed)


@given(steps())
@settings(max_examples=examples(6), deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow], phases=(Phase.explicit, Phase.generate))
def test_pallas_layout_attention_matches_the_reference(step):
    """Hypothesis-drawn mixed prefill / decode steps, GQA groups 1-4, blocks of 16 and 32, padded
    tokens and requests, no window or a sliding one (fixed examples, no shrinking: a failure prints
    its step; each example compiles and calls back, so shrinking would take minutes)."""
    bs, hkv, group, window, reqs, seed = step
    check_layer(bs, hkv, group, window, reqs, seed)


@pytest.mark.parametrize("kv_dtype,kv_scales", [(jnp.float8_e4m3fn, (0.5, 2.0)), (jnp.float8_e5m2, (1.0, 1.0))])
def test_fp8_pages_read_with_their_scales(kv_dtype, kv_scales):
    check_layer(16, 2, 2, 7, [(37, 5), (20, 1), (0, 9)], 3, kv_dtype=kv_dtype, kv_scales=kv_scales)


def test_padded_tokens_write_only_the_trash_page():
    """Every token padded (slot -1), with queries that would attend: nothing but the trash rows change."""
    bs, hkv, d = 16, 2, 16
    cfg = type("Cfg", (), {"num_hidden_layers": LAYERS, "num_key_value_heads": hkv, "head_dim": d})
    cache = jnp.asarray(np.random.default_rng(0).standard_normal(pa.pallas_kv_shape(cfg, 5, bs)), jnp.float32)
    before = np.asarray(cache)
    k = v = jnp.ones((8, hkv, d), jnp.float32)
    rows = jnp.full((8,), pa.trash_row(cache, LAYERS, bs), jnp.int32)
    for layer in range(LAYERS):
        cache = pa.write_kv(cache, k, v, jnp.int32(layer), rows, bs, LAYERS, (1.0, 1.0))
    after = np.asarray(cache)
    trash_pages = [5, 11]                                   # each layer's last page
    assert (after[trash_pages, 0] == 1).all()
    keep = np.ones(after.shape[:2], bool)
    keep[trash_pages, 0] = False
    np.testing.assert_array_equal(after[keep].view(np.uint8), before[keep].view(np.uint8))


# ---- the whole decoder --------------------------------------------------------------------
BS, NB = 16, 9


def _chunks():
    """(positions computed, tokens scheduled) per request for a chunked prefill then decodes."""
    return [[(0, 9), (0, 13)], [(9, 8), (13, 1)], [(17, 1), (14, 1)], [(18, 1), (15, 1)]]


@pytest.mark.parametrize("spec", [dict(arch="qwen3", **SLIDING), dict(arch="llama")], ids=["qwen3_sliding", "llama"])
def test_decoder_in_the_pallas_layout_matches_the_reference_layout(spec):
    """The jitted decoder, chunked prefill then decodes of two requests: the same logits within the
    reduction tolerance and the same greedy tokens in both layouts, at every step."""
    cfg, params = load_jax_params(tiny_hf_model_dir(**spec))
    fwd = jax.jit(forward, static_argnames=("config", "block_size", "attention"), donate_argnames=("kv_cache",))
    ref_cache = init_kv_cache(cfg, NB, BS, jnp.float32)
    pal_cache = jnp.zeros(pa.pallas_kv_shape(cfg, NB, BS), jnp.float32)
    seqs = random_prompts((26, 26), seed=4)
    blocks = np.array([[1, 3, 0, 0], [2, 4, 0, 0]], np.int32)
    for step in _chunks():
        ids, pos, slots, qsl, lens = [], [], [], [0], []
        for r, (start, n) in enumerate(step):
            ids += seqs[r][start:start + n]
            pos += list(range(start, start + n))
            slots += [blocks[r, p // BS] * BS + p % BS for p in range(start, start + n)]
            qsl.append(len(ids))
            lens.append(start + n)
        pad = 32 - len(ids)
        meta = AttentionMetadata(jnp.asarray(slots + [-1] * pad, jnp.int32), jnp.asarray(qsl + [qsl[-1]], jnp.int32),
                                 jnp.asarray(lens + [0], jnp.int32), jnp.asarray(np.vstack([blocks, [[0] * 4]])))
        ids, pos = jnp.asarray(ids + [0] * pad, jnp.int32), jnp.asarray(pos + [0] * pad, jnp.int32)
        h_ref, ref_cache = fwd(params, ref_cache, ids, pos, meta, config=cfg, block_size=BS)
        h_pal, pal_cache = fwd(params, pal_cache, ids, pos, meta, config=cfg, block_size=BS,
                               attention=pa.PallasAttention(reference_kernel))
        last = jnp.asarray(qsl[1:]) - 1
        want, got = compute_logits(params, h_ref[last], config=cfg), compute_logits(params, h_pal[last], config=cfg)
        assert_close_across_reductions(got, want, width=cfg.hidden_size, err_msg=str(step))
        assert_same_tokens(got, want, err_msg=str(step))
    # Every block but the null one: the same K/V (another program, so within the tolerance).
    assert_close_across_reductions(to_reference_layout(np.asarray(pal_cache), BS)[:, :, BS:],
                                   np.asarray(ref_cache)[:, :, BS:-1], width=cfg.hidden_size)


XLA = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=16,
           precompile_token_paddings=[32], precompile_bs_paddings=[4])


@pytest.fixture
def pallas_on_cpu(monkeypatch):
    """GRAPHRT_ATTENTION=pallas with the reference in the kernel's place (the only way it runs on CPU)."""
    monkeypatch.setenv("GRAPHRT_ATTENTION", "pallas")
    monkeypatch.setattr(pa, "KERNEL_OVERRIDE", reference_kernel)


def test_xla_backend_runs_the_pallas_layout(pallas_on_cpu, monkeypatch):
    """graphrt.LLM on the xla backend: the cache in the page layout, the same greedy tokens and last
    logits as the reference layout (the same schedule, so the same last step)."""
    d = str(tiny_hf_model_dir("qwen3", **SLIDING))
    prompts = random_prompts((5, 30), seed=9)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    pallas = graphrt.LLM(d, backend="xla", **XLA)
    ex = pallas.runner.executor
    assert ex.programs.attention.kernel == "pallas" and ex.kv_cache.ndim == 4
    assert ex.kv_cache.shape[1:] == (16, 2 * 2, 16) and ex.kv_cache.shape[0] % 2 == 0
    got = pallas.generate(prompts, params)
    got_logits = pallas.runner.outputs.logits()
    monkeypatch.setenv("GRAPHRT_ATTENTION", "reference")
    reference = graphrt.LLM(d, backend="xla", **XLA)
    assert reference.runner.executor.kv_cache.ndim == 5
    want = reference.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert_close_across_reductions(got_logits, reference.runner.outputs.logits(), width=64)


# ---- the choice -----------------------------------------------------------------------------
def _cfg(head_dim=128, kv_heads=2):
    return type("Cfg", (), {"head_dim": head_dim, "num_key_value_heads": kv_heads, "num_attention_heads": 8,
                            "num_hidden_layers": 2})()


def test_the_choice_on_this_machine(monkeypatch):
    devices = jax.devices()
    choose = functools.partial(pa.choose_xla_attention, _cfg(), devices, jnp.bfloat16, jnp.bfloat16,
                               own_decoder=True, tp_size=1)
    monkeypatch.delenv("GRAPHRT_ATTENTION", raising=False)
    assert choose().kernel == ("pallas" if ON_TPU else "reference")
    monkeypatch.setenv("GRAPHRT_ATTENTION", "reference")
    chosen = choose()
    assert chosen[:3] == ("reference", None, "GRAPHRT_ATTENTION=reference")
    # the choice returns what its kernel declares: the executables key the context (buckets)
    assert chosen.declarations.keyed_host_values(devices, jnp.bfloat16) == ("max_seq_len",)
    assert "float8_e4m3fn" in chosen.declarations.kv_cache_dtypes
    monkeypatch.setenv("GRAPHRT_ATTENTION", "triton")
    with pytest.raises(ConfigError, match="GRAPHRT_ATTENTION='triton'"):
        choose()
    monkeypatch.setenv("GRAPHRT_ATTENTION", "pallas")
    if not ON_TPU:
        with pytest.raises(ConfigError, match="runs on TPUs only"):
            choose()
    with pytest.raises(ConfigError, match="tp_size=2"):
        pa.choose_xla_attention(_cfg(), devices, jnp.bfloat16, jnp.bfloat16, own_decoder=True, tp_size=2)
    with pytest.raises(ConfigError, match="forward of its own"):
        pa.choose_xla_attention(_cfg(), devices, jnp.bfloat16, jnp.bfloat16, own_decoder=False, tp_size=1)
    monkeypatch.setattr(pa, "KERNEL_OVERRIDE", reference_kernel)
    assert choose()[:3] == ("pallas", pa.PallasAttention(reference_kernel),
                        "GRAPHRT_ATTENTION=pallas: Pallas ragged paged attention runs")


def test_kernel_constraints_are_named():
    tpu = [type("Dev", (), {"platform": "tpu"})()]
    problem = functools.partial(pa.pallas_problem, devices=tpu, own_decoder=True, tp_size=1)
    assert "head_dim=64" in problem(_cfg(head_dim=64), dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16)
    assert "float16" in problem(_cfg(), dtype=jnp.float16, kv_dtype=jnp.float16)
    assert "do not tile" in problem(_cfg(kv_heads=3), dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16)
    assert problem(_cfg(), dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16) is None


def test_auto_on_tpu_logs_why_it_keeps_the_reference(monkeypatch, caplog):
    monkeypatch.delenv("GRAPHRT_ATTENTION", raising=False)
    tpu = [type("Dev", (), {"platform": "tpu"})()]
    choice = pa.choose_xla_attention(_cfg(head_dim=64), tpu, jnp.bfloat16, jnp.bfloat16, own_decoder=True,
                                     tp_size=1)
    assert choice.kernel == "reference" and "head_dim=64" in choice.reason and "head_dim=64" in caplog.text


#: Ops that would make a copy or a view of the whole cache if they produced or took its type.
_CACHE_COPIES = ("stablehlo.transpose", "stablehlo.dynamic_slice", "stablehlo.slice", "stablehlo.reshape",
                 "stablehlo.concatenate", "stablehlo.gather", "stablehlo.copy", "stablehlo.pad")


def test_the_decoder_lowers_for_tpu_with_the_kernel_reading_the_cache_in_place(monkeypatch):
    """jax.export for TPU (no TPU needed to lower): the real Pallas kernel lowers to Mosaic at
    graphrt's shapes, once per distinct window of a hybrid model (lax.switch), and nothing in the
    program reshapes, slices or copies the cache: the kernels read the scan's carried cache."""
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes

    for module, name, value in ((tpu_info, "get_device_kind", lambda: "TPU v5 lite"),
                                (tpu_info, "get_num_device_cores", lambda: 1),
                                (tuned_block_sizes, "get_tpu_version", lambda: 5),
                                (tuned_block_sizes, "get_device_name", lambda: "TPU v5e")):
        if not hasattr(module, name):
            pytest.skip(f"this jax has no {module.__name__}.{name} to stand in for a TPU's")
        monkeypatch.setattr(module, name, value)
    cfg, params = load_jax_params(tiny_hf_model_dir("qwen3", head_dim=128, **SLIDING))
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16), params)
    shape = pa.pallas_kv_shape(cfg, 64, 16)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    fwd = jax.jit(functools.partial(forward, config=cfg, block_size=16, attention=pa.PallasAttention()),
                  donate_argnums=(1,))
    exported = jax.export.export(fwd, platforms=["tpu"])(
        abstract, jax.ShapeDtypeStruct(shape, jnp.bfloat16), i32((64,)), i32((64,)),
        AttentionMetadata(i32((64,)), i32((9,)), i32((8,)), i32((8, 8))))
    text = exported.mlir_module()
    assert text.count("stablehlo.custom_call @tpu_custom_call") == len(set(cfg.sliding_windows)) == 2
    cache_type = "tensor<" + "x".join(map(str, shape)) + "xbf16>"
    copies = [line.strip()[:120] for line in text.splitlines()
              if cache_type in line and any(op in line for op in _CACHE_COPIES)]
    assert not copies, copies


@pytest.mark.skipif(not ON_TPU, reason="needs a TPU: the Pallas kernel itself (Mosaic) runs on TPUs only; "
                                       "on CPU its reference stands in for it (the tests above)")
def test_the_tpu_kernel_matches_its_reference_in_graphrt_layout():
    """On a TPU: the real kernel against ``ref_ragged_paged_attention`` through the same glue (head_dim 128)."""
    meta, positions, real, num_blocks = build_step(16, [(40, 8), (30, 1), (0, 12)], 5)
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((T, 8, 128)), jnp.bfloat16)
    cache = jnp.asarray(rng.standard_normal((LAYERS * (num_blocks + 1), 16, 4, 128)), jnp.bfloat16)
    outs = [pa.attend(q, cache, jnp.int32(1), None, meta, attention=kernel, windows=(), block_size=16,
                      num_layers=LAYERS, kv_scales=(1.0, 1.0)) for kernel in ("pallas", reference_kernel)]
    np.testing.assert_allclose(np.asarray(outs[0], np.float32)[:real], np.asarray(outs[1], np.float32)[:real],
                               rtol=graphrt.tolerance("bfloat16").rtol, atol=graphrt.tolerance("bfloat16").atol)


def test_the_kits_view_of_the_page_layout_is_the_reference_layout():
    """``pages_to_rows`` is the test's own conversion plus each layer's trash row, and
    ``rows_to_pages`` inverts it (the trash page's unused rows zero)."""
    num_blocks, hkv, d = 5, 2, 16
    cfg = type("Cfg", (), {"num_hidden_layers": LAYERS, "num_key_value_heads": hkv, "head_dim": d})
    pages = np.random.default_rng(1).standard_normal(pa.pallas_kv_shape(cfg, num_blocks, BS)).astype(np.float32)
    rows = pa.pages_to_rows(pages, LAYERS, BS)
    assert rows.shape == (LAYERS, 2, num_blocks * BS + 1, hkv, d)
    np.testing.assert_array_equal(rows[:, :, :-1], to_reference_layout(pages, BS))
    trash = pages.reshape(LAYERS, num_blocks + 1, BS, 2 * hkv, d)[:, -1, 0]        # each layer's trash row
    np.testing.assert_array_equal(rows[:, 0, -1], trash[:, 0::2])
    np.testing.assert_array_equal(rows[:, 1, -1], trash[:, 1::2])
    back = pa.rows_to_pages(rows, pages.shape, LAYERS, BS)
    used = np.ones(pages.shape[:2], bool).reshape(LAYERS, num_blocks + 1, BS)
    used[:, -1, 1:] = False
    used = used.reshape(pages.shape[:2])
    np.testing.assert_array_equal(back[used], pages[used])
    assert not back[~used].any()


def test_the_kit_checks_kv_isolation_in_the_page_layout(pallas_on_cpu):
    """The conformance kit's KV properties address slots through the reference view of the pages."""
    from graphrt.testing import RunnerFactory, access, check_property

    factory = RunnerFactory(str(tiny_hf_model_dir("qwen3", **SLIDING)), "xla", **XLA)
    runner = factory()
    assert runner.executor.programs.attention.kernel == "pallas"
    view = access.kv_values(runner)
    assert view.shape[2] == runner.num_kv_blocks * XLA["block_size"] + 1
    planted = np.random.default_rng(2).standard_normal(view.shape).astype(np.float32)
    access.set_kv(runner, planted)
    np.testing.assert_array_equal(access.kv_values(runner), planted)
    result = check_property("kv_isolated", factory, examples=examples(2))
    assert result.passed, result.line()


def test_one_parser_reads_the_kernel_variable_for_torch_and_xla(monkeypatch):
    """GRAPHRT_ATTENTION is parsed in one place: torch's and XLA's choices name the same variable
    and value, each with the kernels it takes."""
    from graphrt.core.attention_decl import requested_kernel
    from graphrt.layers.torch.attention.paged import requested_attention

    monkeypatch.setenv("GRAPHRT_ATTENTION", " Pallas ")
    assert requested_kernel(("auto", "pallas"), "x") == "pallas"
    with pytest.raises(ConfigError, match=r"GRAPHRT_ATTENTION='pallas': graphrt's torch attention takes one of"):
        requested_attention()
    monkeypatch.setenv("GRAPHRT_ATTENTION", "triton")
    with pytest.raises(ConfigError, match=r"GRAPHRT_ATTENTION='triton': graphrt's JAX decoder takes one of"):
        pa.choose_xla_attention(_cfg(), jax.devices(), jnp.bfloat16, jnp.bfloat16, own_decoder=True, tp_size=1)


def _kernel_vmem_bytes(q, kv, num_kv_pages_per_block, num_queries_per_block):
    """VMEM the TPU kernel allocates for these block sizes (its scratch and pipelined blocks, as
    ``ragged_paged_attention`` lays them out): the double-buffered KV pages, the q and out blocks
    (double-buffered), the float32 accumulator and the l / m rows (128 lanes each)."""
    q_heads, kv_heads = rpa.kernel.get_min_heads_per_blk(q.shape[1], kv.shape[2], q.dtype, kv.dtype)
    ratio = q.shape[1] // (kv.shape[2] // 2)
    item, kv_item = jnp.dtype(q.dtype).itemsize, jnp.dtype(kv.dtype).itemsize
    pages, queries = num_kv_pages_per_block, num_queries_per_block
    return (2 * pages * kv.shape[1] * kv_heads * kv.shape[3] * kv_item
            + 2 * 2 * queries * q_heads * q.shape[2] * item
            + queries * q_heads * q.shape[2] * 4
            + 2 * (kv_heads // 2) * queries * ratio * 128 * 4)


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("num_tokens", [16, 256])
def test_tpu_kernel_block_sizes_fit_v5e_scoped_vmem(monkeypatch, block_size, num_tokens):
    """The TPU kernel gets block sizes whose VMEM fits v5e's 16 MiB scoped default at a
    Qwen3-0.6B-shaped layer (16 query / 8 KV heads of 128, bf16, 2048-token context): jax's
    untuned default (128 pages a block; the kernel's choice when graphrt passed none) took over
    16 MiB and the program did not compile for v5e (``make compile-check``). The chip is v5e by
    the same lookups the compile check points at a deviceless v5e."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as tbs

    monkeypatch.setattr(tbs, "get_tpu_version", lambda: 5)
    monkeypatch.setattr(tbs, "get_device_name", lambda num_devices=None: "TPU v5")
    seen = []

    def kernel(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
        seen.append(options)
        return jnp.zeros_like(q)
    monkeypatch.setattr(pa, "_kernel", lambda attention: kernel)
    reqs, layers, blocks, width = 16, 4, 256, 2048 // block_size
    q = jax.ShapeDtypeStruct((num_tokens, 16, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((layers * (blocks + 1), block_size, 16, 128), jnp.bfloat16)
    meta = AttentionMetadata(jax.ShapeDtypeStruct((num_tokens,), jnp.int32), jax.ShapeDtypeStruct((reqs + 1,), jnp.int32),
                             jax.ShapeDtypeStruct((reqs,), jnp.int32), jax.ShapeDtypeStruct((reqs, width), jnp.int32))
    jax.eval_shape(lambda q, kv, meta: pa.attend(q, kv, jnp.int32(1), None, meta, attention="pallas", windows=(),
                                                 block_size=block_size, num_layers=layers, kv_scales=(1.0, 1.0)),
                   q, kv, meta)
    (options,) = seen
    pages = options.get("num_kv_pages_per_block")
    queries = options.get("num_queries_per_block")
    if pages is None or queries is None:                       # the kernel's own choice
        pages, queries = tbs.get_tuned_block_sizes(q.dtype, kv.dtype, 16, 8, 128, block_size, num_tokens, width)
    assert 1 <= pages <= width and 1 <= queries <= num_tokens
    assert _kernel_vmem_bytes(q, kv, pages, queries) <= 16 << 20, (pages, queries)
