"""GraphConfig: defaults, validation (field and bound named), derived policies, CLI round-trip."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from graphrt import BucketPolicy, ConfigError, GraphConfig, GraphMode, add_cli_args, from_cli_args
from graphrt.backends.xla.buckets import XlaBuckets
from graphrt.core import defaults
from graphrt.core.kv_spec import kv_cache_dtype_name
from support.fast_subset import examples

FIELDS = list(GraphConfig.model_fields)


# --------------------------------------------------------------------------------------
# Defaults
# --------------------------------------------------------------------------------------

def test_defaults():
    c = GraphConfig()
    assert c.mode is GraphMode.FULL_AND_PIECEWISE
    assert c.cudagraph_capture_sizes is None and c.max_cudagraph_capture_size is None
    assert c.precompile_token_paddings is None and c.precompile_bs_paddings is None
    assert not (c.disable_precompile or c.enforce_eager or c.strict or c.debug_check_addresses)
    assert (c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len, c.block_size) == (
        defaults.DEFAULT_MAX_NUM_SEQS, defaults.DEFAULT_MAX_NUM_BATCHED_TOKENS,
        defaults.DEFAULT_MAX_MODEL_LEN, defaults.DEFAULT_BLOCK_SIZE) == (256, 8192, 4096, 16)
    assert c.compilation_cache_dir is None
    assert c.max_blocks_per_req == 4096 // 16
    # capture sizes: vLLM's list up to min(2 * 256, 512, 8192) = 512
    assert c.capture_policy() == BucketPolicy.vllm_default(512)
    assert len(c.capture_policy()) == 51
    xla = XlaBuckets.from_config(c)
    assert xla.tokens == BucketPolicy.powers_of_two(8192, min_size=16)
    assert xla.batch_sizes == xla.decode == BucketPolicy.powers_of_two(256) and xla.max_reqs == 256
    assert GraphConfig.create() == c


def test_max_blocks_per_req_rounds_up():
    assert GraphConfig(max_model_len=33, block_size=16).max_blocks_per_req == 3
    assert GraphConfig(max_model_len=32, block_size=16).max_blocks_per_req == 2


def test_capture_sizes_are_sorted_and_deduplicated():
    c = GraphConfig(cudagraph_capture_sizes=[8, 1, 4, 4, 2])
    assert c.cudagraph_capture_sizes == [1, 2, 4, 8]
    assert list(c.capture_policy()) == [1, 2, 4, 8]


# --------------------------------------------------------------------------------------
# Validation: (kwargs, words the message must contain)
# --------------------------------------------------------------------------------------

INVALID = [
    (dict(max_num_seqs=0), ["max_num_seqs", "greater than 0"]),
    (dict(max_num_seqs=-3), ["max_num_seqs", "greater than 0"]),
    (dict(max_num_batched_tokens=0), ["max_num_batched_tokens", "greater than 0"]),
    (dict(max_model_len=0), ["max_model_len", "greater than 0"]),
    (dict(block_size=0), ["block_size", "greater than 0"]),
    (dict(max_num_seqs=10, max_num_batched_tokens=5), ["max_num_seqs", "max_num_batched_tokens",
                                                       "10", "5"]),
    (dict(cudagraph_capture_sizes=[]), ["cudagraph_capture_sizes", "empty"]),
    (dict(cudagraph_capture_sizes=[0, 4]), ["cudagraph_capture_sizes", "positive", "0"]),
    (dict(cudagraph_capture_sizes=[-2, 4]), ["cudagraph_capture_sizes", "positive", "-2"]),
    (dict(precompile_token_paddings=[]), ["precompile_token_paddings", "empty"]),
    (dict(precompile_bs_paddings=[0]), ["precompile_bs_paddings", "positive"]),
    (dict(max_cudagraph_capture_size=0), ["max_cudagraph_capture_size", "> 0"]),
    (dict(cudagraph_capture_sizes=[1, 2, 4], max_cudagraph_capture_size=8),
     ["max_cudagraph_capture_size", "cudagraph_capture_sizes", "8", "4"]),
    (dict(cudagraph_capture_sizes=[1, 9000]), ["cudagraph_capture_sizes", "max_num_batched_tokens",
                                               "9000", "8192"]),
    (dict(precompile_token_paddings=[16, 64]), ["precompile_token_paddings", "max_num_batched_tokens",
                                                "64", "8192"]),
    (dict(precompile_bs_paddings=[1, 2]), ["precompile_bs_paddings", "max_num_seqs", "2", "256"]),
    (dict(bogus_flag=1), ["bogus_flag"]),
    (dict(mode="SOMETIMES"), ["mode", "FULL_AND_PIECEWISE"]),
    (dict(max_num_seqs="many"), ["max_num_seqs", "integer"]),
    # issue 26: XLA paddings no step can use (mixed steps padded to 2**24 requests ran out of memory)
    (dict(max_num_seqs=4, precompile_bs_paddings=[4, 2**24]), ["precompile_bs_paddings", "16777216",
                                                               "max_num_seqs (4)"]),
    (dict(precompile_token_paddings=[16, 8192, 2**30]), ["precompile_token_paddings", "1073741824",
                                                         "max_num_batched_tokens (8192)"]),
    # issue 26: every boolean strict (enable_prefix_caching="yes" was accepted by the engine)
    *[(dict(**{flag: value}), [flag, "valid boolean"])
      for flag in ("disable_precompile", "enforce_eager", "strict", "check_baked_values", "debug_check_addresses",
                   "compile_model", "enable_lora", "allow_long_max_model_len")
      for value in ("yes", "no", 1, 0)],
    # issue 30: counts and sizes are ints (4.0, "4", [4.0] and True were taken as 4, 4, [4] and 1)
    (dict(max_num_seqs=4.0), ["max_num_seqs", "integer", "float 4.0"]),
    (dict(max_num_seqs="4"), ["max_num_seqs", "integer", "str '4'"]),
    (dict(cudagraph_capture_sizes=[4.0]), ["cudagraph_capture_sizes", "integer", "4.0"]),
    (dict(max_logprobs=True), ["max_logprobs", "integer", "bool True"]),
    (dict(block_size=16.5), ["block_size", "integer", "16.5"]),
    # issue 30: max_lora_rank is bounded (10**7 was an out-of-memory kill, not an error)
    (dict(max_lora_rank=10**7), ["max_lora_rank", "512", "10000000"]),
]


@pytest.mark.parametrize("kwargs,words", INVALID, ids=[str(k) for k, _ in INVALID])
def test_create_raises_config_error_naming_the_field(kwargs, words):
    with pytest.raises(ConfigError) as excinfo:
        GraphConfig.create(**kwargs)
    assert isinstance(excinfo.value, ValueError)
    for word in words:
        assert word in str(excinfo.value), (word, str(excinfo.value))


@pytest.mark.parametrize("kwargs,words", INVALID, ids=[str(k) for k, _ in INVALID])
def test_constructor_raises_validation_error(kwargs, words):
    with pytest.raises(ValidationError) as excinfo:
        GraphConfig(**kwargs)
    for word in words:
        assert word in str(excinfo.value), (word, str(excinfo.value))


def test_assignment_is_validated():
    c = GraphConfig()
    with pytest.raises(ValidationError, match="max_num_seqs"):
        c.max_num_seqs = 0
    with pytest.raises(ValidationError, match="max_num_batched_tokens"):
        c.max_num_batched_tokens = 8          # now below max_num_seqs=256


def test_paddings_above_the_one_covering_the_limit_are_refused_but_one_covering_padding_is_kept():
    c = GraphConfig.create(max_num_seqs=6, max_num_batched_tokens=100, precompile_bs_paddings=[1, 2, 8],
                           precompile_token_paddings=[16, 64, 128])
    xla = XlaBuckets.from_config(c)
    assert xla.dispatcher().mixed_num_reqs == xla.max_reqs == 8 and xla.tokens.max_size == 128
    with pytest.raises(ConfigError, match=r"precompile_bs_paddings: \[16\] above 8"):
        GraphConfig.create(max_num_seqs=6, max_num_batched_tokens=100, precompile_bs_paddings=[1, 8, 16])


@pytest.mark.parametrize("value", ["yes", "no", "true", 1, 0, None, np.bool_(True)])
def test_engine_flags_are_as_strict_as_the_configs(value):
    """graphrt.LLM's and ModelRunner's boolean keywords go through check_flags: refused exactly
    where GraphConfig refuses the same value for one of its own flags."""
    from graphrt.config import check_flags

    with pytest.raises(ConfigError, match="enable_prefix_caching: Input should be a valid boolean"):
        check_flags(enable_prefix_caching=value)
    with pytest.raises(ConfigError, match="strict: Input should be a valid boolean"):
        GraphConfig.create(strict=value)


def test_counts_take_numpy_integers_and_kv_cache_dtype_takes_every_dtype_spelling():
    c = GraphConfig.create(max_num_seqs=np.int64(4), cudagraph_capture_sizes=[np.int32(2), 4])
    assert (c.max_num_seqs, c.cudagraph_capture_sizes) == (4, [2, 4]) and type(c.max_num_seqs) is int
    for spelling, name in defaults.MODEL_DTYPE_NAMES.items():          # "bf16" was refused, "half" taken
        assert GraphConfig.create(kv_cache_dtype=spelling).kv_cache_dtype == spelling
        assert kv_cache_dtype_name(spelling) == name


def test_booleans_stay_booleans():
    from graphrt.config import check_flags

    check_flags(a=True, b=False)
    c = GraphConfig.create(strict=True, enforce_eager=False, enable_lora=True, allow_long_max_model_len=True)
    assert (c.strict, c.enforce_eager, c.enable_lora, c.allow_long_max_model_len) == (True, False, True, True)


def test_max_model_len_above_the_models_positions_needs_the_explicit_override(caplog):
    """issue 26: max_model_len=4096 on a model of 512 positions was accepted silently."""
    with pytest.raises(ConfigError, match=r"max_model_len: 4096 exceeds the model's max_position_embeddings \(512\)"
                                          r".*allow_long_max_model_len"):
        GraphConfig.create(max_model_len=4096).check_model_len(512)
    GraphConfig.create(max_model_len=4096, allow_long_max_model_len=True).check_model_len(512)
    GraphConfig.create(max_model_len=512).check_model_len(512)
    GraphConfig.create(max_model_len=4096).check_model_len(None)          # a model that does not say
    with caplog.at_level("INFO", logger="graphrt"):
        GraphConfig.create().check_model_len(512)                          # the default was never asked for
    assert "max_model_len defaults to 4096" in caplog.text


def test_mode_accepts_strings_and_enums():
    assert GraphConfig(mode="PIECEWISE").mode is GraphMode.PIECEWISE
    assert GraphConfig(mode=GraphMode.FULL).mode is GraphMode.FULL


# --------------------------------------------------------------------------------------
# Derived policies cover the limits
# --------------------------------------------------------------------------------------

limits = st.integers(1, 1024).flatmap(
    lambda seqs: st.tuples(st.just(seqs), st.integers(seqs, 16384)))


@settings(max_examples=examples(200), deadline=None)
@given(limits)
def test_policies_cover_the_limits(lim):
    seqs, tokens = lim
    c = GraphConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens)
    xla = XlaBuckets.from_config(c)
    assert xla.tokens.max_size >= tokens
    assert xla.batch_sizes.max_size == xla.max_reqs >= seqs
    cap = c.capture_policy()
    # vLLM's min(2 * max_num_seqs, 512), but never below max_num_seqs: the configured largest
    # decode batch always has a graph (issue 26)
    assert cap.max_size == min(max(min(2 * seqs, defaults.VLLM_DEFAULT_MAX_CAPTURE_SIZE), seqs), tokens)
    assert cap.max_size <= tokens
    assert cap == BucketPolicy.vllm_default(cap.max_size)


@settings(max_examples=examples(100), deadline=None)
@given(limits, st.data())
def test_explicit_paddings_are_used(lim, data):
    seqs, tokens = lim
    tok = sorted(set(data.draw(st.lists(st.integers(1, tokens), max_size=5)) + [tokens]))
    bs = sorted(set(data.draw(st.lists(st.integers(1, seqs), max_size=5)) + [seqs]))
    cap = data.draw(st.lists(st.integers(1, tokens), min_size=1, max_size=6))
    c = GraphConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens, precompile_token_paddings=tok,
                    precompile_bs_paddings=bs, cudagraph_capture_sizes=cap)
    xla = XlaBuckets.from_config(c)
    assert list(xla.tokens) == tok
    assert list(xla.batch_sizes) == bs and xla.max_reqs == max(bs)
    assert list(c.capture_policy()) == sorted(set(cap))


def test_max_capture_size_alone():
    c = GraphConfig(max_num_seqs=8, max_num_batched_tokens=64, max_cudagraph_capture_size=40)
    assert c.capture_policy() == BucketPolicy.vllm_default(40)
    c = GraphConfig(max_num_seqs=8, max_num_batched_tokens=64, max_cudagraph_capture_size=100)
    assert c.capture_policy().max_size == 64


def test_dispatchers_follow_the_config():
    c = GraphConfig(max_num_seqs=8, max_num_batched_tokens=64, mode="FULL_DECODE_ONLY")
    d = c.graph_dispatcher()
    assert d.mode is GraphMode.FULL_DECODE_ONLY and d.token_buckets == c.capture_policy()
    assert c.graph_dispatcher(GraphMode.PIECEWISE).mode is GraphMode.PIECEWISE
    eager = GraphConfig(enforce_eager=True).graph_dispatcher()
    assert eager.mode is GraphMode.NONE and eager.keys() == []
    xla = XlaBuckets.from_config(c)
    x = xla.dispatcher()
    assert x.token_buckets == xla.tokens and x.decode_buckets == xla.batch_sizes
    assert x.eager_fallback is False


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engine")
    p.add_argument("--model", default="m")        # the engine's own flags live alongside
    assert add_cli_args(p) is p
    return p


def test_every_field_has_a_flag():
    p = parser()
    flags = p._option_string_actions
    for name in FIELDS:
        flag = "--" + name.replace("_", "-")
        assert flag in flags, flag
        assert flags[flag].dest == name
        assert flags[flag].help


def test_no_flags_gives_the_defaults():
    args = parser().parse_args([])
    assert all(getattr(args, name) is None for name in FIELDS)
    assert from_cli_args(args) == GraphConfig()


def test_flags_parse():
    args = parser().parse_args([
        "--mode", "FULL_DECODE_ONLY", "--cudagraph-capture-sizes", "1", "2", "4", "8",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--enforce-eager", "--strict",
        "--precompile-token-paddings", "16", "64", "--compilation-cache-dir", "/tmp/x",
        "--block-size", "32", "--model", "other"])
    c = from_cli_args(args)
    assert c.mode is GraphMode.FULL_DECODE_ONLY
    assert c.cudagraph_capture_sizes == [1, 2, 4, 8]
    assert c.precompile_token_paddings == [16, 64]
    assert (c.max_num_seqs, c.max_num_batched_tokens, c.block_size) == (8, 64, 32)
    assert c.enforce_eager is True and c.strict is True and c.disable_precompile is False
    assert c.compilation_cache_dir == "/tmp/x"
    assert args.model == "other"


def test_mode_choices():
    p = parser()
    for m in GraphMode:
        assert from_cli_args(p.parse_args(["--mode", m.value])).mode is m
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "SOMETIMES"])
    assert set(p._option_string_actions["--mode"].choices) == {m.value for m in GraphMode}


def test_overrides_and_invalid_cli_values():
    args = parser().parse_args(["--max-num-seqs", "4"])
    assert from_cli_args(args, max_num_seqs=2).max_num_seqs == 2
    with pytest.raises(ConfigError, match="max_num_seqs"):
        from_cli_args(parser().parse_args(["--max-num-seqs", "0"]))
    with pytest.raises(SystemExit):
        parser().parse_args(["--max-num-seqs", "four"])


def to_argv(c: GraphConfig) -> list[str]:
    """Every non-default field of ``c`` as flags."""
    argv: list[str] = []
    for name in FIELDS:
        value = getattr(c, name)
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif isinstance(value, GraphMode):
            argv += [flag, value.value]
        else:
            argv += [flag, str(value)]
    return argv


@st.composite
def configs(draw) -> GraphConfig:
    seqs = draw(st.integers(1, 512))
    tokens = draw(st.integers(seqs, 8192))
    kw = dict(max_num_seqs=seqs, max_num_batched_tokens=tokens,
              mode=draw(st.sampled_from(list(GraphMode))),
              max_model_len=draw(st.integers(1, 32768)), block_size=draw(st.integers(1, 128)))
    for flag in ("disable_precompile", "enforce_eager", "strict", "debug_check_addresses"):
        kw[flag] = draw(st.booleans())
    if draw(st.booleans()):
        kw["cudagraph_capture_sizes"] = draw(st.lists(st.integers(1, tokens), min_size=1, max_size=6))
    elif draw(st.booleans()):
        kw["max_cudagraph_capture_size"] = draw(st.integers(1, tokens))
    if draw(st.booleans()):
        kw["precompile_token_paddings"] = draw(st.lists(st.integers(1, tokens), max_size=4)) + [tokens]
    if draw(st.booleans()):
        kw["precompile_bs_paddings"] = draw(st.lists(st.integers(1, seqs), max_size=4)) + [seqs]
    if draw(st.booleans()):
        kw["compilation_cache_dir"] = "/tmp/" + draw(st.text("abcxyz_-", min_size=1, max_size=8))
    return GraphConfig(**kw)


@settings(max_examples=examples(150), deadline=None)
@given(configs())
def test_cli_round_trip(c):
    assert from_cli_args(parser().parse_args(to_argv(c))) == c
