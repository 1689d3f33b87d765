"""``make compile-check`` (benchmarks/compile_check.py, benchmarks/compilecheck/): the limit and
memory checks on synthetic compiler figures, the report and exit status with planted
regressions, and -- where this venv has the compilers -- the planted regressions compiled for
real (a Triton plan over sm_80's shared memory with Triton's bundled ptxas; a forward that does
not donate its KV cache, on XLA:CPU and, with libtpu, for a TPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import compile_check  # noqa: E402
from compilecheck import limits, xla_checks  # noqa: E402
from compilecheck.report import write_report  # noqa: E402
from compilecheck.triton_part import judge as judge_kernel, parse_amdgcn, parse_ptxas  # noqa: E402

PTXAS_LOG = """ptxas info    : Compiling entry function 'attention_kernel' for 'sm_80'
ptxas info    : Function properties for attention_kernel
    16 bytes stack frame, 28 bytes spill stores, 28 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 504 bytes cmem[0]
"""
AMDGCN = """    .sgpr_count:     106
    .sgpr_spill_count: 80
    .vgpr_count:     256
    .vgpr_spill_count: 3
"""


def _kernel(**over):
    rec = {"kernel": "attention", "plan": "decode hd128", "target": "sm_80", "num_warps": 4, "num_stages": 3,
           "shared": 40960, "registers": 128, "spill_bytes": 0}
    rec.update(over)
    return rec


def test_kernel_limits_per_target():
    sm80, sm90 = limits.TARGETS["sm_80"], limits.TARGETS["sm_90"]
    assert limits.check_kernel(_kernel(), sm80) == []
    big = _kernel(shared=196608)                       # 192 KB: over an A100 block, within an H100's
    assert "shared memory 196608 B > 166912 B" in limits.check_kernel(big, sm80)[0]
    assert limits.check_kernel(big, sm90) == []
    assert "registers x 1024 threads" in limits.check_kernel(_kernel(registers=255, num_warps=32), sm90)[0]
    assert limits.check_kernel(_kernel(spill_bytes=28), sm80) == []             # within the spill budget
    assert "16680 B of register spills" in limits.check_kernel(_kernel(spill_bytes=16680), sm80)[0]
    gfx = limits.TARGETS["gfx942"]
    assert limits.check_kernel(_kernel(target="gfx942", registers=512, shared=65536), gfx) == []
    assert "65537 B > 65536 B" in limits.check_kernel(_kernel(target="gfx942", shared=65537), gfx)[0]


def test_compiler_reports_are_parsed():
    assert parse_ptxas(PTXAS_LOG) == {"registers": 255, "spill_bytes": 28, "spill_loads": 28, "stack": 16}
    amd = parse_amdgcn(AMDGCN)
    assert (amd["registers"], amd["sgpr_spills"], amd["spill_bytes"]) == (256, 80, 12)
    with pytest.raises(ValueError, match="no register count"):
        parse_ptxas("ptxas info : nothing")
    failed = judge_kernel(_kernel(error="CompilationError: boom"))
    assert not failed["ok"] and failed["problems"] == ["CompilationError: boom"]


def _forward(**over):
    rec = {"chip": "v5e", "config": "decoder", "kernel": "reference", "program": "decode", "role": "forward",
           "num_blocks": 256, "num_tokens": 16, "context": 2048, "kv_heads": 8, "head_dim": 128,
           "cache_bytes": 64 << 20, "state_bytes": 0, "alias_bytes": 64 << 20, "temp_bytes": 100 << 20,
           "copies": []}
    rec.update(over)
    return rec


def test_memory_checks_on_synthetic_figures():
    assert xla_checks.check_program(_forward()) == []
    undonated = xla_checks.check_program(_forward(alias_bytes=0, copies=["%copy.1 = bf16[4,2,4097,8,128] copy(%kv)"]))
    assert "donation: 0 B aliased" in undonated[0] and "whole-cache copies" in undonated[1]
    assert "temp" in xla_checks.check_program(_forward(kernel="pallas", temp_bytes=64 << 20))[0]
    grown = xla_checks.judge([_forward(), _forward(num_blocks=1024, cache_bytes=256 << 20, alias_bytes=256 << 20,
                                                   temp_bytes=(100 << 20) + (7 << 20))])
    assert grown[0]["ok"] and not grown[1]["ok"] and "temp grows with the cache" in grown[1]["problems"][0]
    flat = xla_checks.judge([_forward(), _forward(num_blocks=1024, cache_bytes=256 << 20, alias_bytes=256 << 20,
                                                  temp_bytes=(100 << 20) + (6 << 20))])
    assert all(r["ok"] for r in flat)


def test_cache_copies_match_whole_cache_shapes_only():
    hlo = """%copy.83 = bf16[4,2,4097,8,128]{4,3,2,1,0:T(8,128)(2,1)} copy(%kv_cache.1), metadata={}
  %copy-start.2 = (f32[16,8]{1,0}, f32[16,8]{1,0}, u32[]) copy-start(%p)
  %copy.9 = bf16[4,2,4097,8,64]{4,3,2,1,0} copy(%x)"""
    assert xla_checks.cache_copies(hlo, [(4, 2, 4097, 8, 128)]) == [hlo.splitlines()[0].strip()[:200]]
    assert xla_checks.cache_copies(hlo, [(7, 7)]) == []


def _part(name, rc, data):
    return {"part": name, "command": ["python", "-m", f"compilecheck.{name}_part"], "rc": rc, "seconds": 1.0,
            "output_tail": "", "data": data}


def test_planted_regressions_fail_the_report_and_the_exit_status(tmp_path):
    kernel = judge_kernel(_kernel(shared=196608, planted=True, kernel="attention (planted)"))
    forward = xla_checks.judge([_forward(alias_bytes=0, planted=True)])[0]
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "triton.json").write_text(json.dumps(_part("triton", 1, {
        "records": [judge_kernel(_kernel()), kernel],
        "summary": {"kernels": 2, "failed": 1, "attention_plans": 1, "per_target": {
            "sm_80": {"compiled": 1, "failed": 1, "max_shared": 196608, "max_registers": 128,
                      "max_spill_bytes": 0}}}})))
    (parts / "xla.json").write_text(json.dumps(_part("xla", 1, {"records": [forward]})))
    md, ok = write_report(tmp_path, {"cpu_count": 2, "plant": True})
    text = md.read_text()
    assert not ok
    assert "Planted regressions" in text and "shared memory 196608 B > 166912 B" in text
    assert "donation: 0 B aliased" in text and "FAILED (exit 1)" in text
    assert compile_check.main(["--report-only", "--out", str(tmp_path)]) == 1
    (parts / "triton.json").write_text(json.dumps(_part("triton", 0, {"records": [judge_kernel(_kernel())]})))
    (parts / "xla.json").unlink()
    assert compile_check.main(["--report-only", "--out", str(tmp_path)]) == 0


def _tiny_programs(no_donation: bool):
    jax = pytest.importorskip("jax")
    from compilecheck.xla_part import no_donation as planted

    from graphrt.backends.xla import sharding as shd
    from graphrt.backends.xla.abstract_inputs import abstract_inputs
    from graphrt.backends.xla.programs import XlaModel, XlaPrograms
    from graphrt.config import GraphConfig
    from graphrt.core.dispatch import BatchDescriptor
    from graphrt.core.graph_modes import RuntimeMode
    from graphrt.models.hf_config import DecoderConfig
    from graphrt.models.jax.loader import abstract_params

    cfg = DecoderConfig.from_dict(dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32,
                                       intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=16, torch_dtype="float32", eos_token_id=1))
    config = GraphConfig.create(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, block_size=4)
    with planted() if no_donation else _null():
        programs = XlaPrograms(XlaModel(cfg, abstract_params(cfg)), 4, shd.make_mesh(1), max_reqs=2, config=config)
    kv = jax.ShapeDtypeStruct(programs.kv_shape(16, 4), programs.kv_dtype)
    jitted, _, args = abstract_inputs(programs, RuntimeMode.FULL, BatchDescriptor(2, 2, True, max_seq_len=32), kv,
                                      [], None, lambda _k: 8)
    return jitted, args, kv


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("planted", [False, True])
def test_a_forward_that_copies_its_cache_is_caught_on_xla_cpu(planted):
    import numpy as np
    from compilecheck.xla_part import compile_one

    jitted, args, kv = _tiny_programs(planted)
    figures = compile_one(jitted, args)
    cache = int(np.prod(kv.shape)) * 4
    record = _forward(alias_bytes=figures["alias_bytes"], temp_bytes=0, cache_bytes=cache,
                      copies=xla_checks.cache_copies(figures["hlo"], [kv.shape]))
    problems = xla_checks.check_program(record)
    if planted:
        assert len(problems) == 2 and "donation: 0 B aliased" in problems[0]
    else:
        assert problems == []


def test_abstract_params_are_the_loaders_tree():
    jax = pytest.importorskip("jax")
    from support.hf_models import tiny_hf_model_dir

    from graphrt.backends.xla import sharding as shd
    from graphrt.models.jax.loader import abstract_params, load_jax_params

    cfg, params = load_jax_params(tiny_hf_model_dir("qwen3"))
    abstract = abstract_params(cfg)
    assert jax.tree_util.tree_structure(abstract) == jax.tree_util.tree_structure(params)
    assert [(a.shape, a.dtype) for a in jax.tree_util.tree_leaves(abstract)] == \
        [(p.shape, p.dtype) for p in jax.tree_util.tree_leaves(params)]
    mesh = shd.make_mesh(1)
    placed = shd.place(abstract, shd.weight_shardings(abstract, mesh, cfg))
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None
               for leaf in jax.tree_util.tree_leaves(placed))


def _bundled_ptxas() -> str | None:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return "triton does not import"
    ptxas = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return None if ptxas.exists() else f"triton has no bundled ptxas ({ptxas})"


@pytest.mark.skipif(_bundled_ptxas() is not None, reason=str(_bundled_ptxas()))
def test_the_planted_triton_plan_is_compiled_and_caught_on_sm80(tmp_path):
    out = tmp_path / "planted.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")])
    done = subprocess.run([sys.executable, "-m", "compilecheck.triton_part", "--json", str(out), "--only-planted",
                           "--targets", "sm_80", "--workers", "1"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    [record] = json.loads(out.read_text())["records"]
    assert record["planted"] and record["shared"] > limits.TARGETS["sm_80"].shared_bytes
    assert any("shared memory" in p for p in record["problems"])


@pytest.mark.skipif(_bundled_ptxas() is not None, reason=str(_bundled_ptxas()))
def test_float32_attention_plans_compile_without_spilling_on_sm90(monkeypatch):
    """The float32 (IEEE dot) plans the planner picks, decode and prefill at head_dim 128 and GQA
    4, compiled for sm_90 with Triton's bundled ptxas: within sm_90's limits, spills within the
    budget. With the bf16-sized tiles (64 rows x 32 keys, 4 warps) the FMA dot's operands spilled
    13-17 KB a thread at prefill and 1.3 KB at decode."""
    from compilecheck import triton_jobs
    from compilecheck.triton_part import run

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    jobs = [dict(j, target="sm_90") for j in triton_jobs.attention_jobs()
            if " hd128 gqa4 fp32:" in j["plan"]]
    assert len(jobs) == 2
    records = run(jobs, 1, progress=False)
    assert [r["problems"] for r in records] == [[], []], [(r["plan"], r["problems"]) for r in records]
    assert all(r["spill_bytes"] <= limits.SPILL_BUDGET for r in records)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed here (make compile-check installs it into .venv-compile)")
def test_the_planted_xla_forward_is_caught_on_a_deviceless_tpu(tmp_path):
    out = tmp_path / "xla.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")]))
    done = subprocess.run([sys.executable, "-m", "compilecheck.xla_part", "--json", str(out), "--only-planted",
                           "--workers", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr[-2000:]
    [record] = json.loads(out.read_text())["records"]
    assert record["alias_bytes"] == 0 and record["copies"]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed here (make compile-check installs it into .venv-compile)")
def test_the_hybrid_forward_updates_its_kv_cache_in_place_on_a_deviceless_tpu(monkeypatch):
    """A Granite-4-H-shaped hybrid's decode forward (its KV cache 4 heads of 64) compiled for a
    deviceless v5e: the KV cache and the state arrays aliased, and no copy of the whole cache in
    the optimised HLO. Left to choose the cache's entry layout, the TPU compiler laid it out
    another way than the cache's gather and scatter read it and copied it in and out every step."""
    from compilecheck import xla_part

    monkeypatch.setenv("GRAPHRT_ATTENTION", "auto")               # run_group sets it; restored after
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    [record] = xla_part.run_group(dict(chip="v5e", topology=xla_part.CHIPS["v5e"], tp=1, config="hybrid",
                                       attention="auto", role="forward", programs=("decode",), sizes=1))
    assert not record.get("error"), record.get("error")
    assert record["state_bytes"] > 0 and record["alias_bytes"] >= record["cache_bytes"]
    assert record["copies"] == [], record["copies"]
    assert xla_checks.check_program(record) == []


def test_make_compile_check_is_wired():
    text = (ROOT / "Makefile").read_text()
    assert "compile-check:" in text and "benchmarks/compile_check.py" in text
    assert "jax[tpu]==$(COMPILE_JAX)" in text and "--plant" in text
