"""ModelRunner driven directly, with the engine's persistent tables built in the test.

* Padding is invisible (the kit's ``padding_invisible`` and ``replay_matches_eager``): one
  step replayed by the graph of every bucket that covers it and the unpadded eager run give
  the same greedy tokens and real hidden rows, logits and KV writes within
  ``graphrt.tolerance`` (other row counts may pick other matmul kernels); each replay is
  bit-identical to an eager run padded to its key.
* KV isolation: a padded step changes no KV row but its real slots and the trash row,
  even with NaN in the null block; padded rows stay finite.
* Strict mode, eager fallback above the largest bucket, largest-first capture order.
* The sampler: greedy, seeded sampling (reproducible, independent of the batch), top-k /
  top-p (a hypothesis property test on ``graphrt.backends.torch.sampling.sampler.random_sample``).
* Bad input raises ``InputError`` and touches neither the KV cache nor any static buffer.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import graphrt
from graphrt import BatchDescriptor, CacheMissError, InputError, ModelRunner, RuntimeMode
from graphrt import SamplingParams
from graphrt.backends.base import SamplingBatch
from graphrt.runner import sampling_batch
from graphrt.backends.torch.sampling.sampler import random_sample
from graphrt.testing import access, properties
from graphrt.testing.properties import bad_input_rejected, kv_isolated
from graphrt.testing.step import BadStep
from support.runner_steps import CONFIG, LIMITS, VOCAB, greedy
from support.fast_subset import examples

#: Runners by name: (backend, capture sizes, graph mode). ``FULL`` pins one graph per step;
#: ``None`` is the default mode (FULL_AND_PIECEWISE: decode steps FULL graphs, mixed steps
#: piecewise graphs where the backend has them).
RUNNERS = {"cpu[8]": ("cpu", [8], "FULL"), "cpu[16]": ("cpu", [16], "FULL"),
           "cpu[32]": ("cpu", [32], "FULL"), "cpu[1,4,32]": ("cpu", [1, 4, 32], "FULL"),
           "default[8]": ("cpu", [8], None), "default[16]": ("cpu", [16], None),
           "default[32]": ("cpu", [32], None), "eager": ("eager", None, None)}
CPU = [name for name, (backend, _, _) in RUNNERS.items() if backend == "cpu"]


def make_runner(model_dir, backend, sizes, tables, mode="FULL", **kw):
    extra = {} if sizes is None else {"cudagraph_capture_sizes": sizes}
    if mode is not None:
        extra["mode"] = mode
    return ModelRunner(model_dir, backend=backend, num_kv_blocks=tables.num_kv_blocks, progress=False,
                       **LIMITS, **extra, **kw)


@pytest.fixture(scope="module")
def runners(model_dir, tables):
    return {name: make_runner(model_dir, backend, sizes, tables, mode)
            for name, (backend, sizes, mode) in RUNNERS.items()}


def fill_kv(runner, seed: int = 0, poison: bool = True) -> None:
    """Deterministic KV contents: random everywhere; NaN in the null block and the trash row."""
    kv = runner.executor.kv_cache
    gen = torch.Generator().manual_seed(seed)
    kv.copy_(torch.randn(kv.shape, generator=gen, dtype=kv.dtype))
    if poison:
        kv[:, :, :CONFIG.block_size] = float("nan")   # block 0, the null block
        kv[:, :, -1] = float("nan")                   # the trash row


# (rows, computed, scheduled): two prefills; decodes + a new prefill; pure decode; two
# chunks. At most 8 tokens, so every cpu runner replays a graph.
STEPS = [([0, 1], [0, 0], [3, 2]),
         ([0, 1, 2], [3, 2, 0], [1, 1, 4]),
         ([0, 1, 2], [4, 3, 4], [1, 1, 1]),
         ([2, 0], [5, 5], [5, 3])]


# ---- padding is invisible ---------------------------------------------------------------

@pytest.mark.parametrize("name", list(RUNNERS))
def test_padding_is_invisible(runners, tables, name, monkeypatch):
    """The kit's ``padding_invisible`` and ``replay_matches_eager`` on every step: the runner's
    own step, each covering bucket's graph replayed and the unpadded eager step agree (tokens,
    logits, hidden rows, KV at the real slots); the replay equals eager at its padded shape bit
    for bit. The cpu runners replayed graphs of every covering bucket, not only their own."""
    runner = runners[name]
    replayed = []
    replay_at = properties.replay_at

    def spy(r, step, key):
        replayed.append(key.num_tokens)
        return replay_at(r, step, key)

    monkeypatch.setattr(properties, "replay_at", spy)
    for i, (rows, computed, scheduled) in enumerate(STEPS):
        step = tables.step(rows, computed, scheduled, seed=i)
        properties.padding_invisible(lambda: runner, step)
        properties.replay_matches_eager(lambda: runner, step)
        info = runner.last_step
        if RUNNERS[name][0] == "eager":
            assert info.mode is RuntimeMode.NONE and info.key.num_tokens == step.num_tokens
        else:
            assert info.mode is not RuntimeMode.NONE, f"{name}: {info.eager_reason}"
    smallest = min(sum(scheduled) for _, _, scheduled in STEPS)
    sizes = {size for size in RUNNERS[name][1] or [] if size >= smallest}
    assert sizes <= set(replayed) <= sizes | {CONFIG.max_num_seqs}, replayed   # decode graphs: <= 8 reqs


@pytest.mark.parametrize("name", CPU)
def test_padded_step_writes_only_its_real_slots(runners, tables, name):
    """The kit's ``kv_isolated`` on a padded step (NaN in every slot it does not read, the null
    block included): it writes every real slot and no other but the trash row, every row it
    computes -- padded ones included -- is finite, and the NaN changes no bit of its outputs.
    Then, run once more: the padded tokens wrote the trash row, and the static buffers hold
    the padding rules' fill values past the real rows."""
    runner = runners[name]
    step = tables.step([3, 5, 6], [6, 2, 0], [1, 1, 5], seed=1)     # 7 real tokens, 3 requests
    kv_isolated(lambda: runner, step)
    fill_kv(runner, seed=1)
    before = access.kv_bits(runner)
    step.run(runner, greedy(3))
    info = runner.last_step
    t = info.key.num_tokens
    r = info.key.num_reqs if info.key.num_reqs is not None else step.num_reqs   # piecewise: real
    assert info.mode is not RuntimeMode.NONE and t > step.num_tokens
    after = runner.executor.kv_cache
    assert not np.array_equal(before[:, :, -1], access.kv_bits(runner)[:, :, -1])   # padded tokens wrote
    assert torch.isfinite(after[:, :, -1]).all()                                     # the trash row
    # The static buffers hold the padding rules' fill values past the real rows.
    s = runner.executor.static
    assert (s["slot_mapping"][step.num_tokens:t] == -1).all()
    assert (s["input_ids"][step.num_tokens:t] == 0).all() and (s["positions"][step.num_tokens:t] == 0).all()
    assert (s["seq_lens"][3:r] == 0).all() and (s["block_table"][3:r] == 0).all()
    assert (s["query_start_loc"][4:r + 1] == step.num_tokens).all()


def test_nan_in_the_null_block_never_reaches_real_outputs(runners, tables):
    """The kit's ``kv_isolated``: NaN in the null block (which padded requests' block-table
    rows name) and every other slot the step does not read changes no bit of the hidden rows
    and logits, padded or real, which stay finite."""
    kv_isolated(lambda: runners["cpu[16]"], tables.step([0, 4], [0, 0], [5, 2], seed=2))


# ---- strict mode, eager fallback, capture order ---------------------------------------------

def test_strict_mode_raises_on_a_missing_key(model_dir, tables):
    runner = make_runner(model_dir, "cpu", [8, 16], tables, "FULL", strict=True, warmup=False)
    runner.cache.seal()
    assert len(runner.cache) == 0
    step = tables.step([0, 1], [0, 0], [3, 2])
    before = access.device_state(runner)
    with pytest.raises(CacheMissError) as err:
        step.run(runner, greedy(2))
    key = (RuntimeMode.FULL, BatchDescriptor(8, 8, False, max_seq_len=64))   # the context: one bucket
    assert err.value.key == key
    message = str(err.value)   # names the key: mode, tokens, requests; and why it is missing
    assert "FULL" in message and "tokens=8" in message and "reqs=8" in message, message
    assert "not built during warm-up" in message
    assert access.changed(before, access.device_state(runner)) == []
    # Above the largest bucket is not a miss: the policy says eager, strict or not.
    big = tables.step([0, 1], [0, 0], [12, 8])
    big.run(runner, greedy(2))
    assert runner.last_step.mode is RuntimeMode.NONE
    assert "above the largest token bucket (16)" in runner.last_step.eager_reason


def test_non_strict_missing_key_runs_eagerly_and_counts_why(model_dir, tables, runners):
    runner = make_runner(model_dir, "cpu", [8, 16], tables, "FULL", warmup=False)
    runner.cache.seal()
    step = tables.step([0, 1], [0, 0], [3, 2])
    fill_kv(runner)
    tokens = step.run(runner, greedy(2))
    info = runner.last_step
    assert info.mode is RuntimeMode.NONE and info.key.num_tokens == step.num_tokens
    assert "was not captured" in info.eager_reason and "tokens=8" in info.eager_reason
    stats = runner.stats
    assert stats.misses == 1 and stats.eager_steps == 1
    assert stats.eager_reasons[info.eager_reason] == 1
    ref = runners["eager"]
    fill_kv(ref)
    ref_tokens = step.run(ref, greedy(2))
    np.testing.assert_array_equal(runner.outputs.logits(), ref.outputs.logits())   # both eager, same shapes
    np.testing.assert_array_equal(tokens, ref_tokens)


def test_eager_fallback_above_the_largest_bucket(runners, tables):
    runner, ref = runners["cpu[8]"], runners["eager"]
    eager_before = runner.stats.eager_steps
    step = tables.step([0, 1, 2], [0, 0, 0], [5, 4, 3])     # 12 tokens > 8
    for r in (runner, ref):
        fill_kv(r, seed=3)
        step.run(r, greedy(3))
    info = runner.last_step
    assert info.mode is RuntimeMode.NONE
    assert info.key == BatchDescriptor(12, 3, False)
    assert "12 tokens above the largest token bucket (8)" in info.eager_reason
    assert runner.stats.eager_steps == eager_before + 1
    assert runner.stats.eager_reasons[info.eager_reason] >= 1
    np.testing.assert_array_equal(runner.outputs.logits(), ref.outputs.logits())


def test_capture_order_is_largest_first(runners):
    runner = runners["cpu[1,4,32]"]
    keys = runner.cache.keys()
    assert [k[1].num_tokens for k in keys] == [32, 4, 1]
    assert all(k[0] is RuntimeMode.FULL for k in keys)
    sampler_keys = runner.sampler_cache.keys()
    assert [k.num_reqs for k in sampler_keys] == sorted((k.num_reqs for k in sampler_keys), reverse=True)
    assert {k.num_reqs for k in sampler_keys} == {8, 4, 1}
    report = [row["key"] for row in runner.warmup_report]     # the same order, as text
    assert len(report) == len(keys) + len(sampler_keys)
    assert [f"tokens={n}," in row for n, row in zip((32, 4, 1), report)] == [True] * 3, report
    assert runner.cache.sealed and runner.stats.unplanned_builds == 0
    # Every capture counted, the sampler's too (the cache alone counts only its own entries).
    assert runner.stats.compiles == runner.executor.build_count == len(keys) + len(sampler_keys)


def test_stats_dict_reports_the_builds_and_eager_builds_none(runners):
    """``runner.stats.compiles`` (the executor's builds: a torch graph backend's captures, one
    capture report row each) is what the dict for logs says too; on eager nothing is built."""
    graph, eager = runners["cpu[1,4,32]"], runners["eager"]
    assert graph.stats.as_dict()["compiles"] == len(graph.executor.builder.report) > 0
    assert eager.executor.builder is None and eager.stats.compiles == 0


# ---- the sampler ---------------------------------------------------------------------------

SAMPLER_RUNNERS = ["cpu[8]", "eager"]


@pytest.mark.parametrize("name", SAMPLER_RUNNERS)
def test_greedy_is_argmax_of_logits(runners, tables, name):
    runner = runners[name]
    hits = runner.sampler_cache.stats.hits
    for rows, computed, scheduled in STEPS:
        step = tables.step(rows, computed, scheduled)
        tokens = step.run(runner, greedy(step.num_reqs))
        np.testing.assert_array_equal(tokens, runner.outputs.logits().argmax(axis=-1))
    if name.startswith("cpu"):
        assert runner.sampler_cache.stats.hits == hits + len(STEPS)   # the sampler graph ran


def run_request(runner, tables, params: dict[int, SamplingParams], ids: dict[int, int],
                prompt: int = 5, decodes: int = 4) -> dict[int, list[int]]:
    """Prefill ``prompt`` tokens in every listed row, then ``decodes`` decode steps, sampling
    each step with the rows' params; returns each request id's sampled tokens."""
    rows = list(params)
    out = {ids[row]: [] for row in rows}
    runner.executor.kv_cache.zero_()
    for i in range(decodes + 1):
        computed = [0 if i == 0 else prompt + i - 1] * len(rows)
        scheduled = [prompt if i == 0 else 1] * len(rows)
        batch = sampling_batch([params[row] for row in rows], [ids[row] for row in rows], VOCAB)
        tokens = tables.step(rows, computed, scheduled).run(runner, batch)
        for row, tok in zip(rows, tokens):
            out[ids[row]].append(int(tok))
    for row in rows:
        runner.free_request(ids[row])
    return out


@pytest.mark.parametrize("name", SAMPLER_RUNNERS)
def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(runners, tables, name):
    runner = runners[name]
    seeded = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=1234)
    alone = run_request(runner, tables, {0: seeded}, {0: 7})
    again = run_request(runner, tables, {0: seeded}, {0: 99})   # another request id, same seed
    assert again[99] == alone[7]
    companions = {3: SamplingParams(temperature=0.7, seed=5), 0: seeded,
                  5: SamplingParams(temperature=1.3, top_p=0.5), 6: SamplingParams()}
    batched = run_request(runner, tables, companions, {3: 1, 0: 7, 5: 2, 6: 3})
    assert batched[7] == alone[7]
    others = [run_request(runner, tables, {0: SamplingParams(temperature=1.0, seed=s)}, {0: 7})[7]
              for s in range(4)]
    assert len({tuple(o) for o in others}) > 1, "different seeds gave the same samples"


@pytest.mark.parametrize("name", SAMPLER_RUNNERS)
def test_top_k_one_is_greedy_and_samples_stay_in_the_allowed_set(runners, tables, name):
    runner = runners[name]
    step = tables.step([0, 1, 2, 3, 4], [0, 0, 0, 0, 0], [3, 2, 4, 1, 5])
    top1 = [SamplingParams(temperature=1.0, top_k=1)] * 5
    tokens = step.run(runner, sampling_batch(top1, range(5), VOCAB))
    np.testing.assert_array_equal(tokens, runner.outputs.logits().argmax(axis=-1))
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=2.0, top_k=3),
              SamplingParams(temperature=1.0, top_p=0.3), SamplingParams(temperature=0.5, top_k=5, top_p=0.5),
              SamplingParams(temperature=1.0, top_k=4)]
    for seed in range(6):
        batch = sampling_batch([dataclasses.replace(p, seed=100 * seed + i) for i, p in enumerate(params)],
                               range(10 + 5 * seed, 15 + 5 * seed), VOCAB)
        tokens = step.run(runner, batch)
        logits = runner.outputs.logits().copy()
        for i, (tok, p) in enumerate(zip(tokens, params)):
            allowed = allowed_tokens(logits[i], p.temperature, VOCAB if p.top_k < 0 else p.top_k, p.top_p)
            assert allowed[tok], f"row {i}: token {tok} outside top_k={p.top_k} / top_p={p.top_p}"


#: Float32 ulps within which two probabilities are a tie for :func:`allowed_tokens`.
TIE_ULPS = 4


def allowed_tokens(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                   slack: float = 1e-4) -> np.ndarray:
    """Tokens a correct top-k / top-p sampler may return (ties resolved permissively).

    A token is allowed if its float32 probability is at least the k-th largest (the sampler
    selects on float32 probabilities: logits closer than exp's float32 resolution, e.g. a
    denormal 2.5e-42 against 0.0, are a tie; and numpy's and torch's float32 exp may round one
    ulp apart, so probabilities within ``TIE_ULPS`` float32 ulps of the k-th are ties too), and the
    probability mass (over the top-k set)
    of tokens strictly more likely than it is below ``top_p`` (plus ``slack`` for float32
    cumulative sums).
    """
    logits = np.asarray(logits, dtype=np.float32)
    if temperature < 1e-5:
        return logits == logits.max()
    scaled = logits / np.float32(max(temperature, 1e-5))
    p32 = np.exp(scaled - scaled.max())
    kth = np.sort(p32)[::-1][min(max(top_k, 1), scaled.shape[0]) - 1]
    in_k = p32 >= kth * np.float32(1 - TIE_ULPS * 2.0 ** -24)
    s = scaled.astype(np.float64)
    p = np.where(in_k, np.exp(s - s.max()), 0.0)
    p /= p.sum()
    tie = np.float32(1 - TIE_ULPS * 2.0 ** -24)
    greater = np.array([p[p32 * tie > v].sum() for v in p32])      # strictly more likely, ties aside
    return in_k & (greater < top_p + slack)


@st.composite
def sampler_inputs(draw):
    n = draw(st.integers(1, 4))
    vocab = draw(st.integers(1, 48))
    logits = draw(hnp.arrays(np.float32, (n, vocab),
                             elements=st.floats(-30, 30, width=32) | st.sampled_from([0.0, 1.0])))
    temperature = draw(hnp.arrays(np.float32, (n,),
                                  elements=st.sampled_from([0.0, 1.0]) | st.floats(0.0625, 4.0, width=32)))
    top_k = draw(hnp.arrays(np.int64, (n,), elements=st.integers(1, vocab)))
    top_p = draw(hnp.arrays(np.float32, (n,),
                            elements=st.sampled_from([1.0]) | st.floats(0.015625, 1.0, width=32)))
    seed = draw(st.integers(0, 2**31 - 1))
    return logits, temperature, top_k, top_p, seed


@settings(max_examples=examples(200), deadline=None)
@given(sampler_inputs())
@example((np.array([[2.472e-42, 0.0]], np.float32), np.array([1.0], np.float32), np.array([1]),
          np.array([1.0], np.float32), 0))      # equal float32 probabilities: a tie, either token
def test_random_sample_stays_inside_top_k_and_top_p(inputs):
    logits, temperature, top_k, top_p, seed = inputs
    n, vocab = logits.shape
    noise = torch.empty(n, vocab).exponential_(generator=torch.Generator().manual_seed(seed))
    out = random_sample(torch.from_numpy(logits), torch.from_numpy(temperature), torch.from_numpy(top_k),
                        torch.from_numpy(top_p), noise)
    assert out.shape == (n,) and out.dtype == torch.int64
    for i in range(n):
        allowed = allowed_tokens(logits[i], float(temperature[i]), int(top_k[i]), float(top_p[i]))
        tok = int(out[i])
        assert 0 <= tok < vocab and allowed[tok], (
            f"row {i}: sampled {tok} outside the allowed set {np.flatnonzero(allowed).tolist()} "
            f"(T={temperature[i]}, top_k={top_k[i]}, top_p={top_p[i]})")


# ---- bad input -------------------------------------------------------------------------

GOOD = ([0, 1, 2], [0, 0, 0], [3, 2, 4])


def bad_step(tables, kind: str, num_kv_blocks: int) -> BadStep:
    """GOOD with one bad input, as the kit's :class:`BadStep`: the field the error must name
    and a fragment of its text."""
    step = tables.step(*GOOD)
    if kind == "token id out of vocabulary":
        tokens = tables.token_ids.copy()
        tokens[1, 1] = VOCAB
        step.overrides["token_ids"] = tokens
        return BadStep(step, "token_ids", kind, message=f"token id {VOCAB} outside the vocabulary [0, {VOCAB})")
    if kind == "negative token id":
        tokens = tables.token_ids.copy()
        tokens[2, 0] = -3
        step.overrides["token_ids"] = tokens
        return BadStep(step, "token_ids", kind, message="token id -3 outside the vocabulary")
    if kind == "block id beyond the cache":
        blocks = tables.block_table.copy()
        blocks[2, 0] = num_kv_blocks
        step.overrides["block_table"] = blocks
        return BadStep(step, "block_table", kind,
                       message=f"block {num_kv_blocks} is outside the KV cache's {num_kv_blocks} blocks")
    if kind == "wrong block-table width":
        step.overrides["block_table"] = tables.block_table[:, :-1].copy()
        return BadStep(step, "block_table", kind, message=f"{CONFIG.max_blocks_per_req - 1} columns")
    if kind == "null block in a scheduled slot":
        blocks = tables.block_table.copy()
        blocks[0, 0] = 0
        step.overrides["block_table"] = blocks
        return BadStep(step, "block_table", kind, message="null block")
    if kind == "sampling rows mismatch":
        return BadStep(step, "sampling", kind, sampling_rows=2, message="2 rows for 3 requests")
    raise AssertionError(kind)


BAD_KINDS = ["token id out of vocabulary", "negative token id", "block id beyond the cache",
             "wrong block-table width", "null block in a scheduled slot", "sampling rows mismatch"]


@pytest.mark.parametrize("name", ["cpu[8]", "eager"])
def test_bad_input_raises_and_touches_nothing(runners, tables, name):
    """Each bad step through the kit's ``bad_input_rejected`` (an InputError naming the field
    and saying what is wrong, nothing on the device or host side changed), then the runner
    keeps working: the good step again gives the same result."""
    assert issubclass(InputError, ValueError) and issubclass(InputError, graphrt.GraphrtError)
    runner = runners[name]
    fill_kv(runner, seed=4, poison=False)
    good = tables.step(*GOOD)
    first = good.run(runner, greedy(3)), runner.outputs.logits().copy()
    for kind in BAD_KINDS:
        bad_input_rejected(lambda: runner, bad_step(tables, kind, runner.num_kv_blocks))
        tokens = good.run(runner, greedy(3))
        np.testing.assert_array_equal(tokens, first[0])
        np.testing.assert_array_equal(runner.outputs.logits(), first[1])


def test_sampling_rows_must_match_even_when_all_greedy(runners, tables):
    """SamplingBatch rows must match the step's requests even when all greedy."""
    runner = runners["cpu[8]"]
    step = tables.step(*GOOD)
    batch = SamplingBatch(np.zeros(4, np.float32), np.full(4, VOCAB, np.int64), np.ones(4, np.float32),
                          [None] * 4, [0, 1, 2, 3])
    before = access.device_state(runner)
    with pytest.raises(InputError, match="sampling: 4 rows for 3 requests"):
        step.run(runner, batch)
    assert access.changed(before, access.device_state(runner)) == []


# ---- results the caller holds ----------------------------------------------------------------

# A regression test: on CPU backends ``.cpu()`` is a no-op, so ``TorchExecutor.sample`` used to
# return a view of the sampler's static ``tokens`` buffer and the next step overwrote a result the
# caller still held. It now returns a copy there.
@pytest.mark.parametrize("name", ["cpu[8]", "eager"])
def test_execute_result_is_not_overwritten_by_the_next_step(runners, tables, name):
    runner = runners[name]
    first = tables.step([0, 1], [0, 0], [3, 2])
    second = tables.step([4, 5], [0, 0], [2, 3])
    expected_first, expected_second = first.run(runner, greedy(2)), second.run(runner, greedy(2))
    assert not np.array_equal(expected_first, expected_second)     # the two steps sample differently
    held = runner.execute(**first.kwargs(), sampling=greedy(2))
    np.testing.assert_array_equal(held, expected_first)
    runner.execute(**second.kwargs(), sampling=greedy(2))
    np.testing.assert_array_equal(held, expected_first)             # not the second step's tokens


# ---- the two host kernels ---------------------------------------------------------------------

def test_host_kernels_agree_through_the_runner(model_dir, tables):
    """numba and numpy input preparation feed the same staging buffers, step after step
    (captured buckets, padding, eager steps above the largest bucket)."""
    if graphrt.core.inputs.host_kernels.resolve_kernel("auto") != "numba":
        pytest.skip("numba does not import here")
    pair = {kernel: make_runner(model_dir, "cpu", [8], tables, mode=None, host_kernel=kernel)
            for kernel in ("numba", "numpy")}
    assert [r.preparer.kernel for r in pair.values()] == ["numba", "numpy"]
    from support.runner_steps import random_steps
    for step in random_steps(tables, CONFIG, num_steps=16, seed=5):
        seen = []
        for runner in pair.values():
            tokens = step.run(runner, greedy(step.num_reqs))
            staged = {name: buf.copy() for name, buf in runner.executor.host_buffers.items()}
            seen.append((tokens, staged, runner.last_step.key, runner.outputs.logits()))
        (tok_a, staged_a, key_a, logits_a), (tok_b, staged_b, key_b, logits_b) = seen
        assert key_a == key_b
        np.testing.assert_array_equal(tok_a, tok_b)
        np.testing.assert_array_equal(logits_a, logits_b)
        for name in staged_a:
            np.testing.assert_array_equal(staged_a[name], staged_b[name], err_msg=name)
