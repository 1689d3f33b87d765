"""graphrt's hybrid reference models (Mamba2, Granite-4-H, Qwen3-Next) against transformers on torch.

* Parity, teacher-forced: several concurrent requests of different lengths joining at
  different steps, chunked prefill, decode, a preempted request recomputed in another slot;
  every step's logits equal transformers' whole-sequence forward at that position (the same
  greedy token, values within ``graphrt.reduction_tolerance``) -- eagerly (``eager``), and on
  the CPU recording graph in FULL (decode and mixed steps in FULL graphs) and FULL_AND_PIECEWISE
  modes, with and without speculative decoding's K+1 checkpoints.
* A pure Mamba2 model has no attention layer: no KV cache, an empty KV spec, and it runs.
* The state cache's layout and memory: slots + trash slot x checkpoints, in the KV budget; a
  model whose states do not fit is refused with the numbers.
"""

from __future__ import annotations

import numpy as np
import pytest

import graphrt
from graphrt import ConfigError
from support.hybrid_models import hybrid_model_dir, load_hf_hybrid
from support.hybrid_parity import reference_logits, run_schedule

LIMITS = dict(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=32, block_size=4)
LENGTHS = (13, 7, 18, 9)


@pytest.fixture(scope="module", params=["mamba2", "granite", "qwen3_next"])
def model(request):
    d = hybrid_model_dir(request.param)
    rng = np.random.default_rng(5)
    seqs = [[int(t) for t in rng.integers(3, 128, size=n)] for n in LENGTHS]
    return request.param, str(d), seqs, reference_logits(load_hf_hybrid(d), seqs)


#: Graphs and executables of the parity runs: few sizes (short warm-ups) that still hold every
#: step of the schedule (decodes of 1-3 requests, prefill chunks of 5, up to 16 tokens).
SHAPES = {"eager": {}, "cpu": dict(cudagraph_capture_sizes=[4, 16]),
          "xla": dict(precompile_token_paddings=[16], precompile_bs_paddings=[4])}


@pytest.mark.parametrize("backend,mode,k", [
    ("eager", "NONE", 0), ("cpu", "FULL_AND_PIECEWISE", 0), ("cpu", "FULL", 2), ("xla", "FULL", 1),
    # the same paths again without drafts' checkpoints (k = 0 is the FULL_AND_PIECEWISE run's)
    pytest.param("cpu", "FULL", 0, marks=pytest.mark.slow), pytest.param("xla", "FULL", 0, marks=pytest.mark.slow)])
def test_teacher_forced_parity_with_transformers(model, backend, mode, k):
    """Concurrent requests of different lengths, chunked prefill (chunks of 5 over SSD chunks of
    4), decode, request 0 preempted after its prefill began and recomputed in another slot."""
    arch, d, seqs, refs = model
    runner = graphrt.ModelRunner(d, backend=backend, mode=mode, num_speculative_tokens=k, progress=False,
                                 num_kv_blocks=4 * 8 + 1, **SHAPES[backend], **LIMITS)
    steps = run_schedule(runner, seqs, refs, chunk=5, joins=[0, 0, 1, 3], preempt={2: 0})
    assert steps >= 8
    if backend == "cpu":
        assert runner.stats.hits > 0          # graphs replayed, not only eager steps


@pytest.mark.slow
def test_full_graphs_hold_decode_and_mixed_steps():
    """In FULL mode a mixed step (a prefill chunk beside decodes) replays a FULL graph, and so
    does a uniform decode step; both match transformers (the parity test checks values).
    Slow: the state sweep's sample (FULL decode and PIECEWISE steps drawn) and
    tests/test_hybrid_devices.py (every key FULL in FULL mode, graphs replayed) see the same."""
    d = hybrid_model_dir("granite")
    runner = graphrt.ModelRunner(str(d), backend="cpu", mode="FULL_AND_PIECEWISE", progress=False,
                                 num_kv_blocks=4 * 8 + 1, **SHAPES["cpu"], **LIMITS)
    table = np.arange(1, 1 + 3 * 8, dtype=np.int32).reshape(3, 8)
    tokens = np.full((3, 32), 5, np.int32)
    runner.execute(token_ids=tokens, block_table=table, req_rows=np.array([0, 1]), num_computed_tokens=np.array([0, 0]),
                   num_scheduled_tokens=np.array([3, 2]))
    runner.execute(token_ids=tokens, block_table=table, req_rows=np.array([0, 1]), num_computed_tokens=np.array([3, 2]),
                   num_scheduled_tokens=np.array([1, 1]))
    assert runner.last_step.mode is graphrt.RuntimeMode.FULL and runner.last_step.key.uniform_decode
    full = graphrt.ModelRunner(str(d), backend="cpu", mode="FULL", progress=False, num_kv_blocks=4 * 8 + 1,
                               **SHAPES["cpu"], **LIMITS)
    full.execute(token_ids=tokens, block_table=table, req_rows=np.array([0, 1]), num_computed_tokens=np.array([4, 0]),
                 num_scheduled_tokens=np.array([1, 3]))
    assert full.last_step.mode is graphrt.RuntimeMode.FULL and not full.last_step.key.uniform_decode


def test_a_model_without_attention_keeps_no_kv_cache():
    d = hybrid_model_dir("mamba2")
    runner = graphrt.ModelRunner(str(d), backend="cpu", mode="FULL_AND_PIECEWISE", progress=False,
                                 **SHAPES["cpu"], **LIMITS)
    ex = runner.executor
    assert ex.kv_caches == [] and ex.kv_cache is None and ex.kv_cache_bytes_per_block(4) == 0
    assert runner.num_kv_blocks == LIMITS["max_num_seqs"] * (32 // 4) + 1     # blocks cost nothing
    conv, ssm = ex.model.state_layers()[0].state_cache
    assert conv.shape == (3 + 1, 1, 128 + 2 * 2 * 16, 3) and ssm.shape == (3 + 1, 1, 8, 16, 16)


def test_state_memory_is_in_the_kv_budget_and_refused_with_the_numbers():
    """The state cache (3 slots + the trash slot, x 2 checkpoints with one draft) comes out of a
    byte budget before the KV blocks; too small a budget is refused, naming the numbers."""
    d = hybrid_model_dir("granite")
    per_slot = 2 * (4 * (192 * 3) + 4 * (4 * 32 * 16))       # two Mamba2 layers: conv + ssm, float32
    states = (3 + 1) * 2 * per_slot
    per_block = 2 * 2 * 16 * 4 * 4                              # one attention layer: K and V, 2 heads of 16, 4 tokens
    runner = graphrt.ModelRunner(str(d), backend="eager", progress=False, num_speculative_tokens=1,
                                 kv_cache_memory=states + 10 * per_block + 100, **LIMITS)
    state = runner.executor.state_memory
    assert (state.num_slots, state.checkpoints, state.bytes_per_slot, state.nbytes) == (3, 2, per_slot, states)
    assert runner.executor.kv_cache_bytes_per_block(4) == per_block
    assert runner.num_kv_blocks == 10                           # the budget less the states
    assert runner.graph_memory.as_dict()["state_bytes"] == states
    assert "recurrent state: 3 slots + 1 trash slot x 2 checkpoint(s)" in runner.graph_memory.summary()
    with pytest.raises(ConfigError, match=rf"recurrent states need {states} bytes \(3 slots .* leaving {per_block + 1}"):
        graphrt.ModelRunner(str(d), backend="eager", progress=False, kv_cache_memory=states + per_block + 1,
                            num_speculative_tokens=1, **LIMITS)
