"""Issue 42: multi-controller XLA. Two ``jax.distributed`` processes on 127.0.0.1 (gloo CPU
collectives, one CPU device each, the world from ``graphrt.engine.launch``'s flags) each build the
engine over the two-process mesh and get the same requests: their tokens equal one process
with two host devices (greedy, 8 concurrent requests, chunked prefill). Then the processes are
given different requests: both raise ``StepMismatchError`` before the step runs -- no hang."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from graphrt.backends.torch.parallel.tp_protocol import free_port
from support.hf_models import tiny_hf_model_dir

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=48, block_size=4, num_kv_blocks=96,
              precompile_token_paddings=[16], precompile_bs_paddings=[8])
LENGTHS = (3, 21, 11, 30, 5, 17, 8, 26)


def _child(role, port: int, model_dir: str, results) -> None:
    """``role``: "single" (one process, two host devices) or the process index 0 / 1."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2" if role == "single" else ""
    try:
        import numpy as np

        import graphrt
        from graphrt.backends.xla.backend import XlaBackend

        if role != "single":
            from graphrt.engine.launch import launch
            launch("xla", env={}, nnodes=2, node_rank=role, dist_init_addr=f"127.0.0.1:{port}", timeout=120)
        rng = np.random.default_rng(7)
        prompts = [[int(t) for t in rng.integers(3, 120, size=n)] for n in LENGTHS]
        greedy = graphrt.SamplingParams(max_tokens=5, ignore_eos=True)
        llm = graphrt.LLM(model_dir, backend=XlaBackend(tp_size=2), **ENGINE)
        tokens = [o.token_ids for o in llm.generate(prompts, greedy)]
        refused = None
        if role != "single":
            t0 = time.monotonic()
            try:
                llm.generate([prompts[1 + role]], greedy)       # process 1: another prompt
            except graphrt.GenerationError as exc:
                cause = exc.__cause__
                refused = (type(cause).__name__, str(cause), time.monotonic() - t0)
        results.put((role, (tokens, refused)))
    except BaseException as exc:  # noqa: BLE001 - never leave the parent waiting
        results.put((role, ("crashed", repr(exc))))
    results.close()
    results.join_thread()     # flushed before the exit below
    os._exit(0)       # no jax.distributed shutdown barrier: the parent judges from the results


def test_two_processes_give_one_process_tokens_and_refuse_divergent_steps():
    model_dir = str(tiny_hf_model_dir("qwen3"))
    ctx = mp.get_context("spawn")
    port, results = free_port(), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(role, port, model_dir, results), daemon=True)
             for role in ("single", 0, 1)]
    for proc in procs:
        proc.start()
    try:
        got = dict(results.get(timeout=300) for _ in procs)
    finally:
        for proc in procs:
            proc.join(20)
            if proc.exitcode is None:
                proc.kill()
    want, _ = got["single"]
    assert want != "crashed", got["single"]
    for role in (0, 1):
        tokens, refused = got[role]
        assert tokens == want, (role, got[role])
        name, message, seconds = refused
        assert name == "StepMismatchError" and "different steps" in message, refused
        assert seconds < 60, seconds
