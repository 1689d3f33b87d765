"""Issue 42: a collective signature per captured key, agreed across tensor-parallel ranks.

A rank whose model issues one more all-reduce (rank 1, in one layer's MLP) than rank 0's
captures a different collective sequence: both ranks refuse the key with
``CollectiveMismatchError`` naming each rank's first differing collective, within 60 s, with
no hang and no replay. The ranks are launched as torchrun would (an initialised gloo group on
127.0.0.1, ``serve()`` on rank 1); the same model on both ranks still serves."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

import graphrt
from graphrt import CollectiveMismatchError, SamplingParams
from graphrt.backends.torch.parallel.collective_log import first_differences
from graphrt.backends.torch.parallel.tp_protocol import free_port
from support.hf_models import tiny_hf_model_dir

ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, block_size=4,
              cudagraph_capture_sizes=[4], num_kv_blocks=12)
HARD_TIMEOUT_S = 60.0


def _plant_extra_all_reduce() -> None:
    """This rank's model gets one more all-reduce, after layer 1's MLP (a rank-divergent model)."""
    from graphrt.backends.torch.parallel import tp_worker
    from graphrt.models.torch.parallel import all_reduce

    base = tp_worker.TorchExecutor

    def executor(model, *args, **kwargs):
        model.model.layers[1].mlp.register_forward_hook(lambda mod, inp, out: all_reduce(out, None) * 0.5)
        return base(model, *args, **kwargs)
    tp_worker.TorchExecutor = executor


def _rank(rank: int, port: int, model_dir: str, plant: bool, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank:
            from graphrt.backends.torch.parallel.tp_worker import serve
            if plant:
                _plant_extra_all_reduce()
            serve()
            results.put((rank, "served"))
            return
        llm = graphrt.LLM(model_dir, backend="cpu", tensor_parallel_size=2, **ENGINE)
        outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
        hits = llm.stats["hits"]
        llm.close()
        results.put((rank, ("tokens", [o.token_ids for o in outs], hits)))
    except BaseException as exc:
        cause = exc
        while cause is not None and not isinstance(cause, CollectiveMismatchError):
            cause = cause.__cause__ or cause.__context__
        results.put((rank, (type(cause or exc).__name__, str(cause or exc),
                            getattr(cause, "first", None))))
    finally:
        dist.destroy_process_group()


def _launch(model_dir: str, plant: bool) -> dict[int, object]:
    ctx = mp.get_context("spawn")
    port, results = free_port(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(rank, port, model_dir, plant, results), daemon=True) for rank in (0, 1)]
    t0 = time.monotonic()
    for proc in procs:
        proc.start()
    got = {}
    try:
        for _ in procs:
            rank, value = results.get(timeout=HARD_TIMEOUT_S + 30)     # process start-up on top
            got[rank] = value
    finally:
        for proc in procs:
            proc.join(10)
            if proc.exitcode is None:
                proc.kill()
    got["seconds"] = time.monotonic() - t0
    return got


def test_rank_divergent_collectives_are_refused_on_every_rank():
    got = _launch(str(tiny_hf_model_dir("qwen3")), plant=True)
    for rank in (0, 1):
        name, message, first = got[rank]
        assert name == "CollectiveMismatchError", (rank, name, message)
        assert "first difference at collective" in message, message
        assert set(first) == {0, 1} and first[0] != first[1], first
        assert "all_reduce" in first[1], first
    assert got[0][1] == got[1][1], "every rank raises the same error"
    assert got["seconds"] < HARD_TIMEOUT_S + 30, got["seconds"]


@pytest.mark.parametrize("lists,index", [
    ([[("all_reduce", ("sum", "0"), ((4, 8),), ("float32",))]] * 2, 1),
    ([[("all_reduce", ("sum", "0"), ((4, 8),), ("float32",))], [("all_reduce", ("sum", "0"), ((4, 8),), ("bfloat16",))]], 0),
    ([[], [("all_reduce", ("sum", "0"), ((4, 8),), ("float32",))]], 0),
])
def test_first_differences(lists, index):
    found, first = first_differences(lists)
    assert found == index and set(first) == {0, 1}
