"""Per-step extra inputs on the xla backend.

A GPT-NeoX-shaped JAX model of its own (tests/support/jax_neox.py) declares a per-token ``embeds``
input added to its token embeddings. Through a ``ModelRunner``: its logits equal the plain
causal forward that adds the same embeds, over a prefill and decodes padded to buckets; the
forward receives the padded rows with the fill; bad inputs are InputErrors naming the input
before anything runs; nothing compiles after warm-up; the conformance kit's properties hold.
The executable store's fingerprint covers the declaration.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from support import jax_neox as neox  # noqa: E402
from graphrt import ConfigError, ExtraInput, InputError, ModelRunner  # noqa: E402
from graphrt.backends.xla import extra_inputs as xla_extra  # noqa: E402
from graphrt.backends.xla.compile import thread_compiles  # noqa: E402
from graphrt.backends.xla.executables import executable_store  # noqa: E402
from graphrt.backends.xla.programs import XlaModel  # noqa: E402
from graphrt.config import GraphConfig  # noqa: E402
from graphrt.testing import RunnerFactory, check_property  # noqa: E402
from support.runner_steps import greedy  # noqa: E402

LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4,
              precompile_token_paddings=[16, 32], precompile_bs_paddings=[1, 2, 4])
ATOL = 1e-4
CFG = neox.NeoXConfig()
FILL = 0.25          # not zero: padded rows are told apart from rows never written
EMBEDS = {"embeds": ExtraInput("token", (CFG.hidden_size,), "float32", fill=FILL)}


def _model(received: list | None = None) -> XlaModel:
    """The NeoX model with an ``embeds`` input; ``received`` collects what its forward was given."""
    def forward(params, kv_cache, input_ids, positions, meta, *, config, block_size, extra):
        if received is not None:
            jax.debug.callback(lambda e: received.append(np.asarray(e)), extra["embeds"])
        return neox.embeds_forward(params, kv_cache, input_ids, positions, meta, config=config,
                                   block_size=block_size, extra=extra)
    return XlaModel(CFG, neox.init_params(CFG), forward=forward, compute_logits=neox.compute_logits,
                    extra_inputs=EMBEDS)


def _tables() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((4, LIMITS["max_model_len"]), np.int32), (1 + np.arange(64, dtype=np.int32)).reshape(4, 16)


@pytest.fixture(scope="module")
def served():
    received: list = []
    runner = ModelRunner(_model(received), backend="xla", progress=False, **LIMITS)
    return runner, received


def test_logits_equal_the_plain_forward_that_adds_the_embeds_and_nothing_recompiles(served):
    runner, received = served
    ex = runner.executor
    rng = np.random.default_rng(3)
    prompts = {0: rng.integers(1, CFG.vocab_size, 7).tolist(), 1: rng.integers(1, CFG.vocab_size, 5).tolist()}
    # One embedding row per position of each sequence, drawn up front.
    embeds = {r: rng.normal(0, 0.5, (32, CFG.hidden_size)).astype(np.float32) for r in prompts}
    tokens, blocks = _tables()
    seqs = {row: list(p) for row, p in prompts.items()}
    done = {row: 0 for row in seqs}
    for row, p in prompts.items():
        tokens[row, :len(p)] = p
    seen, keys = [], []
    compiles, thread = ex.compiles.stats.compiles, thread_compiles()
    for _ in range(4):                          # the prefill of both (12 tokens -> 16), then three decodes
        rows = sorted(seqs)
        sched = [len(seqs[r]) - done[r] for r in rows]
        step_embeds = np.concatenate([embeds[r][done[r]:len(seqs[r])] for r in rows])
        out = runner.execute(token_ids=tokens, block_table=blocks, req_rows=np.array(rows),
                             num_computed_tokens=np.array([done[r] for r in rows]),
                             num_scheduled_tokens=np.array(sched), sampling=greedy(len(rows)),
                             extra_inputs={"embeds": step_embeds})
        keys.append(runner.last_step.key)
        logits = runner.outputs.logits()
        for i, r in enumerate(rows):
            done[r] = len(seqs[r])
            seen.append((r, done[r] - 1, logits[i]))
            tokens[r, len(seqs[r])] = int(out[i])
            seqs[r].append(int(out[i]))
    assert ex.compiles.stats.compiles == compiles and thread_compiles() == thread     # no recompile
    assert ex.compiles.stats.unplanned_builds == 0
    assert [(k.num_tokens, k.num_reqs) for k in keys] == [(16, 4), (2, 2), (2, 2), (2, 2)]
    # The forward got each key's padded rows: the real ones, then the fill.
    assert [a.shape for a in received[-4:]] == [(16, CFG.hidden_size)] + [(2, CFG.hidden_size)] * 3
    prefill = received[-4]
    np.testing.assert_array_equal(prefill[:7], embeds[0][:7])
    np.testing.assert_array_equal(prefill[7:12], embeds[1][:5])
    assert (prefill[12:] == FILL).all()
    want = {r: neox.reference_logits(params_of(runner), CFG, seq, embeds[r][:len(seq)]) for r, seq in seqs.items()}
    plain = {r: neox.reference_logits(params_of(runner), CFG, seq) for r, seq in seqs.items()}
    for r, position, got in seen:
        np.testing.assert_allclose(got, want[r][position], rtol=ATOL, atol=ATOL)
    assert not all(np.allclose(got, plain[r][position], atol=1e-2) for r, position, got in seen)


def params_of(runner: ModelRunner) -> dict:
    return jax.device_get(runner.executor.weights)


def test_padded_rows_carry_the_fill_after_a_fuller_step(served):
    """A 16-token step writes every row of the bucket; a 9-token step in the same bucket must
    then hand the forward the fill in rows 9..15, not the previous step's values."""
    runner, received = served
    staged = runner.executor.extra_buffers["embeds"]
    tokens, blocks = _tables()
    tokens[:, :16] = 5
    rng = np.random.default_rng(1)
    for scheduled in ([8, 8], [5, 4]):
        values = rng.normal(0, 1, (sum(scheduled), CFG.hidden_size)).astype(np.float32)
        runner.execute(token_ids=tokens, block_table=blocks, req_rows=np.array([2, 3]),
                       num_computed_tokens=np.zeros(2, np.int32), num_scheduled_tokens=np.array(scheduled),
                       sampling=greedy(2), extra_inputs={"embeds": values})
        runner.outputs.logits()
        assert runner.last_step.key.num_tokens == 16
        got = received[-1]
        n = sum(scheduled)
        np.testing.assert_array_equal(got[:n], values)
        np.testing.assert_array_equal(staged[:n], values)
        assert (got[n:] == FILL).all() and (staged[n:16] == FILL).all()


def test_bad_extra_inputs_are_named_before_anything_runs(served):
    runner, received = served
    ex = runner.executor
    tokens, blocks = _tables()
    tokens[0, :3] = 7
    good = np.ones((3, CFG.hidden_size), np.float32)
    cases = (({"embeds": good[:2]}, "extra_inputs['embeds']", r"shape \(2, 32\).*\(3, 32\)"),
             ({"embeds": np.ones((3, CFG.hidden_size + 1), np.float32)}, "extra_inputs['embeds']", "shape"),
             ({"embeds": good.astype(np.float64)}, "extra_inputs['embeds']", "float32"),
             ({}, "extra_inputs['embeds']", "missing"), (None, "extra_inputs['embeds']", "missing"),
             ({"embeds": good, "other": good}, "extra_inputs", r"\['other'\] are not declared"))
    for bad, field, match in cases:
        kv, staged, calls = np.asarray(ex.kv_cache).copy(), ex.extra_buffers["embeds"].copy(), len(received)
        with pytest.raises(InputError, match=match) as err:
            runner.execute(token_ids=tokens, block_table=blocks, req_rows=np.array([0]),
                           num_computed_tokens=np.zeros(1, np.int32), num_scheduled_tokens=np.array([3]),
                           sampling=greedy(1), extra_inputs=bad)
        assert err.value.field == field
        np.testing.assert_array_equal(np.asarray(ex.kv_cache), kv)
        np.testing.assert_array_equal(ex.extra_buffers["embeds"], staged)
        assert len(received) == calls                                         # the forward never ran


def test_a_model_without_extra_inputs_keeps_its_signature_and_refuses_them():
    model = XlaModel(CFG, neox.init_params(CFG), forward=neox.forward, compute_logits=neox.compute_logits)
    runner = ModelRunner(model, backend="xla", disable_precompile=True, progress=False, **LIMITS)
    assert runner.extra is None and runner.executor.extra_buffers == {}
    tokens, blocks = _tables()
    tokens[0, :3] = 7
    step = dict(token_ids=tokens, block_table=blocks, req_rows=np.array([0]), num_computed_tokens=np.zeros(1, np.int32),
                num_scheduled_tokens=np.array([3]), sampling=greedy(1))
    with pytest.raises(InputError, match="declares no extra inputs"):
        runner.execute(**step, extra_inputs={"embeds": np.zeros((3, CFG.hidden_size), np.float32)})
    runner.execute(**step)
    want = neox.reference_logits(params_of(runner), CFG, [7, 7, 7])
    np.testing.assert_allclose(runner.outputs.logits()[0], want[2], rtol=ATOL, atol=ATOL)


def test_declarations_are_checked_and_graphrts_decoder_reads_none():
    with pytest.raises(ConfigError, match=r"model.extra_inputs\['embeds'\] must be a graphrt.ExtraInput"):
        xla_extra.model_extra_specs(types.SimpleNamespace(extra_inputs={"embeds": (4,)}))
    with pytest.raises(ConfigError, match="graphrt's JAX decoder reads no extra inputs"):
        xla_extra.model_extra_specs(XlaModel(CFG, {}, extra_inputs=EMBEDS))
    assert xla_extra.model_extra_specs(XlaModel(CFG, {}, neox.forward, neox.compute_logits)) == {}


def test_the_executable_store_fingerprints_the_declaration(tmp_path):
    """Two executors alike but for their extra inputs never share stored executables."""
    from jax.sharding import Mesh

    config = GraphConfig.create(**LIMITS, compilation_cache_dir=str(tmp_path))
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))

    def store(specs):
        programs = types.SimpleNamespace(own_code=True, mesh=mesh, model_config=CFG, weights={"w": np.zeros(2)},
                                         kv_dtype="float32", decode_query_len=1, max_reqs=4, max_logprobs=0,
                                         extra_inputs=specs)
        return executable_store(programs, config).root

    other = {"embeds": ExtraInput("token", (CFG.hidden_size,), "float32", fill=0.0)}
    roots = {store({}), store(EMBEDS), store(other),
             store({"embeds": ExtraInput("request", (CFG.hidden_size,), "float32", fill=FILL)})}
    assert len(roots) == 4
    assert store(dict(EMBEDS)) == store(EMBEDS)


@pytest.fixture(scope="module")
def kit() -> RunnerFactory:
    return RunnerFactory(_model, "xla")     # one warmed-up runner for every property


@pytest.mark.parametrize("prop", ["padding_invisible", "kv_isolated", "bad_input_rejected"])
def test_the_kit_checks_a_jax_models_extra_inputs(kit, prop):
    factory = kit
    assert factory.strategy_args()["extra_inputs"] == EMBEDS
    result = check_property(prop, factory, examples=4)
    assert result.passed, result.line()


def test_an_nnx_module_declares_them_as_an_attribute():
    nnx = pytest.importorskip("flax.nnx")
    params = neox.init_params(CFG)

    def values(tree):
        return jax.tree.map(lambda v: v[...], tree, is_leaf=lambda v: isinstance(v, nnx.Variable))

    class Module(nnx.Module):
        def __init__(self) -> None:
            self.config, self.block_size, self.extra_inputs = CFG, LIMITS["block_size"], EMBEDS
            self.params = nnx.data(jax.tree.map(nnx.Param, params))

        def __call__(self, kv_cache, input_ids, positions, meta, *, extra):
            return neox.embeds_forward(values(self.params), kv_cache, input_ids, positions, meta,
                                       config=self.config, block_size=self.block_size, extra=extra)

        def compute_logits(self, hidden):
            return neox.compute_logits(values(self.params), hidden, config=self.config)

    runner = ModelRunner(Module(), backend="xla", disable_precompile=True, progress=False, **LIMITS)
    assert runner.extra.specs == EMBEDS and runner.executor.extra_buffers["embeds"].shape == (32, CFG.hidden_size)
    tokens, blocks = _tables()
    tokens[0, :5] = [3, 9, 4, 1, 7]
    embeds = np.random.default_rng(2).normal(0, 0.5, (5, CFG.hidden_size)).astype(np.float32)
    runner.execute(token_ids=tokens, block_table=blocks, req_rows=np.array([0]),
                   num_computed_tokens=np.zeros(1, np.int32), num_scheduled_tokens=np.array([5]), sampling=greedy(1),
                   extra_inputs={"embeds": embeds})
    want = neox.reference_logits(params, CFG, [3, 9, 4, 1, 7], embeds)
    np.testing.assert_allclose(runner.outputs.logits()[0], want[4], rtol=ATOL, atol=ATOL)


def test_tensor_parallelism_replicates_them_in_subprocess():
    """Two CPU devices (XLA_FLAGS must be set before JAX starts, hence a fresh process running
    this file): the extra inputs are replicated over the mesh and the logits still match."""
    import os
    import subprocess
    import sys

    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu",  # tests/ for the support package
           "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=600)
    if "SKIP:" in proc.stdout:
        pytest.skip(proc.stdout.split("SKIP:", 1)[1].strip())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "OK tp=2" in proc.stdout, proc.stdout


def _tp_main() -> None:
    if len(jax.devices()) < 2:
        print(f"SKIP: only {len(jax.devices())} JAX devices here (XLA_FLAGS not honoured)")
        return
    from jax.sharding import PartitionSpec as P

    from graphrt.backends.xla.backend import XlaBackend

    # One bucket, the step's (8 tokens of 2 requests): warm-up compiles one sharded forward, not six.
    limits = dict(LIMITS, max_num_seqs=2, max_num_batched_tokens=16, precompile_token_paddings=[16],
                  precompile_bs_paddings=[2])
    runner = ModelRunner(_model(), backend=XlaBackend(tp_size=2), progress=False, **limits)
    tokens, blocks = _tables()
    prompts = {0: [3, 9, 4, 1, 7], 1: [8, 2, 6]}
    for row, p in prompts.items():
        tokens[row, :len(p)] = p
    embeds = np.random.default_rng(4).normal(0, 0.5, (8, CFG.hidden_size)).astype(np.float32)
    runner.execute(token_ids=tokens, block_table=blocks, req_rows=np.array([0, 1]),
                   num_computed_tokens=np.zeros(2, np.int32), num_scheduled_tokens=np.array([5, 3]),
                   sampling=greedy(2), extra_inputs={"embeds": embeds})
    logits = runner.outputs.logits()
    params = params_of(runner)
    for i, (ids, rows) in enumerate(((prompts[0], embeds[:5]), (prompts[1], embeds[5:]))):
        want = neox.reference_logits(params, CFG, ids, rows)[-1]
        np.testing.assert_allclose(logits[i], want, rtol=ATOL, atol=ATOL)
    entry = runner.cache.get((runner.last_step.mode, runner.last_step.key))
    extra_in = entry.executable.input_shardings[0][5]
    assert extra_in["embeds"].spec == P() and len(extra_in["embeds"].device_set) == 2
    print("OK tp=2", flush=True)


if __name__ == "__main__":
    _tp_main()
