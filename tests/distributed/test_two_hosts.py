"""Issue 42: TP=2 across two "hosts" -- two network namespaces joined by a veth pair, each rank
with its own address and no loopback shortcut (``GLOO_SOCKET_IFNAME`` set to its end of the
pair; each namespace's ``/etc/hosts`` maps the host name to its own address, which JAX's gloo
transport binds to), the world given by SGLang-style flags through ``graphrt.engine.launch`` -- gives
the single-process tokens (greedy, 8 concurrent requests, chunked prefill): torch (rank 0
drives, rank 1 serves) against one torch process, XLA (multi-controller) against one process
with two host devices. Skipped where network namespaces cannot be made (not root, no ``ip``)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import graphrt
from support.hf_models import tiny_hf_model_dir
from support.two_host_workload import ENGINE, GREEDY, prompts

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture
def two_hosts():
    """Two namespaces and a veth pair between them: ``[(namespace, interface, address)] * 2``."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command")
    tag = f"{os.getpid() % 100000}"
    net = f"10.{100 + os.getpid() % 100}.{os.getpid() % 250}"
    hosts = [(f"grt{tag}{s}", f"gv{tag}{s}", f"{net}.{i + 1}") for i, s in enumerate("ab")]
    try:
        _ip("netns", "add", hosts[0][0])
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"network namespaces are not permitted here: {getattr(exc, 'stderr', exc)!r}")
    try:
        _ip("netns", "add", hosts[1][0])
        _ip("link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])
        for ns, dev, addr in hosts:
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns", ns)             # `ip netns exec` mounts it over /etc
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")
        yield hosts
    finally:
        for ns, _, _ in hosts:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
            shutil.rmtree(Path("/etc/netns", ns), ignore_errors=True)


def _rank_cmd(node: str, master: str, model_dir: str, out: Path, backend: str) -> list[str]:
    return [sys.executable, str(ROOT / "tests" / "support" / "two_host_rank.py"), node, master, model_dir, str(out),
            backend]


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_tp2_across_two_network_namespaces_gives_one_process_tokens(two_hosts, tmp_path, backend):
    model_dir = str(tiny_hf_model_dir("qwen3"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]))
    if backend == "cpu":
        want = [o.token_ids for o in graphrt.LLM(model_dir, backend="cpu", **ENGINE).generate(prompts(), GREEDY)]
    else:                                   # one process, two host devices (XLA_FLAGS before jax starts)
        single = tmp_path / "single.json"
        done = subprocess.run(_rank_cmd("single", "-", model_dir, single, "xla"), env=env, capture_output=True,
                              text=True, timeout=TIMEOUT_S)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        want = json.loads(single.read_text())["tokens"]
    master = f"{two_hosts[0][2]}:29500"
    out = tmp_path / "tokens.json"
    procs = []
    for node, (ns, dev, _) in enumerate(two_hosts):
        cmd = ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={dev}",
               *_rank_cmd(str(node), master, model_dir, out, backend)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    got = json.loads(out.read_text())
    assert got["tokens"] == want
    if backend == "cpu":
        assert got["hits"] > 0            # the all-reduces crossed the veth pair from recorded graphs
