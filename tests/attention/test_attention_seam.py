"""The attention seam (issue 22, docs/attention.md): an engine's own attention backend, its
metadata and the host values it declares; per-step extra inputs; the model protocol.

* the user repro: a kernel that reads ``max_seq_len`` as a host integer. Declared keyed, the
  same greedy tokens as graphrt's own attention in every graph mode; undeclared, every capture
  is refused in the default mode naming the value, the steps run eagerly, no token is wrong;
* a user-written backend with its own metadata passes graphrt's conformance properties;
* extra inputs reach the graphs, padded with their fill; bad ones are InputErrors before
  anything is written;
* bad models and backends are refused when the runner is built, each member named.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import graphrt
from graphrt import ConfigError, InputError, ModelRunner, RuntimeMode, SamplingParams
from graphrt.testing import RunnerFactory, check_property
from support.hf_models import random_prompts, tiny_hf_model_dir
from support.user_attention import DenseBackend, dense_model, extra_input_model
from support.fast_subset import examples

ENGINE = dict(backend="cpu", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4,
              num_kv_blocks=40, enable_prefix_caching=False)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = random_prompts((5, 17, 9, 30), seed=4)


@pytest.fixture(scope="module")
def reference_tokens() -> list[list[int]]:
    """graphrt's own attention, eagerly: what every mode must generate."""
    llm = graphrt.LLM(str(tiny_hf_model_dir("qwen3")), **{**ENGINE, "backend": "eager"})
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE", "PIECEWISE", "NONE"])
def test_a_declared_host_integer_gives_the_right_tokens_in_every_mode(mode, reference_tokens):
    llm = graphrt.LLM(dense_model(declare=True), mode=mode, **ENGINE)
    assert llm.runner.executor.capabilities.keyed_host_values == ("max_seq_len",)
    assert llm.runner.stats.failed_builds == 0
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference_tokens
    if mode != "NONE":
        assert llm.stats["hits"] > 0


def test_an_undeclared_host_integer_is_refused_at_capture_naming_it(reference_tokens, caplog):
    with caplog.at_level("WARNING", logger="graphrt"):
        llm = graphrt.LLM(dense_model(declare=False), mode="FULL", **ENGINE)
    runner = llm.runner
    assert runner.stats.failed_builds == len(runner.cache) > 0          # every FULL capture refused
    assert "'max_seq_len'" in caplog.text and "user-dense" in caplog.text and "keyed_host_values" in caplog.text
    outs = llm.generate(PROMPTS, GREEDY)                                  # eagerly, with each step's value
    assert [o.token_ids for o in outs] == reference_tokens
    assert llm.stats["hits"] == 0 and llm.stats["eager_steps"] > 0
    with pytest.raises(graphrt.GraphCaptureError, match="max_seq_len"):
        graphrt.LLM(dense_model(declare=False), mode="FULL", strict=True, **ENGINE)


@pytest.mark.parametrize("prop", ["padding_invisible", "kv_isolated", "replay_matches_eager"])
def test_a_user_backend_passes_the_conformance_properties(prop):
    factory = RunnerFactory(lambda: dense_model(declare=True), "cpu", mode="FULL_AND_PIECEWISE")
    result = check_property(prop, factory, examples=examples(8))
    assert result.passed, result.line()


def test_a_builder_whose_metadata_does_not_fit_the_step_is_refused_before_the_kv_cache():
    with pytest.raises(ConfigError, match=r"user-dense.*trash_row.*\(5,\).*2 tokens"):
        ModelRunner(dense_model(wrong_shapes=True), backend="cpu", warmup=False, **{
            k: v for k, v in ENGINE.items() if k not in ("backend", "enable_prefix_caching")})


# ---- extra inputs -------------------------------------------------------------------------

def _tables() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    return (rng.integers(3, 128, size=(4, 64), dtype=np.int32),
            (np.arange(64, dtype=np.int32) + 1).reshape(4, 16))


def _run(runner: ModelRunner, embeds: np.ndarray, scheduled: list[int]) -> np.ndarray:
    tokens, blocks = _tables()
    n = len(scheduled)
    runner.execute(token_ids=tokens, block_table=blocks, req_rows=np.arange(n, dtype=np.int32),
                   num_computed_tokens=np.zeros(n, np.int32), num_scheduled_tokens=np.asarray(scheduled, np.int32),
                   extra_inputs={"embeds": embeds})
    return runner.outputs.logits()


def test_extra_inputs_reach_the_graphs_padded_with_their_fill():
    limits = {k: v for k, v in ENGINE.items() if k not in ("backend", "enable_prefix_caching")}
    graph = ModelRunner(extra_input_model(), backend="cpu", mode="FULL", cudagraph_capture_sizes=[4, 8], **limits)
    eager = ModelRunner(extra_input_model(), backend="eager", **limits)
    hidden = graph.model.config.hidden_size
    rng = np.random.default_rng(0)
    embeds = rng.normal(0, 0.5, (5, hidden)).astype(np.float32)
    got = _run(graph, embeds, [3, 2])
    assert graph.last_step.mode is RuntimeMode.FULL and graph.last_step.key.num_tokens == 8
    staged = graph.executor.extra_buffers["embeds"]
    assert np.array_equal(staged[:5], embeds) and not staged[5:8].any()      # padded with the fill
    want = _run(eager, embeds, [3, 2])
    np.testing.assert_allclose(got, want, **graphrt.tolerance("float32")._asdict())
    plain = _run(graph, np.zeros_like(embeds), [3, 2])
    assert not np.allclose(plain, got, atol=1e-3)                             # the input is read
    for bad, match in (({"embeds": embeds[:4]}, r"shape \(4, 64\).*\(5, 64\)"),
                       ({"embeds": embeds.astype(np.float64)}, "float32"),
                       ({}, "missing"), ({"embeds": embeds, "other": embeds}, "not declared")):
        before = staged.copy()
        with pytest.raises(InputError, match=match):
            tokens, blocks = _tables()
            graph.execute(token_ids=tokens, block_table=blocks, req_rows=np.arange(2, dtype=np.int32),
                          num_computed_tokens=np.zeros(2, np.int32), num_scheduled_tokens=np.array([3, 2], np.int32),
                          extra_inputs=bad)
        assert np.array_equal(staged, before)


def test_extra_inputs_are_refused_for_a_model_that_declares_none(model_dir):
    r = ModelRunner(model_dir, backend="eager", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                    block_size=4, num_kv_blocks=40)
    tokens, blocks = _tables()
    with pytest.raises(InputError, match="declares no extra inputs"):
        r.execute(token_ids=tokens, block_table=blocks, req_rows=np.array([0], np.int32),
                  num_computed_tokens=np.array([0], np.int32), num_scheduled_tokens=np.array([2], np.int32),
                  extra_inputs={"x": np.zeros(2)})


# ---- the model protocol ---------------------------------------------------------------------

class Half(torch.nn.Module):
    """Has a forward and a config, nothing else of the protocol."""

    config = type("Cfg", (), {"vocab_size": 8, "hidden_size": 4})()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], 4)


def test_a_model_missing_members_is_refused_naming_each():
    with pytest.raises(ConfigError) as err:
        ModelRunner(Half(), backend="cpu", max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16, block_size=4)
    for member in ("compute_logits", "attention_layers", "kv_cache_spec"):
        assert member in str(err.value)


def test_a_model_of_another_framework_is_refused_with_a_sentence():
    class JaxLike:                   # what a JAX model looks like to a torch backend
        params = {}
    with pytest.raises(ConfigError, match="JAX model: use backend='xla'"):
        ModelRunner(JaxLike(), backend="cpu", max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16,
                    block_size=4)


def test_a_backend_that_keys_what_no_key_holds_is_refused():
    class KeysQueryLen(DenseBackend):
        def keyed_host_values(self, device, dtype):
            return ("max_query_len",)
    model = dense_model()
    model.attention_backend = KeysQueryLen()
    with pytest.raises(ConfigError, match=r"max_query_len.*no graph key holds"):
        ModelRunner(model, backend="cpu", warmup=False, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                    block_size=4, num_kv_blocks=40)


@pytest.mark.parametrize("prop", ["padding_invisible", "kv_isolated", "replay_matches_eager", "bad_input_rejected",
                                  "chunking_invariant"])
def test_the_kit_draws_and_checks_a_models_extra_inputs(prop):
    """The kit's steps carry an array per declared extra input (padded by the runner with its
    fill; cut to each chunk's tokens when a step runs in chunks); bad steps also break one
    (wrong shape, dtype, missing), named by the InputError."""
    factory = RunnerFactory(extra_input_model, "cpu", mode="FULL_AND_PIECEWISE")
    assert factory.strategy_args()["extra_inputs"].keys() == {"embeds"}
    result = check_property(prop, factory, examples=examples(8))
    assert result.passed, result.line()


def test_the_kits_bad_extra_inputs_name_the_input():
    from hypothesis import given, settings

    from graphrt.testing import strategies

    factory = RunnerFactory(extra_input_model, "cpu", mode="NONE")
    seen = set()

    for kind in strategies.EXTRA_KINDS:     # each kind drawn on its own: none left to chance
        @settings(max_examples=examples(10), deadline=None, database=None)
        @given(strategies.bad_steps(**factory.strategy_args(), kinds=(kind,)))
        def check(bad):
            seen.add(bad.kind)
            assert bad.field == "extra_inputs['embeds']"
            with pytest.raises(InputError) as err:
                factory().execute(**bad.step.kwargs())
            assert err.value.field == bad.field

        check()
    assert seen == set(strategies.EXTRA_KINDS)


# ---- issue 30: the smaller holes ----------------------------------------------------------------

def test_graphrt_exports_the_attention_backend_and_its_declarations():
    from graphrt.core.attention_decl import AttentionDeclarations
    from graphrt.layers.torch.attention.backend import AttentionBackend

    assert graphrt.AttentionBackend is AttentionBackend and issubclass(AttentionBackend, AttentionDeclarations)
    assert graphrt.AttentionDeclarations is AttentionDeclarations
    assert {"AttentionBackend", "AttentionDeclarations"} <= set(graphrt.__all__)


@pytest.mark.parametrize("dtype,fill", [("int32", float("nan")), ("int8", 1000), ("int32", 2.5), ("bool", 2),
                                        ("float16", 1e6), ("int64", "0")])
def test_an_extra_input_fill_its_dtype_cannot_hold_is_refused_when_the_runner_is_built(dtype, fill):
    """NaN for int32 and 1000 for int8 were accepted; warm-up then dropped every graph to eager
    and each step raised a raw numpy ValueError."""
    model = extra_input_model()
    model.extra_inputs = {"embeds": graphrt.ExtraInput("token", (model.config.hidden_size,), dtype, fill)}
    with pytest.raises(ConfigError, match=rf"extra_inputs\['embeds'\]\.fill: .*{dtype}"):
        ModelRunner(model, backend="cpu", warmup=False, **{
            k: v for k, v in ENGINE.items() if k not in ("backend", "enable_prefix_caching")})


def test_extra_inputs_given_as_a_list_are_an_input_error():
    limits = {k: v for k, v in ENGINE.items() if k not in ("backend", "enable_prefix_caching")}
    r = ModelRunner(extra_input_model(), backend="eager", **limits)
    tokens, blocks = _tables()
    embeds = np.zeros((5, r.model.config.hidden_size), np.float32)
    for given in ([embeds], (embeds,), embeds):
        with pytest.raises(InputError, match="must map each declared input's name to its array") as err:
            r.execute(token_ids=tokens, block_table=blocks, req_rows=np.arange(2, dtype=np.int32),
                      num_computed_tokens=np.zeros(2, np.int32), num_scheduled_tokens=np.array([3, 2], np.int32),
                      extra_inputs=given)
        assert err.value.field == "extra_inputs"


def test_a_failed_capture_counts_under_its_cause_not_as_a_miss():
    from graphrt.core.cache import GraphCache
    from graphrt.core.eager import EagerCause

    cache = GraphCache()
    cache.put_failed("k", "boom")
    cache.record_step(real_tokens=3, padded_tokens=4, real_reqs=1, padded_reqs=1, eager_reason="boom",
                      eager_cause=EagerCause.CAPTURE_FAILED, key="k", hit=False)
    cache.record_step(real_tokens=2, padded_tokens=2, real_reqs=1, padded_reqs=1, eager_reason="k2 not captured",
                      eager_cause=EagerCause.MISS, key="k2", hit=False)
    stats = cache.stats
    assert stats.misses == 1 and stats.eager_by_cause[EagerCause.CAPTURE_FAILED].steps == 1
    assert stats.eager_by_cause[EagerCause.MISS].steps == 1 and stats.eager_steps == 2


def test_the_kits_line_for_an_undeclared_value_says_why_the_graph_was_not_built():
    from graphrt.testing.conformance import run_conformance

    lines: list[str] = []
    results = run_conformance(lambda: dense_model(declare=False), "cpu", examples=2, report=lines.append,
                              mode="FULL", properties=["no_build_after_warmup"])
    assert "captures failed (they run eagerly): attention backend 'user-dense' read the host value " \
           "'max_seq_len'" in lines[0]
    (result,) = results
    assert not result.passed and "ran eagerly" in result.line() and "'max_seq_len'" in result.line()
    assert "misses" not in result.line()

