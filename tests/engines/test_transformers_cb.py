"""transformers' continuous batching on graphrt (issue 40; docs/engines.md, "transformers'
continuous batching"): its manager, scheduler and paged cache unchanged, each step padded to a
graphrt key by graphrt's rules and replayed from graphrt's recording graph.

The oracle is the same manager without graphrt (transformers' eager run on a CPU): greedy tokens
of 7 requests of varied lengths, on a tiny random Llama and Qwen3, with a token budget that
chunks the prefills and mixes them with decodes. Runs in ``make test`` (transformers is graphrt's
test oracle); skips, saying why, where transformers or its continuous batching is missing or
outside the tested range.
"""

from __future__ import annotations

import pytest

from graphrt.integrations import transformers_cb

if (reason := transformers_cb.unavailable_reason()) is not None:
    pytest.skip(reason, allow_module_level=True)

import hypothesis.strategies as st  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: E402
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager  # noqa: E402

import graphrt  # noqa: E402
from graphrt.core import defaults  # noqa: E402
from graphrt.core.eager import EagerCause  # noqa: E402
from graphrt.core.inputs.fields import BOUNDARY, REQUEST, TOKEN  # noqa: E402
from graphrt.integrations.transformers_cb import activation  # noqa: E402
from graphrt.integrations.transformers_cb.padding import KEY, KWARG_RULES, KwargPadder, RealSizes  # noqa: E402
from graphrt.integrations.transformers_cb.runner import GraphrtCBRunner  # noqa: E402
from support.hf_models import load_hf_model, random_prompts, tiny_hf_model_dir  # noqa: E402

PROMPTS = random_prompts((3, 9, 17, 33, 5, 48, 24), seed=4)
NEW_TOKENS = 10
PAGE, BLOCKS = 16, 64                                  # a cache of 1024 tokens: two context buckets


def generation_config() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)


def cb_config(**extra) -> ContinuousBatchingConfig:
    """64 tokens a step: the prefills are chunked and share steps with decodes."""
    return ContinuousBatchingConfig(page_size=PAGE, num_blocks=BLOCKS, max_batch_tokens=64, max_requests_per_batch=8,
                                    **extra)


def generate(model, **extra) -> list[list[int]]:
    out = model.generate_batch(PROMPTS, generation_config=generation_config(), continuous_batching_config=cb_config(),
                               **extra)
    assert len(out) == len(PROMPTS) and all(o.error is None for o in out.values())
    return [list(o.generated_tokens) for o in out.values()]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def eager_tokens(arch):
    """transformers' own run: no graphrt, no graph (a CPU has no accelerator graph)."""
    return generate(load_hf_model(tiny_hf_model_dir(arch)))


@pytest.fixture
def step_log(monkeypatch):
    """(whether the step was a pure decode: one token per request, graph replays it added), per step."""
    steps = []
    compute = GraphrtCBRunner.compute_batch

    def logged(self, model, batch_data):
        decode = all(f.query_length == 1 for f in self.inputs_and_outputs.requests_in_batch)
        before = self.graph_cache.stats.hits
        compute(self, model, batch_data)
        steps.append((decode, self.graph_cache.stats.hits - before))

    monkeypatch.setattr(GraphrtCBRunner, "compute_batch", logged)
    return steps


def test_greedy_tokens_equal_eager_and_every_decode_step_replays_a_graph(arch, eager_tokens, step_log):
    model = load_hf_model(tiny_hf_model_dir(arch))
    with transformers_cb.enabled(model, backend="cpu"):
        tokens = generate(model)
    assert tokens == eager_tokens
    decodes = [replays for decode, replays in step_log if decode]
    assert len(decodes) >= NEW_TOKENS - 1 and decodes == [1] * len(decodes), step_log
    stats = transformers_cb.stats(model)
    runner = transformers_cb.runner_of(model)
    assert stats.hits == sum(replays for _, replays in step_log) and stats.misses == 0
    assert 0 < stats.entries <= len(runner.dispatcher.keys())          # each key captured once, on first use
    # Only the steps above the largest token bucket (chunked prefills of 64 tokens) ran eagerly.
    assert stats.eager_steps == stats.eager_by_cause[EagerCause.ABOVE_LARGEST_BUCKET].steps > 0
    tokens_policy, contexts = runner.dispatcher.token_buckets, runner.dispatcher.context_buckets
    assert all(k.num_tokens in tokens_policy and k.max_seq_len in contexts for k in stats.per_key)
    # graphrt's capture sizes for 8 requests a step; cache reads every 256 tokens of the 1024 cached.
    assert tokens_policy.sizes == (1, 2, 4, 8, 16) and contexts.sizes == (256, 512, 768, 1024)


@pytest.mark.parametrize("arch", ["qwen3"], scope="module")
def test_keys_captured_ahead_strict_padding_writes_only_the_trash(eager_tokens, arch):
    """``ahead``: the whole key set is captured at transformers' warm-up on steps of pure
    padding, the cache sealed (strict); the live cache then holds what the eager run wrote (a
    padded token wrote no live slot) and the read-trash sector stays zero."""
    eager_model, model = (load_hf_model(tiny_hf_model_dir(arch)) for _ in range(2))
    assert generate(eager_model, persistent_manager=True) == eager_tokens
    with transformers_cb.enabled(model, backend="cpu", ahead=True, strict=True, capture_sizes=[8],
                                 context_buckets=[256]):
        tokens = generate(model, persistent_manager=True)
    assert tokens == eager_tokens
    runner = transformers_cb.runner_of(model)
    stats = runner.graph_cache.stats
    assert runner.graph_cache.sealed and stats.unplanned_builds == 0 and stats.failed_builds == 0
    assert stats.entries == len(runner.dispatcher.keys()) == 2         # tokens=8 x contexts 256, 1024
    assert stats.hits > 0 and stats.eager_steps == stats.eager_by_cause[EagerCause.ABOVE_LARGEST_BUCKET].steps
    caches = [m._cached_continuous_batching_manager.batch_processor.cache for m in (eager_model, model)]
    sector = caches[0].bytes_per_sector
    live = [c.cache_tensor[2 * sector:].view(torch.float32) for c in caches]
    torch.testing.assert_close(live[1], live[0], **graphrt.tolerance(torch.float32)._asdict())
    assert not caches[1].cache_tensor[:sector].any()
    assert caches[1].cache_tensor[sector:2 * sector].any()             # padding wrote its trash
    for m in (eager_model, model):
        m.destroy_cached_continuous_batching_manager()


def test_activation_is_explicit_and_reversible():
    """Nothing changes in transformers until enable; a model not enabled keeps transformers'
    runner while another is enabled; the last disable restores transformers' method."""
    original = ContinuousBatchingManager.__dict__["_create_batch_processor"]
    plain, graphed = (load_hf_model(tiny_hf_model_dir("llama")) for _ in range(2))
    assert not activation.is_patched()

    def runner_type(model):
        manager = model.init_continuous_batching(generation_config=generation_config(),
                                                 continuous_batching_config=cb_config())
        manager.warmup()                              # builds the batch processor, starts no thread
        return type(manager.batch_processor.model_runner)

    with transformers_cb.enabled(graphed, backend="cpu"):
        assert activation.is_patched() and activation.is_enabled(graphed) and not activation.is_enabled(plain)
        assert runner_type(graphed) is GraphrtCBRunner
        assert runner_type(plain) is not GraphrtCBRunner
    assert ContinuousBatchingManager.__dict__["_create_batch_processor"] is original
    assert not activation.is_patched() and runner_type(graphed) is not GraphrtCBRunner


def test_refusals_name_the_setting(monkeypatch):
    model = load_hf_model(tiny_hf_model_dir("llama"))
    with pytest.raises(graphrt.ConfigError, match="backend='xla'.*torch module"):
        transformers_cb.enable(model, backend="xla")
    with pytest.raises(graphrt.ConfigError, match="strict=True needs ahead=True"):
        transformers_cb.enable(model, backend="cpu", strict=True)
    with pytest.raises(graphrt.ConfigError, match="has no continuous batching"):
        transformers_cb.enable(torch.nn.Linear(2, 2), backend="cpu")
    assert not activation.is_patched()
    with transformers_cb.enabled(model, backend="cpu"):
        compiled = cb_config(varlen_compile_config={"fullgraph": False})
        with pytest.raises(graphrt.ConfigError, match="continuous_batching_config.varlen_compile_config"):
            model.generate_batch(PROMPTS[:1], generation_config=generation_config(),
                                 continuous_batching_config=compiled)
    assert transformers_cb.version_reason("5.24.0") is None
    monkeypatch.setattr(transformers_cb.importlib.metadata, "version", lambda name: "5.23.1")
    with pytest.raises(graphrt.BackendUnavailableError, match=r"5\.23\.1 is outside .*transformers>=5\.24,<5\.25"):
        transformers_cb.enable(model, backend="cpu")
    assert "transformers>=5.24,<5.25" in transformers_cb.version_reason("5.25.0")


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 8), st.integers(0, 4), st.integers(0, 24), st.data())
def test_padding_follows_graphrts_rules(tokens, reqs, keys, data):
    """Past the real rows every kwarg holds its rule's fill (KWARG_RULES); the real rows are untouched."""
    q, r, kv = 8, 4, 24 + 8
    logits = data.draw(st.integers(0, reqs))
    kwargs = {"input_ids": torch.arange(1, q + 1).view(1, q), "position_ids": torch.arange(5, q + 5).view(1, q),
              "write_index": [torch.arange(100, 100 + q)], "read_index": [torch.arange(200, 200 + kv)],
              "cu_seq_lens_q": torch.arange(r + 1) * 2, "cu_seq_lens_k": {"full_attention": torch.arange(r + 1) * 3},
              "logits_indices": torch.arange(7, 7 + r), "attention_mask": torch.zeros(1, 1, q, kv)}
    before = {k: (v[0].clone() if isinstance(v, list) else {n: t.clone() for n, t in v.items()} if isinstance(v, dict)
                  else v.clone()) for k, v in kwargs.items()}
    real = RealSizes(tokens, reqs, logits, [keys], {"full_attention": keys})
    KwargPadder(write_trash=[4096], read_trash=[0]).fill(kwargs, real)
    rows = {TOKEN: tokens, REQUEST: reqs, BOUNDARY: reqs + 1, KEY: keys}
    fills = defaults.PAD_FILL_VALUES
    expect = {"input_ids": fills["input_ids"], "position_ids": fills["positions"], "write_index": 4096,
              "read_index": 0, "logits_indices": 0}
    for name, rule in KWARG_RULES.items():
        got, old = kwargs[name], before[name]
        if isinstance(got, list):
            got = got[0]
        if name == "attention_mask":
            low = torch.finfo(torch.float32).min
            assert (got[..., tokens:, :] == low).all() and (got[..., :tokens, keys:] == low).all()
            assert (got[..., :tokens, :keys] == 0).all()
            continue
        if isinstance(got, dict):
            got, old = got["full_attention"], old["full_attention"]
        got, old = got.reshape(-1), old.reshape(-1)
        n = logits if name == "logits_indices" else rows[rule.level]
        assert torch.equal(got[:n], old[:n]), name
        tail = got[n:]
        want = old[n - 1] if rule.graphrt_field == "query_start_loc" else expect[name]
        assert (tail == want).all(), (name, tail, want)
