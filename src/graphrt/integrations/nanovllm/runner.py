"""nano-vllm's model runner interface over :class:`graphrt.ModelRunner`.

nano-vllm's ``LLMEngine`` calls ``model_runner.call("run", seqs, is_prefill)`` once per step
with the sequences its scheduler picked and takes one token id per sequence back;
``call("exit")`` at the end. This class answers those calls with graphrt's runner: the model
loaded by graphrt from the checkpoint directory, graphs (or XLA executables) per bucket,
graphrt's sampler. Nothing here imports nano-vllm: a sequence is read through the attributes
nano-vllm's ``Sequence`` has (``seq_id``, ``token_ids``, ``block_table``,
``num_cached_tokens``, ``num_scheduled_tokens``, ``temperature``).

Three differences between the two are bridged here:

* **Rows.** graphrt reads a step's tokens and blocks from persistent tables, one row per
  request; nano-vllm's scheduler keeps more sequences alive than one step carries (running ones
  wait while others decode, a chunked prefill waits between its chunks). Each live sequence
  holds a row from its first step until :meth:`release` (its blocks were freed: it finished or
  was preempted), so a step writes only the tokens and blocks its sequences gained. The tables
  start at ``max_num_seqs`` rows and double when more sequences are alive.
* **Block ids.** nano-vllm numbers its blocks from 0; graphrt keeps block 0 as the null block,
  so nano-vllm's block ``b`` is graphrt's ``b + 1`` and the cache has one block more.
* **Temperature 0.** A sequence whose ``temperature`` is 0 samples greedily (graphrt's rule);
  nano-vllm's own ``SamplingParams`` refuses 0, the engine in :mod:`.engine` accepts graphrt's.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from graphrt.core import defaults
from graphrt.core.errors import ConfigError
from graphrt.core.sampling.batch import TOP_K_DISABLED, SamplingBatch
from graphrt.runner import ModelRunner

#: graphrt's block id of nano-vllm's block 0: the one after graphrt's null block.
BLOCK_OFFSET = defaults.NULL_BLOCK + 1


class GraphrtModelRunner:
    """Runs nano-vllm's scheduled steps on a :class:`graphrt.ModelRunner`.

    ``config`` is nano-vllm's ``Config``: its model directory, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``max_model_len``, ``kvcache_block_size`` and ``enforce_eager``
    become graphrt's; ``num_kvcache_blocks`` (> 0) is the cache's size in nano-vllm's blocks,
    otherwise graphrt sizes the cache and the count is written back to ``config``, as nano-vllm's
    own runner does. ``backend`` and ``graph_fields`` (``GraphConfig`` fields: ``mode``,
    ``strict``, capture sizes, ...) go to graphrt.
    """

    def __init__(self, config: Any, *, backend: Any = "auto", **graph_fields: Any) -> None:
        blocks = config.num_kvcache_blocks
        self.runner = ModelRunner(
            config.model, backend=backend, num_kv_blocks=blocks + BLOCK_OFFSET if blocks > 0 else None,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, block_size=config.kvcache_block_size,
            enforce_eager=config.enforce_eager, max_logprobs=0, progress=False, warmup=False, **graph_fields)
        if self.runner.executor.num_state_slots:         # refused before any graph is built
            self.runner.close()
            raise ConfigError("graphrt.integrations.nanovllm: the model keeps recurrent state per request, "
                              "which nano-vllm's block manager (prefix blocks shared by hash) cannot hold; "
                              "use graphrt.LLM for it (docs/hybrid.md)")
        self.runner.warmup()
        config.num_kvcache_blocks = self.runner.num_kv_blocks - BLOCK_OFFSET
        cfg = self.runner.config
        self.tokens = np.zeros((cfg.max_num_seqs, cfg.max_model_len), dtype=np.int32)
        self.blocks = np.zeros((cfg.max_num_seqs, cfg.max_blocks_per_req), dtype=np.int32)
        #: seq_id -> [row, tokens written to it, blocks written to it]
        self.rows: dict[int, list[int]] = {}
        self.free_rows = list(range(cfg.max_num_seqs - 1, -1, -1))
        self.peak_rows = 0                  # the most sequences that held a row at once
        self._requests = np.zeros((3, cfg.max_num_seqs), dtype=np.int32)    # rows, computed, scheduled
        self._batch: SamplingBatch | None = None
        self._batch_ids: list[int] = []

    # ---- nano-vllm's interface ----------------------------------------------------------
    def call(self, method_name: str, *args: Any) -> Any:
        """What nano-vllm's ``LLMEngine`` calls: ``"run"`` or ``"exit"``."""
        return getattr(self, method_name)(*args)

    def run(self, seqs: Sequence[Any], is_prefill: bool) -> list[int]:
        """One step of ``seqs`` (each computes ``num_scheduled_tokens`` from ``num_cached_tokens``);
        one sampled token per sequence. ``is_prefill`` is nano-vllm's step kind: graphrt reads it
        from the counts themselves."""
        n = len(seqs)
        rows, computed, scheduled = self._requests[:, :n]
        ids = [seq.seq_id for seq in seqs]
        for i, seq in enumerate(seqs):
            held = self.rows.get(seq.seq_id) or self._take_row(seq.seq_id)
            row, tokens_in_row, blocks_in_row = held
            start, count = seq.num_cached_tokens, seq.num_scheduled_tokens
            rows[i], computed[i], scheduled[i] = row, start, count
            end = start + count
            if tokens_in_row < end:
                self.tokens[row, tokens_in_row:end] = seq.token_ids[tokens_in_row:end]
                held[1] = end
            table = seq.block_table
            if blocks_in_row < len(table):
                self.blocks[row, blocks_in_row:len(table)] = table[blocks_in_row:]
                self.blocks[row, blocks_in_row:len(table)] += BLOCK_OFFSET
                held[2] = len(table)
        if ids != self._batch_ids:         # a sequence's temperature never changes
            temperature = np.array([seq.temperature for seq in seqs], dtype=np.float32)
            self._batch = SamplingBatch(temperature, np.full(n, TOP_K_DISABLED, dtype=np.int64),
                                        np.ones(n, dtype=np.float32), [None] * n, ids)
            self._batch_ids = ids
        tokens = self.runner.execute(token_ids=self.tokens, block_table=self.blocks, req_rows=rows,
                                     num_computed_tokens=computed, num_scheduled_tokens=scheduled,
                                     sampling=self._batch)
        return tokens.tolist()

    def exit(self) -> None:
        """Close graphrt's runner (idempotent)."""
        self.runner.close()

    # ---- rows ---------------------------------------------------------------------------
    def release(self, seq_id: int) -> None:
        """Free the row of a sequence whose blocks nano-vllm freed (finished or preempted); a
        sequence that never ran holds none."""
        held = self.rows.pop(seq_id, None)
        if held is not None:
            self.free_rows.append(held[0])

    @property
    def rows_in_use(self) -> int:
        """Sequences holding a row now."""
        return len(self.rows)

    def _take_row(self, seq_id: int) -> list[int]:
        """A free row for ``seq_id`` (its blocks reset to the null block); the tables double when
        every row is held."""
        if not self.free_rows:
            grown = len(self.tokens)
            self.tokens = np.concatenate([self.tokens, np.zeros_like(self.tokens)])
            self.blocks = np.concatenate([self.blocks, np.zeros_like(self.blocks)])
            self.free_rows = list(range(2 * grown - 1, grown - 1, -1))
        row = self.free_rows.pop()
        self.blocks[row] = defaults.NULL_BLOCK
        held = self.rows[seq_id] = [row, 0, 0]
        self.peak_rows = max(self.peak_rows, len(self.rows))
        return held


__all__ = ["BLOCK_OFFSET", "GraphrtModelRunner"]
