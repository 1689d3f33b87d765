"""Sampling parameters are validated once, at construction, by one rule per field.

* ``SamplingBatch`` (a step's arrays) rejects wrong lengths, NaN / inf, out-of-range values,
  wrong types and bad seeds with an ``InputError`` naming the field and the row.
* ``SamplingParams`` (one request) applies the same rules to its scalars, plus ``max_tokens``
  (and ``logprobs`` / ``prompt_logprobs``: None or an integer >= 0).
* Through a runner (cpu and xla), every bad batch raises ``InputError`` and no byte of the KV
  cache changes; a batch whose rows differ from the step's requests is refused by ``execute``.
* A seed is honoured in full on both backends: seeds differing only above bit 32 sample
  differently, and the largest seed works.
* ``LLM`` rejects ragged, nested and non-integer prompts naming ``prompt_token_ids[i]``.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import graphrt
from graphrt import InputError, ModelRunner, SamplingParams
from graphrt.backends.base import SamplingBatch
from graphrt.core.sampling import batch as core_sampling
from graphrt.core.sampling.batch import SAMPLING_MAX_TOP_K, SAMPLING_SEED_LIMIT
from graphrt.core.sampling import batch as rules
from graphrt.runner import sampling_batch
from support.hf_models import tiny_hf_model_dir
from support.fast_subset import examples

VOCAB = 128
N = 3
SEED_LIMIT = SAMPLING_SEED_LIMIT


def batch(**change) -> SamplingBatch:
    """A good 3-row random batch with ``change`` applied to its arguments."""
    args = dict(temperature=np.array([0.7, 1.0, 0.0], np.float32), top_k=np.array([VOCAB, 5, VOCAB], np.int64),
                top_p=np.array([1.0, 0.9, 1.0], np.float32), seeds=[None, 11, None], request_ids=[7, 8, 9])
    args.update(change)
    return SamplingBatch(**args)


def f32(*values) -> np.ndarray:
    return np.array(values, np.float32)


#: (what, the batch's changed arguments, the field the error names, a fragment of its message)
BAD_BATCHES = {
    "top_k too short": (dict(top_k=np.array([VOCAB, 5], np.int64)), "top_k", "2 rows"),
    "top_p too long": (dict(top_p=f32(1, 1, 1, 1)), "top_p", "4 rows"),
    "request_ids too short": (dict(request_ids=[7, 8]), "request_ids", "2 rows"),
    "seeds too short": (dict(seeds=[None, 11]), "seeds", "2 rows"),
    "2-D temperature": (dict(temperature=np.zeros((3, 1), np.float32)), "temperature", "1-D"),
    "NaN temperature": (dict(temperature=f32(0.7, np.nan, 0.0)), "temperature[1]", "nan"),
    "negative temperature": (dict(temperature=f32(0.7, 1.0, -0.5)), "temperature[2]", "-0.5"),
    "infinite temperature": (dict(temperature=f32(np.inf, 1.0, 0.0)), "temperature[0]", "[0, 1e+06]"),
    "string temperature": (dict(temperature=np.array(["0.5", "1", "0"])), "temperature", "real number"),
    "bool temperature": (dict(temperature=np.array([True, False, True])), "temperature", "real number"),
    "NaN top_p": (dict(top_p=f32(np.nan, 0.9, 1.0)), "top_p[0]", "nan"),
    "zero top_p": (dict(top_p=f32(1.0, 0.0, 1.0)), "top_p[1]", "(0, 1]"),
    "top_p above 1": (dict(top_p=f32(1.0, 0.9, 1.5)), "top_p[2]", "(0, 1]"),
    "zero top_k": (dict(top_k=np.array([VOCAB, 0, VOCAB])), "top_k[1]", "-1 (disabled)"),
    "top_k -2": (dict(top_k=np.array([-2, 5, VOCAB])), "top_k[0]", "-1 (disabled)"),
    "top_k beyond int32": (dict(top_k=np.array([VOCAB, 5, 2**40])), "top_k[2]", str(2**40)),
    "float top_k": (dict(top_k=np.array([2.5, 5.0, 1.0])), "top_k", "integer"),
    "string seed": (dict(seeds=[None, "abc", None]), "seeds[1]", "'abc'"),
    "seed 2**70": (dict(seeds=[2**70, 11, None]), "seeds[0]", str(2**70)),
    "seed 2**64": (dict(seeds=[None, 11, SEED_LIMIT]), "seeds[2]", str(SEED_LIMIT)),
    "negative seed": (dict(seeds=[None, -1, None]), "seeds[1]", "-1"),
    "bool seed": (dict(seeds=[True, 11, None]), "seeds[0]", "True"),
    "float seed": (dict(seeds=[None, 11, 1.5]), "seeds[2]", "1.5"),
    "negative logprobs": (dict(logprobs=[None, -1, 2]), "logprobs[1]", "-1"),
    "float logprobs": (dict(logprobs=[2.5, None, None]), "logprobs[0]", "2.5"),
    "bool logprobs": (dict(logprobs=[None, None, True]), "logprobs[2]", "True"),
    "string logprobs": (dict(logprobs=["3", None, None]), "logprobs[0]", "'3'"),
    "logprobs too short": (dict(logprobs=[1, 2]), "logprobs", "2 rows"),
}


# ---- SamplingBatch ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(BAD_BATCHES))
def test_bad_sampling_batch_is_refused_at_construction(kind):
    change, field, fragment = BAD_BATCHES[kind]
    with pytest.raises(InputError) as err:
        batch(**change)
    assert err.value.field == field, f"{kind}: {err.value}"
    assert fragment in str(err.value), f"{kind}: {err.value}"


def test_good_sampling_batches_are_accepted():
    b = batch()
    assert not b.all_greedy and b.temperature.dtype == np.float32 and b.top_k.dtype == np.int64
    assert b.logprobs is None and b.max_num_logprobs is None
    b = batch(logprobs=[None, np.int64(4), 0])
    assert b.logprobs.tolist() == [-1, 4, 0] and b.max_num_logprobs == 4
    assert batch(logprobs=[None] * 3).logprobs is None, "no row asks: no logprobs"
    assert batch(temperature=np.zeros(3, np.float32)).all_greedy
    # Other real / integer dtypes, lists, -1 for a disabled top_k, numpy seeds, the largest seed.
    b = batch(temperature=[1, 0.5, 0], top_k=np.array([-1, 5, 2**31 - 1], np.int32), top_p=np.ones(3),
              seeds=[np.uint64(SEED_LIMIT - 1), 0, np.int32(4)], request_ids=np.arange(3))
    assert b.temperature.dtype == np.float32 and b.top_p.dtype == np.float32
    assert b.top_k.dtype == np.int64 and b.top_k[0] >= VOCAB, "-1 must mean the whole vocabulary"
    assert list(b.seeds) == [SEED_LIMIT - 1, 0, 4]
    assert SamplingBatch(f32(), np.zeros(0, np.int64), f32(), [], []).all_greedy


def test_a_validated_batch_is_frozen():
    b = batch()
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.top_p = f32(np.nan, 1, 1)


FLOATS = st.sampled_from([0.0, -0.0, 1.0, 0.5, 1e-45, -1e-45, 3.4e38, -1.0, 1.0000001, 2.0,
                          float("nan"), float("inf"), -float("inf")]) | st.floats(-2, 2, width=32)
INTS = st.sampled_from([-1, 0, 1, 2, -2, 2**31 - 1, 2**31, -2**63, 2**63 - 1]) | st.integers(-3, 300)


@settings(max_examples=examples(300), deadline=None)
@given(data=st.data(), n=st.integers(1, 40), list_rows=st.sampled_from([0, 16, 1000]))
def test_the_batch_fast_check_agrees_with_the_exact_rule(data, n, list_rows):
    """Whatever path takes the columns' bounds (lists or numpy), a batch is refused exactly
    when some value breaks its field's exact rule, and names the first such row."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(core_sampling, "SAMPLING_CHECK_LIST_ROWS", list_rows)
        check_batch_against_rows(data, n)


def check_batch_against_rows(data, n: int) -> None:
    t = np.array(data.draw(st.lists(FLOATS, min_size=n, max_size=n)), np.float32)
    p = np.array(data.draw(st.lists(FLOATS, min_size=n, max_size=n)), np.float32)
    k = np.array(data.draw(st.lists(INTS, min_size=n, max_size=n)), np.int64)
    bad = [(name, np.flatnonzero(~rule.rows_ok(col))) for name, rule, col in
           (("temperature", rules.TEMPERATURE, t), ("top_p", rules.TOP_P, p), ("top_k", rules.TOP_K, k))]
    bad = [(name, int(rows[0])) for name, rows in bad if rows.size]
    if not bad:
        b = SamplingBatch(t, k, p, [None] * n, list(range(n)))
        assert b.all_greedy == bool((t == 0).all())
        np.testing.assert_array_equal(b.top_k, np.where(k == -1, SAMPLING_MAX_TOP_K, k))
        return
    with pytest.raises(InputError) as err:
        SamplingBatch(t, k, p, [None] * n, list(range(n)))
    assert err.value.field == f"{bad[0][0]}[{bad[0][1]}]"


def test_sampling_batch_from_objects_that_are_not_params_names_the_row():
    good = SamplingParams(temperature=1.0)
    odd = dataclasses.make_dataclass("Odd", ["temperature", "top_p", "top_k", "seed"])("abc", 1.0, 5, None)
    with pytest.raises(InputError) as err:
        sampling_batch([good, odd], [1, 2], VOCAB)
    assert err.value.field == "temperature"   # a column of mixed types: named, not a numpy error


# ---- SamplingParams --------------------------------------------------------------------------

BAD_PARAMS = [
    ({"temperature": "0.5"}, "temperature", "real number"),
    ({"temperature": None}, "temperature", "real number"),
    ({"temperature": True}, "temperature", "real number"),
    ({"temperature": float("nan")}, "temperature", "nan"),
    ({"temperature": float("inf")}, "temperature", "[0, 1e+06]"),
    ({"temperature": -0.5}, "temperature", "[0, 1e+06]"),
    ({"top_p": float("nan")}, "top_p", "nan"),
    ({"top_p": "1"}, "top_p", "real number"),
    ({"top_k": 2.5}, "top_k", "integer"),
    ({"top_k": True}, "top_k", "integer"),
    ({"top_k": 2**31}, "top_k", str(2**31)),
    ({"top_k": 2**70}, "top_k", str(2**70)),
    ({"max_tokens": 2.5}, "max_tokens", "integer"),
    ({"max_tokens": True}, "max_tokens", "integer"),
    ({"max_tokens": "8"}, "max_tokens", "integer"),
    ({"temperature": 1.0, "seed": "abc"}, "seed", "'abc'"),
    ({"temperature": 1.0, "seed": 2**70}, "seed", str(2**70)),
    ({"temperature": 1.0, "seed": SEED_LIMIT}, "seed", str(SEED_LIMIT)),
    ({"temperature": 1.0, "seed": -1}, "seed", "-1"),
    ({"temperature": 1.0, "seed": 1.0}, "seed", "1.0"),
    ({"temperature": 1.0, "seed": False}, "seed", "False"),
    ({"ignore_eos": "no"}, "ignore_eos", "bool"),
    ({"logprobs": -1}, "logprobs", "-1"),
    ({"logprobs": 2.5}, "logprobs", "2.5"),
    ({"logprobs": True}, "logprobs", "True"),
    ({"logprobs": "3"}, "logprobs", "'3'"),
    ({"prompt_logprobs": -2}, "prompt_logprobs", "-2"),
    ({"prompt_logprobs": 1.0}, "prompt_logprobs", "1.0"),
]


@pytest.mark.parametrize("kwargs, field, fragment", BAD_PARAMS, ids=[repr(k) for k, _, _ in BAD_PARAMS])
def test_bad_sampling_params_are_refused(kwargs, field, fragment):
    with pytest.raises(InputError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field, str(err.value)
    assert fragment in str(err.value), str(err.value)


def test_good_sampling_params_are_accepted_and_normalised():
    p = SamplingParams(temperature=np.float32(0.5), top_p=1, top_k=np.int64(3), max_tokens=np.int32(4),
                       ignore_eos=np.bool_(True), seed=np.uint64(SEED_LIMIT - 1))
    assert (type(p.temperature), type(p.top_p), type(p.top_k), type(p.max_tokens), type(p.seed),
            type(p.ignore_eos)) == (float, float, int, int, int, bool)
    assert p.seed == SEED_LIMIT - 1 and p.top_k == 3 and p.max_tokens == 4
    assert SamplingParams(seed=0).seed == 0 and SamplingParams().greedy


def test_params_and_batch_share_one_rule():
    """Whatever SamplingParams accepts builds a batch; the batch refuses what it refuses."""
    largest = rules.SAMPLING_MAX_TEMPERATURE
    good = [SamplingParams(temperature=t, top_p=p, top_k=k, seed=s)
            for t, p, k, s in [(0.0, 1.0, -1, None), (1.5, 1e-6, 1, 0), (largest, 0.5, 2**31 - 1, SEED_LIMIT - 1)]]
    b = sampling_batch(good, [1, 2, 3], VOCAB)
    assert b.seeds == [None, 0, SEED_LIMIT - 1]
    for kwargs, field, _ in BAD_PARAMS:
        name = {"seed": "seeds"}.get(field, field)
        if name not in ("temperature", "top_p", "top_k", "seeds"):
            continue
        column = {"temperature": [0.5] * 3, "top_p": [1.0] * 3, "top_k": [5] * 3, "seeds": [None] * 3}
        value = kwargs[field]
        if isinstance(value, bool):
            continue   # a bool in a list of numbers becomes a number; the params refuse it
        column[name] = [column[name][0], value, column[name][2]]
        if name != "seeds":
            try:
                column[name] = np.array(column[name])
            except (ValueError, TypeError, OverflowError):
                column[name] = np.array(column[name], dtype=object)
        with pytest.raises(InputError) as err:
            SamplingBatch(column["temperature"], column["top_k"], column["top_p"], column["seeds"], [1, 2, 3])
        assert err.value.field.startswith(name), f"{kwargs}: {err.value}"


# ---- through a runner: nothing is touched ----------------------------------------------------

#: Three request slots and a 3-row sampler bucket: no other test compiles these XLA programs, so
#: this module's compiles never serve another module's from JAX's caches (that would hide
#: their compile times, which test_xla_backend.py checks).
LIMITS = dict(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=32, block_size=4)
PROMPT = 5


def _tables(runner) -> tuple[np.ndarray, np.ndarray]:
    cfg = runner.config
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(cfg.max_num_seqs, cfg.max_model_len), dtype=np.int32)
    width = cfg.max_blocks_per_req
    blocks = (1 + np.arange(cfg.max_num_seqs * width, dtype=np.int32)).reshape(cfg.max_num_seqs, width)
    return tokens, blocks


def _kv_bytes(runner) -> bytes:
    kv = runner.executor.kv_cache
    if hasattr(kv, "detach"):
        return kv.detach().cpu().numpy().tobytes()
    return np.asarray(kv).tobytes()


def _step(runner, rows, computed, scheduled, sampling):
    tokens, blocks = _tables(runner)
    out = runner.execute(token_ids=tokens, block_table=blocks, req_rows=np.asarray(rows, np.int32),
                         num_computed_tokens=np.asarray(computed, np.int32),
                         num_scheduled_tokens=np.asarray(scheduled, np.int32), sampling=sampling)
    return None if out is None else np.array(out)


@pytest.fixture(scope="module", params=["cpu", "xla"])
def runner(request):
    if request.param == "xla":
        pytest.importorskip("jax")
        kw = dict(precompile_token_paddings=[16], precompile_bs_paddings=[3])
    else:
        kw = dict(cudagraph_capture_sizes=[3, 16], mode="FULL")
    rows = LIMITS["max_num_seqs"] * (LIMITS["max_model_len"] // LIMITS["block_size"])
    return ModelRunner(str(tiny_hf_model_dir("qwen3")), backend=request.param, num_kv_blocks=rows + 1,
                       progress=False, **LIMITS, **kw)


#: Runners that have run a good step: the KV cache is in use from then on, and every bad batch
#: after it must leave it as it is.
_PRIMED: weakref.WeakSet = weakref.WeakSet()


@pytest.mark.parametrize("kind", list(BAD_BATCHES))
def test_bad_batch_through_the_runner_touches_no_kv_byte(runner, kind):
    change, field, _ = BAD_BATCHES[kind]
    if runner not in _PRIMED:    # a good step first, once per runner: KV in use
        _step(runner, [0, 1, 2], [0, 0, 0], [PROMPT] * 3, batch())
        _PRIMED.add(runner)
    before = _kv_bytes(runner)
    with pytest.raises(InputError) as err:
        _step(runner, [0, 1, 2], [PROMPT] * 3, [1, 1, 1], batch(**change))
    assert err.value.field == field
    assert _kv_bytes(runner) == before, f"{kind}: the KV cache changed"


def test_batch_rows_must_match_the_steps_requests(runner):
    _step(runner, [0, 1, 2], [0, 0, 0], [PROMPT] * 3, batch())
    before = _kv_bytes(runner)
    for rows in ([0, 1], [0]):
        with pytest.raises(InputError, match=f"sampling: 3 rows for {len(rows)} requests"):
            _step(runner, rows, [PROMPT] * len(rows), [1] * len(rows), batch())
    assert _kv_bytes(runner) == before
    tokens = _step(runner, [0, 1, 2], [PROMPT] * 3, [1, 1, 1], batch())   # and the runner still works
    assert tokens.shape == (3,)


def _seeded_tokens(runner, seed: int, request_id: int, decodes: int = 6) -> list[int]:
    """One request sampled with ``seed`` at temperature 1: prefill, then ``decodes`` decodes."""
    out = []
    for i in range(decodes + 1):
        computed, scheduled = (0, PROMPT) if i == 0 else (PROMPT + i - 1, 1)
        b = SamplingBatch(f32(1.0), np.array([VOCAB]), f32(1.0), [seed], [request_id])
        out.append(int(_step(runner, [0], [computed], [scheduled], b)[0]))
    runner.free_request(request_id)
    return out


def test_every_bit_of_a_seed_counts(runner):
    low = _seeded_tokens(runner, 7, 501)
    assert _seeded_tokens(runner, 7, 502) == low, "a seed must reproduce its samples"
    assert _seeded_tokens(runner, 7 + 2**32, 503) != low, "a seed's high 32 bits were dropped"
    assert _seeded_tokens(runner, 7 + 2**63, 504) != low, "a seed's top bit was dropped"
    top = _seeded_tokens(runner, SEED_LIMIT - 1, 505)
    assert _seeded_tokens(runner, SEED_LIMIT - 1, 506) == top


# ---- LLM prompts -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    return graphrt.LLM(str(tiny_hf_model_dir("qwen3")), backend="eager", max_num_seqs=4,
                       max_num_batched_tokens=32, max_model_len=64, block_size=4, num_kv_blocks=12)


BAD_PROMPTS = {
    "ragged nested": [[5, 6], [7]],
    "nested": [[5, 6], [7, 8]],
    "a bare token id": 5,
    "None": None,
    "strings": ["a", "b"],
    "a string": "abc",
    "mixed": [5, "6"],
    "None inside": [5, None],
    "bools": [True, False],
    "beyond int64": [2**70],
}


@pytest.mark.parametrize("kind", list(BAD_PROMPTS))
def test_bad_prompt_shape_or_type_names_the_prompt(llm, kind):
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with pytest.raises(InputError) as err:
        llm.generate([[5, 6, 7], BAD_PROMPTS[kind]], params)
    assert err.value.field == "prompt_token_ids[1]", str(err.value)
    assert not llm.has_unfinished()
    with pytest.raises(InputError) as err:
        llm.add_request(BAD_PROMPTS[kind], params)
    assert err.value.field == "prompt_token_ids", str(err.value)
    out = llm.generate([[5, 6, 7]], params)               # the engine keeps serving
    assert len(out[0].token_ids) == 2


def test_seeded_rows_need_distinct_request_ids():
    """Each seeded request has its own generator, keyed by its id: two seeded rows with one id
    would share (and advance twice) one generator. Unseeded rows may repeat ids."""
    n = 3
    args = (np.ones(n, np.float32), np.full(n, -1), np.ones(n, np.float32))
    with pytest.raises(InputError, match=r"request_ids: request id 7 is on two seeded rows"):
        SamplingBatch(*args, [1, None, 2], [7, 8, 7])
    SamplingBatch(*args, [None, None, None], [7, 7, 7])
    SamplingBatch(*args, [1, None, None], [7, 7, 7])
