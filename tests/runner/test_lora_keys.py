"""LoRA-aware keys (issue 14): a step's distinct adapters are a key dimension, bucketed to
0, 1, 2, 4, ..., max_loras (vLLM's ``cudagraph_specialize_lora``), so steps with and without
adapters -- or with different adapter counts -- never replay the same graph.

* Keys: with ``max_loras = 0`` nothing changes; with adapters every key exists once per bucket,
  and a hypothesis property over random adapter assignments: the key's bucket covers the
  step's distinct adapters and is 0 only when there are none.
* End to end on the tiny Qwen3 (LoRA on ``o_proj``): a graph runner (``cpu``: FULL decode graphs,
  PIECEWISE fx pieces; breakable pieces too) is bitwise its eager twin at the same padded shapes, logits and KV; each
  request with an adapter matches a model with that adapter merged into the weight (within
  ``graphrt.tolerance``); a request without one is bitwise the base model's; adapters loaded
  (or replaced) after capture are what the replays apply.
* Bad ``lora_ids`` / adapters raise ``InputError`` naming the field, with nothing mutated.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrt import ConfigError, GraphConfig, InputError, ModelRunner, RuntimeMode
from graphrt.core.buckets import BucketPolicy
from graphrt.core.dispatch import BatchDescriptor, Dispatcher
from graphrt.core.graph_modes import GraphMode
from graphrt.core.lora import LoraInputs
from graphrt.models.torch.loader import load_torch_model
from graphrt.models.torch.lora import LoRALinear
from support.hf_models import tiny_hf_model_dir
from support.parity import assert_bitwise, assert_close_across_shapes, pad_like
from support.fast_subset import examples

LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32, block_size=4)
SIZES = [4, 16]
ROWS, WIDTH = 4, 8
PROMPTS = (5, 3, 6)                       # 14 tokens: the 16-token PIECEWISE bucket
MAX_LORAS, RANK, SCALE = 2, 8, 0.5
O_PROJ = "model.layers.{}.self_attn.o_proj"


# ---------------------------------------------------------------------------------- keys

def test_lora_off_keys_are_unchanged():
    policy = BucketPolicy([1, 2, 4, 8, 16])
    for mode in GraphMode:
        off = Dispatcher(mode, token_buckets=policy, max_num_seqs=8)
        on = Dispatcher(mode, token_buckets=policy, max_num_seqs=8, max_loras=4)
        assert all(k.num_loras == 0 for _, k in off.keys())
        assert "loras" not in " ".join(str(k) for _, k in off.keys())
        assert len(on.keys()) == 4 * len(off.keys())          # buckets 0, 1, 2, 4
        assert {(m, k) for m, k in on.keys() if k.num_loras == 0} == set(off.keys())
    assert GraphConfig.create(**LIMITS).graph_dispatcher().keys() == \
        GraphConfig.create(**LIMITS, max_loras=0).graph_dispatcher().keys()


def test_steps_with_and_without_adapters_never_share_a_key():
    d = GraphConfig.create(**LIMITS, cudagraph_capture_sizes=SIZES, max_loras=4).graph_dispatcher()
    for t, r, uniform in ((3, 3, True), (14, 3, False), (4, 4, True)):
        keys = [d.dispatch(t, r, uniform, n).key for n in (0, 1, 3)]
        assert [k.num_loras for k in keys] == [0, 1, 4]
        assert len(set(keys)) == 3 and all(k in {key for _, key in d.keys()} for k in keys)
    assert str(d.dispatch(3, 3, True, 1).key) == "(decode, tokens=4, reqs=4, loras=1)"
    with pytest.raises(InputError, match="lora_ids"):
        d.dispatch(3, 3, True, 5)                              # above max_loras


@settings(max_examples=examples(150), deadline=None)
@given(max_loras=st.integers(1, 8), data=st.data())
def test_the_key_bucket_covers_the_step_adapters(max_loras, data):
    num_reqs = data.draw(st.integers(max_loras, 8))
    ids = np.array(data.draw(st.lists(st.integers(-1, max_loras - 1), min_size=1, max_size=num_reqs)))
    lora = LoraInputs(max_loras, num_reqs, {"lora_index": np.zeros(64, np.int64),
                                            "lora_groups": np.zeros(max_loras, np.int64)},
                      np.ones(max_loras, bool))
    _, n = lora.check(ids, len(ids))
    assert n == len(set(ids.tolist()) - {-1})
    mode = data.draw(st.sampled_from(list(GraphMode)))
    d = Dispatcher(mode, token_buckets=BucketPolicy([1, 2, 4, 8, 16, 32]), max_num_seqs=num_reqs,
                   max_loras=max_loras)
    uniform = data.draw(st.booleans())
    got = d.dispatch(len(ids), len(ids), uniform, n)
    assert got.key.num_loras >= n and (got.key.num_loras == 0) == (n == 0)
    assert got.key.num_loras <= max_loras
    if got.mode is not RuntimeMode.NONE:
        assert (got.mode, got.key) in set(d.keys())
        assert got.key.num_loras in (0, *d.lora_buckets)


def test_graph_memory_samples_every_adapter_count():
    """The KV budget's estimate (core/graph_memory.py) lines up keys of one adapter count only:
    a LoRA graph holds more than the graph of its size without adapters."""
    from graphrt.core.graph_memory import choose_samples, extrapolate

    jobs = GraphConfig.create(**LIMITS, max_loras=2).graph_dispatcher().keys()
    samples = choose_samples(jobs)
    assert {k.num_loras for _, k in samples} == {0, 1, 2}
    cost = {0: 100, 1: 150, 2: 200}                # bytes per token by adapter count
    measured = {k: cost[k.num_loras] * k.num_tokens for _, k in samples}
    assert extrapolate(jobs, measured) == sum(cost[k.num_loras] * k.num_tokens for _, k in jobs)


def test_config_flags():
    assert GraphConfig.create(**LIMITS, enable_lora=True).max_loras == 1     # vLLM's default
    cfg = GraphConfig.create(**LIMITS, max_loras=2, max_lora_rank=8)
    assert cfg.lora_enabled and cfg.max_lora_rank == 8 and cfg.enable_lora is None
    for bad, match in (({"enable_lora": False, "max_loras": 2}, "contradicts"),
                       ({"enable_lora": True, "max_loras": 0}, "contradicts"),
                       ({"max_loras": 5}, "max_num_seqs"), ({"max_lora_rank": 0}, "max_lora_rank")):
        with pytest.raises(ConfigError, match=match):
            GraphConfig.create(**LIMITS, **bad)


def test_xla_refuses_lora():
    pytest.importorskip("jax")
    from graphrt import select_backend

    with pytest.raises(ConfigError, match="xla backend has no LoRA support"):   # before the model is read
        select_backend("xla").create_executor(None, GraphConfig.create(max_loras=1, **LIMITS))


# ------------------------------------------------------------------------- end to end

def tables() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 128, size=(ROWS, LIMITS["max_model_len"]), dtype=np.int32)
    blocks = (rng.permutation(ROWS * WIDTH) + 1).astype(np.int32).reshape(ROWS, WIDTH)
    return tokens, blocks


def adapter(seed: int, rank: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """PEFT-layout weights (lora_a [rank, in], lora_b [out, rank]) for both o_proj layers."""
    rng = np.random.default_rng(seed)
    return {O_PROJ.format(i): (rng.normal(0, 0.2, (rank, 64)).astype(np.float32),
                               rng.normal(0, 0.2, (64, rank)).astype(np.float32)) for i in range(2)}


ADAPTERS = {0: adapter(1, 4), 1: adapter(2, RANK)}


def runner(backend: str, model=None, **overrides) -> ModelRunner:
    return ModelRunner(model if model is not None else str(tiny_hf_model_dir("qwen3")), backend=backend,
                       num_kv_blocks=ROWS * WIDTH + 1, progress=False, cudagraph_capture_sizes=SIZES,
                       **{**LIMITS, **overrides})


def merged(weights: dict | None) -> ModelRunner:
    """An eager LoRA-off runner whose o_proj weights have ``weights`` merged in (None: the base)."""
    model = load_torch_model(tiny_hf_model_dir("qwen3"))
    with torch.no_grad():
        for name, (a, b) in (weights or {}).items():
            model.get_submodule(name).weight += SCALE * torch.from_numpy(b) @ torch.from_numpy(a)
    return runner("eager", model)


def step(r: ModelRunner, tokens, blocks, computed, scheduled, lora_ids) -> np.ndarray:
    n = len(scheduled)
    r.execute(token_ids=tokens, block_table=blocks, req_rows=np.arange(n), num_computed_tokens=np.asarray(computed),
              num_scheduled_tokens=np.asarray(scheduled), lora_ids=lora_ids)
    return r.outputs.logits()


def test_adapters_through_graphs_equal_eager_and_the_merged_weights():
    tokens, blocks = tables()
    graph = runner("cpu", max_loras=MAX_LORAS, max_lora_rank=RANK)
    eager = pad_like(runner("eager", max_loras=MAX_LORAS, max_lora_rank=RANK), graph)
    refs = {-1: pad_like(merged(None), graph), 0: merged(ADAPTERS[0]), 1: merged(ADAPTERS[1])}
    built = len(graph.cache)
    for r in (graph, eager):                     # loaded after capture: the replays must see them
        for slot, weights in ADAPTERS.items():
            r.lora.load(slot, weights, scale=SCALE)
    assert isinstance(graph.model.model.layers[0].self_attn.o_proj, LoRALinear)

    prompts = list(PROMPTS)
    # (lora_ids, computed, scheduled): request 0 runs adapter 0, request 1 none, request 2
    # adapter 1 (2 adapters), then requests 0 and 1 alone (1 adapter).
    plan = [([0, -1, 1], [0, 0, 0], [p - 2 for p in prompts], "prefill"),
            ([0, -1, 1], [p - 2 for p in prompts], [1, 1, 1], "decode"),
            ([0, -1], [p - 1 for p in prompts[:2]], [1, 1], "decode")]
    for lora_ids, computed, scheduled, kind in plan:
        got = step(graph, tokens, blocks, computed, scheduled, lora_ids)
        info = graph.last_step
        want = step(eager, tokens, blocks, computed, scheduled, lora_ids)
        assert eager.last_step.key == info.key and info.key.num_loras == len(set(lora_ids) - {-1})
        assert info.mode is (RuntimeMode.FULL if kind == "decode" else RuntimeMode.PIECEWISE), info
        assert_bitwise(got, want, f"{kind} {info.key}")
        assert_bitwise(graph.executor.kv_cache, eager.executor.kv_cache, f"KV after {info.key}")
        base = step(refs[-1], tokens, blocks, computed, scheduled, None)
        for row, slot in enumerate(lora_ids):
            if slot == -1:                       # unaffected by the others' adapters, to the bit
                assert_bitwise(got[row], base[row], f"row {row} without an adapter, {info.key}")
        # Each merged reference runs every step (its adapter on every request), so the KV of the
        # requests it stands for has the history of the LoRA runner's.
        outs = {s: step(refs[s], tokens, blocks, computed, scheduled, None) for s in (0, 1)}
        for row, slot in enumerate(lora_ids):
            if slot >= 0:
                assert_close_across_shapes(got[row], outs[slot][row], err_msg=f"row {row} slot {slot}")
                assert np.abs(got[row] - base[row]).max() > 1e-2          # the adapter does something
    assert graph.stats.misses == 0 and len(graph.cache) == built

    # A new adapter in slot 0 after capture: the FULL decode graph replays with it.
    replaced = adapter(3, RANK)
    for r in (graph, eager):
        r.lora.load(0, replaced, scale=SCALE)
    computed = [prompts[0], prompts[1], prompts[2] - 1]
    got = step(graph, tokens, blocks, computed, [1, 1, 1], [0, -1, -1])
    assert_bitwise(got, step(eager, tokens, blocks, computed, [1, 1, 1], [0, -1, -1]), "after reloading slot 0")
    assert graph.last_step.mode is RuntimeMode.FULL and graph.last_step.key.num_loras == 1
    before = step(refs[0], tokens, blocks, computed, [1, 1, 1], None)       # the old adapter's logits
    assert np.abs(got[0] - before[0]).max() > 1e-2
    assert graph.stats.misses == 0 and len(graph.cache) == built

    computed = [prompts[0] + 1, prompts[1] + 1, prompts[2]]       # no adapter at all: the key without LoRA
    got = step(graph, tokens, blocks, computed, [1, 1, 1], None)
    assert_bitwise(got, step(eager, tokens, blocks, computed, [1, 1, 1], None), "no adapters")
    assert graph.last_step.key == BatchDescriptor(4, 4, True, max_seq_len=LIMITS["max_model_len"])
    assert graph.last_step.mode is RuntimeMode.FULL

    assert graph.lora.remove(0) and not graph.lora.remove(0)
    with pytest.raises(InputError, match=r"lora_ids\[0\].*slot 0 holds no adapter"):
        step(graph, tokens, blocks, computed, [1, 1, 1], [0, -1, -1])


def test_breakable_pieces_apply_adapters_as_eager():
    """PIECEWISE captured the breakable way (no fx): the LoRA ops run inside the pieces."""
    tokens, blocks = tables()
    graph = runner("cpu", max_loras=MAX_LORAS, max_lora_rank=RANK, mode="PIECEWISE", piecewise_capture="breakable")
    eager = pad_like(runner("eager", max_loras=MAX_LORAS, max_lora_rank=RANK), graph)
    for r in (graph, eager):
        for slot, weights in ADAPTERS.items():
            r.lora.load(slot, weights, scale=SCALE)
    for lora_ids, computed, scheduled in (([0, -1, 1], [0, 0, 0], [p - 2 for p in PROMPTS]),
                                          ([1, -1], [p - 2 for p in PROMPTS[:2]], [1, 1])):
        got = step(graph, tokens, blocks, computed, scheduled, lora_ids)
        assert graph.last_step.mode is RuntimeMode.PIECEWISE and graph.executor.pieces.capture == "breakable"
        assert_bitwise(got, step(eager, tokens, blocks, computed, scheduled, lora_ids), str(graph.last_step.key))
        assert_bitwise(graph.executor.kv_cache, eager.executor.kv_cache, "KV")
    assert graph.last_step.key.num_loras == 1 and graph.stats.misses == 0


def test_max_loras_zero_leaves_the_model_as_it_was():
    r = runner("eager")
    assert all(type(layer.self_attn.o_proj) is torch.nn.Linear for layer in r.model.model.layers)
    assert r.executor.lora is None and not r.lora.enabled      # nothing to load into
    tokens, blocks = tables()
    with pytest.raises(InputError, match="lora_ids.*max_loras=0"):
        step(r, tokens, blocks, [0], [3], [-1])
    for call in (lambda: r.lora.load(0, ADAPTERS[0]), lambda: r.lora.remove(0), r.lora.targets):
        with pytest.raises(InputError, match="slot.*max_loras=0"):   # named, not an AttributeError on None
            call()


BAD_IDS = [([0, 1], r"lora_ids: 2 rows for 3 requests"), ([[0], [1], [0]], r"lora_ids: must be 1-D"),
           ([0.0, 1.0, -1.0], r"lora_ids: must hold integer"), ([True, False, True], r"lora_ids: must hold integer"),
           ([0, 2, -1], r"lora_ids\[1\]: must be -1 \(no adapter\) or a slot in \[0, 2\)"),
           ([0, -2, -1], r"lora_ids\[1\]"), ([0, 2**70, -1], r"lora_ids\[1\]"),
           ("abc", r"lora_ids"), ([-1, None, 1], r"lora_ids\[2\]: slot 1 holds no adapter")]


def test_bad_lora_ids_are_refused_and_nothing_is_mutated():
    r = runner("eager", max_loras=MAX_LORAS, max_lora_rank=RANK)
    r.lora.load(0, ADAPTERS[0], scale=SCALE)
    tokens, blocks = tables()
    step(r, tokens, blocks, [0, 0, 0], [2, 2, 2], [0, None, -1])            # None: no adapter
    assert r.last_step.key.num_loras == 1
    kv = r.executor.kv_cache.clone()
    host = {k: v.copy() for k, v in {**r.executor.host_buffers, **r.executor.lora.host_buffers}.items()}
    for bad, match in BAD_IDS:
        with pytest.raises(InputError, match=match):
            step(r, tokens, blocks, [2, 2, 2], [1, 1, 1], bad)
    assert torch.equal(r.executor.kv_cache, kv)
    for name, buf in {**r.executor.host_buffers, **r.executor.lora.host_buffers}.items():
        assert np.array_equal(buf, host[name]), name


def test_bad_adapters_are_refused_and_nothing_is_copied():
    r = runner("eager", max_loras=MAX_LORAS, max_lora_rank=RANK)
    r.lora.load(1, ADAPTERS[1], scale=SCALE)
    layers = r.executor.lora.layers
    saved = {n: (l.lora_a.clone(), l.lora_b.clone()) for n, l in layers.items()}
    a, b = ADAPTERS[0][O_PROJ.format(0)]
    nan = a.copy()
    nan[0, 0] = np.nan
    cases = [(2, ADAPTERS[0], {}, r"slot: must be an integer in \[0, 2\)"),
             (True, ADAPTERS[0], {}, "slot"),
             (1, {"model.layers.0.mlp.down_proj": (a, b)}, {}, "weights: unknown modules"),
             (1, {O_PROJ.format(0): (a.T, b)}, {}, r"weights\['model.layers.0.self_attn.o_proj'\]: shapes"),
             (1, {O_PROJ.format(0): (np.zeros((9, 64), np.float32), np.zeros((64, 9), np.float32))}, {},
              r"rank 9 outside \[1, 8\]"),
             (1, {O_PROJ.format(0): (nan, b)}, {}, "non-finite"),
             (1, {O_PROJ.format(0): (a,)}, {}, "must be a pair"),
             (1, ADAPTERS[0], {"scale": float("inf")}, "scale"), (1, {}, {}, "weights")]
    for slot, weights, kw, match in cases:
        with pytest.raises(InputError, match=match):
            r.lora.load(slot, weights, **kw)
    for n, layer in layers.items():
        assert torch.equal(layer.lora_a, saved[n][0]) and torch.equal(layer.lora_b, saved[n][1])
    assert r.executor.lora.loaded.tolist() == [False, True]
    assert r.lora.targets() == {O_PROJ.format(i): (64, 64) for i in range(2)}
