"""One scheduler step over an engine's persistent tables, as the kit draws and runs it.

numpy only: a :class:`Step` is what ``ModelRunner.execute`` takes (the token-id table, the
block table, and per request its table row, computed tokens and scheduled tokens), plus the
slot arithmetic the properties need, written independently of graphrt's input preparation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from graphrt.core.kv_spec import blocks_for


@dataclass(eq=False)
class Step:
    """One ``ModelRunner.execute`` call: persistent tables and this step's schedule.

    ``token_ids [rows, max_model_len]`` / ``block_table [rows, max_blocks_per_req]``: the engine's
    tables; request ``i`` is row ``req_rows[i]`` with ``num_computed_tokens[i]`` tokens in the KV
    and ``num_scheduled_tokens[i]`` new ones. ``seed`` seeds the planted KV. ``extra_inputs``: an
    array per declared extra input, or None. ``state_slots``: each row's recurrent-state slot
    (scheduled rows distinct), or None.
    """

    token_ids: np.ndarray
    block_table: np.ndarray
    req_rows: np.ndarray
    num_computed_tokens: np.ndarray
    num_scheduled_tokens: np.ndarray
    block_size: int
    seed: int = 0
    overrides: dict[str, Any] = field(default_factory=dict)
    extra_inputs: dict[str, np.ndarray] | None = None
    state_slots: np.ndarray | None = None

    @property
    def num_reqs(self) -> int:
        return int(self.req_rows.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(np.asarray(self.num_scheduled_tokens, dtype=np.int64).sum())

    @property
    def uniform_decode(self) -> bool:
        """Every request schedules exactly one token."""
        return bool((np.asarray(self.num_scheduled_tokens) == 1).all())

    def kwargs(self) -> dict[str, Any]:
        """The arguments of ``ModelRunner.execute`` (without ``sampling``)."""
        args = dict(token_ids=self.token_ids, block_table=self.block_table, req_rows=self.req_rows,
                    num_computed_tokens=self.num_computed_tokens,
                    num_scheduled_tokens=self.num_scheduled_tokens)
        if self.extra_inputs is not None:
            args["extra_inputs"] = self.extra_inputs
        if self.state_slots is not None:
            args["state_slots"] = self.state_slots
        args.update(self.overrides)
        return args

    def _slots(self, start_of: Any, end_of: Any) -> np.ndarray:
        bs = self.block_size
        out = [np.zeros(0, dtype=np.int64)]
        for i, row in enumerate(self.req_rows):
            pos = np.arange(int(start_of(i)), int(end_of(i)), dtype=np.int64)
            out.append(self.block_table[int(row), pos // bs].astype(np.int64) * bs + pos % bs)
        return np.concatenate(out)

    def write_slots(self) -> np.ndarray:
        """KV slots the step's real tokens write: positions computed .. computed + scheduled."""
        c, n = self.num_computed_tokens, self.num_scheduled_tokens
        return self._slots(lambda i: c[i], lambda i: int(c[i]) + int(n[i]))

    def read_slots(self) -> np.ndarray:
        """KV slots the step's real tokens may attend to: positions 0 .. seq_len of each request."""
        c, n = self.num_computed_tokens, self.num_scheduled_tokens
        return self._slots(lambda i: 0, lambda i: int(c[i]) + int(n[i]))

    def state_reads(self, checkpoints: int) -> list[tuple[int, int]]:
        """(slot, checkpoint) entries of the state cache the step reads: each continuing
        request's state after its position ``computed - 1`` (docs/hybrid.md)."""
        if self.state_slots is None:
            return []
        return [(int(self.state_slots[int(row)]), (int(c) - 1) % checkpoints)
                for row, c in zip(self.req_rows, self.num_computed_tokens) if int(c) > 0]

    def state_writes(self, checkpoints: int) -> list[tuple[int, int]]:
        """(slot, checkpoint) entries the step writes: each request's state after each of its
        last ``min(scheduled, checkpoints)`` positions ``p``, at entry ``p % checkpoints``."""
        if self.state_slots is None:
            return []
        out = []
        for row, c, n in zip(self.req_rows, self.num_computed_tokens, self.num_scheduled_tokens):
            end = int(c) + int(n)
            out += [(int(self.state_slots[int(row)]), p % checkpoints)
                    for p in range(max(int(c), end - checkpoints), end)]
        return out

    def sequences(self) -> list[np.ndarray]:
        """Each request's token ids from position 0 through its last scheduled token: what a
        plain eager loop runs to get the logits the runner samples from for that request."""
        ends = np.asarray(self.num_computed_tokens, np.int64) + np.asarray(self.num_scheduled_tokens, np.int64)
        return [self.token_ids[int(row), :int(end)].copy() for row, end in zip(self.req_rows, ends)]

    def describe(self) -> str:
        """A readable one-request-per-line account (the counterexample the kit prints)."""
        lines = [f"Step: {self.num_reqs} request(s), {self.num_tokens} token(s), block_size "
                 f"{self.block_size}, KV seed {self.seed}"]
        for i, row in enumerate(self.req_rows):
            c, n = int(self.num_computed_tokens[i]), int(self.num_scheduled_tokens[i])
            need = blocks_for(c + n, self.block_size)
            blocks = self.block_table[int(row)].tolist()
            kind = "decode" if n == 1 and c > 0 else ("prefix hit" if c > 0 else "prefill")
            lines.append(f"  request {i}: row {int(row)}, computed {c}, scheduled {n} ({kind}); "
                         f"blocks {blocks[:need]} then {blocks[need:]}; "
                         f"token ids {self.token_ids[int(row), c:c + n].tolist()}")
        if self.state_slots is not None:
            lines.append(f"  state slots by row: {self.state_slots.tolist()}")
        for name, value in self.overrides.items():
            lines.append(f"  override {name}: {np.asarray(value).tolist() if np.ndim(value) < 2 else '(table)'}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.describe()


@dataclass(eq=False)
class Split:
    """A step and the chunks each request's scheduled tokens are split into (``pieces[i]`` sums
    to request ``i``'s scheduled tokens): the same tokens run as :meth:`rounds`, round ``j``
    scheduling each request's ``j``-th chunk, must give what the whole step gives."""

    step: Step
    pieces: list[list[int]]

    def rounds(self) -> list[Step]:
        """The steps of the split, in order (the step itself where nothing is split); each
        request's token-level extra inputs are cut to its chunk, request-level ones kept."""
        step = self.step
        if all(len(p) == 1 for p in self.pieces):
            return [step]
        starts = np.concatenate(([0], np.cumsum(step.num_scheduled_tokens)))[:-1]
        done = [0] * step.num_reqs
        out = []
        for j in range(max(len(p) for p in self.pieces)):
            reqs = [i for i, p in enumerate(self.pieces) if j < len(p)]
            sizes = [self.pieces[i][j] for i in reqs]
            tokens = np.concatenate([np.arange(starts[i] + done[i], starts[i] + done[i] + n)
                                     for i, n in zip(reqs, sizes)])
            extras = None
            if step.extra_inputs is not None:        # a token-level input has a row per token of the step
                extras = {name: np.ascontiguousarray(a[tokens] if a.shape[0] == step.num_tokens else a[reqs])
                          for name, a in step.extra_inputs.items()}
            computed = np.array([int(step.num_computed_tokens[i]) + done[i] for i in reqs], np.int32)
            out.append(Step(step.token_ids, step.block_table, step.req_rows[reqs].copy(), computed,
                            np.array(sizes, np.int32), step.block_size, step.seed, extra_inputs=extras,
                            state_slots=step.state_slots))
            for i, n in zip(reqs, sizes):
                done[i] += n
        return out

    def describe(self) -> str:
        """The step, then each request's chunks."""
        chunks = "; ".join(f"request {i}: {p}" for i, p in enumerate(self.pieces))
        return f"{self.step.describe()}\n  split into chunks: {chunks}"

    def __repr__(self) -> str:
        return self.describe()


@dataclass(eq=False)
class BadStep:
    """A step that breaks exactly one bound: the :class:`InputError` must name ``field``.

    ``kind``: which bound; ``sampling_rows``: the bad sampling batch's row count (None: a greedy
    batch per request); ``message``: a fragment the error's text must contain, when set.
    """

    step: Step
    field: str
    kind: str
    sampling_rows: int | None = None
    message: str | None = None

    def __repr__(self) -> str:
        return f"BadStep({self.kind}; the error must name {self.field!r})\n{self.step.describe()}"


__all__ = ["BadStep", "Split", "Step"]
