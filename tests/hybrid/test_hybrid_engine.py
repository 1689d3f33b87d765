"""graphrt.LLM and speculative decoding on hybrid models (docs/hybrid.md).

* State slots: handed out at admission with the request's row, distinct among running
  requests, taken back at finish and preemption; a preempted request restarts from an empty
  state (in whatever slot it gets next) and its outputs are still transformers' greedy tokens.
* Prefix caching is refused for models with recurrent state: off by default (said at INFO),
  a ConfigError naming ``enable_prefix_caching`` and the reason when asked for.
* Speculative decoding: a verification step writes the state after each of its 1 + k
  positions; after rejected drafts the next step reads the state of the last accepted token
  (ring entry ``(computed - 1) % (1 + k)``), so its logits equal a run that never saw the drafts.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

import graphrt
from graphrt import ConfigError
from graphrt.engine.prefix_cache import HYBRID_PREFIX_REASON
from graphrt.engine.request import Status
from support.hybrid_models import hf_sequence_logits, hybrid_model_dir, load_hf_hybrid
from support.parity import assert_close_across_shapes

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40], [50, 51],
           [60, 61, 62, 63, 64]]
ENGINE = dict(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=48, block_size=4)


def _check_teacher_forced(hf, prompt: list[int], got: list[int]) -> None:
    """Every generated token is transformers' greedy token after the prompt and the tokens before."""
    logits = hf_sequence_logits(hf, prompt + got)
    want = logits[len(prompt) - 1:len(prompt) - 1 + len(got)].argmax(-1).tolist()
    assert got == want, (prompt, got, want)


#: granite is slow here: the xla engine test below runs it with preemptions, and
#: tests/hybrid/test_hybrid_models.py's parity preempts it on cpu graphs.
@pytest.mark.parametrize("arch", [pytest.param("granite", marks=pytest.mark.slow), "mamba2", "qwen3_next"])
def test_generate_with_preemption_keeps_transformers_tokens(arch):
    d = hybrid_model_dir(arch)
    llm = graphrt.LLM(str(d), backend="cpu", num_kv_blocks=9, schedule_conservativeness=0.0,
                      cudagraph_capture_sizes=[4, 16], **ENGINE)
    slots_seen: set[int] = set()
    params = graphrt.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in PROMPTS]
    outputs = {}
    while llm.has_unfinished():
        for out in llm.step():
            outputs[out.request_id] = out
        running = llm.scheduler.running
        slots = [r.state_slot for r in running]
        assert len(set(slots)) == len(slots) and all(0 <= s < 3 for s in slots), slots
        assert all(r.state_slot == -1 for r in llm.scheduler.waiting)
        slots_seen.update(slots)
    assert llm.scheduler.num_preemptions > 0
    assert sorted(llm.scheduler._free_slots) == [0, 1, 2]        # every slot back
    hf = load_hf_hybrid(d)
    for rid, prompt in zip(ids, PROMPTS):
        out = outputs[rid]
        _check_teacher_forced(hf, prompt, list(out.token_ids))


def test_overlapped_engine_on_xla_keeps_transformers_tokens():
    """xla overlaps steps (depth 1: the next step launched before the last is resolved); with
    preemptions the outputs are still transformers' greedy tokens."""
    pytest.importorskip("jax")
    d = hybrid_model_dir("granite")
    llm = graphrt.LLM(str(d), backend="xla", num_kv_blocks=11, schedule_conservativeness=0.0,
                      precompile_token_paddings=[16], precompile_bs_paddings=[4], **{**ENGINE, "max_num_seqs": 4})
    assert llm.loop.depth == 1
    outs = llm.generate(PROMPTS, graphrt.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert llm.scheduler.num_preemptions > 0
    hf = load_hf_hybrid(d)
    for prompt, out in zip(PROMPTS, outs):
        _check_teacher_forced(hf, prompt, list(out.token_ids))


def test_prefix_caching_is_refused_with_the_reason(caplog):
    d = str(hybrid_model_dir("mamba2"))
    with caplog.at_level(logging.INFO, logger="graphrt"):
        llm = graphrt.LLM(d, backend="eager", **ENGINE)
    assert llm.prefix_cache is None and "prefix caching is off" in caplog.text
    with pytest.raises(ConfigError, match="enable_prefix_caching: not available .*recurrent state"):
        graphrt.LLM(d, backend="eager", enable_prefix_caching=True, **ENGINE)
    assert "block boundaries" in HYBRID_PREFIX_REASON
    plain = graphrt.LLM(d, backend="eager", enable_prefix_caching=False, **ENGINE)
    assert plain.prefix_cache is None


def _verify_then_continue(runner, prompt: list[int], drafts: list[int], accepted: int, bonus: int,
                          follow: list[int]) -> np.ndarray:
    """Prefill ``prompt``, verify ``drafts`` (1 + k tokens: the prompt's last, then the drafts),
    accept ``accepted`` of them plus ``bonus``, then verify ``follow`` from there; returns the
    second verification's position logits."""
    q = 1 + len(drafts)
    seq = prompt + drafts
    table = np.arange(1, 1 + 12, dtype=np.int32).reshape(1, 12)
    tokens = np.zeros((1, 48), np.int32)
    tokens[0, :len(seq)] = seq
    args = dict(block_table=table, req_rows=np.array([0]))
    c = len(prompt) - 1
    runner.execute(token_ids=tokens, num_computed_tokens=np.array([0]), num_scheduled_tokens=np.array([c]), **args)
    runner.execute(token_ids=tokens, num_computed_tokens=np.array([c]), num_scheduled_tokens=np.array([q]), **args)
    kept = prompt + drafts[:accepted] + [bonus]
    tokens[0] = 0
    tokens[0, :len(kept) + len(follow)] = kept + follow
    runner.execute(token_ids=tokens, num_computed_tokens=np.array([len(kept) - 1]),
                   num_scheduled_tokens=np.array([q]), **args)
    return runner.outputs.position_logits()[0]


@pytest.mark.parametrize("arch,backend", [("granite", "eager"), ("granite", "cpu"), ("granite", "xla"),
                                          ("jamba", "cpu"), ("lfm2", "cpu"), ("recurrent_gemma", "cpu"),
                                          ("minimax", "cpu")])
def test_rejected_drafts_roll_the_state_back(arch, backend):
    """Granite-4-H (Mamba2), Jamba (Mamba1's selective scan), LFM2 (short convolutions),
    RecurrentGemma (RG-LRU) and MiniMax (lightning attention), the last four through the
    Transformers backend."""
    if backend == "xla":
        pytest.importorskip("jax")
    d = hybrid_model_dir(arch)
    # Every step here is one request of at most 6 tokens (a 5-token prefill, 3-token verifications):
    # xla compiles one 8-token program (its paddings must reach max_num_batched_tokens).
    shapes = {"eager": {}, "cpu": dict(cudagraph_capture_sizes=[3, 16]),
              "xla": dict(precompile_token_paddings=[8], precompile_bs_paddings=[2], max_num_batched_tokens=8)}[backend]
    runner = graphrt.ModelRunner(str(d), backend=backend, num_speculative_tokens=2, progress=False,
                                 num_kv_blocks=13, max_num_seqs=2, max_model_len=48, block_size=4,
                                 **{"max_num_batched_tokens": 16, **shapes})
    hf = load_hf_hybrid(d)
    prompt = [40, 41, 42, 43, 44, 45]
    greedy = hf_sequence_logits(hf, prompt).argmax(-1).tolist()
    first = greedy[-1]
    drafts = [first, (first + 7) % 128]                 # draft 1 right, draft 2 wrong: accept 1
    bonus = int(hf_sequence_logits(hf, prompt + [first]).argmax(-1)[-1])
    follow = [3, 9]
    want = hf_sequence_logits(hf, prompt + [first, bonus] + follow)[-3:].numpy()

    def check() -> None:
        got = _verify_then_continue(runner, prompt, drafts, 1, bonus, follow)
        assert_close_across_shapes(got, want, np.float32, "after the rejected draft")
        assert (got.argmax(-1) == want.argmax(-1)).all()

    check()
    if backend == "xla":                          # the torch executor's ring is the one planted below
        return
    runner.executor.state_backend.checkpoints = 1  # planted: one checkpoint, the state after the last draft
    with pytest.raises(AssertionError):
        check()
