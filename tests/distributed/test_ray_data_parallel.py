"""graphrt.DataParallelLLM with ``data_parallel_backend="ray"`` (issue 42): replicas as Ray actors.

Without Ray (the shared venv, CI): the option raises a ConfigError naming the extra, and Ray's
options are refused without it, before any worker starts. With Ray (`make test-ray`, its own
venv): on a local Ray cluster of 2 CPUs, two actor replicas answer with the greedy tokens of two
local worker processes and both replicas serve; a cluster without room is named with the
resources asked; a replica whose process is killed is named by the next call; close() then ends
the other actor and removes the placement group; a process not connected to a cluster is told
how to connect.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

import graphrt
import graphrt.engine
from graphrt import ConfigError, GraphrtError, SamplingParams

LLM_KW = dict(backend="eager", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
              block_size=4, num_kv_blocks=96)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20], [3, 4], [30, 31, 32, 33]]
#: Different lengths, so outputs come back out of request order.
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (7, 2, 5, 1, 6)]


def no_worker_may_start(monkeypatch) -> list:
    started: list = []
    monkeypatch.setattr(multiprocessing.get_context("spawn").Process, "start", lambda proc: started.append(proc))
    return started


def test_ray_backend_without_ray_raises_naming_the_extra(model_dir, monkeypatch):
    """Where ``ray`` does not import, the option is a ConfigError saying `pip install
    'graphrt[ray]'`, raised before anything starts (today: an unknown keyword of LLM)."""
    monkeypatch.setitem(sys.modules, "ray", None)       # `import ray` now raises ImportError
    monkeypatch.delitem(sys.modules, "graphrt.engine.dp_ray", raising=False)
    monkeypatch.delattr(graphrt.engine, "dp_ray", raising=False)
    started = no_worker_may_start(monkeypatch)
    with pytest.raises(ConfigError, match=re.escape("pip install 'graphrt[ray]'")):
        graphrt.DataParallelLLM(model_dir, data_parallel_size=2, data_parallel_backend="ray", **LLM_KW)
    assert started == []


@pytest.mark.parametrize("bad,match", [
    (dict(data_parallel_backend="spark"), "data_parallel_backend must be one of"),
    (dict(ray_resources={"CPU": 1}), "ray_resources is for data_parallel_backend='ray'"),
    (dict(ray_placement_strategy="PACK"), "ray_placement_strategy is for"),
    (dict(data_parallel_backend="ray", device_ids=[0, 1]), "device_ids is for data_parallel_backend='mp'"),
    (dict(data_parallel_backend="ray", ray_placement_strategy="ANYWHERE"), "ray_placement_strategy must be"),
    (dict(data_parallel_backend="ray", ray_resources={"CPU": -1}), "ray_resources must map"),
    (dict(data_parallel_backend="ray", ray_resources={"CPU": 0}), "one at least > 0"),
], ids=["backend", "resources-mp", "strategy-mp", "device-ids-ray", "strategy", "resources", "empty-bundle"])
def test_bad_ray_options_raise_before_any_worker_starts(model_dir, monkeypatch, bad, match):
    started = no_worker_may_start(monkeypatch)
    with pytest.raises(ConfigError, match=match):
        graphrt.DataParallelLLM(model_dir, data_parallel_size=2, **{**LLM_KW, **bad})
    assert started == []


# ---- with Ray ---------------------------------------------------------------------------------

def gone(pid: int) -> bool:
    """No such process, or only a zombie left to reap."""
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True


def wait_until(cond, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def pids_of(dp) -> list[int]:
    return [w["pid"] for w in dp.stats["workers"]]


@pytest.fixture(scope="module")
def ray():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():        # a local cluster on this machine's 2 cores
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_dp(ray, model_dir):
    with graphrt.DataParallelLLM(model_dir, data_parallel_size=2, data_parallel_backend="ray",
                                 **LLM_KW) as dp:
        yield dp


def test_a_process_not_connected_to_ray_is_told_how_to_connect(model_dir, monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match=r"(?s)ray\.init\(address='auto'\).*ray start --head"):
        graphrt.DataParallelLLM(model_dir, data_parallel_size=2, data_parallel_backend="ray", **LLM_KW)


def test_two_ray_replicas_give_the_tokens_of_two_local_replicas(ray_dp, model_dir):
    with graphrt.DataParallelLLM(model_dir, data_parallel_size=2, **LLM_KW) as local:
        expected = [o.token_ids for o in local.generate(PROMPTS, PARAMS)]
    outs = ray_dp.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == expected
    assert [len(t) for t in expected] == [p.max_tokens for p in PARAMS]
    assert {ray_dp.worker_of(o.request_id) for o in outs} == {0, 1}     # both replicas served
    stats = ray_dp.stats
    assert stats["data_parallel_backend"] == "ray"
    for w in stats["workers"]:
        assert w["alive"] and w["where"].startswith("Ray actor on ") and w["engine"]["decode_tokens"] > 0
    pids = pids_of(ray_dp)
    assert len(set(pids)) == 2 and os.getpid() not in pids


def test_replicas_the_cluster_has_no_room_for_are_named(ray, model_dir):
    with pytest.raises(GraphrtError, match=r"could not place 2 replicas of ray_resources=\{'CPU': 64\}"):
        graphrt.DataParallelLLM(model_dir, data_parallel_size=2, data_parallel_backend="ray",
                                ray_resources={"CPU": 64}, start_timeout=2, **LLM_KW)


def test_a_killed_ray_replica_is_named_by_the_next_call(ray_dp):
    """It breaks the module's front: only the close test comes after it."""
    pid = pids_of(ray_dp)[1]
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(GraphrtError, match=rf"(?s)worker 1 \(Ray actor on [\d.]+, pid {pid}\).*Ray actor is gone"):
        ray_dp.generate(PROMPTS, PARAMS, timeout=60)
    assert time.monotonic() - start < 30


def test_close_ends_the_actors_and_removes_the_placement_group(ray, ray_dp):
    """After a replica was lost too: the survivor's actor ends and the group is removed."""
    from ray.util import placement_group_table

    pids = pids_of(ray_dp)
    ray_dp.close()
    assert wait_until(lambda: all(gone(p) for p in pids), 30), pids
    assert {g["state"] for g in placement_group_table().values()} == {"REMOVED"}
    with pytest.raises(GraphrtError, match="closed"):
        ray_dp.generate([[1, 2, 3]])
