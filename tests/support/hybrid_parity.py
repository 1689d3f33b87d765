"""Teacher-forced parity of a hybrid model's runner with transformers' own forward.

:func:`run_schedule` drives a :class:`graphrt.ModelRunner` like a small engine: requests of
different lengths join at different steps, prefill half their tokens in chunks within a token
budget, decode the rest one token at a time (the next token is the sequence's own: teacher forcing), each in a state slot
handed out at admission; a preempted request gives its slot back, restarts from nothing and is
readmitted into another slot (its state recomputed). Every step's logits at each request's last
scheduled token are compared with transformers' logits of the whole sequence at that position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import graphrt
from support.hybrid_models import hf_sequence_logits


@dataclass
class _Req:
    seq: list[int]
    row: int
    join: int
    prompt: int
    computed: int = 0
    slot: int = -1
    positions: list[int] = field(default_factory=list)


#: The routed mixers' parity runs (tests/hybrid/test_transformers_*.py): 3 requests at a time, 16
#: tokens a step, blocks of 4; FULL graphs of 4 and 16 tokens on ``cpu``.
ROUTED_LIMITS = dict(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=32, block_size=4, num_kv_blocks=33)
ROUTED_SHAPES = {"eager": {}, "cpu": dict(cudagraph_capture_sizes=[4, 16])}


def routed_runner(model_dir, backend: str, mode: str) -> graphrt.ModelRunner:
    """A runner of ``model_dir`` through the Transformers backend at :data:`ROUTED_LIMITS`."""
    return graphrt.ModelRunner(str(model_dir), backend=backend, mode=mode, model_impl="transformers", progress=False,
                               **ROUTED_SHAPES[backend], **ROUTED_LIMITS)


def run_routed_schedule(runner: graphrt.ModelRunner, seqs: list[list[int]], refs: list[np.ndarray],
                        backend: str) -> None:
    """The routed mixers' schedule: 4 requests joining at steps 0, 0, 1 and 3, chunks of 5 tokens,
    request 2 preempted at step 0; every step's logits checked (:func:`run_schedule`). On ``cpu``
    FULL graphs hold every step (hits, no eager step)."""
    assert run_schedule(runner, seqs, refs, chunk=5, joins=[0, 0, 1, 3], preempt={2: 0}) >= 8
    if backend == "cpu":
        assert runner.stats.hits > 0 and runner.stats.eager_steps == 0


def reference_logits(hf_model, seqs: list[list[int]]) -> list[np.ndarray]:
    """transformers' float32 logits of each whole sequence, every position."""
    return [hf_sequence_logits(hf_model, s).numpy() for s in seqs]


def run_schedule(runner: graphrt.ModelRunner, seqs: list[list[int]], refs: list[np.ndarray], *, chunk: int,
                 joins: list[int] | None = None, preempt: dict[int, int] | None = None,
                 table_width: int | None = None) -> int:
    """Run every sequence to its end through ``runner``; ``preempt``: step -> request preempted
    at that step (before scheduling). Asserts each step's logits against ``refs`` (the same
    greedy tokens, values within ``graphrt.reduction_tolerance``); returns the steps run."""
    cfg = runner.config
    rows, width = len(seqs), table_width or cfg.max_blocks_per_req
    tokens = np.zeros((rows, cfg.max_model_len), np.int32)
    table = np.zeros((rows, width), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
        table[i] = np.arange(1 + i * width, 1 + (i + 1) * width)
    reqs = [_Req(list(s), i, (joins or [0] * rows)[i], max(1, len(s) // 2)) for i, s in enumerate(seqs)]
    stateless = runner.executor.num_state_slots is None          # attention only: slots only bound the batch
    free = list(range(cfg.max_num_seqs if stateless else runner.executor.num_state_slots))[::-1]
    slots = np.full(rows, -1, np.int32)
    step = 0
    while any(r.computed < len(r.seq) for r in reqs):
        if preempt and step in preempt:
            victim = reqs[preempt[step]]
            if victim.slot >= 0:                      # its slot back; it restarts from nothing
                free.insert(0, victim.slot)
                victim.slot, victim.computed = -1, 0
        batch, budget = [], cfg.max_num_batched_tokens
        for r in reqs:
            if r.join > step or r.computed >= len(r.seq) or budget == 0 or len(batch) == cfg.max_num_seqs:
                continue
            if r.slot < 0:
                if not free:
                    continue
                r.slot = free.pop()
                slots[r.row] = r.slot
            n = min(chunk, r.prompt - r.computed, budget) if r.computed < r.prompt else 1   # prefill, then decode
            n = min(n, budget)
            batch.append((r, n))
            budget -= n
        step += 1
        if not batch:
            continue
        runner.execute(token_ids=tokens, block_table=table, req_rows=np.array([r.row for r, _ in batch], np.int32),
                       num_computed_tokens=np.array([r.computed for r, _ in batch], np.int32),
                       num_scheduled_tokens=np.array([n for _, n in batch], np.int32),
                       **({} if stateless else dict(state_slots=slots)))
        logits = runner.outputs.logits()
        for k, (r, n) in enumerate(batch):
            r.computed += n
            want = refs[r.row][r.computed - 1]
            tol = graphrt.reduction_tolerance("float32", magnitude=float(np.abs(want).max()),
                                              width=int(runner.model.config.hidden_size))
            np.testing.assert_allclose(logits[k], want, rtol=tol.rtol, atol=tol.atol,
                                       err_msg=f"request {r.row} at position {r.computed - 1} (step {step}, "
                                               f"{runner.last_step.mode.value} {runner.last_step.key})")
            assert int(logits[k].argmax()) == int(want.argmax()), (r.row, r.computed - 1)
            if r.computed >= len(r.seq):              # finished: the slot goes back
                free.insert(0, r.slot)
                r.slot = -1
    return step
