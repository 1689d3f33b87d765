"""JAX models with a config class of their own on the xla backend.

A GPT-NeoX-shaped model (tests/support/jax_neox.py: partial rotary, parallel residual, LayerNorm,
its own frozen-dataclass config with no ``architecture``) runs through a ``ModelRunner`` as an
``XlaModel(config, params, forward=, compute_logits=)`` and as a flax nnx module, and gives
its own plain causal forward's logits step after step. The config protocol
(``graphrt.models.jax.model_config``) is checked when the runner is built: a missing member is
named before anything compiles. graphrt's own DecoderConfig keeps working (test_xla_backend.py).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import graphrt  # noqa: E402
from support import jax_neox as neox  # noqa: E402
from graphrt import ConfigError, InputError, ModelRunner  # noqa: E402
from graphrt.backends.xla.programs import XlaModel  # noqa: E402
from graphrt.models.hf_config import model_eos_token_ids  # noqa: E402
from graphrt.models.jax.model_config import JaxModelConfig, check_model_config  # noqa: E402
from support.runner_steps import greedy  # noqa: E402

LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4,
              precompile_token_paddings=[16, 32], precompile_bs_paddings=[1, 2, 4])
ATOL = 1e-4


def _nnx_module(cfg: neox.NeoXConfig, params: dict, block_size: int):
    nnx = pytest.importorskip("flax.nnx")

    def values(tree):
        return jax.tree.map(lambda v: v[...], tree, is_leaf=lambda v: isinstance(v, nnx.Variable))

    class NeoXModule(nnx.Module):
        def __init__(self) -> None:
            self.config, self.block_size = cfg, block_size
            self.params = nnx.data(jax.tree.map(nnx.Param, params))

        def __call__(self, kv_cache, input_ids, positions, meta):
            return neox.forward(values(self.params), kv_cache, input_ids, positions, meta,
                                config=self.config, block_size=self.block_size)

        def compute_logits(self, hidden):
            return neox.compute_logits(values(self.params), hidden, config=self.config)

    return NeoXModule()


def _model(kind: str, cfg: neox.NeoXConfig, params: dict):
    if kind == "functions":
        return XlaModel(cfg, params, forward=neox.forward, compute_logits=neox.compute_logits)
    return _nnx_module(cfg, params, LIMITS["block_size"])


@pytest.mark.parametrize("kind", ["functions", "nnx"])
def test_a_neox_model_with_its_own_config_matches_its_plain_forward(kind):
    cfg = neox.NeoXConfig()
    assert isinstance(cfg, JaxModelConfig) and not hasattr(cfg, "architecture")
    params = neox.init_params(cfg)
    runner = ModelRunner(_model(kind, cfg, params), backend="xla", disable_precompile=True, progress=False,
                         **LIMITS)
    assert runner.vocab_size == cfg.vocab_size
    assert runner.executor.kv_cache.shape == (2, 2, runner.num_kv_blocks * 4 + 1, 4, 8)
    rng = np.random.default_rng(3)
    prompts = {0: rng.integers(1, cfg.vocab_size, 7).tolist(), 1: rng.integers(1, cfg.vocab_size, 5).tolist()}
    tokens = np.zeros((4, LIMITS["max_model_len"]), np.int32)
    blocks = (1 + np.arange(4 * 16, dtype=np.int32)).reshape(4, 16)
    seqs = {row: list(p) for row, p in prompts.items()}
    done = {row: 0 for row in seqs}
    seen = []
    for row, p in prompts.items():
        tokens[row, :len(p)] = p
    for _ in range(4):                          # the prefill of both, then three decodes
        rows = sorted(seqs)
        sched = [len(seqs[r]) - done[r] for r in rows]
        out = runner.execute(token_ids=tokens, block_table=blocks, req_rows=np.array(rows),
                             num_computed_tokens=np.array([done[r] for r in rows]),
                             num_scheduled_tokens=np.array(sched), sampling=greedy(len(rows)))
        logits = runner.outputs.logits()
        for i, r in enumerate(rows):
            done[r] = len(seqs[r])
            seen.append((r, done[r] - 1, logits[i]))
            assert int(out[i]) == int(np.argmax(logits[i]))
            tokens[r, len(seqs[r])] = int(out[i])
            seqs[r].append(int(out[i]))
    # Causal: the plain forward of each whole sequence has every step's logits in its rows.
    want = {r: neox.reference_logits(params, cfg, seq) for r, seq in seqs.items()}
    for r, position, got in seen:
        np.testing.assert_allclose(got, want[r][position], rtol=ATOL, atol=ATOL)
    assert runner.executor.compiles.stats.unplanned_builds == 0


@dataclasses.dataclass(frozen=True)
class _NoHeadDim:
    vocab_size: int = 96
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_key_value_heads: int = 4


def test_a_missing_member_is_named_when_the_runner_is_built():
    params = neox.init_params(neox.NeoXConfig())
    model = XlaModel(_NoHeadDim(), params, forward=neox.forward, compute_logits=neox.compute_logits)
    with pytest.raises(ConfigError, match=r"_NoHeadDim\) without head_dim"):
        ModelRunner(model, backend="xla", warmup=False, progress=False, **LIMITS)
    with pytest.raises(ConfigError, match="no config"):
        check_model_config(None)
    zero_heads = type("C", (), {**dataclasses.asdict(_NoHeadDim()), "head_dim": 8, "num_key_value_heads": 0})()
    with pytest.raises(ConfigError, match=r"model.config.num_key_value_heads: must be a positive integer"):
        check_model_config(zero_heads)


def test_tensor_parallelism_also_needs_the_head_and_mlp_sizes():
    cfg = type("C", (), {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2,
                         "num_key_value_heads": 4, "head_dim": 8})()
    check_model_config(cfg)
    with pytest.raises(ConfigError, match="without num_attention_heads, intermediate_size"):
        check_model_config(cfg, tp_size=2)


def test_graphrts_decoder_needs_its_decoder_config_and_functions_come_in_pairs():
    cfg = neox.NeoXConfig()
    params = neox.init_params(cfg)
    with pytest.raises(InputError, match="reads a DecoderConfig, not a NeoXConfig"):
        ModelRunner(XlaModel(cfg, params), backend="xla", warmup=False, progress=False, **LIMITS)
    with pytest.raises(InputError, match="both forward and compute_logits"):
        ModelRunner(XlaModel(cfg, params, forward=neox.forward), backend="xla", warmup=False, progress=False,
                    **LIMITS)


def test_an_eos_id_written_as_one_int_is_read():
    model = XlaModel(neox.NeoXConfig(eos_token_id=0), {}, neox.forward, neox.compute_logits)
    assert model_eos_token_ids(model) == (0,)


class _NoMlpSize:
    """A config without ``intermediate_size`` (read only for tensor parallelism and the estimate)."""

    def __init__(self, cfg: neox.NeoXConfig) -> None:
        self._cfg = cfg

    def __getattr__(self, name: str):
        if name == "intermediate_size":
            raise AttributeError(name)
        return getattr(self._cfg, name)


def test_a_config_without_intermediate_size_runs_on_one_device():
    """docs/xla.md: intermediate_size is needed only above tp_size 1 (it was a raw AttributeError)."""
    cfg = neox.NeoXConfig()
    params = neox.init_params(cfg)
    runner = ModelRunner(XlaModel(_NoMlpSize(cfg), params, forward=neox.forward, compute_logits=neox.compute_logits),
                         backend="xla", warmup=False, progress=False, **LIMITS)
    want = ModelRunner(XlaModel(cfg, params, forward=neox.forward, compute_logits=neox.compute_logits),
                       backend="xla", warmup=False, progress=False, **LIMITS)
    tokens = np.arange(1, 9, dtype=np.int32).reshape(1, 8)
    for r in (runner, want):
        r.execute(token_ids=tokens, block_table=np.arange(1, 17, dtype=np.int32).reshape(1, 16),
                  req_rows=np.array([0]), num_computed_tokens=np.array([0]), num_scheduled_tokens=np.array([5]))
    np.testing.assert_allclose(runner.outputs.logits(), want.outputs.logits(), atol=ATOL)


class _DevicesLengths(graphrt.AttentionDeclarations):
    """A JAX attention that reads every length on the device: it keys no context."""

    name = "neox-any-context"


def _neox(attention=None) -> XlaModel:
    cfg = neox.NeoXConfig()
    return XlaModel(cfg, neox.init_params(cfg), forward=neox.forward, compute_logits=neox.compute_logits,
                    attention_backend=attention)


def test_an_xla_models_attention_is_declared_as_a_torch_models_is():
    """The declarations are the seam's, read by the xla backend: keying nothing drops the context
    buckets (one executable per token / batch padding serves any context), and the tokens stay."""
    narrow = ModelRunner(_neox(), backend="xla", warmup=False, progress=False, **LIMITS)
    wide = ModelRunner(_neox(_DevicesLengths()), backend="xla", warmup=False, progress=False, **LIMITS)
    assert narrow.executor.capabilities.keyed_host_values == ("max_seq_len",) and narrow.dispatcher.context_sizes
    assert wide.executor.capabilities.keyed_host_values == () and wide.dispatcher.context_sizes == ()
    assert all(key.max_seq_len is None for _, key in wide.dispatcher.keys())
    assert all(key.max_seq_len == 64 for _, key in narrow.dispatcher.keys())
    tokens = np.arange(1, 9, dtype=np.int32).reshape(1, 8)
    for r in (narrow, wide):
        r.execute(token_ids=tokens, block_table=np.arange(1, 17, dtype=np.int32).reshape(1, 16),
                  req_rows=np.array([0]), num_computed_tokens=np.array([0]), num_scheduled_tokens=np.array([5]))
    assert wide.last_step.key.max_seq_len is None and narrow.last_step.key.max_seq_len is not None
    np.testing.assert_allclose(wide.outputs.logits(), narrow.outputs.logits(), atol=ATOL)


@pytest.mark.parametrize("attrs,settings,message", [
    (dict(graph_support=graphrt.AttentionGraphSupport.UNIFORM_BATCH), {}, r"graph_support UNIFORM_BATCH.*ALWAYS"),
    (dict(refreshed_host_values=("seq_lens",)), {}, r"refreshed_host_values \['seq_lens'\].*runs no Python"),
    (dict(kv_cache_dtypes=("float32",)), dict(kv_cache_dtype="fp8"), r"groups\[0\]\.dtype: float8_e4m3fn"),
    (dict(keyed_host_values=lambda self, d, t: ("seq_lens",)), {}, r"keys on \['seq_lens'\]"),
])
def test_what_the_xla_backend_cannot_do_is_refused_naming_the_declaration(attrs, settings, message):
    declared = type("Declared", (graphrt.AttentionDeclarations,), {"name": "neox-declared", **attrs})()
    with pytest.raises(ConfigError, match=r"attention backend 'neox-declared'|" + message) as err:
        ModelRunner(_neox(declared), backend="xla", warmup=False, progress=False, **LIMITS, **settings)
    assert re.search(message, str(err.value)), str(err.value)
