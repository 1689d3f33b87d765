"""KV cache specs (issue 22): what a model declares of its KV cache, and what the runner does
with it.

* the spec in the core: sizes per group (K and V head sizes apart, MLA, fp8), layers of one
  stored layout sharing one allocation, the old ``(layers, kv_heads, head_dim)`` tuple;
* bad specs refused with a ConfigError naming the field before the executor exists (so before
  any allocation), as tests/core/test_preflight.py checks its sizes;
* user models end to end on ``cpu``: one returning the old tuple, a hybrid whose two layers have
  different specs and layouts but one block table, and one that owns its cache;
* the torch executor's allocation per group, K and V of different head sizes included;
* fp8 KV scales read from the checkpoint.
"""

from __future__ import annotations

import re
import types

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import graphrt
from graphrt import ConfigError, InputError, KVCacheGroup, KVCacheSpec, SamplingParams
from graphrt.backends import preflight
from graphrt.backends.torch.backend import TorchBackend
from graphrt.backends.torch.executor import TorchExecutor
from graphrt.core.kv_spec import resolve_kv_spec
from graphrt.layers.torch.attention.paged import PagedAttention
from graphrt.models.torch.loader import load_torch_model
from support.hf_models import SLIDING, make_tiny_hf_model, random_prompts, tiny_hf_model_dir
from support.fast_subset import examples, slow_except
from support.parity import assert_close_across_shapes

LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4)
CPU = dict(LIMITS, cudagraph_capture_sizes=[4, 8, 32])
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = random_prompts((2, 7, 13, 40), seed=5)
TORCH_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


# ---- the spec in the core -------------------------------------------------------------------

def test_bytes_per_block_follow_each_group():
    spec = resolve_kv_spec(KVCacheSpec((
        KVCacheGroup((0, 2), 2, 16),                                     # fp32 K and V: 2 * 2 * 16 * 4
        KVCacheGroup((1,), 4, 16, head_size_v=8, dtype="bfloat16"),      # K 16, V 8: 4 * 24 * 2
        KVCacheGroup.mla((3,), 576, dtype="fp8"),                        # one latent row: 576 * 1
        KVCacheGroup((4,), 2, 16, sliding_window=8))),                   # as group 0, sliding
        block_size=4, model_dtype="float32", supported=TORCH_DTYPES, backend="cpu", num_layers=5)
    assert spec.bytes_per_token() == 3 * 256 + 192 + 576
    assert spec.bytes_per_block(4) == 4 * (3 * 256 + 192 + 576)
    assert spec.sliding_windows == (0, 0, 0, 0, 8)
    assert [g.dtype for g in spec.groups] == ["float32", "bfloat16", "float8_e4m3fn", "float32"]
    # The window changes nothing stored: layers 0, 2 and 4 are one allocation.
    assert [(g.layer_shapes(9), layers) for g, layers in spec.storage()] == [
        (((2, 9, 2, 16),), (0, 2, 4)), (((9, 4, 16), (9, 4, 8)), (1,)), (((9, 576),), (3,))]


def test_the_old_tuple_is_one_group_and_kv_cache_dtype_fills_auto():
    spec = resolve_kv_spec((2, 2, 16), block_size=4, model_dtype="bfloat16", supported=TORCH_DTYPES,
                           backend="cpu", kv_cache_dtype="fp8_e5m2")
    assert spec == KVCacheSpec((KVCacheGroup((0, 1), 2, 16, dtype="float8_e5m2", block_size=4),))
    assert spec.bytes_per_block(4) == 4 * 2 * 2 * 2 * 16
    same = resolve_kv_spec(KVCacheSpec.uniform(2, 2, 16), block_size=4, model_dtype=torch.bfloat16,
                           supported=TORCH_DTYPES, backend="cpu")
    assert same.groups[0].dtype == "bfloat16"


# ---- bad specs: a ConfigError naming the field, before any allocation -------------------------

class Declared(torch.nn.Module):
    """graphrt's Qwen3 (or the hybrid sliding one) with a user's declarations on top."""

    def __init__(self, inner: torch.nn.Module, spec=None, **methods) -> None:
        super().__init__()
        self.inner, self.config, self._spec = inner, inner.config, spec
        for name, fn in methods.items():
            setattr(self, name, fn)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)

    def attention_layers(self) -> list[torch.nn.Module]:
        return self.inner.attention_layers()

    def kv_cache_spec(self):
        return self.inner.kv_cache_spec() if self._spec is None else self._spec


class NoSpec(Declared):
    kv_cache_spec = None


def qwen3(**overrides) -> torch.nn.Module:
    return load_torch_model(tiny_hf_model_dir("qwen3", **overrides))


BAD_SPECS = [   # (field named, spec the model returns, runner settings)
    ("kv_cache_spec.groups[0].head_size", KVCacheSpec.uniform(2, 2, 0), {}),
    ("kv_cache_spec.groups[0].num_kv_heads", (2, 0, 16), {}),
    ("kv_cache_spec.groups[0].dtype", KVCacheSpec.uniform(2, 2, 16, dtype="int8"), {}),
    ("kv_cache_spec.groups[0].block_size", KVCacheSpec.uniform(2, 2, 16, block_size=8), {}),
    ("kv_cache_spec.groups[0].layers", KVCacheSpec.uniform(3, 2, 16), {}),
    ("kv_cache_spec.groups[1].layers", KVCacheSpec((KVCacheGroup((0, 1), 2, 16), KVCacheGroup((1,), 2, 16))), {}),
    ("kv_cache_spec.groups", KVCacheSpec((KVCacheGroup((0,), 2, 16),)), {}),
    ("kv_cache_spec.groups[0].num_kv_heads", KVCacheSpec((KVCacheGroup((0, 1), 2, 16, latent_dim=64),)), {}),
    ("kv_cache_spec.groups[0].sliding_window", KVCacheSpec.uniform(2, 2, 16, sliding_window=-1), {}),
    ("kv_cache_spec", "a spec", {}),
    ("kv_cache_spec", KVCacheSpec.owned(), {}),                  # owns its cache, allocates nothing
    ("kv_cache_dtype", KVCacheSpec.uniform(2, 2, 16, dtype="float16"), dict(kv_cache_dtype="fp8")),
    ("kv_cache_dtype", None, dict(kv_cache_dtype="int4")),
]


@pytest.fixture
def nothing_allocated(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the executor was created (allocation began) before the ConfigError")

    monkeypatch.setattr(TorchBackend, "create_executor", refuse)


@pytest.mark.parametrize("field,spec,settings", BAD_SPECS, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BAD_SPECS)])
def test_bad_specs_are_refused_naming_the_field_before_allocating(field, spec, settings, nothing_allocated):
    model = Declared(qwen3(), spec)
    with pytest.raises(ConfigError, match="^" + re.escape(field) + ": "):
        graphrt.ModelRunner(model, backend="cpu", **LIMITS, **settings)


def test_missing_method_and_a_window_the_layers_do_not_have_are_refused(nothing_allocated):
    with pytest.raises(ConfigError, match=r"\(NoSpec\) does not follow .*implement kv_cache_spec: kv_cache_spec\(\) -> a graphrt.KVCacheSpec"):
        graphrt.ModelRunner(NoSpec(qwen3()), backend="cpu", **LIMITS)
    hybrid = qwen3(**SLIDING)                   # layer 1 slides over 5 tokens; this spec says none does
    with pytest.raises(ConfigError, match=r"^kv_cache_spec.groups\[0\].sliding_window: 0, but attention layer 1"):
        graphrt.ModelRunner(Declared(hybrid, KVCacheSpec.uniform(2, 2, 16)), backend="cpu", **LIMITS)


LYING_SPECS = [   # issue 30: a spec the layers contradict (every capture then failed, then a raw error)
    (KVCacheSpec.uniform(2, 4, 16), r"groups\[0\]\.num_kv_heads: 4, but attention layer 0 \(PagedAttention\) has "
                                    r"num_kv_heads 2$"),
    ((2, 4, 16), r"groups\[0\]\.num_kv_heads: 4, but attention layer 0 \(PagedAttention\) has num_kv_heads 2$"),
    (KVCacheSpec.uniform(2, 2, 32), r"groups\[0\]\.head_size: 32, but attention layer 0 \(PagedAttention\) has "
                                    r"head_size 16$"),
    (KVCacheSpec.uniform(2, 2, 16, head_size_v=8), r"groups\[0\]\.head_size_v: 8, but attention layer 0 "
                                                   r"\(PagedAttention\) has head_size_v 16$"),
    (KVCacheSpec((KVCacheGroup((0,), 2, 16), KVCacheGroup((1,), 1, 16))),
     r"groups\[1\]\.num_kv_heads: 1, but attention layer 1 \(PagedAttention\) has num_kv_heads 2$"),
    (KVCacheSpec((KVCacheGroup((0,), 2, 16), KVCacheGroup.mla((1,), 64))),
     r"groups\[1\]\.latent_dim: 64 \(an MLA group.*attention layer 1 \(PagedAttention\) attends over paged KV "
     r"heads \(num_kv_heads 2, head_size 16\)"),
]


@pytest.mark.parametrize("spec,message", LYING_SPECS, ids=[str(i) for i in range(len(LYING_SPECS))])
def test_a_spec_the_layers_contradict_is_refused_naming_group_layer_and_values(spec, message, nothing_allocated):
    with pytest.raises(ConfigError, match=r"^kv_cache_spec\." + message):
        graphrt.ModelRunner(Declared(qwen3(), spec), backend="cpu", **LIMITS)


def test_an_fp8_cache_for_a_kernel_that_declares_none_is_refused_by_name():
    """An own kernel given kv_cache_dtype="fp8" got an fp8 cache it cannot write (a raw dtype
    error at the first step). Its backend declares the KV dtypes it reads and writes."""
    from support import user_attention
    for kv in ("fp8", "fp8_e5m2"):
        with pytest.raises(ConfigError, match=r"^kv_cache_spec\.groups\[0\]\.dtype: float8_e\w+, but attention "
                                              r"backend 'user-dense' reads and writes KV caches of \['float64', "
                                              r"'float32', 'float16', 'bfloat16'\] only"):
            graphrt.ModelRunner(user_attention.dense_model(), backend="cpu", kv_cache_dtype=kv, **LIMITS)

    class Fp8Dense(user_attention.DenseBackend):
        kv_cache_dtypes = ("float32", "fp8")                 # it says it writes fp8: no refusal
    model = user_attention.dense_model()
    model.attention_backend = Fp8Dense()
    runner = graphrt.ModelRunner(model, backend="cpu", kv_cache_dtype="fp8", warmup=False, **LIMITS)
    assert runner.executor.kv_cache.dtype == torch.float8_e4m3fn
    layers = qwen3().attention_layers()                       # graphrt's own: fp8 declared
    assert graphrt.ModelRunner(qwen3(), backend="cpu", kv_cache_dtype="fp8", warmup=False,
                               **LIMITS).executor.attention.kv_cache_dtypes[-2:] == ("float8_e4m3fn", "float8_e5m2")
    assert all(isinstance(layer, PagedAttention) for layer in layers)


def test_a_dtype_xla_cannot_hold_is_refused_before_compiling(monkeypatch):
    pytest.importorskip("jax")
    from graphrt.backends.xla.backend import XlaBackend

    monkeypatch.setattr(XlaBackend, "create_executor", lambda *a, **k: pytest.fail("executor created"))
    with pytest.raises(ConfigError, match=r"^kv_cache_dtype: float64 is not a KV cache dtype the xla backend holds"):
        graphrt.LLM(str(tiny_hf_model_dir("qwen3")), backend="xla", kv_cache_dtype="float64", **LIMITS)


# ---- sizing from the spec ---------------------------------------------------------------------

def test_preflight_and_the_runner_size_the_cache_by_the_spec_dtype():
    """fp8 holds a float32 cache's tokens in a quarter of the bytes: preflight's KV need is a
    quarter, and a KV budget holds four times the blocks."""
    backend, model = graphrt.select_backend("cpu"), qwen3()

    def kv_need(**settings) -> int:
        config = graphrt.GraphConfig.create(**LIMITS, **settings)
        _, device = preflight.runner_needs(backend, model, config, num_kv_blocks=100, kv_cache_memory=None)
        return next(need.nbytes for need in device if need.field == "num_kv_blocks")

    per_token = 2 * 2 * 2 * 16 * 4                     # K and V, 2 layers, 2 heads of 16, float32
    assert kv_need() == (100 * 4 + 1) * per_token and kv_need(kv_cache_dtype="fp8") * 4 == kv_need()
    budget = 10 * 4 * per_token
    blocks = [graphrt.ModelRunner(model, backend="eager", kv_cache_memory=budget, **LIMITS, **fp8).num_kv_blocks
              for fp8 in ({}, {"kv_cache_dtype": "fp8_e5m2"})]
    assert blocks == [10, 40]


# ---- user models end to end ------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference():
    """graphrt's own Qwen3 and hybrid sliding Qwen3 on cpu: (tokens, last step's logits) per model."""
    out = {}
    for name, overrides in (("qwen3", {}), ("sliding", SLIDING)):
        llm = graphrt.LLM(str(tiny_hf_model_dir("qwen3", **overrides)), backend="cpu", **CPU)
        out[name] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], last_logits(llm)
    return out


def last_logits(llm: graphrt.LLM) -> np.ndarray:
    """The logits of each prompt's last token, one request at a time."""
    rows = []
    for prompt in PROMPTS:
        llm.generate([prompt], SamplingParams(max_tokens=1))
        rows.append(llm.runner.outputs.logits()[0])
    return np.array(rows)


@pytest.mark.slow
def test_a_model_returning_the_old_tuple_still_runs(reference):
    inner = qwen3()
    llm = graphrt.LLM(Declared(inner, (2, 2, 16)), backend="cpu", **CPU)
    assert tuple(llm.runner.executor.kv_cache.shape) == (2, 2, llm.runner.num_kv_blocks * 4 + 1, 2, 16)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference["qwen3"][0]


class LatentPagedAttention(PagedAttention):
    """graphrt's attention over an MLA-shaped cache: one ``[rows, latent_dim]`` tensor per layer,
    each row holding the token's K then V heads (latent_dim = 2 * kv_heads * head_dim); it says
    so (``latent_dim``), so an MLA group may name it."""

    @property
    def latent_dim(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def kv_cache(self):
        return self._packed

    @kv_cache.setter
    def kv_cache(self, latent):
        self._packed = None if latent is None else latent.view(latent.shape[0], 2, self.num_kv_heads,
                                                               self.head_dim).transpose(0, 1)


def test_a_hybrid_model_of_two_layouts_shares_one_block_table(reference):
    """Layer 0: K and V, full attention; layer 1: a latent row per token, a 5-token window. One
    block table addresses both; the tokens are those of the same model with one layout."""
    inner = qwen3(**SLIDING)
    old = inner.model.layers[1].self_attn.attn
    latent = LatentPagedAttention(old.num_heads, old.num_kv_heads, old.head_dim, sliding_window=old.sliding_window)
    inner.model.layers[1].self_attn.attn = latent
    spec = KVCacheSpec((KVCacheGroup((0,), 2, 16), KVCacheGroup.mla((1,), 2 * 2 * 16, sliding_window=5)))
    llm = graphrt.LLM(Declared(inner, spec), backend="cpu", **CPU)
    ex, rows = llm.runner.executor, llm.runner.num_kv_blocks * 4 + 1
    assert ex.kv_cache is None and [tuple(t.shape) for t in ex.kv_caches] == [(1, 2, rows, 2, 16), (1, rows, 64)]
    assert latent.kv_cache.data_ptr() == ex.kv_caches[1].data_ptr()
    tokens, logits = reference["sliding"]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == tokens
    assert llm.stats["hits"] > 0 and llm.stats["eager_steps"] == 0
    assert_close_across_shapes(last_logits(llm), logits, "float32")


def hybrid_model() -> torch.nn.Module:
    """Layer 0 K / V with full attention, layer 1 an MLA-shaped latent row with a 5-token window."""
    inner = qwen3(**SLIDING)
    old = inner.model.layers[1].self_attn.attn
    inner.model.layers[1].self_attn.attn = LatentPagedAttention(old.num_heads, old.num_kv_heads, old.head_dim,
                                                                sliding_window=old.sliding_window)
    return Declared(inner, KVCacheSpec((KVCacheGroup((0,), 2, 16), KVCacheGroup.mla((1,), 2 * 2 * 16,
                                                                                    sliding_window=5))))


@pytest.mark.parametrize("prop", slow_except(["kv_isolated", "padding_invisible", "replay_matches_eager"], "kv_isolated"))
def test_the_kit_checks_a_cache_of_two_layouts_slot_by_slot(prop):
    """The kit's KV properties see every stored layout: a slot is each layout's row of it."""
    from graphrt.testing import RunnerFactory, access, check_property

    factory = RunnerFactory(hybrid_model, "cpu", mode="FULL_AND_PIECEWISE")
    runner = factory()
    rows = runner.num_kv_blocks * runner.config.block_size + 1
    view = access.kv_values(runner)
    assert view.shape == (1, 1, rows, 2 * 2 * 16 + 2 * 2 * 16, 1)      # layer 0's K and V, layer 1's latent
    planted = np.random.default_rng(0).standard_normal(view.shape).astype(np.float32)
    access.set_kv(runner, planted)
    np.testing.assert_array_equal(access.kv_values(runner), planted)
    np.testing.assert_array_equal(runner.executor.kv_caches[1][0].numpy(), planted[0, 0, :, 64:, 0])
    result = check_property(prop, factory, examples=examples(6))
    assert result.passed, result.line()


class OwnCache:
    """A model's own KV cache: per-layer tensors it allocates, reporting 3x their bytes per block
    (say, for metadata of its own), so the runner's sizing visibly follows its number."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.calls = model, []

    def bytes_per_block(self, block_size: int) -> int:
        return 3 * 2 * 2 * block_size * 2 * 16 * 4

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.calls.append((num_blocks, block_size))
        for layer in self.model.attention_layers():
            layer.kv_cache = torch.zeros(2, num_blocks * block_size + 1, 2, 16)


def test_a_model_that_owns_its_cache_allocates_it_and_sizes_it(reference):
    inner = qwen3()
    own = OwnCache(inner)
    model = Declared(inner, KVCacheSpec.owned(), kv_cache_bytes_per_block=own.bytes_per_block,
                     allocate_kv_cache=own.allocate)
    runner = graphrt.ModelRunner(model, backend="eager", kv_cache_memory=40 * own.bytes_per_block(4) + 100, **LIMITS)
    assert runner.num_kv_blocks == 40 and own.calls == [(40, 4)]
    assert runner.executor.kv_cache is None and runner.executor.kv_caches == []
    llm = graphrt.LLM(model, backend="cpu", **CPU)
    assert llm.runner.executor.kv_caches == [] and own.calls[-1] == (llm.runner.num_kv_blocks, 4)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference["qwen3"][0]


# ---- allocation per group ---------------------------------------------------------------------

class Slot(torch.nn.Module):
    """An attention layer of a user's own: it only holds what the executor assigns, and says its
    kernel reads and writes fp8 caches too (a layer that does not say so gets float ones only)."""

    kv_cache = None
    kv_cache_dtypes = ("float32", "bfloat16", "float8_e5m2")


def test_the_torch_executor_allocates_each_group_its_layout():
    model = torch.nn.Module()
    model.config = types.SimpleNamespace(vocab_size=8, hidden_size=4)
    model.proj = torch.nn.Linear(4, 4)
    model.slots = torch.nn.ModuleList(Slot() for _ in range(4))
    model.attention_layers = lambda: list(model.slots)
    spec = KVCacheSpec((KVCacheGroup((0, 2), 2, 16), KVCacheGroup((1,), 4, 16, head_size_v=8, dtype="bfloat16"),
                        KVCacheGroup.mla((3,), 576, dtype="fp8_e5m2")))
    model.kv_cache_spec = lambda: spec
    config = graphrt.GraphConfig.create(**LIMITS)
    ex = TorchExecutor(model, config, torch.device("cpu"), None)
    assert ex.kv_cache_bytes_per_block(4) == 4 * (2 * 256 + 4 * 24 * 2 + 576)
    ex.allocate_kv_cache(3, 4)
    layers = model.attention_layers()
    assert [tuple(t.shape) for t in ex.kv_caches] == [(2, 2, 13, 2, 16), (1, 13, 4, 16), (1, 13, 4, 8), (1, 13, 576)]
    assert ex.kv_cache is None and sum(t.nbytes for t in ex.kv_caches) == 13 * ex.kv_cache_bytes_per_block(4) // 4
    k, v = layers[1].kv_cache
    assert (k.shape, v.shape, k.dtype) == ((13, 4, 16), (13, 4, 8), torch.bfloat16)
    assert layers[2].kv_cache.data_ptr() == ex.kv_caches[0][1].data_ptr()
    assert (layers[3].kv_cache.shape, layers[3].kv_cache.dtype) == ((13, 576), torch.float8_e5m2)


# ---- fp8 scales from the checkpoint -----------------------------------------------------------

def _with_scales(tmp_path, scales: dict[str, float]):
    path = make_tiny_hf_model(tmp_path, "qwen3")
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    tensors.update({name: torch.tensor(value) for name, value in scales.items()})
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def test_kv_scales_are_read_from_the_checkpoint(tmp_path):
    path = _with_scales(tmp_path, {"model.layers.0.self_attn.k_scale": 2.0, "model.layers.0.self_attn.v_scale": 0.5,
                                   "model.layers.1.self_attn.kv_scale": 1.5})
    layers = load_torch_model(path).attention_layers()
    assert [(a.k_scale, a.v_scale) for a in layers] == [(2.0, 0.5), (1.5, 1.5)]
    bad = _with_scales(tmp_path, {"model.layers.1.self_attn.v_proj.v_scale": -1.0})
    with pytest.raises(InputError, match=r"v_proj.v_scale.*finite and > 0"):
        load_torch_model(bad)
