"""Context buckets (issue 23): a step's attention cost follows its longest request, not
``max_model_len``.

graphrt's reference kernels attend over every column of the block table they are given, so
the executor narrows the table to a context length: in a FULL graph the key's context bucket
(a key field, ``BatchDescriptor.max_seq_len``), in an eager step or between PIECEWISE pieces
the step's own longest request. Kernels that read every length on the device (Triton) key
nothing.

* the dispatcher's keys: FULL keys once per context bucket (graph backends up to
  ``DEFAULT_MAX_GRAPH_CONTEXT``, longer steps PIECEWISE or eager; XLA up to max_model_len),
  every dispatched FULL key holding the step's longest request (hypothesis);
* end to end on cpu and xla: steps at short and long contexts give the unpadded eager
  reference's logits, under the keys they should, and the block table each forward reads is
  as wide as its context.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from graphrt import GraphConfig, GraphMode, ModelRunner, RuntimeMode, tolerance
from graphrt.core import defaults
from graphrt.core.eager import EagerCause
from support.hf_models import tiny_hf_model_dir
from support.fast_subset import examples

BS = 16
LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=1024, block_size=BS)
WIDTH = LIMITS["max_model_len"] // BS


def test_graph_keys_carry_context_buckets_up_to_the_graph_limit():
    cfg = GraphConfig.create(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=8192)
    d = cfg.graph_dispatcher(GraphMode.FULL_AND_PIECEWISE, keyed_context=True)
    assert d.context_sizes == (defaults.DEFAULT_MIN_CONTEXT_BUCKET, defaults.DEFAULT_MAX_GRAPH_CONTEXT) == (256, 512)
    full = [k for m, k in d.keys() if m is RuntimeMode.FULL]
    assert full and {k.max_seq_len for k in full} == {256, 512}
    assert all(k.max_seq_len is None for m, k in d.keys() if m is RuntimeMode.PIECEWISE)
    short = d.dispatch(3, 3, True, 0, d.context_bucket(300))
    assert short.mode is RuntimeMode.FULL and short.key.max_seq_len == 512 and short.key.num_reqs == 4
    assert d.dispatch(3, 3, True, 0, d.context_bucket(100)).key.max_seq_len == 256
    long = d.dispatch(3, 3, True, 0, d.context_bucket(600))            # above the graphs' contexts
    assert d.context_bucket(600) == -1 and long.mode is RuntimeMode.PIECEWISE
    eager = cfg.graph_dispatcher(GraphMode.FULL, keyed_context=True).dispatch(3, 3, True, 0, -1)
    assert eager.mode is RuntimeMode.NONE and eager.cause is EagerCause.ABOVE_LARGEST_CONTEXT
    assert "context bucket" in eager.reason
    plain = cfg.graph_dispatcher(GraphMode.FULL_AND_PIECEWISE)           # a kernel that keys nothing
    assert plain.context_sizes == () and all(k.max_seq_len is None for _, k in plain.keys())
    assert len(full) == 2 * len([k for m, k in plain.keys() if m is RuntimeMode.FULL])


def test_the_buckets_stop_at_max_model_len_and_can_be_given():
    small = GraphConfig.create(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=300)
    assert tuple(small.context_policy(largest=512)) == (256, 300)
    assert tuple(small.context_policy(growth=4)) == (256, 300)
    assert tuple(GraphConfig.create(max_model_len=64).context_policy(largest=512)) == (64,)
    given_ = GraphConfig.create(max_model_len=8192, context_buckets=[128, 1024, 4096])
    assert tuple(given_.context_policy()) == (128, 1024, 4096, 8192)                 # XLA: max_model_len too
    assert tuple(given_.context_policy(largest=2048)) == (128, 1024)
    with pytest.raises(Exception, match="context_buckets"):
        GraphConfig.create(context_buckets=[0, 64])


@settings(max_examples=examples(150), deadline=None)
@given(st.integers(1, 16), st.integers(16, 256), st.sampled_from([64, 300, 2048, 40000]),
       st.sampled_from(list(GraphMode)), st.data())
def test_every_dispatched_full_key_holds_the_steps_longest_request(seqs, tokens, max_len, mode, data):
    cfg = GraphConfig.create(max_num_seqs=seqs, max_num_batched_tokens=max(tokens, seqs), max_model_len=max_len)
    d = cfg.graph_dispatcher(mode, keyed_context=True)
    keys = set(d.keys())
    r = data.draw(st.integers(1, seqs))
    longest = data.draw(st.integers(1, max_len))
    res = d.dispatch(r, r, True, 0, d.context_bucket(longest))
    if res.mode is RuntimeMode.FULL:
        assert (res.mode, res.key) in keys and res.key.max_seq_len >= longest
        assert res.key.max_seq_len <= max(2 * longest, defaults.DEFAULT_MIN_CONTEXT_BUCKET)
    else:
        assert res.key.max_seq_len is None
        assert (longest > min(max_len, defaults.DEFAULT_MAX_GRAPH_CONTEXT) or mode is not GraphMode.FULL
                or res.cause in (EagerCause.ABOVE_LARGEST_BUCKET, EagerCause.ABOVE_LARGEST_CONTEXT))


# ---- end to end ---------------------------------------------------------------------------

def _tables(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 128, size=(LIMITS["max_num_seqs"], LIMITS["max_model_len"]), dtype=np.int32)
    blocks = (rng.permutation(LIMITS["max_num_seqs"] * WIDTH) + 1).astype(np.int32).reshape(-1, WIDTH)
    return tokens, blocks


def _runner(backend: str, **kw) -> ModelRunner:
    return ModelRunner(str(tiny_hf_model_dir("qwen3", max_position_embeddings=2048)), backend=backend, progress=False,
                       num_kv_blocks=LIMITS["max_num_seqs"] * WIDTH + 1, **{**LIMITS, **kw})


def _step(runner: ModelRunner, tokens: np.ndarray, blocks: np.ndarray, computed: list[int],
          scheduled: list[int]) -> np.ndarray:
    n = len(computed)
    runner.execute(token_ids=tokens, block_table=blocks, req_rows=np.arange(n, dtype=np.int32),
                   num_computed_tokens=np.asarray(computed, np.int32),
                   num_scheduled_tokens=np.asarray(scheduled, np.int32))
    return runner.outputs.logits()


def _widths(monkeypatch: pytest.MonkeyPatch, runner: ModelRunner) -> list[int]:
    """Record the block-table width of every metadata the executor builds from now on."""
    seen: list[int] = []
    build = runner.executor.fwd.metadata

    def spy(num_tokens, num_reqs, host):
        meta = build(num_tokens, num_reqs, host)
        seen.append(int(meta.block_table.shape[1]))
        return meta
    monkeypatch.setattr(runner.executor.fwd, "metadata", spy)
    return seen


@settings(max_examples=examples(100), deadline=None)
@given(buckets=st.lists(st.integers(1, 600), min_size=0, max_size=4, unique=True), swap_at=st.integers(0, 30),
       data=st.data())
def test_the_remembered_context_bucket_is_always_the_dispatchers(buckets, swap_at, data):
    """``ServingKeys.context`` remembers the last bucket with its range (issue 44): whatever the
    lengths, each step gets ``Dispatcher.context_bucket``'s answer, across a served dispatcher
    with other buckets (or none) too."""
    from graphrt.runner.keys import ServingKeys

    cfg = GraphConfig.create(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=4096,
                             **({"context_buckets": sorted(buckets)} if buckets else {}))
    first = cfg.graph_dispatcher(GraphMode.FULL_AND_PIECEWISE, keyed_context=bool(buckets))
    second = cfg.graph_dispatcher(GraphMode.FULL_AND_PIECEWISE, keyed_context=not buckets)
    keys = ServingKeys(first, strict=False)
    edges = sorted({e + d for e in (*first.context_sizes, *second.context_sizes, 256, 512) for d in (-1, 0, 1)})
    lengths = data.draw(st.lists(st.one_of(st.integers(0, 5000), st.sampled_from(edges)), min_size=1, max_size=30))
    for i, n in enumerate(lengths):
        if i == swap_at:
            keys.serve(second)
        assert keys.context(n) == keys.dispatcher.context_bucket(n), (n, keys.dispatcher.context_sizes)


def test_cpu_graphs_and_eager_steps_attend_over_their_context(monkeypatch):
    tokens, blocks = _tables()
    graph, ref = _runner("cpu"), _runner("eager")
    assert graph.executor.capabilities.keyed_host_values == ("max_seq_len",) and graph.dispatcher.context_sizes == (256, 512)
    seen = _widths(monkeypatch, graph)
    tol = tolerance("float32")
    # a short decode: FULL at context 256 (16 blocks of 16, not the table's 64)
    for computed, scheduled in [([0, 0], [30, 2]), ([30, 2], [1, 1])]:
        got, want = _step(graph, tokens, blocks, computed, scheduled), _step(ref, tokens, blocks, computed, scheduled)
        np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=tol.atol)
    assert graph.last_step.mode is RuntimeMode.FULL and graph.last_step.key.max_seq_len == 256
    # a request grown past the graphs' 512: its decode runs PIECEWISE, attention at its own length
    computed = 0
    while computed < 640:
        _step(graph, tokens, blocks, [computed], [32])
        _step(ref, tokens, blocks, [computed], [32])
        computed += 32
    seen.clear()
    got, want = _step(graph, tokens, blocks, [computed], [1]), _step(ref, tokens, blocks, [computed], [1])
    np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=tol.atol)
    assert graph.last_step.mode is RuntimeMode.PIECEWISE and seen == [-(-(computed + 1) // BS)]
    assert graph.stats.misses == 0


def test_the_eager_backend_reads_only_the_blocks_a_step_fills(monkeypatch):
    tokens, blocks = _tables(1)
    ref = _runner("eager")
    seen = _widths(monkeypatch, ref)
    _step(ref, tokens, blocks, [0, 0], [20, 3])
    assert seen == [2]                                 # 20 tokens: 2 blocks of 16, not 64


def test_xla_keys_each_context_bucket_and_matches_eager():
    pytest.importorskip("jax")
    tokens, blocks = _tables(2)
    xla = _runner("xla", precompile_token_paddings=[32], precompile_bs_paddings=[4])
    ref = _runner("eager")
    assert xla.dispatcher.context_sizes == (256, 1024)
    assert {k.max_seq_len for _, k in xla.dispatcher.keys()} == {256, 1024}
    tol = tolerance("float32")
    computed = 0
    contexts = []
    while computed < 320:                       # past the first bucket
        got = _step(xla, tokens, blocks, [computed], [32])
        np.testing.assert_allclose(got, _step(ref, tokens, blocks, [computed], [32]), rtol=tol.rtol, atol=tol.atol)
        contexts.append(xla.last_step.key.max_seq_len)
        computed += 32
    assert contexts[0] == 256 and contexts[-1] == 1024 and xla.stats.unplanned_builds == 0
