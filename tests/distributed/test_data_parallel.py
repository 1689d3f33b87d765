"""graphrt.DataParallelLLM: two worker processes behind one front, both load-balance methods.

Every request is answered exactly once, in request order, with the greedy tokens of a single
``graphrt.LLM``; round robin alternates workers; shortest queue sends to the less loaded one;
a killed worker makes the front raise a GraphrtError naming it within seconds; close() (and
interpreter exit without it) leaves no worker process behind; engine arguments a worker's LLM
would refuse are refused at the front before any process starts. One module-scoped front per
method (spawning a worker that imports torch costs seconds); the tests that break or close a
front come last in the file.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import graphrt
from graphrt import ConfigError, GraphrtError, InputError, SamplingParams
from graphrt.engine import dp_processes
from support.fast_subset import slow_except

LLM_KW = dict(backend="eager", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
              block_size=4, num_kv_blocks=96)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20], [3, 4], [30, 31, 32, 33], [40, 41], [50]]
#: Different lengths, so outputs come back out of request order.
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (7, 2, 5, 1, 6, 3, 4)]


def spawned_children() -> list[int]:
    """Pids of this process's children that run multiprocessing's spawn_main (from /proc)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if int(fields.get("PPid", "0")) == me and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def shm_inodes(pid: int) -> set[int]:
    """Inodes of the /dev/shm files (named semaphores, segments) process ``pid`` has mapped: a
    semaphore is mapped under the temporary name it was created with, so the inode finds it."""
    inodes = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
            inodes.add(int(fields[4]))
    return inodes


def shm_left(inodes: set[int]) -> list[str]:
    """The /dev/shm files that still hold one of ``inodes``."""
    return [entry.name for entry in os.scandir("/dev/shm") if entry.inode() in inodes]


def gone(pid: int) -> bool:
    """No such process, or only a zombie left for init to reap."""
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = graphrt.LLM(model_dir, **LLM_KW)
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def round_robin(model_dir):
    with graphrt.DataParallelLLM(model_dir, data_parallel_size=2, load_balance_method="round_robin",
                                 **LLM_KW) as dp:
        yield dp


@pytest.fixture(scope="module")
def shortest_queue(model_dir):
    with graphrt.DataParallelLLM(model_dir, data_parallel_size=2, load_balance_method="shortest_queue",
                                 **LLM_KW) as dp:
        yield dp


def test_bad_arguments_raise_before_any_process_starts(model_dir):
    before = multiprocessing.active_children()
    with pytest.raises(ConfigError, match="load_balance_method"):
        graphrt.DataParallelLLM(model_dir, load_balance_method="random")
    with pytest.raises(ConfigError, match="data_parallel_size"):
        graphrt.DataParallelLLM(model_dir, data_parallel_size=0)
    with pytest.raises(ConfigError, match="device_ids"):
        graphrt.DataParallelLLM(model_dir, data_parallel_size=2, device_ids=[0])
    with pytest.raises(InputError, match="directory"):
        graphrt.DataParallelLLM(object())
    assert multiprocessing.active_children() == before


BAD_ENGINE_ARGS = [(dict(max_num_seqs=0), ConfigError, "max_num_seqs"),
                   (dict(block_size=0), ConfigError, "block_size"),
                   (dict(no_such_option=1), ConfigError, "no_such_option"),
                   (dict(max_num_seqs=64, max_num_batched_tokens=32), ConfigError, "max_num_seqs"),
                   (dict(watchdog_action="shrug"), ConfigError, "watchdog_action"),
                   (dict(disable_overlap_schedule="no"), ConfigError, "disable_overlap_schedule"),
                   (dict(schedule_policy="newest"), InputError, "schedule_policy"),
                   (dict(schedule_conservativeness=-1.0), InputError, "schedule_conservativeness"),
                   (dict(decode_log_interval=0), InputError, "decode_log_interval")]


@pytest.mark.parametrize("bad,error,match", BAD_ENGINE_ARGS,
                         ids=[f"{next(iter(b))}={next(iter(b.values()))}" for b, _, _ in BAD_ENGINE_ARGS])
def test_bad_engine_arguments_raise_at_the_front_before_any_process_starts(model_dir, monkeypatch, bad, error,
                                                                           match):
    """What each worker's graphrt.LLM would refuse is refused by the front, as LLM refuses it,
    with no worker process started (today: the workers spawn, fail, and a traceback says why)."""
    started = []
    monkeypatch.setattr(multiprocessing.get_context("spawn").Process, "start", lambda proc: started.append(proc))
    before = multiprocessing.active_children()
    with pytest.raises(error, match=match):
        graphrt.DataParallelLLM(model_dir, data_parallel_size=2, **{**LLM_KW, **bad})
    assert started == [] and multiprocessing.active_children() == before


def test_a_model_directory_without_config_json_is_refused_at_the_front(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(multiprocessing.get_context("spawn").Process, "start", lambda proc: started.append(proc))
    with pytest.raises(InputError, match="config.json"):
        graphrt.DataParallelLLM(tmp_path, data_parallel_size=1, backend="eager")
    assert started == []


@pytest.mark.parametrize("method", slow_except(["round_robin", "shortest_queue"], "round_robin"))
def test_every_request_answered_once_in_order_with_single_llm_tokens(method, request, reference):
    dp = request.getfixturevalue(method)
    sent_before = sum(w["requests"] for w in dp.stats["workers"])
    outs = dp.generate(PROMPTS, PARAMS)
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert len({o.request_id for o in outs}) == len(PROMPTS)
    assert [o.token_ids for o in outs] == reference
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in PARAMS]
    assert {o.finish_reason for o in outs} == {"length"}
    workers = dp.stats["workers"]
    assert sum(w["requests"] for w in workers) - sent_before == len(PROMPTS)
    assert all(w["requests"] > 0 for w in workers)          # both workers served
    assert [w["queue_length"] for w in workers] == [0, 0]


def test_round_robin_alternates_workers(round_robin):
    before = [w["requests"] for w in round_robin.stats["workers"]]
    outs = round_robin.generate(PROMPTS[:6], PARAMS[:6])
    ranks = [round_robin.worker_of(o.request_id) for o in outs]
    assert all(a != b for a, b in zip(ranks, ranks[1:])), ranks
    after = [w["requests"] for w in round_robin.stats["workers"]]
    assert [a - b for a, b in zip(after, before)] == [3, 3]


def test_shortest_queue_sends_to_the_less_loaded_worker(shortest_queue):
    LONG = 100        # tokens of a long request: it must outlast a one-token one by far
    dp = shortest_queue
    assert [w["queue_length"] for w in dp.stats["workers"]] == [0, 0]
    long = dp.add_request([5, 6, 7], SamplingParams(max_tokens=LONG, ignore_eos=True))
    short = dp.add_request([8], SamplingParams(max_tokens=1, ignore_eos=True))
    busy, free = dp.worker_of(long), dp.worker_of(short)
    assert (busy, free) == (0, 1)       # ties go to the lowest rank; then the idle one
    got = []
    while short not in {o.request_id for o in got}:
        got += dp.step()
    queues = [w["queue_length"] for w in dp.stats["workers"]]
    assert queues[busy] == 1 and queues[free] == 0, "the long request finished too soon"
    # third runs long too, so both queues hold one request when fourth arrives (a one-token
    # third could finish first and leave worker 1 idle again: a race, not the policy).
    third = dp.add_request([9], SamplingParams(max_tokens=LONG, ignore_eos=True))
    fourth = dp.add_request([10], SamplingParams(max_tokens=1, ignore_eos=True))
    assert dp.worker_of(third) == free          # round robin would have chosen worker 0
    assert dp.worker_of(fourth) == 0            # 1 and 1: the lower rank
    while dp.has_unfinished():
        got += dp.step()
    assert sorted(o.request_id for o in got) == sorted([long, short, third, fourth])
    assert len(next(o for o in got if o.request_id == long).token_ids) == LONG


def test_step_api_returns_each_request_once(round_robin, reference):
    ids = [round_robin.add_request(p, sp) for p, sp in zip(PROMPTS[:4], PARAMS[:4])]
    got = []
    while round_robin.has_unfinished():
        got += round_robin.step()
    assert sorted(o.request_id for o in got) == sorted(ids)
    by_id = {o.request_id: o.token_ids for o in got}
    assert [by_id[i] for i in ids] == reference[:4]
    assert round_robin.step(timeout=0.0) == []


def test_bad_prompt_raises_input_error_and_sends_nothing(round_robin):
    before = [w["requests"] for w in round_robin.stats["workers"]]
    with pytest.raises(InputError, match=r"prompt_token_ids\[1\]"):
        round_robin.generate([[5], [999]], PARAMS[0])
    assert [w["requests"] for w in round_robin.stats["workers"]] == before
    assert len(round_robin.generate([[5]], PARAMS[0])) == 1      # still serving


def test_stats_per_worker(round_robin):
    stats = round_robin.stats
    assert stats["data_parallel_size"] == 2 and stats["load_balance_method"] == "round_robin"
    pids = {w["pid"] for w in stats["workers"]}
    assert len(pids) == 2 and os.getpid() not in pids
    for rank, w in enumerate(stats["workers"]):
        assert w["rank"] == rank and w["alive"]
        assert w["engine"]["waiting"] == 0 and w["engine"]["running"] == 0
        assert w["engine"]["decode_tokens"] > 0        # the worker's own LLM.stats


def test_concurrent_generate_calls_each_get_their_own_outputs(round_robin, reference):
    results: dict[int, list] = {}

    def call(k: int) -> None:
        results[k] = round_robin.generate(PROMPTS[k::2], PARAMS[k::2])

    threads = [threading.Thread(target=call, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for k in (0, 1):
        assert [o.token_ids for o in results[k]] == reference[k::2]


@pytest.mark.slow
def test_a_worker_that_fails_to_start_raises_naming_it(model_dir, tmp_path):
    (tmp_path / "config.json").write_text((Path(model_dir) / "config.json").read_text())   # no weights
    with pytest.raises(GraphrtError, match=r"(?s)worker 0 \(pid \d+\) failed to start.*safetensors") as err:
        graphrt.DataParallelLLM(tmp_path, data_parallel_size=1, backend="eager")
    assert gone(int(re.search(r"pid (\d+)", str(err.value)).group(1)))


def test_a_killed_worker_raises_naming_it(shortest_queue):
    """... and leaves nothing in /dev/shm (it used to leave tqdm's multiprocessing lock, a named
    semaphore the worker created, until the front exited; the resource tracker warned)."""
    pids = [w["pid"] for w in shortest_queue.stats["workers"]]
    pid = pids[1]
    held = shm_inodes(pid)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(GraphrtError, match=rf"worker 1 \(pid {pid}\)"):
        shortest_queue.generate(PROMPTS, SamplingParams(max_tokens=100, ignore_eos=True))
    assert time.monotonic() - start < 5.0
    with pytest.raises(GraphrtError, match="worker 1"):      # and every later call
        shortest_queue.add_request([5])
    assert not shortest_queue.stats["workers"][1]["alive"]
    shortest_queue.close()
    assert all(gone(p) for p in pids) and not set(spawned_children()) & set(pids)
    assert shm_left(held) == []


def test_close_leaves_no_child_processes(round_robin, monkeypatch):
    """close() while both workers are busy terminates them at once (no join wait here) and
    leaves no process and nothing in /dev/shm."""
    pids = [w["pid"] for w in round_robin.stats["workers"]]
    assert sorted(spawned_children()) == sorted(pids)
    held = set().union(*(shm_inodes(pid) for pid in pids))
    busy = [round_robin.add_request([5, 6, 7], SamplingParams(max_tokens=250, ignore_eos=True)) for _ in pids]
    assert sorted(round_robin.worker_of(r) for r in busy) == [0, 1]
    monkeypatch.setattr(dp_processes, "DP_WORKER_JOIN_TIMEOUT_S", 0.0)
    round_robin.close()
    assert multiprocessing.active_children() == []
    assert spawned_children() == [] and all(gone(p) for p in pids)
    assert shm_left(held) == []
    round_robin.close()         # idempotent
    with pytest.raises(GraphrtError, match="closed"):
        round_robin.generate([[5]])


@pytest.mark.slow
def test_workers_do_not_outlive_their_front(model_dir, tmp_path):
    """A front nobody closed: interpreter exit stops its workers (the atexit hook runs before
    multiprocessing would join its non-daemonic workers); a front killed outright leaves
    workers that see their pipe close and exit. Both fronts run at once (each starts in
    seconds)."""
    script = tmp_path / "front.py"
    script.write_text(
        "import sys, time, graphrt\n"
        "if __name__ == '__main__':\n"
        f"    dp = graphrt.DataParallelLLM({model_dir!r}, data_parallel_size=1, backend='eager',\n"
        "                                 max_num_seqs=2, max_model_len=32, block_size=4)\n"
        "    print(dp.stats['workers'][0]['pid'], flush=True)\n"
        "    if sys.argv[1] == 'sigkill':\n"
        "        time.sleep(120)\n")
    fronts = {how: subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, text=True)
              for how in ("exit", "sigkill")}
    pids = {}
    try:
        for how, front in fronts.items():
            pids[how] = int(front.stdout.readline())
        fronts["sigkill"].kill()
        codes = {how: front.wait(timeout=60) for how, front in fronts.items()}
        assert codes == {"exit": 0, "sigkill": -signal.SIGKILL}
    finally:
        for front in fronts.values():
            front.kill()
            front.wait()
            front.stdout.close()
    deadline = time.monotonic() + 5.0
    while not all(gone(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {how: gone(pid) for how, pid in pids.items()} == {"exit": True, "sigkill": True}
