"""FlashInfer behind the attention seam (layers/torch/attention/flashinfer_attention.py, GRAPHRT_ATTENTION=flashinfer).

On a CPU (every machine) a fake ``flashinfer`` module is injected: its wrapper keeps FlashInfer's
contract as documented and as its source checks it (NHD pages ``[pages, page_size, H, D]``; in
CUDA-graph mode a fixed batch size, the most rows fixed at the first plan, indices within the
buffer, everything copied into the caller's buffers at ``plan``), records every plan, and
attends densely from what it was planned with (indptr / indices / last-page lengths, read from
its buffers at ``run``, rows past ``qo_indptr[-1]`` left NaN). So these check the adapter's side:

* hypothesis-drawn mixed prefill / decode steps (GQA, block sizes 16 and 32, windows, padding,
  NaN in unread cache rows) give graphrt's reference attention's outputs and KV bytes;
* the plan is made from the host, in ``before_replay``: graphs captured by the CPU recording
  backend replay steps of other lengths as eager runs do, and generate the reference's tokens;
  an adapter that does not replan before a replay gives other tokens;
* importing the module imports no flashinfer; selecting it without flashinfer, or off CUDA, is
  a ConfigError.

With the real flashinfer on a CUDA GPU (``gpu``-marked; skipped elsewhere, never run here):
parity against the Triton kernel, and a model run with FULL graphs against Triton's tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import graphrt
from support.attention_steps import FLOAT_STEPS, SLOW_OK, Spec, build_step, bytes_of, run_kernel
from graphrt import ConfigError, SamplingParams, reduction_tolerance
from graphrt.layers.torch.forward_context import forward_context
from graphrt.layers.torch.attention import paged as attention_mod
from graphrt.layers.torch.attention import flashinfer_attention as fi
from graphrt.layers.torch.attention import flashinfer_kernel as fk
from graphrt.layers.torch.attention.paged import PagedAttention, choose_attention_kernel, paged_attention_kernel
from graphrt.layers.torch.attention.backend import CaptureHostValues, HostValues, StepTensors
from graphrt.testing import RunnerFactory, check_property
from support.hf_models import random_prompts, tiny_hf_model_dir
from support.fast_subset import examples

ROOT = Path(__file__).resolve().parents[2]


# ---- the fake flashinfer ----------------------------------------------------------------------

class FakePrefillWrapper:
    """``BatchPrefillWithPagedKVCacheWrapper``'s contract, attending densely on any device."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: torch.Tensor | None = None, paged_kv_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf: torch.Tensor | None = None, backend: str = "auto") -> None:
        assert kv_layout == "NHD"
        self.graph = use_cuda_graph
        self.bufs = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf)
        if use_cuda_graph:
            assert all(isinstance(b, torch.Tensor) for b in self.bufs)
        self.max_rows: int | None = None
        self.args: dict | None = None

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, *, causal=False, sm_scale=None, window_left=-1,
             q_data_type="float16", kv_data_type=None, non_blocking=True) -> None:
        arrays = (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        assert all(a.device.type == "cpu" and a.dtype == torch.int32 for a in arrays), "plan from host int32"
        pages = paged_kv_indptr[1:] - paged_kv_indptr[:-1]
        assert (pages >= 0).all() and int(paged_kv_indptr[-1]) == len(paged_kv_indices)
        assert ((paged_kv_last_page_len >= 1) & (paged_kv_last_page_len <= page_size) | (pages == 0)).all()
        rows, batch = int(qo_indptr[-1]), len(qo_indptr) - 1
        if self.graph:      # flashinfer/prefill.py's checks in CUDA-graph mode
            self.max_rows = rows if self.max_rows is None else self.max_rows
            assert rows <= self.max_rows, "rows exceed the first plan's"
            assert batch == len(self.bufs[0]) - 1, "batch size fixed per graph wrapper"
            assert len(paged_kv_indices) <= len(self.bufs[2]), "indices buffer too small"
            for buf, a in zip(self.bufs, arrays):
                buf[:len(a)].copy_(a)
        else:
            self.bufs = tuple(a.clone() for a in arrays)
        self.args = dict(heads=(num_qo_heads, num_kv_heads, head_dim_qk), page_size=page_size, causal=causal,
                         sm_scale=sm_scale, window_left=window_left, dtypes=(q_data_type, kv_data_type))
        FAKE_PLANS.append(dict(self.args, graph=self.graph, wrapper=id(self),
                               arrays=tuple(a.clone() for a in arrays)))

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        k_pages, v_pages = paged_kv_cache
        hq, hkv, d = self.args["heads"]
        ps = self.args["page_size"]
        assert k_pages.shape[1:] == (ps, hkv, d) and v_pages.shape == k_pages.shape and q.shape[1:] == (hq, d)
        qo, kv_indptr, indices, last = (b.long() for b in self.bufs)
        t, n = q.shape[0], indices.shape[0]
        tok = torch.arange(t)
        req = (torch.searchsorted(qo, tok, right=True) - 1).clamp(0, qo.shape[0] - 2)
        npages = (kv_indptr[1:] - kv_indptr[:-1]).index_select(0, req)
        kv_len = torch.where(npages > 0, (npages - 1) * ps + last.index_select(0, req), 0)
        pos = kv_len - (qo.index_select(0, req + 1) - tok)                  # the token's own position
        j = torch.arange(n * ps)
        slot = kv_indptr.index_select(0, req)[:, None] + j // ps
        page = indices.index_select(0, slot.clamp(max=n - 1).flatten()).view(t, -1)
        rows = page * ps + j % ps
        ok = (j < kv_len[:, None]) & (j <= pos[:, None])
        if self.args["window_left"] >= 0:
            ok &= j >= pos[:, None] - self.args["window_left"]
        keys = k_pages.reshape(-1, hkv, d)[rows].float()                      # [T, L, Hkv, D]
        vals = torch.where(ok[..., None, None], v_pages.reshape(-1, hkv, d)[rows].float(), 0)
        s = torch.einsum("tkgd,tlkd->tkgl", q.float().view(t, hkv, hq // hkv, d), keys) * self.args["sm_scale"]
        m = ok[:, None, None, :]
        p = torch.where(m, torch.softmax(torch.where(m, s, float("-inf")), -1), 0.0)
        out = torch.einsum("tkgl,tlkd->tkgd", p, vals).reshape(t, hq, d)
        beyond = (tok >= qo[-1])[:, None, None]                               # FlashInfer writes none of these
        return torch.where(beyond, float("nan"), out).to(q.dtype)


FAKE_PLANS: list[dict] = []


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The fake as ``flashinfer``, allowed on CPU, and ``GRAPHRT_ATTENTION=flashinfer``."""
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(fk, "SUPPORTED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setenv(attention_mod.ATTENTION_ENV, "flashinfer")
    FAKE_PLANS.clear()
    return module


def _tensors(step) -> StepTensors:
    m = step.meta
    t, r = m.slot_mapping.shape[0], m.seq_lens.shape[0]
    zeros = torch.zeros(t, dtype=torch.int32)
    return StepTensors(zeros, zeros, m.slot_mapping, m.query_start_loc, m.seq_lens, torch.zeros(r, dtype=torch.int32),
                       m.block_table, m.block_size)


def _run_adapter(spec: Spec, step) -> tuple[torch.Tensor, torch.Tensor, fi.FlashInferAttentionBackend]:
    """The step through a PagedAttention layer under the FlashInfer backend (plan, build, run)."""
    layer = PagedAttention(spec.kv_heads * spec.groups, spec.kv_heads, spec.head_dim, sliding_window=spec.window)
    layer.kv_cache = step.cache.clone()
    backend = fi.FlashInferAttentionBackend([layer], workspace_bytes=16)
    assert backend.setup(torch.device("cpu"), spec.q_dtype) == ()
    tensors = _tensors(step)
    t, r = tensors.slot_mapping.shape[0], tensors.seq_lens.shape[0]
    host = HostValues(t, r, step.real_tokens, len(spec.reqs), max(s for _, s in spec.reqs), step.max_context, False)
    backend.before_replay(tensors, host)
    with forward_context(backend.build(tensors, host)):
        out = layer(step.q, step.k, step.v)
    return out, layer.kv_cache, backend


@settings(SLOW_OK, max_examples=examples(40),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(spec=FLOAT_STEPS)
def test_drawn_steps_through_the_adapter_match_the_reference(spec: Spec, fake_flashinfer) -> None:
    FAKE_PLANS.clear()
    step = build_step(spec, "cpu")
    out, cache, _ = _run_adapter(spec, step)
    ref_cache = step.cache.clone()
    ref = run_kernel(paged_attention_kernel, step, spec, ref_cache)
    n = step.real_tokens
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padded tokens must get zeros"
    want = ref[:n].double()
    tol = reduction_tolerance(spec.q_dtype, magnitude=float(want.abs().max()) if n else 0.0,
                              width=max(spec.head_dim, step.max_context))
    torch.testing.assert_close(out[:n].double(), want, **tol._asdict(), msg=lambda m: f"{spec}\n{m}")
    trash = cache.shape[1] - 1
    assert torch.equal(bytes_of(cache)[:, :trash], bytes_of(ref_cache)[:, :trash]), "KV bytes differ"
    (plan,) = FAKE_PLANS                                  # one signature, one plan, from before_replay
    assert plan["window_left"] == (spec.window - 1 if spec.window else -1) and plan["causal"]
    assert plan["heads"] == (spec.kv_heads * spec.groups, spec.kv_heads, spec.head_dim)
    assert plan["page_size"] == spec.block_size and not plan["graph"]


def test_the_plan_arrays_and_the_page_view_of_a_fixed_step(fake_flashinfer) -> None:
    """Block size 4: a chunked prefill (5 cached + 3 new), a decode at 9, a padded request."""
    spec = Spec(kv_heads=2, groups=2, head_dim=8, block_size=4, q_dtype=torch.float32, cache_dtype=torch.float32,
                reqs=[(5, 3), (8, 1)], pad_reqs=1, pad_tokens=2, table_width=4)
    step = build_step(spec, "cpu")
    _run_adapter(spec, step)
    qo, kv_indptr, indices, last = FAKE_PLANS[-1]["arrays"]
    table = step.meta.block_table
    assert qo.tolist() == [0, 3, 4, 4]
    assert kv_indptr.tolist() == [0, 2, 5, 5]                  # ceil(8 / 4), ceil(9 / 4), none
    assert indices.tolist() == table[0, :2].tolist() + table[1, :3].tolist()
    assert last.tolist() == [4, 1, 0]
    k_pages, v_pages = fk.paged_view(step.cache, 4)
    assert k_pages.shape == (step.cache.shape[1] // 4, 4, 2, 8)
    assert k_pages.data_ptr() == step.cache.data_ptr() and v_pages.data_ptr() == step.cache[1].data_ptr()
    assert torch.equal(k_pages[3, 2], step.cache[0, 14]) and torch.equal(v_pages[5, 1], step.cache[1, 21])


def test_captures_plan_once_with_padding_and_steps_plan_in_before_replay(fake_flashinfer) -> None:
    """A capture's build plans its shape's graph wrappers once (padding, every token in some
    request); building again plans nothing; only before_replay plans a step."""
    spec = Spec(kv_heads=1, groups=2, head_dim=8, block_size=4, q_dtype=torch.float32, cache_dtype=torch.float32,
                reqs=[(6, 2), (3, 1)], pad_reqs=1, pad_tokens=1, table_width=3)
    step = build_step(spec, "cpu")
    layer = PagedAttention(2, 1, 8)
    layer.kv_cache = step.cache.clone()
    backend = fi.FlashInferAttentionBackend([layer], workspace_bytes=16)
    assert backend.setup(torch.device("cpu"), torch.float32) == ()
    tensors = _tensors(step)
    host = HostValues(4, 3, 3, 2, 2, 9, False)
    guarded = CaptureHostValues(host, (), "flashinfer", "key")
    backend.build_for_capture(tensors, guarded)                 # the capture phase: reads no host value
    (first,) = FAKE_PLANS
    assert first["graph"] and first["arrays"][0].tolist() == [0, 2, 3, 4]
    backend.build_for_capture(tensors, guarded)
    assert len(FAKE_PLANS) == 1
    backend.before_replay(tensors, host)
    assert len(FAKE_PLANS) == 2 and FAKE_PLANS[1]["wrapper"] == first["wrapper"]
    assert FAKE_PLANS[1]["arrays"][0].tolist() == [0, 2, 3, 3]
    meta = backend.build(tensors, host)                        # uses what before_replay planned
    assert len(FAKE_PLANS) == 2 and id(next(iter(meta.flashinfer_wrappers.values()))) == first["wrapper"]


def test_step_views_on_a_device_apart_carry_the_host_staging_views() -> None:
    """What before_replay plans from: ``StepTensors.on_host``, the rows the runner wrote into the
    staging buffers (a "meta" device stands in for a GPU); None where the step is on the host."""
    from graphrt.backends.torch.step_buffers import StepBuffers

    apart = StepBuffers(8, 4, 3, 4, torch.device("meta"), False)
    views = apart.tensors(5, 2)
    assert views.seq_lens.device.type == "meta" and views.on_host.seq_lens.device.type == "cpu"
    apart.host_arrays["seq_lens"][:2] = [7, 9]
    apart.host_arrays["block_table"][1] = [4, 5, 6]
    assert views.on_host.seq_lens.tolist() == [7, 9] and views.on_host.block_table[1].tolist() == [4, 5, 6]
    assert views.on_host.query_start_loc.shape == (3,) and views.on_host.on_host is None
    assert StepBuffers(8, 4, 3, 4, torch.device("cpu"), False).tensors(5, 2).on_host is None


# ---- graphs through the CPU recording backend ----------------------------------------------------

ENGINE = dict(backend="cpu", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4,
              num_kv_blocks=40, enable_prefix_caching=False)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = random_prompts((5, 17, 9, 30), seed=4)


def _reference_tokens(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    with monkeypatch.context() as m:
        m.setenv(attention_mod.ATTENTION_ENV, "reference")
        llm = graphrt.LLM(str(tiny_hf_model_dir("qwen3")), **{**ENGINE, "backend": "eager"})
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_cpu_graphs_with_the_fake_generate_the_reference_tokens(fake_flashinfer, monkeypatch) -> None:
    want = _reference_tokens(monkeypatch)
    llm = graphrt.LLM(str(tiny_hf_model_dir("qwen3")), mode="FULL_AND_PIECEWISE", **ENGINE)
    executor = llm.runner.executor
    assert executor.attention.name == "flashinfer" and llm.runner.stats.failed_builds == 0
    FAKE_PLANS.clear()
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert llm.stats["hits"] > 0
    graph_plans = [p for p in FAKE_PLANS if p["graph"]]
    assert graph_plans and len({tuple(p["arrays"][1].tolist()) for p in graph_plans}) > 1   # replanned per step


def test_replays_of_other_lengths_match_eager_runs(fake_flashinfer) -> None:
    factory = RunnerFactory(str(tiny_hf_model_dir("qwen3")), "cpu", mode="FULL_AND_PIECEWISE")
    result = check_property("replay_matches_eager", factory, examples=examples(8))
    assert result.passed, result.line()


def test_a_plan_baked_into_the_graph_gives_other_tokens(fake_flashinfer, monkeypatch) -> None:
    """Graph wrappers planned only once (at capture), as if the plan were part of the graph:
    the steps read the capture's layout, and the tokens check above sees it."""
    want = _reference_tokens(monkeypatch)
    plan = fi.FlashInferAttentionBackend._plan

    def plan_graphs_once(self, wset, layout, block_size):
        if wset is not self._eager and wset.planned:
            return True
        return plan(self, wset, layout, block_size)

    monkeypatch.setattr(fi.FlashInferAttentionBackend, "_plan", plan_graphs_once)
    llm = graphrt.LLM(str(tiny_hf_model_dir("qwen3")), mode="FULL_AND_PIECEWISE", **ENGINE)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] != want


# ---- imports and refusals ------------------------------------------------------------------------

def test_importing_the_adapter_imports_no_flashinfer() -> None:
    code = ("import sys\nimport graphrt.layers.torch.attention.flashinfer_attention\n"
            "import graphrt.layers.torch.attention.flashinfer_kernel as f\n"
            "from graphrt.backends.torch import model_protocol\n"
            "print('flashinfer' in sys.modules, f.flashinfer_unavailable_reason('cpu'))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("False") and "CUDA devices only" in done.stdout


def test_selecting_flashinfer_where_it_cannot_run_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)         # not installed
    monkeypatch.setenv(attention_mod.ATTENTION_ENV, "flashinfer")
    with pytest.raises(ConfigError, match="FlashInfer cannot run: the model runs on cpu.*CUDA devices only"):
        graphrt.LLM(str(tiny_hf_model_dir("qwen3")), **ENGINE)
    with pytest.raises(ConfigError, match=r"flashinfer does not import.*graphrt\[flashinfer\]"):
        choose_attention_kernel("cuda", 64, torch.bfloat16, torch.bfloat16)
    monkeypatch.setattr(fk, "SUPPORTED_DEVICE_TYPES", ("cuda", "cpu"))
    with pytest.raises(ConfigError, match=r"flashinfer does not import.*flashinfer-python"):
        graphrt.LLM(str(tiny_hf_model_dir("qwen3")), **ENGINE)
    monkeypatch.setenv(attention_mod.ATTENTION_ENV, "auto")
    assert choose_attention_kernel("cpu", 64, torch.float32, torch.float32).kernel == "reference"


def test_fp8_caches_are_refused_with_a_sentence(fake_flashinfer) -> None:
    spec = Spec(kv_heads=1, groups=1, head_dim=8, block_size=4, q_dtype=torch.float32,
                cache_dtype=torch.float8_e4m3fn, reqs=[(2, 1)])
    with pytest.raises(ConfigError, match="float caches only"):
        _run_adapter(spec, build_step(spec, "cpu"))


# ---- the real flashinfer on a CUDA GPU -------------------------------------------------------------

def _real_flashinfer():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return pytest.importorskip("flashinfer")


GPU_SPECS = {
    "bf16-gqa-bs16": Spec(kv_heads=2, groups=4, head_dim=128, block_size=16, q_dtype=torch.bfloat16,
                          cache_dtype=torch.bfloat16, reqs=[(300, 64), (0, 40), (700, 1), (31, 1), (0, 1)],
                          pad_reqs=2, pad_tokens=5, seed=3),
    "fp16-window-bs32": Spec(kv_heads=4, groups=2, head_dim=64, block_size=32, q_dtype=torch.float16,
                             cache_dtype=torch.float16, reqs=[(500, 17), (90, 1), (1000, 1)], window=200,
                             pad_reqs=1, pad_tokens=3, seed=8),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_SPECS))
def test_gpu_flashinfer_matches_triton(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _real_flashinfer()
    from graphrt.layers.torch.attention.triton_attention import triton_paged_attention, triton_unavailable_reason

    if triton_unavailable_reason("cuda"):
        pytest.skip(f"Triton: {triton_unavailable_reason('cuda')}")
    monkeypatch.setenv(attention_mod.ATTENTION_ENV, "flashinfer")
    spec = GPU_SPECS[name]
    step = build_step(spec, "cuda")
    layer = PagedAttention(spec.kv_heads * spec.groups, spec.kv_heads, spec.head_dim, sliding_window=spec.window)
    layer.kv_cache = step.cache.clone()
    backend = fi.FlashInferAttentionBackend([layer])
    backend.setup(torch.device("cuda"), spec.q_dtype)
    m = step.meta
    t, r = m.slot_mapping.shape[0], m.seq_lens.shape[0]
    ints = torch.zeros(t, dtype=torch.int32, device="cuda")
    tensors = StepTensors(ints, ints, m.slot_mapping, m.query_start_loc, m.seq_lens, m.seq_lens, m.block_table,
                          spec.block_size)
    host = HostValues(t, r, step.real_tokens, len(spec.reqs), 64, step.max_context, False)
    backend.before_replay(tensors, host)
    with forward_context(backend.build(tensors, host)):
        out = layer(step.q, step.k, step.v)
    tri_cache = step.cache.clone()
    want = run_kernel(triton_paged_attention, step, spec, tri_cache)
    n = step.real_tokens
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    tol = reduction_tolerance(spec.q_dtype, magnitude=float(want[:n].abs().max()),
                              width=max(spec.head_dim, step.max_context))
    torch.testing.assert_close(out[:n].double(), want[:n].double(), **tol._asdict())
    assert torch.equal(bytes_of(layer.kv_cache)[:, :-1], bytes_of(tri_cache)[:, :-1])


@pytest.mark.gpu
def test_gpu_full_graphs_generate_tritons_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny Qwen3 (head size 64, fp16) on cuda: FULL requested (FULL decode graphs, PIECEWISE
    prefill), greedy tokens as with the Triton kernel, graphs hit."""
    _real_flashinfer()
    engine = {**ENGINE, "backend": "cuda", "dtype": "float16"}
    model = str(tiny_hf_model_dir("qwen3", head_dim=64))
    monkeypatch.setenv(attention_mod.ATTENTION_ENV, "auto")
    want = [o.token_ids for o in graphrt.LLM(model, mode="FULL", **engine).generate(PROMPTS, GREEDY)]
    monkeypatch.setenv(attention_mod.ATTENTION_ENV, "flashinfer")
    llm = graphrt.LLM(model, mode="FULL", **engine)
    assert llm.runner.executor.attention.name == "flashinfer" and llm.runner.stats.failed_builds == 0
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert llm.stats["hits"] > 0
