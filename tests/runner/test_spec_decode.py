"""Speculative-decoding graphs: ``num_speculative_tokens = k`` makes a uniform decode step one
where every request schedules ``1 + k`` tokens (its last sampled token and ``k`` drafts).

* Keys: decode keys hold ``b`` requests and ``b * (1 + k)`` tokens; the largest decode batch
  the token buckets hold is always a key, even off the grid of multiples (vllm-ascend #16623);
  a hypothesis property over random bucket lists, ``k`` and ``max_num_seqs``.
* Parity through a draft-free runner path (the drafts are the reference's own greedy tokens,
  so no draft model is needed): a verification step's position logits equal the same tokens
  decoded one at a time by a ``k = 0`` runner (within ``graphrt.tolerance``, the same greedy
  tokens: every draft accepted), in every graph mode, on ``cpu``, ``eager`` and ``xla``;
  PIECEWISE pads a verification step to token buckets that are not multiples of ``1 + k``
  (vLLM #46324 crashed there); a replay is bit-identical to eager at its padded shape.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrt import ConfigError, GraphConfig, ModelRunner, RuntimeMode
from graphrt.backends.xla.buckets import XlaBuckets
from graphrt.core.buckets import BucketPolicy
from graphrt.core.dispatch import BatchDescriptor, Dispatcher
from graphrt.core.graph_modes import GraphMode
from graphrt.core.inputs.preparer import InputPreparer
from support.hf_models import tiny_hf_model_dir
from support.parity import assert_bitwise, assert_close_across_shapes, assert_same_tokens, pad_like
from support.fast_subset import examples, slow_except

K = 2
Q = 1 + K
LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32, block_size=4)
#: The keys' context bucket (cpu's and xla's reference kernels key it): one, max_model_len.
CTX = LIMITS["max_model_len"]
SIZES = [4, 16]                     # not multiples of Q: decode keys derive their own (3 and 12
                                    # tokens); 9-token steps pad to 16 (each size is one capture)
ROWS, WIDTH = 4, 8
PROMPTS = (7, 5, 10)                 # prompt lengths of the three requests


# ---------------------------------------------------------------------------------- keys

@settings(max_examples=examples(200), deadline=None)
@given(sizes=st.lists(st.integers(1, 96), min_size=1, max_size=8),
       k=st.integers(0, 5), max_num_seqs=st.integers(1, 40))
def test_decode_keys_are_multiples_of_the_query_len_and_cover_every_decode_batch(sizes, k, max_num_seqs):
    q = 1 + k
    policy = BucketPolicy(sizes)
    d = Dispatcher(GraphMode.FULL_AND_PIECEWISE, token_buckets=policy, max_num_seqs=max_num_seqs,
                   decode_query_len=q)
    decode = [key for _, key in d.keys() if key.uniform_decode]
    for key in decode:
        assert key.num_tokens == key.num_reqs * q and key.num_tokens <= policy.max_size
        assert key.num_reqs <= max_num_seqs
    top = min(max_num_seqs, policy.max_size // q)
    for r in range(1, top + 1):           # every decode batch the token buckets can hold
        got = d.dispatch(r * q, r, True)
        assert got.mode is RuntimeMode.FULL and got.key in decode and got.key.num_reqs >= r, (r, got)
    if top >= 1:
        assert BatchDescriptor(top * q, top, True) in decode   # the largest batch, on or off the grid


def test_the_largest_decode_batch_is_captured_off_the_grid():
    """vllm-ascend #16623: 64 tokens, 3 per request: 21 requests (63 tokens) must be a key."""
    d = Dispatcher(GraphMode.FULL_DECODE_ONLY, token_buckets=BucketPolicy([1, 2, 4, 8, 16, 32, 64]),
                   max_num_seqs=32, decode_query_len=3)
    keys = {key for _, key in d.keys()}
    assert BatchDescriptor(63, 21, True) in keys
    assert d.dispatch(60, 20, True).key == BatchDescriptor(63, 21, True)
    assert {key.num_reqs for key in keys} == {1, 2, 5, 10, 21}


def test_uniform_means_every_request_schedules_the_query_len():
    prep = InputPreparer(max_num_reqs=4, max_num_tokens=32, block_size=4, decode_query_len=Q)
    tokens = np.zeros((4, 32), np.int32)
    table = (np.arange(32, dtype=np.int32) + 1).reshape(4, 8)
    for scheduled, uniform in (([3, 3], True), ([1, 1], False), ([3, 1], False), ([2, 4], False), ([3], True)):
        n = len(scheduled)
        shape = prep.check(token_ids=tokens, block_table=table, req_rows=np.arange(n),
                           num_computed_tokens=np.full(n, 4), num_scheduled_tokens=np.array(scheduled))
        assert shape.uniform_decode is uniform, scheduled


def test_config_rejects_a_query_len_above_the_token_budget():
    with pytest.raises(ConfigError, match="num_speculative_tokens=8"):
        GraphConfig.create(max_num_seqs=2, max_num_batched_tokens=8, num_speculative_tokens=8)
    cfg = GraphConfig.create(max_num_seqs=8, max_num_batched_tokens=16, num_speculative_tokens=3)
    assert (cfg.decode_query_len, cfg.max_decode_batch) == (4, 4)
    assert max(k.num_reqs for _, k in XlaBuckets.from_config(cfg).dispatcher().keys() if k.uniform_decode) == 4


UNIFORM_MODES = (GraphMode.FULL, GraphMode.FULL_DECODE_ONLY, GraphMode.FULL_AND_PIECEWISE)


def test_the_configured_largest_decode_batch_is_captured_by_default():
    """Issue 26: 12 requests verifying 2 drafts each (36 tokens) had no FULL key; 8 was the largest."""
    cfg = GraphConfig.create(max_num_seqs=12, max_num_batched_tokens=96, max_model_len=256,
                             num_speculative_tokens=2)
    assert cfg.max_decode_batch == 12
    assert all(s % 3 == 0 for s in cfg.capture_policy())          # multiples of 1 + k
    for mode in UNIFORM_MODES:
        d = cfg.graph_dispatcher(mode)
        got = d.dispatch(36, 12, True)
        assert got.mode is RuntimeMode.FULL and (got.mode, got.key) in d.keys(), (mode, got)
    decode = {k.num_reqs for _, k in cfg.graph_dispatcher(GraphMode.FULL_AND_PIECEWISE).keys() if k.uniform_decode}
    assert decode == {1, 2, 4, 8, 12}


def _decode_limits():
    """(max_num_seqs, k, max_num_batched_tokens): the token budget holds at least one decode request."""
    return st.tuples(st.integers(1, 640), st.integers(0, 6)).flatmap(
        lambda sk: st.tuples(st.just(sk[0]), st.just(sk[1]),
                             st.integers(max(sk[0], 1 + sk[1]), max(sk[0], 1 + sk[1]) * 8)))


@settings(max_examples=examples(60), deadline=None)
@given(_decode_limits())
def test_every_decode_batch_up_to_the_largest_has_a_full_graph_by_default(limits):
    """Default capture sizes: every uniform decode step of 1 .. max_decode_batch requests runs a
    FULL graph warm-up built (no eager, no PIECEWISE), in every mode with uniform keys and on XLA."""
    seqs, k, tokens = limits
    cfg = GraphConfig.create(max_num_seqs=seqs, max_num_batched_tokens=tokens, num_speculative_tokens=k)
    q, top = 1 + k, cfg.max_decode_batch
    assert top == min(seqs, tokens // q) >= 1
    for d in [cfg.graph_dispatcher(m) for m in UNIFORM_MODES] + [XlaBuckets.from_config(cfg).dispatcher()]:
        built = set(d.keys())                 # what warm-up captures / compiles
        for r in range(1, top + 1):
            got = d.dispatch(r * q, r, True)
            assert got.mode is RuntimeMode.FULL and (got.mode, got.key) in built, (d.mode, r, got)
            assert got.key.num_tokens >= r * q and (got.key.num_reqs or r) >= r


# ------------------------------------------------------------------------------- parity

def tables() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 128, size=(ROWS, LIMITS["max_model_len"]), dtype=np.int32)
    blocks = (rng.permutation(ROWS * WIDTH) + 1).astype(np.int32).reshape(ROWS, WIDTH)
    return tokens, blocks


def runner(backend: str, k: int, **overrides) -> ModelRunner:
    sizes = {} if backend == "xla" else {"cudagraph_capture_sizes": SIZES}
    return ModelRunner(str(tiny_hf_model_dir("qwen3")), backend=backend, num_kv_blocks=ROWS * WIDTH + 1,
                       progress=False, num_speculative_tokens=k, **{**LIMITS, **sizes, **overrides})


def execute(r: ModelRunner, tokens, blocks, rows, computed, scheduled) -> None:
    r.execute(token_ids=tokens, block_table=blocks, req_rows=np.asarray(rows), num_computed_tokens=np.asarray(computed),
              num_scheduled_tokens=np.asarray(scheduled))


@functools.lru_cache(maxsize=1)
def _reference() -> tuple[np.ndarray, np.ndarray]:
    """:func:`reference` on :func:`tables`, computed once per module (eager and deterministic;
    callers get copies)."""
    return reference(*tables())


def reference_on_tables() -> tuple[np.ndarray, np.ndarray]:
    tokens, out = _reference()
    return tokens.copy(), out.copy()


def reference(tokens: np.ndarray, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eager, k = 0: prefill each prompt, then decode Q tokens one at a time; the token
    table's positions after each prompt hold the greedy continuation (so every draft of a
    verification step is what the target would sample). Returns the tokens and, per
    request, the logits after each of its Q decoded positions ``[R, Q, V]``."""
    ref = runner("eager", 0)
    tokens = tokens.copy()
    n = len(PROMPTS)
    execute(ref, tokens, blocks, range(n), [0] * n, [p - 1 for p in PROMPTS])
    out = np.zeros((n, Q, ref.vocab_size), np.float32)
    for j in range(Q):
        execute(ref, tokens, blocks, range(n), [p - 1 + j for p in PROMPTS], [1] * n)
        out[:, j] = ref.outputs.logits()
        for i, p in enumerate(PROMPTS):
            if j + 1 < Q:
                tokens[i, p + j] = out[i, j].argmax()     # the next draft: the greedy token
    return tokens, out


def verify(r: ModelRunner, tokens: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Prefill the prompts but their last token, then one verification step: each request's
    last prompt token and its K drafts."""
    n = len(PROMPTS)
    execute(r, tokens, blocks, range(n), [0] * n, [p - 1 for p in PROMPTS])
    execute(r, tokens, blocks, range(n), [p - 1 for p in PROMPTS], [Q] * n)
    return r.outputs.position_logits()


MODES = ["FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "PIECEWISE"]


@pytest.mark.parametrize("backend,mode", slow_except([("cpu", m) for m in MODES] + [("eager", None), ("xla", None)],
                                                      ("cpu", "FULL_AND_PIECEWISE")))
def test_verification_equals_decoding_one_token_at_a_time(backend, mode):
    tokens, want = reference_on_tables()
    blocks = tables()[1]
    r = runner(backend, K, **({"mode": mode} if mode else {}))
    got = verify(r, tokens, blocks)
    info = r.last_step
    assert got.shape == want.shape
    assert_close_across_shapes(got, want, err_msg=f"{backend} {mode} {info.mode.value} {info.key}")
    assert_same_tokens(got, want)
    drafts = np.stack([tokens[i, p:p + K] for i, p in enumerate(PROMPTS)])
    assert np.array_equal(got[:, :K].argmax(-1), drafts)          # every draft accepted
    assert np.array_equal(r.outputs.logits(), got[:, -1])                 # the sampled row is the last one
    if backend == "eager":
        assert info.mode is RuntimeMode.NONE
    elif mode == "PIECEWISE":     # 9 tokens padded to the 16-token bucket: not a multiple of Q
        assert info.mode is RuntimeMode.PIECEWISE and info.key.num_tokens == 16
    elif mode == "FULL":          # one graph family for every step: the 16-token mixed key
        assert info.mode is RuntimeMode.FULL and info.key == BatchDescriptor(16, 4, False, max_seq_len=CTX)
    else:                         # 3 requests: the decode key of 4 requests, 12 tokens
        assert info.mode is RuntimeMode.FULL and info.key == BatchDescriptor(12, 4, True, max_seq_len=CTX)
        assert r.stats.misses == 0 and r.stats.unplanned_builds == 0


@pytest.mark.parametrize("mode", slow_except(["FULL_DECODE_ONLY", "PIECEWISE"], "FULL_DECODE_ONLY"))
def test_verification_replay_is_bitwise_eager_at_its_padded_shape(mode):
    tokens, blocks = tables()
    graph = runner("cpu", K, mode=mode)
    eager = pad_like(runner("eager", K), graph)
    got, want = verify(graph, tokens, blocks), verify(eager, tokens, blocks)
    assert eager.last_step.key == graph.last_step.key
    assert_bitwise(got, want, f"{mode} {graph.last_step.key}")
    assert_bitwise(graph.executor.kv_cache, eager.executor.kv_cache, "KV cache")


def test_position_logits_need_speculative_tokens():
    r = runner("eager", 0)
    tokens, blocks = tables()
    execute(r, tokens, blocks, [0], [0], [3])
    with pytest.raises(Exception, match="num_speculative_tokens > 0"):
        r.outputs.position_logits()


@pytest.mark.parametrize("mode", slow_except(["FULL_AND_PIECEWISE", "PIECEWISE"], "FULL_AND_PIECEWISE"))
def test_the_kit_holds_with_speculative_decode_steps(mode):
    """graphrt.testing's properties with k = 2: its decode steps schedule 3 tokens per
    request, so padding, KV isolation and warm-up coverage are checked on verification keys."""
    from graphrt.testing.conformance import run_conformance

    results = run_conformance(str(tiny_hf_model_dir("qwen3")), "cpu", examples=15, mode=mode, report=None,
                              num_speculative_tokens=K,
                              properties=["padding_invisible", "kv_isolated", "no_build_after_warmup"])
    assert all(r.passed for r in results), [r.line() for r in results]
