"""Configuration refused before anything is loaded or allocated (issue 26: accepted, then failing
later), each a ConfigError naming the field:

* sizes far past memory (``num_kv_blocks``, ``max_model_len``, ``max_num_seqs``,
  ``max_num_batched_tokens``, ``cudagraph_capture_sizes``, ``max_loras``) against the host's
  RAM and the device's memory, before the executor exists (backends/preflight.py);
* ``max_model_len`` above the model's ``max_position_embeddings`` without
  ``allow_long_max_model_len``;
* every boolean keyword of graphrt.LLM and ModelRunner strict, before the model is loaded;
* ``dtype`` names ("bfloat16", "half", "auto", ...) accepted on the torch and JAX backends, unknown
  ones refused naming ``dtype``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphrt
from graphrt import ConfigError, GraphConfig
from graphrt.backends import preflight
from graphrt.backends.torch.backend import TorchBackend
from graphrt.core.memory_bounds import Need, check_needs, physical_memory_bytes
from support.hf_models import make_tiny_hf_model, tiny_hf_model_dir
from support.fast_subset import examples

SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4)
GiB = 2**30


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(tiny_hf_model_dir("qwen3"))           # max_position_embeddings 256, float32


@pytest.fixture
def nothing_allocated(monkeypatch):
    """Creating an executor (where a runner's allocation starts) fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the executor was created (allocation began) before the ConfigError")

    monkeypatch.setattr(TorchBackend, "create_executor", refuse)


@pytest.fixture
def nothing_loaded(monkeypatch):
    """Loading a model fails the test: the engine's settings are checked before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the ConfigError")

    monkeypatch.setattr(TorchBackend, "load_model", refuse)


@pytest.fixture
def ram_8gib(monkeypatch):
    """A host of 8 GiB, whatever this machine has: the bounds are then the same everywhere."""
    monkeypatch.setattr(preflight, "physical_memory_bytes", lambda: 8 * GiB)


# ------------------------------------------------------------------------------ memory

MEMORY = [   # (field named, settings over SMALL): each implies far more than 8 GiB
    ("num_kv_blocks", dict(num_kv_blocks=10**9)),
    ("max_model_len", dict(max_model_len=10**9, allow_long_max_model_len=True, max_num_seqs=64,
                            max_num_batched_tokens=64)),
    ("max_num_seqs", dict(max_num_seqs=10**7, max_num_batched_tokens=10**7)),
    ("max_num_batched_tokens", dict(max_num_batched_tokens=10**8)),
    ("cudagraph_capture_sizes", dict(max_num_batched_tokens=10**8, cudagraph_capture_sizes=[8, 10**8])),
    # max_lora_rank itself is bounded at 512 (issue 30: test_config.py); many slots of it are not
    ("max_loras", dict(max_loras=4096, max_lora_rank=512, max_num_seqs=4096, max_num_batched_tokens=4096)),
]


@pytest.mark.parametrize("field,settings", MEMORY, ids=[f for f, _ in MEMORY])
def test_sizes_past_memory_are_refused_naming_the_field_before_allocating(field, settings, model_dir,
                                                                           nothing_allocated, ram_8gib):
    with pytest.raises(ConfigError, match=rf"^{field}: implies \d+ bytes .* above the {8 * GiB} bytes") as err:
        graphrt.ModelRunner(model_dir, backend="cpu", progress=False, **{**SMALL, **settings})
    assert "host RAM" in str(err.value)


@pytest.mark.parametrize("field,settings", MEMORY, ids=[f for f, _ in MEMORY])
def test_the_same_settings_at_sane_sizes_pass_the_check(field, settings, model_dir, ram_8gib):
    sane = {k: v for k, v in settings.items() if k in ("enable_lora", "allow_long_max_model_len")}
    if "max_loras" in settings:
        sane["enable_lora"] = True
    model = graphrt.select_backend("eager").load_model(model_dir)
    cfg = GraphConfig.create(**{**SMALL, **sane})
    preflight.check_memory(graphrt.select_backend("cpu"), model, cfg, num_kv_blocks=64)


def test_the_engines_own_tables_are_checked_before_the_model_is_loaded(model_dir, nothing_loaded, ram_8gib):
    """max_model_len=10**9 (allowed past the model's positions): the engine's token table of
    64 x 10**9 int32 -- a numpy MemoryError after seconds of allocation before."""
    with pytest.raises(ConfigError, match=r"^max_model_len: implies \d+ bytes .*engine's token and block tables"):
        graphrt.LLM(model_dir, backend="cpu", max_num_seqs=64, max_num_batched_tokens=64, max_model_len=10**9,
                    allow_long_max_model_len=True)


def test_a_device_is_checked_against_its_own_memory(model_dir, nothing_allocated, monkeypatch):
    """Host tables against the host's RAM, the KV cache and buffers against the device's."""
    backend = graphrt.select_backend("cpu")
    monkeypatch.setattr(type(backend), "device_memory_bytes", lambda self: 1 * GiB)
    blocks = 3 * GiB // (16 * 512)             # 3 GiB of KV cache: 512 bytes a token slot, 16 a block
    with pytest.raises(ConfigError, match=r"^num_kv_blocks: .* of cpu device memory"):
        graphrt.ModelRunner(model_dir, backend=backend, progress=False, num_kv_blocks=blocks,
                            **{**SMALL, "block_size": 16})


def test_the_host_bound_is_the_machines_physical_memory():
    assert physical_memory_bytes() == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") > 0


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 2**50)), min_size=1, max_size=5),
       st.integers(0, 2**51))
def test_needs_are_refused_exactly_when_they_exceed_what_is_available_naming_the_largest(parts, available):
    needs = [Need(field, f"thing {i}", nbytes) for i, (field, nbytes) in enumerate(parts)]
    total = sum(n for _, n in parts)
    if total <= available:
        check_needs(needs, available, "somewhere")
        return
    with pytest.raises(ConfigError) as err:
        check_needs(needs, available, "somewhere")
    largest = max(needs, key=lambda n: n.nbytes)
    assert str(err.value).startswith(f"{largest.field}: implies {largest.nbytes} bytes")
    assert f"with the rest {total} bytes" in str(err.value) and f"{available} bytes" in str(err.value)


# ----------------------------------------------------------------------- max_model_len

def test_max_model_len_above_the_models_positions_is_refused_before_loading(model_dir, nothing_loaded):
    """issue 26: max_model_len=4096 on a model of fewer positions was accepted silently."""
    for make in (lambda: graphrt.LLM(model_dir, backend="cpu", max_model_len=4096),
                 lambda: graphrt.ModelRunner(model_dir, backend="cpu", max_model_len=4096)):
        with pytest.raises(ConfigError, match=r"^max_model_len: 4096 exceeds the model's max_position_embeddings "
                                              r"\(256\).*allow_long_max_model_len"):
            make()


def test_allow_long_max_model_len_opts_in(model_dir):
    llm = graphrt.LLM(model_dir, backend="eager", max_num_seqs=2, max_num_batched_tokens=16, max_model_len=512,
                      allow_long_max_model_len=True)
    assert llm.config.max_model_len == 512
    assert len(llm.generate([[5, 6, 7]], graphrt.SamplingParams(max_tokens=2))[0].token_ids) == 2


# ------------------------------------------------------------------------------ booleans

@pytest.mark.parametrize("flag", ["enable_prefix_caching", "disable_overlap_schedule", "progress", "strict",
                                  "enforce_eager", "allow_long_max_model_len"])
@pytest.mark.parametrize("value", ["yes", "no", 1])
def test_every_boolean_keyword_of_the_engine_is_strict_before_loading(flag, value, model_dir, nothing_loaded):
    """issue 26: enable_prefix_caching="yes" was accepted while disable_overlap_schedule="no" was refused."""
    with pytest.raises(ConfigError, match=rf"{flag}: Input should be a valid boolean"):
        graphrt.LLM(model_dir, backend="cpu", **{**SMALL, flag: value})


@pytest.mark.parametrize("flag", ["progress", "strict", "debug_check_addresses"])
def test_the_runners_boolean_keywords_are_strict_before_loading(flag, model_dir, nothing_loaded):
    with pytest.raises(ConfigError, match=rf"{flag}: Input should be a valid boolean"):
        graphrt.ModelRunner(model_dir, backend="cpu", **{**SMALL, flag: "no"})


@pytest.mark.parametrize("value", ["no", "yes", 1, "eager"])
def test_the_runners_warmup_keyword_names_its_choices_before_loading(value, model_dir, nothing_loaded):
    """warmup is True / False or a mode ("upfront", "background"); anything else names them."""
    with pytest.raises(ConfigError, match=r"warmup: must be one of \['upfront', 'background'\], True or False"):
        graphrt.ModelRunner(model_dir, backend="cpu", **{**SMALL, "warmup": value})


# ------------------------------------------------------- kv_cache_memory, unknown keywords

def test_llm_takes_kv_cache_memory_as_the_runner_does(model_dir):
    """issue 47: graphrt.LLM refused kv_cache_memory (Extra inputs are not permitted) while
    docs/hybrid.md sizes the states out of it; the LLM's cache is the runner's for the budget."""
    per_block = 2 * 2 * 2 * 16 * 4 * 4        # layers x (K, V) x KV heads x head_dim x block_size x fp32
    llm = graphrt.LLM(model_dir, backend="eager", kv_cache_memory=10 * per_block + 7, **SMALL)
    assert llm.runner.num_kv_blocks == 10 and llm.runner.graph_memory.budget == 10 * per_block + 7
    assert llm.allocator.capacity == 9                          # block 0 is the null block
    assert len(llm.generate([[5, 6, 7]], graphrt.SamplingParams(max_tokens=2))[0].token_ids) == 2


@pytest.mark.parametrize("budget", ["8GB", True, -1, float("nan")])
def test_llm_refuses_a_bad_kv_cache_memory_before_loading(budget, model_dir, nothing_loaded):
    with pytest.raises(graphrt.InputError, match="kv_cache_memory: must be None or a finite number of bytes"):
        graphrt.LLM(model_dir, backend="eager", kv_cache_memory=budget, **SMALL)


@pytest.mark.parametrize("make", [graphrt.LLM, graphrt.ModelRunner])
def test_an_unknown_keyword_names_the_close_one_before_loading(make, model_dir, nothing_loaded):
    """issue 47: a misspelt keyword named no alternative ("Extra inputs are not permitted")."""
    with pytest.raises(ConfigError, match=r"kv_cache_memroy: not a keyword .* did you mean kv_cache_memory\b"):
        make(model_dir, backend="eager", kv_cache_memroy=1 << 20, **SMALL)
    with pytest.raises(ConfigError, match=r"max_num_seq: not a keyword .* did you mean max_num_seqs"):
        make(model_dir, backend="eager", **{**SMALL, "max_num_seq": 4})


# --------------------------------------------------------------------------------- dtype

@pytest.mark.parametrize("name,want", [("bfloat16", torch.bfloat16), ("BF16", torch.bfloat16),
                                       ("half", torch.float16), ("float16", torch.float16),
                                       ("float32", torch.float32), ("float", torch.float32),
                                       ("auto", torch.float32), (torch.bfloat16, torch.bfloat16),
                                       (None, torch.float32)])
def test_torch_loads_the_dtype_names_users_write(name, want, model_dir):
    """issue 26: dtype="bfloat16" failed deep in loading (empty(): argument 'dtype' must be torch.dtype)."""
    model = graphrt.select_backend("eager").load_model(model_dir, name)
    assert {p.dtype for p in model.parameters()} == {want}


def test_auto_is_the_checkpoints_dtype_and_the_engine_runs_in_it(tmp_path):
    path = make_tiny_hf_model(tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw.update({key: "bfloat16" for key in ("torch_dtype", "dtype") if key in raw} or {"torch_dtype": "bfloat16"})
    (path / "config.json").write_text(json.dumps(raw))
    llm = graphrt.LLM(str(path), backend="eager", dtype="auto", **SMALL)
    assert {p.dtype for p in llm.runner.model.parameters()} == {torch.bfloat16}
    assert len(llm.generate([[5, 6, 7]], graphrt.SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_the_jax_backend_loads_the_same_names(model_dir):
    import jax
    import jax.numpy as jnp

    xla = graphrt.select_backend("xla")
    for name, want in (("bfloat16", jnp.bfloat16), ("half", jnp.float16), ("auto", jnp.float32),
                       (torch.float16, jnp.float16)):
        model = xla.load_model(model_dir, name)
        assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(model.params)} == {jnp.dtype(want)}, name


@pytest.mark.parametrize("dtype", ["float8", "int8", "bfloat", torch.int32, 3])
def test_unknown_dtypes_are_refused_naming_dtype_before_loading(dtype, model_dir, nothing_loaded):
    for make in (lambda: graphrt.LLM(model_dir, backend="cpu", dtype=dtype, **SMALL),
                 lambda: graphrt.ModelRunner(model_dir, backend="cpu", dtype=dtype, **SMALL)):
        with pytest.raises(ConfigError, match=r"^dtype: .* is not a dtype graphrt's models run in"):
            make()
