"""nano-vllm's engine on graphrt (issue 40; docs/engines.md, "nano-vllm"): its LLMEngine,
Scheduler and BlockManager unchanged, graphrt's runner in place of its CUDA one.

The workload has the two things nano-vllm's scheduler does that graphrt must follow: prefix-cache
hits (four prompts share a full 256-token block) and preemption (a cache of 5 blocks; the three
~250-token prompts cross into a second block while decoding). Its tokens are transformers' greedy
ones, and both events are counted by wrapping nano-vllm's own scheduler and block manager.

Runs where nano-vllm and xxhash import (``make test-engines``, which builds that venv); skips,
saying why, elsewhere.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from graphrt.integrations import nanovllm as integration

if (reason := integration.unavailable_reason()) is not None:
    pytest.skip(reason, allow_module_level=True)

import torch  # noqa: E402

import graphrt  # noqa: E402
from graphrt.integrations.nanovllm import LLM  # noqa: E402
from support.hf_models import load_hf_model, make_tiny_hf_model, random_prompts  # noqa: E402
from support.hf_tokenizer import save_tiny_tokenizer  # noqa: E402

BLOCK = 256                     # nano-vllm's smallest block (its Config asserts a multiple of 256)
SHARED = random_prompts([BLOCK], seed=11)[0]
PROMPTS = ([SHARED + tail for tail in random_prompts((3, 5, 8, 2), seed=12)]
           + random_prompts((250, 252, 248), seed=13))
LIMITS = dict(max_num_seqs=3, max_num_batched_tokens=2 * BLOCK, max_model_len=4 * BLOCK,
              kvcache_block_size=BLOCK, num_kvcache_blocks=5)
#: graphrt's own settings, passed through: one decode size (its FULL graph) on cpu, two XLA programs.
GRAPHS = {"cpu": dict(cudagraph_capture_sizes=[3]),
          "xla": dict(precompile_token_paddings=[4, 2 * BLOCK], precompile_bs_paddings=[3])}
GREEDY = graphrt.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("nanovllm"), "qwen3", max_position_embeddings=4 * BLOCK)
    return str(save_tiny_tokenizer(path))


@pytest.fixture(scope="module")
def hf_greedy(model_dir):
    """transformers' greedy ``generate`` of every prompt, EOS not stopping it (``ignore_eos``)."""
    from transformers import GenerationConfig

    model = load_hf_model(model_dir)
    config = GenerationConfig(max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    outs = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        outs.append(out[0, len(prompt):].tolist())
    return outs


class Recorder:
    """Counts, by wrapping the engine's own objects, what nano-vllm's scheduler did (preemptions,
    prefix blocks found cached) and what each step ran as on graphrt; checks every step's rows."""

    def __init__(self, llm) -> None:
        self.preemptions, self.cached_blocks, self.steps = 0, 0, []
        scheduler, manager, runner = llm.scheduler, llm.scheduler.block_manager, llm.model_runner
        preempt, allocate, run = scheduler.preempt, manager.allocate, runner.run

        def count_preempt(seq):
            self.preemptions += 1
            preempt(seq)

        def count_allocate(seq, num_cached_blocks):
            self.cached_blocks += num_cached_blocks
            allocate(seq, num_cached_blocks)

        def check_run(seqs, is_prefill):
            tokens = run(seqs, is_prefill)
            for seq in seqs:        # nano-vllm's block b is graphrt's b + 1: block 0 stays null
                row = runner.rows[seq.seq_id][0]
                assert runner.blocks[row, :len(seq.block_table)].tolist() == [b + 1 for b in seq.block_table]
            self.steps.append((is_prefill, llm.runner.last_step.mode))
            return tokens

        scheduler.preempt, manager.allocate, runner.run = count_preempt, count_allocate, check_run


def run_checked(llm, prompts, hf_tokens) -> Recorder:
    recorder = Recorder(llm)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == hf_tokens
    assert recorder.preemptions > 0 and recorder.cached_blocks > 0, (recorder.preemptions, recorder.cached_blocks)
    runner = llm.model_runner
    assert runner.rows_in_use == 0 and sorted(runner.free_rows) == list(range(len(runner.tokens)))
    assert runner.peak_rows > LIMITS["max_num_seqs"]        # more live sequences than one step carries
    assert llm.scheduler.block_manager.used_block_ids == set()
    return recorder


@pytest.fixture(scope="module")
def cpu_llm(model_dir):
    llm = LLM(model_dir, backend="cpu", **GRAPHS["cpu"], **LIMITS)
    yield llm
    llm.exit()


def test_greedy_tokens_equal_transformers_on_cpu_graphs_with_prefix_hits_and_preemption(cpu_llm, hf_greedy):
    recorder = run_checked(cpu_llm, PROMPTS, hf_greedy)
    decodes = [mode for is_prefill, mode in recorder.steps if not is_prefill]
    assert decodes and all(mode is graphrt.RuntimeMode.FULL for mode in decodes), decodes
    stats = cpu_llm.runner.stats
    assert stats.hits >= len(decodes) and stats.unplanned_builds == 0


def test_xla_gives_the_same_tokens(model_dir, hf_greedy):
    pytest.importorskip("jax")
    llm = LLM(model_dir, backend="xla", **GRAPHS["xla"], **LIMITS)
    try:
        recorder = run_checked(llm, PROMPTS, hf_greedy)
        stats = llm.runner.stats
        assert stats.hits == len(recorder.steps) and stats.eager_steps == 0 and stats.unplanned_builds == 0
    finally:
        llm.exit()


def test_sampling_params_nano_and_graphrt(cpu_llm):
    """nano-vllm's own params sample (its rule: temperature > 0); graphrt's may be greedy and set
    nothing a nano-vllm Sequence cannot carry."""
    import nanovllm
    from nanovllm import SamplingParams as NanoParams

    assert isinstance(cpu_llm, nanovllm.LLM)
    with pytest.raises(AssertionError, match="greedy sampling is not permitted"):
        NanoParams(temperature=0.0)
    prompts = random_prompts((5, 9), seed=3)
    outs = cpu_llm.generate(prompts, NanoParams(temperature=1.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [4, 4] and all(0 <= t < 128 for o in outs for t in o["token_ids"])
    with pytest.raises(graphrt.InputError, match=r"sampling_params\.top_p.*carries only ignore_eos, max_tokens"):
        cpu_llm.add_request(prompts[0], graphrt.SamplingParams(top_p=0.5))
    assert cpu_llm.is_finished() and cpu_llm.model_runner.rows_in_use == 0


def test_refusals_name_the_setting(model_dir):
    with pytest.raises(graphrt.ConfigError, match="block_size: neither .*kvcache_block_size"):
        LLM(model_dir, backend="cpu", block_size=16)
    with pytest.raises(graphrt.ConfigError, match="gpu_memory_utilization=0.5"):
        LLM(model_dir, backend="cpu", gpu_memory_utilization=0.5)


def test_a_model_with_recurrent_state_is_refused(tmp_path):
    """nano-vllm's block manager shares prefix blocks by hash: a hybrid model's recurrent state
    is not in them, so the runner refuses it before building any graph."""
    import json
    import shutil

    from support.hybrid_models import hybrid_model_dir

    path = tmp_path / "granite"
    shutil.copytree(hybrid_model_dir("granite"), path)
    save_tiny_tokenizer(path, vocab_size=json.loads((path / "config.json").read_text())["vocab_size"])
    with pytest.raises(graphrt.ConfigError, match="recurrent state per request"):
        LLM(str(path), backend="cpu", max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256)


def test_nano_vllms_own_runner_says_why_it_cannot_run(model_dir):
    """Without flash-attn, nano-vllm imported through the integration keeps its own LLM, whose
    CUDA runner raises a named error (the stand-in is gone from sys.modules)."""
    import nanovllm

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed: nano-vllm's own runner is the real one")
    assert "nanovllm.engine.model_runner" not in sys.modules
    with pytest.raises(graphrt.BackendUnavailableError, match="needs flash-attn"):
        nanovllm.LLM(model_dir)
