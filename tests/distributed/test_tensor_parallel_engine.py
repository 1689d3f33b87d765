"""Tensor-parallel engines (issue 12): ``graphrt.LLM`` / ``ModelRunner`` with
``tensor_parallel_size > 1`` start their worker ranks, drive them from rank 0 and stop them.

* TP=2 on ``eager`` and on ``cpu`` (recording graphs replaying the all-reduces) gives TP=1's
  greedy tokens and, step by step, its logits within ``graphrt.reduction_tolerance``, on Qwen3 and Llama,
  tied and untied, through one workload with prefill, chunked prefill, decode and preemption;
* 4 ranks over 2 KV heads (replicated) give TP=1's tokens;
* ranks launched by someone else (torchrun-style: an initialised gloo group, ``serve()`` on
  rank 1) give TP=1's tokens;
* a worker killed with SIGKILL, or stopped (SIGSTOP), gives a GraphrtError naming its rank and
  the step within the timeout, and the engine stops every rank;
* ``close()`` (and a ``ModelRunner`` context manager) leaves no worker process, shared-memory
  segment or semaphore behind; refusals need no worker at all.

Workers start from a fork server (one torch import per test session), so each engine costs
about its warm-up; one workload per engine covers every step kind.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import graphrt
from graphrt import ConfigError, GraphConfig, GraphMode, GraphrtError, ModelRunner, SamplingParams
from graphrt.backends.torch import acl
from graphrt.backends.torch.parallel.tp_protocol import RUN, free_port
from graphrt.backends.torch.parallel import tp_ranks
from graphrt.core import defaults
from graphrt.core.inputs.fields import ARRAY_FIELDS
from support.fast_subset import slow_except
from support.hf_models import random_prompts, tiny_hf_model_dir
from support.parity import assert_close_across_reductions

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4,
              cudagraph_capture_sizes=[4, 32], num_kv_blocks=20, schedule_conservativeness=0.0)
#: Eight prompts for four request slots; 40 and 57 tokens are prefilled in chunks of 32; 19
#: usable KV blocks of 4 tokens cannot hold four such requests, so decodes preempt.
LENGTHS = (3, 40, 11, 57, 25, 30, 19, 7)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
#: The tiny models' hidden size: the width each rank's partial sums reduce over.
HIDDEN = 64


@pytest.fixture(autouse=True, scope="module")
def fork_server_and_one_thread():
    """One intra-op thread per rank: two ranks on two cores, not four threads. The fork server
    the workers start from is started first, so that its imports overlap the checkpoint builds."""
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(["graphrt.backends.torch.parallel.tp_worker"])
    forkserver.ensure_running()
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def drive(llm: graphrt.LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy tokens per prompt and every step's logits (the engine stepped by hand)."""
    ids = [llm.add_request(p, GREEDY) for p in prompts]
    done, logits = {}, []
    while llm.has_unfinished():
        for out in llm.step():
            assert out.finish_reason == "length", out.error
            done[out.request_id] = out.token_ids
        logits.append(llm.runner.outputs.logits())
    return [done[i] for i in ids], logits


def channel_names(spec) -> list[str]:
    """The /dev/shm names of a step channel's segment and semaphores."""
    return [spec.name] + [f"sem.{w._semlock.name.lstrip('/')}" for w in spec.wakeups]


def handles(executor) -> tuple[list[int], list[str]]:
    """Worker pids, and the /dev/shm names of the step channel's segment and semaphores."""
    ranks = executor.ranks
    return [proc.pid for proc in ranks.procs], channel_names(ranks.channel.spec)


def assert_released(pids: list[int], names: list[str]) -> None:
    """No worker process (nor an unreaped one) and no segment or semaphore is left."""
    assert not [p for p in mp.active_children() if p.pid in pids]
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    for _ in range(50):
        left = [name for name in names if Path("/dev/shm", name.lstrip("/")).exists()]
        if not left:
            return
        time.sleep(0.02)
    raise AssertionError(f"left in /dev/shm: {left}")


CASES = [("eager", "qwen3", ()), ("eager", "llama", (("tie_word_embeddings", True),)),
         ("cpu", "qwen3-tied", ()), ("cpu", "llama", ())]


@pytest.mark.parametrize("backend,arch,overrides", slow_except(CASES, CASES[0], CASES[2]), ids=[f"{b}-{a}{'-tied' * bool(o)}" for b, a, o in CASES])
def test_tp2_equals_tp1(backend, arch, overrides, monkeypatch):
    model_dir = str(tiny_hf_model_dir(arch, **dict(overrides)))
    prompts = random_prompts(LENGTHS, seed=0)
    reference = graphrt.LLM(model_dir, backend=backend, **ENGINE)
    ref_tokens, ref_logits = drive(reference, prompts)
    assert reference.stats["preemptions"] > 0
    reference.close()

    from graphrt.backends.torch.backend import TorchBackend
    loads = []
    load = TorchBackend.load_model
    monkeypatch.setattr(TorchBackend, "load_model", lambda self, *a, **kw: loads.append(kw) or load(self, *a, **kw))
    llm = graphrt.LLM(model_dir, backend=backend, tensor_parallel_size=2, **ENGINE)
    assert [kw.get("tp_size", 1) for kw in loads] == [2], "rank 0 loaded more than its shard"
    pids, names = handles(llm.runner.executor)
    tokens, logits = drive(llm, prompts)
    stats = llm.stats
    llm.close()
    assert_released(pids, names)

    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits) and stats["preemptions"] > 0
    for step, (got, want) in enumerate(zip(logits, ref_logits)):
        assert_close_across_reductions(got, want, width=HIDDEN, err_msg=f"step {step}")
    if backend == "cpu":            # the collectives were replayed from recorded graphs
        assert stats["hits"] > 0 and stats["eager_steps"] == 0
    assert llm.runner.model.tp_size == 2 and llm.runner.executor.steps == len(logits)


def test_four_ranks_replicate_kv_heads():
    model_dir = str(tiny_hf_model_dir("qwen3"))       # 2 KV heads over 4 ranks: 0, 0, 1, 1
    prompts = random_prompts((9, 40, 5, 22), seed=2)
    config = dict(ENGINE, num_kv_blocks=None)
    want = graphrt.LLM(model_dir, backend="eager", **config).generate(prompts, GREEDY)
    llm = graphrt.LLM(model_dir, backend="eager", tensor_parallel_size=4, **config)
    executor = llm.runner.executor
    pids, names = handles(executor)
    sent = []
    send = executor.ranks.send
    executor.ranks.send = lambda method, arrays: sent.append((method, len(arrays))) or send(method, arrays)
    got = llm.generate(prompts, GREEDY)
    # A step not prepared in the resident buffers goes with its arrays: the same tokens.
    executor._resident = False
    again = llm.generate(prompts[:1], GREEDY)
    assert llm.runner.model.num_kv_heads == 1 and len(pids) == 3
    llm.close()
    assert_released(pids, names)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert again[0].token_ids == want[0].token_ids
    runs = [n for method, n in sent if method == RUN]
    assert runs[0] == 1 and runs[-1] == 1 + len(ARRAY_FIELDS), runs     # row only, then row + arrays


def _launched_rank(rank: int, port: int, model_dir: str, results) -> None:
    """A rank of a group launched outside graphrt (as torchrun would): rank 0 builds the
    engine, rank 1 runs ``serve()`` until rank 0 closes it."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank:
            from graphrt.backends.torch.parallel.tp_worker import serve
            serve()
            results.put((rank, None))
            return
        llm = graphrt.LLM(model_dir, backend="eager", tensor_parallel_size=2, **ENGINE)
        outs = llm.generate(random_prompts((5, 40, 12), seed=3), GREEDY)
        llm.close()
        results.put((rank, [o.token_ids for o in outs]))
    except BaseException as exc:
        results.put((rank, f"rank {rank} raised {exc!r}"))
        raise
    finally:
        dist.destroy_process_group()


def test_joins_a_group_launched_elsewhere():
    model_dir = str(tiny_hf_model_dir("llama"))   # built here: a child would build its own copy
    want = graphrt.LLM(model_dir, backend="eager", **ENGINE).generate(random_prompts((5, 40, 12), seed=3), GREEDY)
    ctx = mp.get_context("forkserver")            # torch already imported there: a fast start
    port, results = free_port(), ctx.Queue()
    procs = [ctx.Process(target=_launched_rank, args=(rank, port, model_dir, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(30)
    assert got == {0: [o.token_ids for o in want], 1: None}
    assert [proc.exitcode for proc in procs] == [0, 0]


@pytest.mark.parametrize("sig", slow_except([signal.SIGKILL, signal.SIGSTOP], signal.SIGKILL), ids=["killed", "stopped"])
def test_failed_worker_is_named_and_every_rank_stops(monkeypatch, sig):
    timeout = 10.0  # the group's timeout: a busy machine's first step can take seconds
    monkeypatch.setattr(defaults, "TP_TIMEOUT_S", timeout)
    monkeypatch.setattr(tp_ranks, "TP_FAULT_GRACE_S", 0.3)
    llm = graphrt.LLM(str(tiny_hf_model_dir("qwen3")), backend="eager", tensor_parallel_size=2, **ENGINE)
    pids, names = handles(llm.runner.executor)
    first = llm.generate(random_prompts((6, 9), seed=0), GREEDY)
    assert all(o.finish_reason == "length" for o in first)
    steps = llm.runner.executor.steps
    os.kill(pids[0], sig)
    try:
        llm.add_request(random_prompts((7,), seed=0)[0], GREEDY)
        start = time.monotonic()
        (out,) = llm.step()
        elapsed = time.monotonic() - start
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[0], signal.SIGCONT)
    assert out.finish_reason == "error"
    what = "exited with code -9 (SIGKILL)" if sig == signal.SIGKILL else "is alive but did not read the call"
    assert f"tensor-parallel worker rank 1 {what}" in out.error
    assert f"during step {steps + 1} (run " in out.error
    assert elapsed < timeout + tp_ranks.TP_FAULT_GRACE_S + 2.0
    assert_released(pids, names)                  # the fault stopped every rank already
    llm.add_request([5, 6, 7], GREEDY)
    (again,) = llm.step()                         # later steps fail at once with the same error
    assert again.finish_reason == "error" and "tensor-parallel worker rank 1" in again.error
    llm.close()


def test_worker_dying_while_rank0_forms_the_group_is_named_at_once(monkeypatch):
    """A worker that dies as rank 0 forms the process group fails start-up within seconds with a
    GraphrtError naming its rank and signal -- not after the rendezvous timeout as torch's
    DistStoreError -- and leaves no process, segment or semaphore."""
    import torch.distributed as dist
    from graphrt.backends.torch.parallel.tp_ranks import SpawnedRanks

    monkeypatch.setattr(defaults, "TP_TIMEOUT_S", 60.0)       # the hang this replaces
    monkeypatch.setattr(tp_ranks, "TP_FAULT_GRACE_S", 0.3)
    seen = {}
    connect, init = SpawnedRanks.connect, dist.init_process_group

    def recording_connect(self):
        seen.update(procs=list(self.procs), names=channel_names(self.channel.spec))
        return connect(self)

    def kill_then_init(*args, **kwargs):
        if "start" not in seen:                 # the first engine only
            for proc in seen["procs"]:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(30)
            seen["start"] = time.monotonic()
        return init(*args, **kwargs)

    monkeypatch.setattr(SpawnedRanks, "connect", recording_connect)
    monkeypatch.setattr(dist, "init_process_group", kill_then_init)
    with pytest.raises(GraphrtError, match=r"tensor-parallel worker rank 1 exited with code -9 \(SIGKILL\) "
                                           r"during start-up"):
        graphrt.LLM(str(tiny_hf_model_dir("qwen3")), backend="eager", tensor_parallel_size=2, **ENGINE)
    assert time.monotonic() - seen["start"] < 30.0
    assert not dist.is_initialized()
    pids, names = [proc.pid for proc in seen["procs"]], seen["names"]
    assert_released(pids, names)
    # The failed start-up leaves nothing that stops the next engine from forming its group.
    with ModelRunner(str(tiny_hf_model_dir("qwen3")), backend="eager", tensor_parallel_size=2,
                     max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4,
                     num_kv_blocks=8, progress=False) as runner:
        assert runner.model.tp_size == 2 and time.monotonic() - seen["start"] < 60.0
        pids, names = handles(runner.executor)
    assert_released(pids, names)


def test_close_from_another_thread_waits_for_the_running_step():
    """close() from another thread while a step runs waits for it: the generate in flight gets
    its outputs or a GenerationError saying the engine is closed (no fault, no "exited"),
    nothing is left, and every later call says the engine is closed."""
    import threading

    llm = graphrt.LLM(str(tiny_hf_model_dir("qwen3")), backend="eager", tensor_parallel_size=2, **ENGINE)
    executor = llm.runner.executor
    pids, names = handles(executor)
    in_step, times = threading.Event(), {}
    run = executor.local.run

    def slow_run(*args, **kwargs):                 # rank 0's part of step 2 takes a while
        if executor.steps == 2:
            in_step.set()
            time.sleep(0.5)
            try:
                return run(*args, **kwargs)
            finally:
                times["step_end"] = time.monotonic()
        return run(*args, **kwargs)

    executor.local.run = slow_run
    result = {}

    def generate():
        try:
            result["outs"] = llm.generate(random_prompts((6, 9), seed=0),
                                          SamplingParams(max_tokens=20, ignore_eos=True))
        except GraphrtError as exc:
            result["error"] = exc

    thread = threading.Thread(target=generate)
    thread.start()
    assert in_step.wait(60)
    llm.close()
    times["closed"] = time.monotonic()
    thread.join(60)
    assert not thread.is_alive()
    assert times["closed"] >= times["step_end"], "close() did not wait for the running step"
    error = result.get("error")
    assert isinstance(error, graphrt.GenerationError), error
    assert "closed" in str(error) and "exited" not in str(error), str(error)
    assert {o.finish_reason for o in error.outputs} == {"abort"}
    assert executor.ranks.fault_error is None
    assert_released(pids, names)
    for call in (lambda: llm.generate([[5, 6, 7]], GREEDY), lambda: llm.add_request([5, 6, 7], GREEDY), llm.step):
        with pytest.raises(GraphrtError, match="closed") as err:
            call()
        assert "exited" not in str(err.value)
    llm.close()                                   # idempotent


def test_runner_context_manager_stops_workers():
    with ModelRunner(str(tiny_hf_model_dir("qwen3")), backend="eager", tensor_parallel_size=2,
                     max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4,
                     num_kv_blocks=8, progress=False) as runner:
        pids, names = handles(runner.executor)
        assert all(Path(f"/proc/{pid}").exists() for pid in pids)
        assert runner.model.tp_size == 2
    assert_released(pids, names)
    assert runner.recover_kv_cache() is False
    with pytest.raises(GraphrtError, match="closed"):
        runner.executor.allocate_kv_cache(2, 4)
    runner.close()                                # idempotent


def test_refusals_start_nothing():
    before = set(mp.active_children())
    with pytest.raises(ConfigError, match="Hugging Face directory"):
        ModelRunner(torch.nn.Linear(2, 2), backend="eager", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="LoRA"):
        ModelRunner(str(tiny_hf_model_dir("qwen3")), backend="eager", tensor_parallel_size=2, max_loras=1)
    assert set(mp.active_children()) == before


def test_npu_capture_budget_counts_the_tensor_parallel_group(monkeypatch):
    from graphrt.backends.torch.npu import NpuGraphBackend

    seen = {}
    monkeypatch.setattr(acl, "capture_budget", lambda layers, **kw: seen.update(kw, layers=layers) or 2)
    config = GraphConfig.create(max_num_seqs=4, max_num_batched_tokens=64, cudagraph_capture_sizes=[1, 2, 4, 8, 16],
                                tensor_parallel_size=4)
    model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=3))
    NpuGraphBackend("cpu", npu=object()).dispatcher(config, GraphMode.FULL, model)
    assert seen["tp_size"] == 4 and seen["layers"] == 3
