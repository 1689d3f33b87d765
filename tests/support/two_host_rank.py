"""One rank of a two-"host" tensor-parallel job (tests/distributed/test_two_hosts.py): run inside
its own network namespace as ``python two_host_rank.py NODE_RANK ADDR:PORT MODEL_DIR OUT.json
[BACKEND]``. The world comes from SGLang-style flags through ``graphrt.engine.launch``. torch (``cpu``):
rank 0 generates, rank 1 serves. ``xla``: both processes generate (multi-controller). NODE_RANK
``single``: one process with two host devices, no launcher (the XLA reference). Rank 0 writes the
tokens to OUT.json."""

from __future__ import annotations

import json
import sys

import torch


def main_xla(node_rank: str, addr: str, model_dir: str, out: str) -> None:
    import os

    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2" if node_rank == "single" else ""
    import graphrt
    from graphrt.backends.xla.backend import XlaBackend
    from graphrt.engine.launch import launch
    from support.two_host_workload import ENGINE, GREEDY, prompts

    if node_rank != "single":
        launch("xla", nnodes=2, node_rank=int(node_rank), dist_init_addr=addr, timeout=120)
    llm = graphrt.LLM(model_dir, backend=XlaBackend(tp_size=2), **ENGINE, precompile_token_paddings=[16],
                      precompile_bs_paddings=[8])
    outs = llm.generate(prompts(), GREEDY)
    if node_rank in ("single", "0"):
        with open(out, "w") as f:
            json.dump({"tokens": [o.token_ids for o in outs]}, f)
    os._exit(0)      # no shutdown barrier: the other process may already be gone


def main(node_rank: int, addr: str, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    import graphrt
    from graphrt.engine.launch import launch

    torch.set_num_threads(1)
    world = launch("gloo", nnodes=2, node_rank=node_rank, dist_init_addr=addr, timeout=120)
    if world.rank:
        from graphrt.backends.torch.parallel.tp_worker import serve
        serve()
    else:
        from support.two_host_workload import ENGINE, GREEDY, prompts
        llm = graphrt.LLM(model_dir, backend="cpu", tensor_parallel_size=2, **ENGINE)
        outs = llm.generate(prompts(), GREEDY)
        stats = llm.stats
        llm.close()
        with open(out, "w") as f:
            json.dump({"tokens": [o.token_ids for o in outs], "hits": stats["hits"]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[5:] == ["xla"]:
        main_xla(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
