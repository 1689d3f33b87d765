"""vLLM on graphrt (issue 40; docs/engines.md, "vLLM"): the platform plugin, through vLLM's own
``LLM`` on tiny random Llama and Qwen3 checkpoints (head_dim 32, block size 32: vLLM's CPU attention
refuses head_dim 16 and wants blocks in multiples of 32).

The oracle is vLLM itself: its ``enforce_eager=True`` run without the plugin. vLLM resolves its
platform once per process, so every configuration runs in a fresh interpreter
(:mod:`support.vllm_engine`), both models in one (an interpreter start with vLLM costs ~30 s here).
The workload: 8 concurrent requests whose prompts (5 to 40 tokens) are prefilled together in one
step above the largest capture size (8), then decode with 8, 7, ..., 1 requests left (each request
stops at its own ``max_tokens``), so the decode keys pad (7 -> 8, 3 -> 4, ...).

Runs where vLLM imports (``make test-engine-vllm`` builds that venv); skips, saying why, elsewhere.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from graphrt.integrations import vllm as integration

if (reason := integration.unavailable_reason()) is not None:
    pytest.skip(reason, allow_module_level=True)

from support.hf_models import make_tiny_hf_model, random_prompts  # noqa: E402
from support.hf_tokenizer import save_tiny_tokenizer  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
#: head_dim 32 and block size 32: the smallest vLLM's CPU attention takes.
SHAPE = dict(head_dim=32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
PROMPTS = random_prompts((5, 9, 14, 20, 26, 31, 35, 40), seed=40)
MAX_TOKENS = [12, 11, 10, 9, 8, 7, 6, 12]
CAPTURE_SIZES = [1, 2, 4, 8]
ENGINE = dict(block_size=32, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, dtype="float32",
              seed=0)
#: The engine steps of the workload: one prefill of every prompt, then a decode step per further token.
DECODE_STEPS = max(MAX_TOKENS) - 1
MODES = ("PIECEWISE", "FULL_AND_PIECEWISE")
#: Per cudagraph mode: the runtime mode of the decode steps, and the keys per capture size.
DECODES = {"PIECEWISE": ("PIECEWISE", 1), "FULL_AND_PIECEWISE": ("FULL", 2), "FULL_DECODE_ONLY": ("FULL", 1)}


def run_engines(models: list[str], engine: dict, *, plugin: bool, fails: bool = False, timeout: int = 1200,
                **spec: object) -> tuple[dict | None, str]:
    """Run :mod:`support.vllm_engine` in a fresh interpreter (``spec``: its other keys): (its result
    per model, or None where it was expected to fail -- ``fails`` --, and its log)."""
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    if plugin:
        env["VLLM_PLUGINS"] = integration.PLUGIN_NAME
    spec = {"models": models, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "engine": engine, **spec}
    proc = subprocess.run([sys.executable, "-m", "support.vllm_engine", json.dumps(spec)], cwd=TESTS, env=env,
                          capture_output=True, text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if fails:
        assert proc.returncode != 0 and not lines, log[-6000:]
        return None, log
    assert proc.returncode == 0 and lines, log[-6000:]
    return json.loads(lines[-1][len("RESULT "):]), log


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("vllm")
    return [str(save_tiny_tokenizer(make_tiny_hf_model(root, arch, **SHAPE))) for arch in ("llama", "qwen3")]


@pytest.fixture(scope="module")
def eager_tokens(models) -> dict[str, list[list[int]]]:
    """vLLM's own eager run, without the plugin: the oracle."""
    result, _ = run_engines(models, dict(ENGINE, enforce_eager=True), plugin=False)
    assert all(r["stats"] is None and r["platform"] == "CpuPlatform" for r in result.values())
    return {model: r["tokens"] for model, r in result.items()}


def graph_engine(mode: str) -> dict:
    return dict(ENGINE, compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": CAPTURE_SIZES})


@pytest.mark.parametrize("mode", list(DECODES))
def test_tokens_equal_vllm_eager_and_every_decode_step_replays(models, eager_tokens, mode):
    """PIECEWISE: vLLM's CPU attention between graphrt's piece graphs. FULL_AND_PIECEWISE and
    FULL_DECODE_ONLY: decode steps replay one FULL graph each, graphrt's attention inside (vLLM's
    CPU attention cannot be held in one)."""
    result, log = run_engines(models, graph_engine(mode), plugin=True)
    decode_mode, keys_per_size = DECODES[mode]
    for model, run in result.items():
        assert run["platform"] == "GraphrtCpuPlatform"
        assert run["tokens"] == eager_tokens[model], model
        stats = run["stats"]
        # PIECEWISE keys per capture size, and (FULL_AND_PIECEWISE) a FULL decode key per size too.
        assert stats["mode"] == mode and stats["keys"] == len(CAPTURE_SIZES) * keys_per_size
        # The prefill (180 tokens) is above the largest capture size; every decode step replayed a key.
        assert stats["hits"] == DECODE_STEPS and stats["replays_by_mode"].get(decode_mode) == DECODE_STEPS
        assert stats["misses"] == 0 and stats["unplanned_builds"] == 0
        assert stats["eager_steps"] == 1 and stats["eager_by_cause"]["above_largest_bucket"] == {
            "steps": 1, "tokens": sum(map(len, PROMPTS))}
        assert stats["padded_tokens"] > stats["real_tokens"]     # 7 requests ran a key of 8, 3 one of 4, ...
    assert f"graphrt under vLLM ({mode})" in log          # the worker's shutdown line


def test_without_vllm_plugins_vllm_runs_stock(models, eager_tokens):
    """The plugin is installed but ``VLLM_PLUGINS`` is unset: vLLM loads every platform plugin and
    calls it, and it must answer None -- vLLM's own CPU platform, no graphrt graph."""
    result, _ = run_engines(models, graph_engine("PIECEWISE"), plugin=False)
    for model, run in result.items():
        assert run["platform"] == "CpuPlatform" and run["stats"] is None
        assert run["tokens"] == eager_tokens[model]


def test_outside_the_tested_versions_the_plugin_refuses_and_vllm_runs_stock(models, eager_tokens):
    result, log = run_engines(models[:1], graph_engine("PIECEWISE"), plugin=True, version="0.31.2")
    run = result[models[0]]
    assert run["platform"] == "CpuPlatform" and run["stats"] is None
    assert run["tokens"] == eager_tokens[models[0]]
    assert f"tested with vLLM {integration.TESTED_RANGE}, and this is vLLM 0.31.2" in log


def test_a_late_capture_is_an_error_naming_the_key_and_the_module(models):
    """After warm-up graphrt is strict: a key vLLM's dispatcher did not have at capture time (here
    planted into it) is refused, not captured on first use."""
    _, log = run_engines(models[:1], graph_engine("PIECEWISE"), plugin=True, fails=True,
                         prompts=PROMPTS[:3], max_tokens=MAX_TOKENS[:3], after_init="ask_for_an_uncaptured_key")
    assert "CacheMissError" in log and "no captured graph / compiled executable for PIECEWISE" in log
    assert "BatchDescriptor(num_tokens=3" in log and "piece submod_0 of LlamaForCausalLM's fx split" in log


def test_a_host_sync_in_a_full_graph_is_an_error_naming_the_module(models):
    _, log = run_engines(models[:1], graph_engine("FULL_AND_PIECEWISE"), plugin=True, fails=True,
                         plant="plant_host_sync_in_attention")
    assert "GraphCaptureError: graphrt cannot capture LlamaForCausalLM" in log
    assert "as a FULL graph for BatchDescriptor(num_tokens=8, num_reqs=8, uniform=True" in log and ".item()" in log


CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


@contextlib.contextmanager
def vllm_server(model: str, args: list[str], *, plugin: bool, log_path: Path) -> Iterator[str]:
    """``vllm serve model`` on a free loopback port, until the block ends: yields its base URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    if plugin:
        env["VLLM_PLUGINS"] = integration.PLUGIN_NAME
    log = open(log_path, "w")
    server = subprocess.Popen([sys.executable, "-m", "support.vllm_cli", "serve", model, "--host", "127.0.0.1",
                               "--port", str(port), *args], cwd=TESTS, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            assert server.poll() is None, log_path.read_text()[-6000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()[-6000:]
            time.sleep(2)
        yield url
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def ask_concurrently(url: str, model: str, n: int = 16) -> list[str]:
    """``n`` OpenAI requests at once over loopback (half completions on token ids, half chat), greedy."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    prompts = random_prompts([5 + 3 * i for i in range(n)], seed=41)

    def ask(i: int) -> str:
        if i % 2:
            chat = client.chat.completions.create(
                model=model, temperature=0.0, max_tokens=8,
                messages=[{"role": "user", "content": " ".join(f"t{t}" for t in prompts[i])}])
            return chat.choices[0].message.content
        completion = client.completions.create(model=model, prompt=prompts[i], temperature=0.0, max_tokens=8)
        return completion.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(ask, range(n)))


def test_vllm_serve_with_the_plugin_answers_as_the_eager_server(models, tmp_path):
    """16 concurrent OpenAI requests (completions and chat) over loopback to ``vllm serve`` with the
    plugin (FULL_AND_PIECEWISE) and to an eager server without it: the same completions."""
    model = models[0]
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    common = ["--block-size", "32", "--max-model-len", "256", "--max-num-seqs", "16", "--dtype", "float32",
              "--chat-template", str(template), "--served-model-name", "tiny"]
    graphs = ["--compilation-config", json.dumps({"cudagraph_mode": "FULL_AND_PIECEWISE",
                                                  "cudagraph_capture_sizes": [1, 2, 4, 8, 16]})]
    answers = {}
    for plugin, args in ((False, ["--enforce-eager"]), (True, graphs)):
        log_path = tmp_path / f"serve-{plugin}.log"
        with vllm_server(model, common + args, plugin=plugin, log_path=log_path) as url:
            answers[plugin] = ask_concurrently(url, "tiny")
        log = log_path.read_text()
        assert ("graphrt: captured 10 keys" in log) == plugin, log[-4000:]
        assert ("graphrt under vLLM (FULL_AND_PIECEWISE)" in log) == plugin        # logged at shutdown
    assert all(answers[False]) and answers[True] == answers[False]


#: The kit's engine: a KV cache of 64 blocks (the checks copy the blocks a step does not use).
KIT_ENGINE = dict(graph_engine("FULL_AND_PIECEWISE"), kv_cache_memory_bytes=64 * 32 * 1024)
KIT_ENV = {"VLLM_CPU_KVCACHE_SPACE": None}


@pytest.mark.parametrize("mode", MODES)
def test_the_kit_passes_vllm_models_through_the_plugin(models, mode):
    """graphrt's padding-invisible and KV-isolation properties, hypothesis-drawn workloads, every
    traffic step checked in vLLM's runner: graphrt's attention in FULL graphs, vLLM's CPU attention
    between PIECEWISE pieces."""
    engine = dict(KIT_ENGINE, compilation_config=graph_engine(mode)["compilation_config"])
    result, _ = run_engines(models, engine, plugin=True, kit=6, env=KIT_ENV)
    for model, run in result.items():
        assert run["findings"] is None and run["kit_steps"] > 6, (model, run)


def test_the_kit_finds_a_padded_row_writing_the_kv_cache(models):
    result, _ = run_engines(models[:1], KIT_ENGINE, plugin=True, kit=6, env=KIT_ENV, plant="plant_padded_kv_write")
    findings = result[models[0]]["findings"]
    assert findings is not None and "KV isolation: step BatchDescriptor(" in findings, findings
    assert "wrote KV rows" in findings and "outside its real ones" in findings


REFUSED = {
    "inductor": ({"compilation_config": {"cudagraph_mode": "PIECEWISE", "backend": "inductor"}},
                 ["compilation_config.backend='inductor': on a CPU graphrt's recording graph", "use backend 'eager'"]),
    "worker": ({"worker_cls": "my_engine.worker.MyWorker"},
               ["parallel_config.worker_cls='my_engine.worker.MyWorker': graphrt's graphs need "
                "graphrt's worker"]),
}


@pytest.mark.parametrize("option", list(REFUSED))
def test_an_option_graphrt_cannot_honour_is_a_named_error_at_engine_start(models, option):
    settings, messages = REFUSED[option]
    _, log = run_engines(models[:1], dict(ENGINE, **settings), plugin=True, fails=True)
    # graphrt's ConfigError is a ValueError: vLLM's pydantic config reports it as its own validation error.
    assert "ValidationError: 1 validation error for VllmConfig" in log
    assert all(message in log for message in messages), log[-3000:]
