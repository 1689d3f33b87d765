"""Issue 42: multi-controller XLA, two ways over two ``jax.distributed`` processes on 127.0.0.1
(gloo CPU collectives, one CPU device each, the world from ``graphrt.engine.launch``'s flags),
against one process with two host devices (greedy, 8 concurrent requests, chunked prefill):

* SPMD: each process builds the engine over the two-process mesh (``XlaBackend(tp_size=2)``)
  and gets the same requests: the same tokens; then the processes are given different requests:
  both raise ``StepMismatchError`` before the step runs -- no hang.
* led by process 0: ``graphrt.LLM(model_dir, backend="xla", tensor_parallel_size=2)`` on process
  0, ``graphrt.backends.xla.follower.serve()`` on process 1, which follows its calls: the same
  tokens; process 1 building an ``LLM`` of its own is refused with a ConfigError naming
  ``serve()``.

The five processes run at once in one test: the one-process reference is computed once."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time

import pytest

import graphrt
from graphrt.backends.torch.parallel.tp_protocol import free_port
from support.hf_models import tiny_hf_model_dir

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=48, block_size=4, num_kv_blocks=96,
              precompile_token_paddings=[16], precompile_bs_paddings=[8])
LENGTHS = (3, 21, 11, 30, 5, 17, 8, 26)


def _prompts():
    import numpy as np

    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(3, 120, size=n)] for n in LENGTHS]


def _spmd(index: int, model_dir: str, greedy) -> tuple:
    from graphrt.backends.xla.backend import XlaBackend

    prompts = _prompts()
    llm = graphrt.LLM(model_dir, backend=XlaBackend(tp_size=2), **ENGINE)
    tokens = [o.token_ids for o in llm.generate(prompts, greedy)]
    t0 = time.monotonic()
    try:
        llm.generate([prompts[1 + index]], greedy)       # process 1: another prompt
        refused = None
    except graphrt.GenerationError as exc:
        cause = exc.__cause__
        refused = (type(cause).__name__, str(cause), time.monotonic() - t0)
    return tokens, refused


def _led(index: int, model_dir: str, greedy) -> tuple:
    if index == 1:
        try:
            graphrt.LLM(model_dir, backend="xla", tensor_parallel_size=2, **ENGINE)
            refused = None
        except graphrt.ConfigError as exc:
            refused = str(exc)
        from graphrt.backends.xla.follower import serve
        return refused, serve()
    llm = graphrt.LLM(model_dir, backend="xla", tensor_parallel_size=2, **ENGINE)
    tokens = [o.token_ids for o in llm.generate(_prompts(), greedy)]
    llm.close()
    return tokens


def _child(role, port: int, model_dir: str, results) -> None:
    """``role``: "single" (one process, two host devices), or ("spmd" | "led", process index)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2" if role == "single" else ""
    try:
        greedy = graphrt.SamplingParams(max_tokens=5, ignore_eos=True)
        if role == "single":
            llm = graphrt.LLM(model_dir, backend="xla", tensor_parallel_size=2, **ENGINE)
            out = [o.token_ids for o in llm.generate(_prompts(), greedy)]
        else:
            from graphrt.engine.launch import launch
            kind, index = role
            launch("xla", env={}, nnodes=2, node_rank=index, dist_init_addr=f"127.0.0.1:{port}", timeout=120)
            out = (_spmd if kind == "spmd" else _led)(index, model_dir, greedy)
        results.put((role, out))
    except BaseException as exc:  # noqa: BLE001 - never leave the parent waiting
        results.put((role, ("crashed", repr(exc))))
    results.close()
    results.join_thread()     # flushed before the exit below
    os._exit(0)       # no jax.distributed shutdown barrier: the parent judges from the results


def test_one_device_refuses_tensor_parallel_size_2_naming_the_devices():
    """In this (one-device) process: the mesh ``tensor_parallel_size`` asks for, named."""
    import jax

    if jax.device_count() >= 2:
        pytest.skip("this process has two devices")
    with pytest.raises(graphrt.ConfigError, match=r"tp_size=2 needs 2 devices.*xla_force_host_platform"):
        graphrt.LLM(str(tiny_hf_model_dir("qwen3")), backend="xla", tensor_parallel_size=2, **ENGINE)


def test_two_processes_give_one_process_tokens_spmd_and_led_by_process_0():
    model_dir = str(tiny_hf_model_dir("qwen3"))
    ctx = mp.get_context("spawn")
    ports, results = {"spmd": free_port(), "led": free_port()}, ctx.Queue()
    roles = ["single", ("spmd", 0), ("spmd", 1), ("led", 0), ("led", 1)]
    procs = [ctx.Process(target=_child, args=(role, ports[role[0]] if role != "single" else 0, model_dir, results),
                         daemon=True) for role in roles]
    for proc in procs:
        proc.start()
    got: dict = {}
    try:
        while len(got) < len(procs):
            try:
                role, out = results.get(timeout=300)
            except queue.Empty:
                raise AssertionError(f"no result within 300 s from {[r for r in roles if r not in got]}; "
                                     f"got {got}") from None
            got[role] = out
    finally:
        for proc in procs:
            proc.join(20)
            if proc.exitcode is None:
                proc.kill()
    want = got["single"]
    assert want[0] != "crashed", got
    for index in (0, 1):
        tokens, refused = got[("spmd", index)]
        assert tokens == want, (index, got[("spmd", index)])
        name, message, seconds = refused
        assert name == "StepMismatchError" and "different steps" in message, refused
        assert seconds < 60, seconds
    assert got[("led", 0)] == want, got[("led", 0)]
    refused, calls = got[("led", 1)]
    assert refused is not None and "follower.serve()" in refused and "process 1" in refused, refused
    assert calls > 10, calls        # the compiles, the allocation, every forward and sampler
