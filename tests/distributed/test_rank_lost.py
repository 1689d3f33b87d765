"""Issue 42: a rank lost mid-step. Two ranks launched as torchrun would (gloo on 127.0.0.1,
``serve()`` on rank 1); rank 1's process is killed (SIGKILL) inside its forward in the middle
of ``generate``. Rank 0 fails every in-flight request with ``RankLostError`` naming rank 1,
closes its engine and exits, within 60 s of the kill; nothing hangs."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import torch

from graphrt.backends.torch.parallel.tp_protocol import free_port
from support.hf_models import random_prompts, tiny_hf_model_dir

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4, num_kv_blocks=40)
BOUND_S = 60.0
#: Rank 1 dies in its forward number this (prefills done, decodes under way).
KILL_AT_FORWARD = 6


def _die_in_forward() -> None:
    """Rank 1 kills its own process inside forward KILL_AT_FORWARD (mid-step, mid-generate)."""
    from graphrt.backends.torch.parallel import tp_worker

    base, count = tp_worker.TorchExecutor, [0]

    def hook(module, inputs, output):
        count[0] += 1
        if count[0] == KILL_AT_FORWARD:
            os.kill(os.getpid(), signal.SIGKILL)

    def executor(model, *args, **kwargs):
        model.model.layers[1].register_forward_hook(hook)
        return base(model, *args, **kwargs)
    tp_worker.TorchExecutor = executor


def _rank(rank: int, port: int, model_dir: str, results) -> None:
    import torch.distributed as dist

    import graphrt
    from graphrt import GenerationError, RankLostError, SamplingParams

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank:
        from graphrt.backends.torch.parallel.tp_worker import serve
        _die_in_forward()
        serve()
        results.put((rank, "served to the end"))
        return
    llm = graphrt.LLM(model_dir, backend="eager", tensor_parallel_size=2, **ENGINE)
    try:
        llm.generate(random_prompts((5, 9, 3, 7, 4, 6), seed=5), SamplingParams(max_tokens=20, ignore_eos=True))
        results.put((rank, ("finished", None, None, None)))
    except GenerationError as exc:
        cause = exc.__cause__
        reasons = sorted({o.finish_reason for o in exc.outputs})
        results.put((rank, (type(cause).__name__, getattr(cause, "rank", None), str(cause), reasons)))
    finally:
        llm.close()
        results.put((rank, ("closed", time.monotonic())))
    dist.destroy_process_group()


def test_a_rank_killed_mid_step_is_named_and_the_survivor_exits():
    model_dir = str(tiny_hf_model_dir("llama"))
    ctx = mp.get_context("spawn")
    port, results = free_port(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(rank, port, model_dir, results), daemon=True) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        rank, outcome = results.get(timeout=240)     # two spawned torch imports, the engine, the kill
        procs[1].join(5)
        killed = time.monotonic()
        assert procs[1].exitcode == -signal.SIGKILL, procs[1].exitcode
        assert rank == 0
        name, lost, message, reasons = outcome
        assert name == "RankLostError" and lost == 1, outcome
        assert "rank 1 lost" in message, message
        assert reasons and set(reasons) <= {"error", "abort"} and "error" in reasons, reasons
        assert results.get(timeout=BOUND_S)[1][0] == "closed"
        procs[0].join(BOUND_S)
        assert procs[0].exitcode == 0, procs[0].exitcode
        assert time.monotonic() - killed < BOUND_S
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
