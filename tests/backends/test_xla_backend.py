"""The ``xla`` backend: parity with transformers, padding invisibility, no compile after warm-up,
strict mode, pytree stability, bad input, the persistent cache and flax nnx modules.

Two engines are shared by most tests (module fixtures, compiled once): a strict Qwen3 one and a
non-strict Llama one, both with tiny bucket lists so the whole file stays well under a minute
of compiling on two CPU cores. Sharded runs live in ``test_xla_sharded.py`` (own process).
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import graphrt  # noqa: E402
from graphrt import SamplingParams  # noqa: E402
from graphrt.backends.xla.backend import XlaBackend  # noqa: E402
from graphrt.backends.xla.buckets import XlaBuckets  # noqa: E402
from graphrt.backends.xla.entries import XlaEntry, compile_report  # noqa: E402
from graphrt.backends.xla.programs import XlaModel  # noqa: E402
from graphrt.backends.xla.batch import (SamplingMetadata, XlaBatch, batch_spec,  # noqa: E402
                                        describe_change, signature)
from graphrt.backends.xla.compile import CompileCounter  # noqa: E402
from graphrt.core.buckets import BucketPolicy  # noqa: E402
from graphrt.core.dispatch import BatchDescriptor, Dispatcher, SamplerKey
from graphrt.core.errors import CacheMissError, InputError  # noqa: E402
from graphrt.core.graph_modes import GraphMode, RuntimeMode  # noqa: E402
from graphrt.runner import ModelRunner, sampling_batch  # noqa: E402
from support.fast_subset import slow_except
from support.hf_models import hf_logits, load_hf_model, make_tiny_hf_model, random_prompts, tiny_hf_model_dir  # noqa: E402
from support.parity import assert_close_across_shapes, assert_same_tokens  # noqa: E402

VOCAB = 128
LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4)
#: Every key's context bucket: one, max_model_len (XLA's buckets start at 256 tokens).
CTX = LIMITS["max_model_len"]
TOKEN_PADDINGS = [16, 32]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
ATOL = 1e-4


@pytest.fixture(scope="module")
def qwen():
    """Strict Qwen3 engine: every step must hit a precompiled executable."""
    d = tiny_hf_model_dir("qwen3")
    llm = graphrt.LLM(str(d), backend="xla", strict=True, precompile_token_paddings=TOKEN_PADDINGS,
                      precompile_bs_paddings=[1, 2, 4], **LIMITS)
    return llm, load_hf_model(d)


@pytest.fixture(scope="module")
def llama():
    """Non-strict Llama engine (unplanned compiles are logged and counted)."""
    d = tiny_hf_model_dir("llama")
    llm = graphrt.LLM(str(d), backend="jax", precompile_token_paddings=TOKEN_PADDINGS,
                      precompile_bs_paddings=[2, 4], **LIMITS)
    return llm, load_hf_model(d)


_REQUEST_IDS = itertools.count(10_000)  # unique over the session, as an engine's would be


class Driver:
    """Requests pinned to rows of a runner's tables; each ``step`` is one ``execute`` call."""

    def __init__(self, runner: ModelRunner) -> None:
        cfg = runner.config
        self.runner = runner
        rows, width = cfg.max_num_seqs, cfg.max_blocks_per_req
        assert runner.num_kv_blocks > rows * width
        self.tokens = np.zeros((rows, cfg.max_model_len), np.int32)
        self.blocks = (1 + np.arange(rows * width, dtype=np.int32)).reshape(rows, width)
        self.seqs: list[list[int]] = [[] for _ in range(rows)]
        self.done = [0] * rows
        self.ids = [0] * rows

    def add(self, row: int, prompt: list[int]) -> None:
        self.seqs[row], self.done[row] = list(prompt), 0
        self.tokens[row, :len(prompt)] = prompt
        self.ids[row] = next(_REQUEST_IDS)

    def step(self, sched: dict[int, int], params: dict[int, SamplingParams] | None = None) -> dict[int, int]:
        rows = sorted(sched)
        sp = [(params or {}).get(r, GREEDY) for r in rows]
        out = self.runner.execute(
            token_ids=self.tokens, block_table=self.blocks, req_rows=np.array(rows),
            num_computed_tokens=np.array([self.done[r] for r in rows]),
            num_scheduled_tokens=np.array([sched[r] for r in rows]),
            sampling=sampling_batch(sp, [self.ids[r] for r in rows], VOCAB))
        sampled = {}
        for i, r in enumerate(rows):
            self.done[r] += sched[r]
            if self.done[r] == len(self.seqs[r]):
                tok = int(out[i])
                sampled[r] = tok
                self.tokens[r, len(self.seqs[r])] = tok
                self.seqs[r].append(tok)
        return sampled


def check_logits(hf, driver: Driver, rows: list[int]) -> None:
    """The last step's logits of ``rows`` (in step order) match transformers' for the same prefixes."""
    logits = driver.runner.outputs.logits()
    for i, r in enumerate(rows):
        ref = hf_logits(hf, driver.seqs[r][:driver.done[r]]).numpy()[-1]
        np.testing.assert_allclose(logits[i], ref, rtol=ATOL, atol=ATOL)


def assert_greedy_parity(hf, outputs, prompts) -> None:
    for out, prompt in zip(outputs, prompts):
        assert out.prompt_token_ids == prompt and len(out.token_ids) == GREEDY.max_tokens
        seq = prompt + out.token_ids
        ref = hf_logits(hf, seq[:-1]).numpy()
        for j, tok in enumerate(out.token_ids):
            row = ref[len(prompt) - 1 + j]
            assert row[tok] >= row.max() - ATOL, (prompt, j, tok, int(row.argmax()))


# ---- registry, end to end ----------------------------------------------------------------
def test_registry_and_options():
    assert graphrt.available_backends()["xla"] is None
    backend = graphrt.select_backend("jax")
    assert isinstance(backend, XlaBackend) and backend.name == "xla" and backend.framework == "jax"
    assert backend.tp_size == 1 and XlaBackend.unavailable_reason() is None
    with pytest.raises(graphrt.ConfigError, match="xla_force_host_platform_device_count"):
        XlaBackend(tp_size=len(jax.devices()) + 1)


def test_paddings_no_step_can_use_are_refused_before_anything_compiles(monkeypatch):
    """Issue 26: precompile_bs_paddings=[4, 2**24] with max_num_seqs=4 was accepted, and every
    prefill was padded to 2**24 requests (an 8 GiB OOM at the first step)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the executor was created before the ConfigError")

    monkeypatch.setattr(XlaBackend, "create_executor", refuse)
    d = str(tiny_hf_model_dir("qwen3"))
    for make in (lambda **kw: graphrt.LLM(d, backend="xla", **kw), lambda **kw: ModelRunner(d, backend="xla", **kw)):
        with pytest.raises(graphrt.ConfigError, match=r"^precompile_bs_paddings: \[16777216\] above 4"):
            make(**{**LIMITS, "precompile_bs_paddings": [4, 2**24]})
        with pytest.raises(graphrt.ConfigError, match=r"^precompile_token_paddings: \[1073741824\] above 32"):
            make(**{**LIMITS, "precompile_token_paddings": [16, 32, 2**30]})


@pytest.mark.parametrize("engine", slow_except(["qwen", "llama"], "qwen"))
def test_llm_greedy_parity_with_transformers(engine, request):
    """Chunked prefill (45 > 32 tokens), more prompts than slots, decode at every bucket."""
    llm, hf = request.getfixturevalue(engine)
    prompts = random_prompts((1, 3, 8, 13, 45, 21), seed=1)
    with CompileCounter() as counter:
        outputs = llm.generate(prompts, GREEDY)
    assert_greedy_parity(hf, outputs, prompts)
    assert counter.compiles == 0, counter.names
    stats = llm.stats
    assert stats["unplanned_builds"] == 0 and stats["eager_steps"] == 0 and stats["misses"] == 0


def test_warmup_report_and_entries(qwen):
    runner = qwen[0].runner
    ex = runner.executor
    assert not ex.capabilities.eager_fallback and ex.capabilities.has_graphs and ex.compiles.sealed
    keys = {k for _, k in runner.cache}
    assert keys == {BatchDescriptor(32, 4, False, max_seq_len=CTX), BatchDescriptor(16, 4, False, max_seq_len=CTX), BatchDescriptor(4, 4, True, max_seq_len=CTX),
                    BatchDescriptor(2, 2, True, max_seq_len=CTX), BatchDescriptor(1, 1, True, max_seq_len=CTX)}
    assert {k for k in runner.sampler_cache} == {SamplerKey(r, g, lp) for r in (1, 2, 4)
                                                 for g, lp in ((True, False), (False, False), (False, True))}
    report = compile_report(runner.cache, runner.sampler_cache)
    # Every entry was lowered here; a compile may take ~0 s when another test in this process
    # already compiled the identical program (JAX's in-memory cache), so only the total is > 0.
    assert len(report) == 5 + 3 * 3 and all(r["lower_s"] > 0 and r["compile_s"] >= 0 for r in report)
    assert sum(r["compile_s"] for r in report) > 0
    assert all(r["seconds"] > 0 for r in runner.warmup_report)
    # Host buffers cover the largest token bucket and the fixed mixed batch size.
    assert ex.host_buffers["input_ids"].shape == (32,) and ex.host_buffers["block_table"].shape == (4, 16)
    # XLA's largest batch size is one number: the grid's, the dispatcher's mixed batch, the
    # programs' sampled rows and the staging buffers' request rows.
    assert XlaBuckets.from_config(runner.config).max_reqs == runner.dispatcher.mixed_num_reqs == 4
    assert ex.programs.max_reqs == ex.host_buffers["seq_lens"].shape[0] == 4


def test_planned_keys_are_warmups_from_the_runners_dispatcher(qwen):
    runner = qwen[0].runner
    forward = {k for _, k in runner.dispatcher.keys()}
    assert runner.executor.compiles.planned == forward | set(runner.sampler_cache)
    assert forward == {k for _, k in runner.cache}
    # One entry store: the runner's caches hold every executable; the executor keeps only keys.
    assert set(runner.executor.compiles) == forward | set(runner.sampler_cache)
    assert all(isinstance(runner.cache.lookup(k), XlaEntry) for k in runner.cache)
    # The compile ledger's count reaches the runner's statistics (forward and sampler compiles).
    assert runner.stats.compiles == runner.executor.compiles.stats.compiles >= len(runner.executor.compiles) > 0
    held = [x for v in vars(runner.executor.compiles).values() if isinstance(v, (dict, set, frozenset))
            for x in (v.values() if isinstance(v, dict) else v)]
    assert held and not any(isinstance(x, XlaEntry) for x in held)


# ---- padding ----------------------------------------------------------------------------
def test_padding_is_invisible_and_writes_no_real_slot(qwen):
    llm, hf = qwen
    d = Driver(llm.runner)
    ex = llm.runner.executor
    p, q = random_prompts((10, 15), seed=2)
    d.add(0, p)
    d.add(1, p)
    d.add(2, q)
    d.add(3, random_prompts((3,), seed=3)[0])
    kv_before = np.asarray(ex.kv_cache)
    d.step({0: 10})                                   # 10 tokens -> bucket (16, 4)
    assert llm.runner.last_step.key == BatchDescriptor(16, 4, False, max_seq_len=CTX)
    alone, alone_hidden = llm.runner.outputs.logits()[0], llm.runner.outputs.hidden_states()[:10]
    kv_after = np.asarray(ex.kv_cache)
    written = (d.blocks[0, :3, None] * 4 + np.arange(4)).reshape(-1)[:10]
    changed = np.flatnonzero((kv_after[:, :, :-1] != kv_before[:, :, :-1]).any(axis=(0, 1, 3, 4)))
    assert set(changed) <= set(written)               # padded tokens wrote only the trash row
    assert np.isfinite(kv_after).all()
    d.step({1: 10, 2: 15})                            # 25 tokens -> bucket (32, 4)
    assert llm.runner.last_step.key == BatchDescriptor(32, 4, False, max_seq_len=CTX)
    assert_close_across_shapes(llm.runner.outputs.logits()[0], alone)       # another bucket: graphrt.tolerance
    assert_close_across_shapes(llm.runner.outputs.hidden_states()[:10], alone_hidden)
    assert_same_tokens(llm.runner.outputs.logits()[0], alone)
    check_logits(hf, d, [1, 2])
    d.step({0: 1})                                    # decode bucket 1
    assert llm.runner.last_step.key == BatchDescriptor(1, 1, True, max_seq_len=CTX)
    solo = llm.runner.outputs.logits()[0]
    check_logits(hf, d, [0])
    d.step({3: 3})
    d.step({1: 1, 2: 1, 3: 1})                        # decode bucket 4 with 3 requests
    assert llm.runner.last_step.key == BatchDescriptor(4, 4, True, max_seq_len=CTX)
    assert_close_across_shapes(llm.runner.outputs.logits()[0], solo)
    assert_same_tokens(llm.runner.outputs.logits()[0], solo)
    check_logits(hf, d, [1, 2, 3])


def test_a_wider_block_table_gives_the_trimmed_tables_logits(qwen):
    """A block table wider than max_model_len / block_size (extra columns of stale ids) runs the
    same executables and gives bitwise the trimmed table's logits and tokens."""
    runner = qwen[0].runner
    trimmed, wide = Driver(runner), Driver(runner)
    extra = np.random.default_rng(5).integers(1, runner.num_kv_blocks, size=(wide.blocks.shape[0], 2))
    wide.blocks = np.ascontiguousarray(np.concatenate([wide.blocks, extra.astype(np.int32)], axis=1))
    prompt = random_prompts((9,), seed=6)[0]
    with CompileCounter() as c:
        for d in (trimmed, wide):
            d.add(1, prompt)
        for sched in ({1: 9}, {1: 1}, {1: 1}):
            logits = []
            for d in (trimmed, wide):
                d.step(sched)
                logits.append(runner.outputs.logits())
            np.testing.assert_array_equal(logits[0], logits[1])
    assert trimmed.seqs[1] == wide.seqs[1] and c.compiles == 0


def test_kv_cache_is_donated(qwen):
    runner = qwen[0].runner
    d = Driver(runner)
    d.add(0, [5, 6, 7])
    before = runner.executor.kv_cache
    d.step({0: 3})
    assert before.is_deleted() and not runner.executor.kv_cache.is_deleted()


# ---- no compile after warm-up ------------------------------------------------------------
def test_varied_workload_after_warmup_compiles_nothing(qwen):
    llm, hf = qwen
    d = Driver(llm.runner)
    rng = np.random.default_rng(4)
    ex = llm.runner.executor
    compiled_before = ex.compiles.stats.compiles
    with CompileCounter() as counter:
        for rnd in range(3):
            lengths = rng.integers(1, 20, size=4)
            for r in range(4):
                d.add(r, random_prompts((int(lengths[r]),), seed=100 + 4 * rnd + r)[0])
            pending = {r: int(lengths[r]) for r in range(4)}
            while pending:                            # chunked prefill within the 32-token budget
                sched, budget = {}, 32
                for r, left in pending.items():
                    if budget:
                        sched[r] = min(left, budget)
                        budget -= sched[r]
                params = {r: SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=r or None)
                          for r in sched if r % 2}
                d.step(sched, params)
                pending = {r: left - sched.get(r, 0) for r, left in pending.items() if left > sched.get(r, 0)}
            for width in (4, 3, 2, 1):                # every decode bucket, greedy and random
                rows = list(range(width))
                d.step({r: 1 for r in rows}, {rows[-1]: SamplingParams(temperature=1.0, seed=7)})
    assert counter.compiles == 0, counter.names
    assert ex.compiles.stats.compiles == compiled_before and ex.compiles.stats.unplanned_builds == 0
    assert llm.runner.stats.unplanned_builds == 0


# ---- strict mode -------------------------------------------------------------------------
def _dispatcher_with_extra_bucket(runner: ModelRunner) -> Dispatcher:
    cfg = runner.config
    grid = XlaBuckets.from_config(cfg)
    return Dispatcher(GraphMode.FULL, token_buckets=BucketPolicy(TOKEN_PADDINGS + [24]), decode_buckets=grid.decode,
                      mixed_num_reqs=grid.max_reqs, max_num_seqs=cfg.max_num_seqs, eager_fallback=False,
                      separate_decode=True, context_buckets=grid.contexts, max_context=cfg.max_model_len)


def _serve_extra_bucket(runner: ModelRunner, request: pytest.FixtureRequest) -> None:
    """Serve under the dispatcher with a never-compiled bucket until the test ends (the engines
    are the module's: the served dispatcher is put back)."""
    served = runner.dispatcher
    runner.keys.serve(_dispatcher_with_extra_bucket(runner))
    request.addfinalizer(lambda: runner.keys.serve(served))


def test_strict_forced_miss_raises(qwen, request):
    runner = qwen[0].runner
    _serve_extra_bucket(runner, request)
    d = Driver(runner)
    d.add(0, random_prompts((20,), seed=5)[0])
    with CompileCounter() as counter, pytest.raises(CacheMissError) as err:
        d.step({0: 20})                               # -> (24, 4): never compiled
    assert err.value.key == (RuntimeMode.FULL, BatchDescriptor(24, 4, False, max_seq_len=CTX))
    assert counter.compiles == 0
    with pytest.raises(CacheMissError) as err:        # the executor names the field and the shapes
        runner.executor.build(RuntimeMode.FULL, BatchDescriptor(24, 4, False, max_seq_len=CTX))
    msg = str(err.value)
    assert "shape: field 'input_ids' is (24,)" in msg and "nearest" in msg
    with pytest.raises(CacheMissError, match="logits"):
        runner.executor.build(RuntimeMode.FULL, SamplerKey(3, True))


_FRESH_SHAPES = itertools.count(11)


def _leaky(entry: XlaEntry, monkeypatch) -> None:
    """Make an entry run an eager jnp op of a never-seen shape before its executable."""
    real = entry.executable
    shape = (3, 5, 7, next(_FRESH_SHAPES))

    def call(*args):
        jnp.zeros(shape, jnp.float32).sum()
        return real(*args)
    monkeypatch.setattr(entry, "executable", call)


def test_strict_compile_during_run_raises(qwen, monkeypatch):
    runner = qwen[0].runner
    key = BatchDescriptor(1, 1, True, max_seq_len=CTX)
    _leaky(runner.cache.get((RuntimeMode.FULL, key)), monkeypatch)
    d = Driver(runner)
    d.add(0, [9, 8, 7])
    d.step({0: 3})
    with pytest.raises(CacheMissError) as err:
        d.step({0: 1})
    assert err.value.key == key and "compile" in str(err.value) and "hot path" in str(err.value)


def test_non_strict_unplanned_compiles_are_logged_and_counted(llama, request, monkeypatch, caplog):
    llm, hf = llama
    runner = llm.runner
    ex = runner.executor
    _serve_extra_bucket(runner, request)
    d = Driver(runner)
    d.add(0, random_prompts((20,), seed=6)[0])
    builds, unplanned = runner.stats.unplanned_builds, ex.compiles.stats.unplanned_builds
    compiles = runner.stats.compiles         # the runner reports the executor's compile ledger
    assert compiles == ex.compiles.stats.compiles > 0
    with caplog.at_level(logging.WARNING, logger="graphrt"):
        d.step({0: 20})
    assert runner.last_step.key == BatchDescriptor(24, 4, False, max_seq_len=CTX)
    check_logits(hf, d, [0])
    assert runner.stats.unplanned_builds == builds + 1 and ex.compiles.stats.unplanned_builds == unplanned + 1
    assert runner.stats.compiles == ex.compiles.stats.compiles > compiles
    compiles = runner.stats.compiles
    assert "input_ids" in caplog.text and "(24,)" in caplog.text
    _leaky(runner.cache.get((RuntimeMode.FULL, BatchDescriptor(2, 2, True, max_seq_len=CTX))), monkeypatch)
    with caplog.at_level(logging.WARNING, logger="graphrt"):
        d.step({0: 1})
    assert ex.compiles.stats.unplanned_builds == unplanned + 2 and "hot path" in caplog.text
    assert runner.stats.compiles == ex.compiles.stats.compiles > compiles   # one no cache lookup saw
    assert runner.stats.as_dict()["compiles"] == runner.stats.compiles
    check_logits(hf, d, [0])


# ---- pytree stability --------------------------------------------------------------------
def test_pytree_stability(qwen):
    runner = qwen[0].runner
    ex = runner.executor
    # Every forward executable takes (weights, kv cache, batch, future tokens, future rows) with
    # the same batch structure.
    for (_, key), entry in ((k, runner.cache.get(k)) for k in list(runner.cache)):
        spec = batch_spec(key.num_tokens, key.num_reqs, key.uniform_decode, runner.config.max_blocks_per_req)
        leaf = np.zeros(1)
        assert entry.executable.in_tree == jax.tree.structure(((ex.weights, ex.kv_cache, spec, leaf, leaf), {}))
    # Sampling metadata has one structure whether rows are seeded, unseeded or mixed.
    kinds = [[None] * 3, [1, 2, 3], [None, 5, None]]
    sigs = {signature(ex.sampling_rows.metadata(3, 4, sampling_batch(
        [SamplingParams(temperature=1.0, seed=s) for s in seeds], [900 + i for i in range(3)], VOCAB)))
        for seeds in kinds}
    assert len(sigs) == 1
    for i in range(3):
        ex.free_request(900 + i)
    # A field switching between an array and None is a structure change, named.
    arrays = {f: np.zeros(s.shape, np.int32) for f, s in vars(batch_spec(16, 4, False, 16)).items()
              if hasattr(s, "shape")}
    full = XlaBatch(**arrays, num_tokens=16, num_reqs=4)
    holed = XlaBatch(**{**arrays, "seq_lens": None}, num_tokens=16, num_reqs=4)
    assert describe_change(full, full) is None
    assert "pytree structure" in describe_change(full, holed) and "seq_lens" in describe_change(full, holed)
    assert "seq_lens" in describe_change(holed, full)
    assert "static fields" in describe_change(full, XlaBatch(**arrays, num_tokens=16, num_reqs=4,
                                                             uniform_decode=True))
    meta = SamplingMetadata(*(np.zeros(1, np.float32) for _ in range(5)))
    assert "dtype" in describe_change(meta, SamplingMetadata(*(np.zeros(1, np.int32) for _ in range(5))))


# ---- bad input ---------------------------------------------------------------------------
def test_bad_input_is_an_input_error_and_touches_nothing(qwen):
    runner = qwen[0].runner
    ex = runner.executor
    d = Driver(runner)
    d.add(0, random_prompts((33,), seed=7)[0])
    kv = ex.kv_cache
    with CompileCounter() as counter:
        with pytest.raises(InputError, match="max_num"):          # oversized step: never a compile
            d.step({0: 33})
        with pytest.raises(InputError, match="no eager fallback"):
            runner.dispatcher.dispatch(40, 4, False)
        with pytest.raises(InputError) as err:                    # wrong dtype from the engine
            runner.execute(token_ids=d.tokens.astype(np.float32), block_table=d.blocks,
                           req_rows=np.array([0]), num_computed_tokens=np.array([0]),
                           num_scheduled_tokens=np.array([4]))
        assert err.value.field == "token_ids"
        inputs = runner.preparer.prepare(token_ids=d.tokens, block_table=d.blocks, req_rows=np.array([0]),
                                         num_computed_tokens=np.array([0]),
                                         num_scheduled_tokens=np.array([5]))
        key = BatchDescriptor(16, 4, False, max_seq_len=CTX)
        entry = runner.cache.get((RuntimeMode.FULL, key))
        padded = runner.preparer.padder.pad(inputs, num_tokens=16, num_reqs=4)  # allocating: slot_mapping int64
        with pytest.raises(InputError) as err:
            ex.run(RuntimeMode.FULL, key, entry, padded)
        assert err.value.field == "slot_mapping" and "int64" in str(err.value) and "int32" in str(err.value)
        padded = runner.preparer.padder.pad(inputs, num_tokens=32, num_reqs=4, out=ex.host_buffers)
        with pytest.raises(InputError) as err:                    # padded for another bucket
            ex.run(RuntimeMode.FULL, key, entry, padded)
        assert err.value.field == "input_ids" and "(32,)" in str(err.value)
        holed = runner.preparer.padder.pad(inputs, num_tokens=16, num_reqs=4, out=ex.host_buffers)
        holed.seq_lens = None
        with pytest.raises(InputError, match="pytree structure"):
            ex.run(RuntimeMode.FULL, key, entry, holed)
        with pytest.raises(graphrt.GraphrtError, match="no executable for"):   # no eager path, no store
            ex.run(RuntimeMode.FULL, key, None, runner.preparer.padder.pad(inputs, num_tokens=16, num_reqs=4,
                                                                  out=ex.host_buffers))
        with pytest.raises(InputError, match="logits"):
            ex.sample(np.zeros((3, VOCAB), np.float32), 3, sampling_batch([GREEDY] * 3, [1, 2, 3], VOCAB),
                      padded_reqs=4)
    assert counter.compiles == 0
    assert ex.kv_cache is kv and not kv.is_deleted()


# ---- sampling ----------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_and_filters_hold(qwen):
    runner = qwen[0].runner
    seeded = SamplingParams(temperature=1.5, seed=1234)
    prompt = random_prompts((6,), seed=8)[0]

    def run(companions: int) -> list[int]:
        d = Driver(runner)
        d.add(0, prompt)
        for r in range(1, companions + 1):
            d.add(r, random_prompts((4 + r,), seed=20 + r)[0])
        d.step({r: len(d.seqs[r]) for r in range(companions + 1)}, {0: seeded})
        for _ in range(4):
            d.step({r: 1 for r in range(companions + 1)},
                   {0: seeded, **{r: SamplingParams(temperature=1.0) for r in range(1, companions + 1)}})
        for r in range(companions + 1):
            runner.free_request(d.ids[r])
        return d.seqs[0][len(prompt):]

    alone, crowded = run(0), run(3)                   # decode buckets 1 and 4: same draws
    assert alone == crowded
    d = Driver(runner)
    d.add(0, prompt)
    d.add(1, prompt)
    d.add(2, prompt)
    out = d.step({0: 6, 1: 6, 2: 6}, {0: SamplingParams(temperature=5.0, top_k=1),
                                      1: SamplingParams(temperature=5.0, top_p=1e-6),
                                      2: SamplingParams(temperature=5.0, top_k=2, seed=3)})
    logits = runner.outputs.logits()
    greedy = int(logits[0].argmax())
    assert out[0] == greedy and out[1] == greedy
    assert out[2] in set(np.argsort(logits[2])[-2:].tolist())


# ---- persistent compilation cache ----------------------------------------------------------
@pytest.fixture
def restore_compilation_cache():
    from jax.experimental.compilation_cache import compilation_cache as cc
    saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    yield
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
    cc.reset_cache()


def _cached_runner(cache_dir, model_dir=None, bs_paddings=(1, 4), **overrides):
    limits = {**LIMITS, **overrides}
    return ModelRunner(str(model_dir or tiny_hf_model_dir("qwen3")), backend="xla", warmup=False,
                       compilation_cache_dir=str(cache_dir), precompile_token_paddings=[32],
                       precompile_bs_paddings=list(bs_paddings), **limits)


CACHE_KEYS = [(RuntimeMode.FULL, BatchDescriptor(1, 1, True, max_seq_len=CTX)), (RuntimeMode.FULL, SamplerKey(1, True))]


def _build_ahead(runner):
    """The entries ``build_many`` (warm-up's parallel compile) returns for ``CACHE_KEYS``."""
    return [built.entry for built in runner.executor.build_many(CACHE_KEYS)]


def test_persistent_cache_is_reused(tmp_path, restore_compilation_cache):
    cold = _build_ahead(_cached_runner(tmp_path))
    assert not any(e.persistent_cache_hit for e in cold)
    assert all(e.lower_seconds > 0 for e in cold)
    assert any(p.name.startswith("jit_step") for p in tmp_path.iterdir())        # JAX's cache
    assert len(list((tmp_path / "graphrt-executables").rglob("*.xla"))) == 2     # graphrt's
    with CompileCounter() as counter:
        warm = _build_ahead(_cached_runner(tmp_path))
    # A restart deserializes both executables: no lowering, and nothing compiles from scratch.
    assert all(e.persistent_cache_hit and e.lower_seconds == 0.0 for e in warm)
    assert counter.compiles == counter.persistent_cache_hits, counter.names


def test_unplanned_build_with_the_executable_store_counts_once(tmp_path, restore_compilation_cache):
    ex = _cached_runner(tmp_path).executor
    ex.compiles.seal()
    ex.build(RuntimeMode.FULL, SamplerKey(1, True))   # not on disk: looked up there, then compiled
    assert ex.compiles.stats.unplanned_builds == 1


def test_loaded_executables_give_identical_results(tmp_path, restore_compilation_cache):
    prompts = random_prompts([5, 3], seed=7)
    outs = []
    for _ in range(2):
        # One batch padding (the step's 2 requests pad to 4): every key warm-up builds is still
        # compiled cold and loaded warm, with half the executables of [1, 4].
        runner = _cached_runner(tmp_path, bs_paddings=[4])
        runner.warmup()
        with CompileCounter() as again:               # the caches hold every key: nothing twice
            runner.warmup()
        assert again.compiles == 0 and runner.executor.compiles.stats.unplanned_builds == 0
        table = np.zeros((LIMITS["max_num_seqs"], LIMITS["max_model_len"]), np.int32)
        blocks = np.zeros((LIMITS["max_num_seqs"], runner.config.max_blocks_per_req), np.int32)
        for i, p in enumerate(prompts):
            table[i, :len(p)] = p
            blocks[i, :2] = [1 + 2 * i, 2 + 2 * i]
        runner.execute(token_ids=table, block_table=blocks, req_rows=np.array([0, 1]),
                       num_computed_tokens=np.array([0, 0]),
                       num_scheduled_tokens=np.array([len(p) for p in prompts]))
        outs.append((runner.outputs.logits(), compile_report(runner.cache, runner.sampler_cache)))
    (cold_logits, cold_report), (warm_logits, warm_report) = outs
    assert not any(r["persistent_cache_hit"] for r in cold_report)
    # Every forward is deserialized; a sampler whose executable XLA cannot serialize (a sort
    # comparator, in some processes) is lowered again, which is the documented fallback.
    forwards = [r for r in warm_report if not r["key"].startswith("sampler")]
    assert forwards and all(r["persistent_cache_hit"] and r["lower_s"] == 0.0 for r in forwards)
    np.testing.assert_array_equal(cold_logits, warm_logits)


def test_executable_cache_never_serves_another_model_or_shape(tmp_path, restore_compilation_cache):
    cache = tmp_path / "cache"
    _build_ahead(_cached_runner(cache))
    # A different block size changes the KV cache and the block table: a new fingerprint.
    other = _build_ahead(_cached_runner(cache, block_size=8, max_model_len=64))
    # Same shapes, another rotary base: baked into the executable, so it must not be reused.
    theta = make_tiny_hf_model(tmp_path, "qwen3", rope_theta=12345.0)
    third = _build_ahead(_cached_runner(cache, model_dir=theta))
    for entries in (other, third):
        assert not any(e.lower_seconds == 0.0 for e in entries)
    assert len(list((cache / "graphrt-executables").iterdir())) == 3


def test_unreadable_cached_executable_is_rebuilt(tmp_path, restore_compilation_cache, caplog):
    _build_ahead(_cached_runner(tmp_path))
    for f in (tmp_path / "graphrt-executables").rglob("*.xla"):
        f.write_bytes(b"not an executable")
    with caplog.at_level(logging.WARNING):
        rebuilt = _build_ahead(_cached_runner(tmp_path))
    assert all(e.lower_seconds > 0 for e in rebuilt)
    assert "ignoring unreadable cached executable" in caplog.text


# ---- flax nnx, lazy compilation ------------------------------------------------------------
def test_nnx_module_matches_params_model_with_lazy_compiles():
    pytest.importorskip("flax")
    from graphrt.models.jax.nnx import NnxDecoder
    backend = XlaBackend()
    model = backend.load_model(str(tiny_hf_model_dir("qwen3")))
    assert isinstance(model, XlaModel)
    module = NnxDecoder(model.config, model.params, block_size=LIMITS["block_size"])
    outs = []
    for m in (model, module):
        runner = ModelRunner(m, backend=backend, disable_precompile=True, precompile_token_paddings=[16, 32],
                             precompile_bs_paddings=[1, 4], progress=False, **LIMITS)
        assert compile_report(runner.cache, runner.sampler_cache) == [] and not runner.cache.sealed
        d = Driver(runner)
        d.add(0, [3, 1, 4, 1, 5, 9, 2, 6])
        d.step({0: 8})
        first = runner.outputs.logits()[0]
        d.step({0: 1})
        outs.append((first, runner.outputs.logits()[0], d.seqs[0]))
        assert len(compile_report(runner.cache, runner.sampler_cache)) == 4
        assert runner.executor.compiles.stats.unplanned_builds == 0 and not runner.executor.compiles.sealed
        # Each sampler compiled on first use is in the runner's sampler cache: a hit, as a forward.
        assert len(runner.sampler_cache) == 2 and (runner.sampler_stats.hits, runner.sampler_stats.misses) == (2, 0)
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    assert outs[0][2] == outs[1][2]
