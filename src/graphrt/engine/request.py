"""One generation request as the engine tracks it: a plain record whose fields several engine
modules own (each group below names its writer). Plain attributes, ``num_tokens`` included, so a
decode step reads and writes them at attribute cost.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from graphrt.engine.prefix_cache import Node
from graphrt.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    """Where a request is: queued, running (it holds a row, blocks and maybe a state slot), done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One generation request and its progress (module doc: who writes which field)."""

    # What was asked (engine/llm.py, once) and the tokens known so far: engine/loop.py appends
    # the generated ones (placeholders until resolved, see below) and keeps ``num_tokens``.
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    # Scheduling (engine/scheduler.py): its state, computed tokens (engine/loop.py adds each
    # step's), KV blocks, table row, recurrent-state slot (hybrid models: docs/hybrid.md), why it
    # finished (``Scheduler.finish``, the reason its caller's), preemptions and prefix-cache hits.
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    row: int = -1
    state_slot: int = -1
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0   # tokens whose KV came from the prefix cache, all admissions
    # The engine's persistent tables (engine/loop.py writes them; engine/scheduler.py resets the
    # counts when the row changes hands): tokens / blocks already written at ``row``.
    tokens_in_row: int = 0
    blocks_in_row: int = 0
    # Prefix cache bookkeeping (engine/scheduler.py): full-block keys, the tree node of the last
    # block the tree holds (and its epoch), how many that is, and whether its blocks stay private.
    block_keys: list[bytes] = field(default_factory=list, repr=False)
    cache_node: Node | None = field(default=None, repr=False)
    cache_epoch: int = -1
    cached_blocks: int = 0
    cache_private: bool = False
    # Overlap scheduling (engine/loop.py): trailing generated tokens not known yet (their ids are
    # placeholders), the row of the in-flight step that samples the newest of them, and whether
    # its launched tokens already reach its length limit (the scheduler skips it).
    num_unresolved: int = 0
    future_row: int = -1
    retiring: bool = False
    # Logprobs asked for by its params (engine/loop.py makes the lists, engine/outputs.py fills
    # them): one dict per resolved generated token, and one per prompt token (None until
    # computed; always None for the first).
    sample_logprobs: list | None = field(default=None, repr=False)
    prompt_logprobs: list | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        #: Known tokens (prompt, generated, placeholders): read per request every step, so a
        #: plain attribute; engine/loop.py updates it with ``output_token_ids``.
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """Known tokens whose KV is not computed yet."""
        return self.num_tokens - self.num_computed_tokens

    def tokens(self, start: int, end: int) -> list[int]:
        """Known token ids ``[start, end)`` (prompt, then generated; a decode's are generated
        only, and engine/loop.py slices ``output_token_ids`` for them itself)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]


__all__ = ["Request", "Status"]
