"""Tensor-parallel ``xla`` serving on 2 and 4 CPU devices, greedy parity with transformers.

``XLA_FLAGS=--xla_force_host_platform_device_count=4`` must be set before JAX starts, so the
test runs this file as a script in a fresh process; the script prints one ``OK`` line per case
(or ``SKIP:`` with the reason when the host cannot provide four devices).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4)
#: (arch, tp, checkpoint overrides, whether KV heads split over the mesh): both archs, both
#: mesh sizes, and 2 KV heads split over 2 devices and replicated over 4.
CASES = [("qwen3", 2, {}, True), ("llama", 4, {}, False)]
DEVICES = 4


def test_sharded_greedy_parity_in_subprocess():
    pytest.importorskip("jax")
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu",  # tests/ for the support package
           "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True,
                          text=True, timeout=600)
    if "SKIP:" in proc.stdout:
        pytest.skip(proc.stdout.split("SKIP:", 1)[1].strip())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count("OK ") == len(CASES), proc.stdout


def _main() -> None:
    import jax
    if len(jax.devices()) < DEVICES:
        print(f"SKIP: only {len(jax.devices())} JAX devices here (XLA_FLAGS not honoured)")
        return
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import graphrt
    from graphrt.backends.xla.backend import XlaBackend
    from graphrt.backends.xla.compile import CompileCounter
    from graphrt.core.dispatch import BatchDescriptor
    from graphrt.core.graph_modes import RuntimeMode
    from support.hf_models import hf_logits, load_hf_model, tiny_hf_model_dir

    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 128, size=n)] for n in (5, 11, 30)]
    params = graphrt.SamplingParams(max_tokens=4, ignore_eos=True)
    for arch, tp, overrides, kv_split in CASES:
        d = tiny_hf_model_dir(arch, **overrides)
        llm = graphrt.LLM(str(d), backend=XlaBackend(tp_size=tp), precompile_token_paddings=[32],
                          precompile_bs_paddings=[4], strict=True, **LIMITS)
        ex = llm.runner.executor
        with CompileCounter() as counter:
            outputs = llm.generate(prompts, params)
        assert counter.compiles == 0, counter.names
        hf = load_hf_model(d)
        for out, prompt in zip(outputs, prompts):
            ref = hf_logits(hf, (prompt + out.token_ids)[:-1]).numpy()
            for j, tok in enumerate(out.token_ids):
                row = ref[len(prompt) - 1 + j]
                assert row[tok] >= row.max() - 1e-4, (arch, tp, j, tok, int(row.argmax()))
        # Weights and the KV cache carry the planned shardings, and the executables were
        # compiled for them.
        layers = ex.weights["layers"]
        assert layers["wq"].sharding.spec == P(None, None, "tp")
        assert layers["wo"].sharding.spec == P(None, "tp", None)
        assert layers["wk"].sharding.spec == (P(None, None, "tp") if kv_split else P())
        kv_spec = P(None, None, None, "tp", None) if kv_split else P()
        assert ex.kv_cache.sharding.spec == kv_spec and len(ex.kv_cache.sharding.device_set) == tp
        entry = llm.runner.cache.get((RuntimeMode.FULL, BatchDescriptor(32, 4, False, max_seq_len=LIMITS['max_model_len'])))
        (weights_in, kv_in, *_), _ = entry.executable.input_shardings
        assert weights_in["layers"]["w_up"].spec == P(None, None, "tp") and kv_in.spec == kv_spec
        print(f"OK {arch} tp={tp} kv_heads_split={kv_split}", flush=True)


if __name__ == "__main__":
    _main()
