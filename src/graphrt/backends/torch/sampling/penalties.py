"""Repetition / presence / frequency penalties on the device (vLLM's meanings).

Two persistent ``[max_reqs + 1, vocab]`` float32 planes, ``counts`` (output) and ``seen`` (prompt
or output), row 0 zero; the host's :class:`~graphrt.core.sampling.penalty_ledger.PenaltyLedger` says which
row is whose. :meth:`PenaltyState.update` adds a step's tokens eagerly before the sampler graph;
:meth:`PenaltyState.apply` (captured) penalises a copy of the logits::

    x = x / r   where x > 0 and seen,  x * r  where x <= 0 and seen
    x = x - frequency * count - presence * (count > 0),  clamped to float32's finite range

Nothing is allocated unless a batch asks for penalties (or ``enable_penalties``)."""

from __future__ import annotations

from typing import Any

import torch

from graphrt.core.sampling.penalty_ledger import PenaltyLedger, PenaltyStep

#: Penalised logits are clamped to float32's finite range: a logit the penalties push past it
#: keeps its place at the end of the order instead of becoming inf (and NaN in the sampler).
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class PenaltyState:
    """The device side of penalties for up to ``max_reqs`` sampler rows (module doc)."""

    def __init__(self, max_reqs: int, vocab_size: int, max_tokens: int, device: torch.device,
                 pin_memory: bool) -> None:
        self.ledger = PenaltyLedger(max_reqs, vocab_size, max_tokens, max_reqs)
        self.vocab_size = vocab_size
        self.counts = torch.zeros(max_reqs + 1, vocab_size, dtype=torch.float32, device=device)
        self.seen = torch.zeros(max_reqs + 1, vocab_size, dtype=torch.float32, device=device)
        self.plane = torch.zeros(max_reqs, vocab_size, dtype=torch.float32, device=device)
        # Per sampler row: repetition, presence, frequency, and its device row.
        host = {"params": torch.zeros(3, max_reqs, dtype=torch.float32, pin_memory=pin_memory),
                "slots": torch.zeros(max_reqs, dtype=torch.int64, pin_memory=pin_memory)}
        self._host = host
        self.static = host if device.type == "cpu" else {k: t.to(device) for k, t in host.items()}
        self._tokens = (torch.zeros(max_tokens, dtype=torch.int64, pin_memory=pin_memory),
                        torch.zeros(2, max_tokens, dtype=torch.float32, pin_memory=pin_memory))
        self.device = device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.counts, self.seen, self.plane))

    def write(self, sampling: Any, step: PenaltyStep, num_reqs: int, rows: int) -> None:
        """The step's per-row penalties and rows into the static buffers (padded rows neutral)."""
        params, slots = self._host["params"].numpy(), self._host["slots"].numpy()
        for i, column in enumerate(sampling.penalties):
            params[i, :num_reqs] = column
        params[0, num_reqs:rows] = 1.0
        params[1:, num_reqs:rows] = 0.0
        slots[:rows] = step.row_slots[:rows]
        if self.static is not self._host:
            for k, t in self.static.items():
                t[..., :rows].copy_(self._host[k][..., :rows], non_blocking=True)

    def update(self, step: PenaltyStep, input_ids: torch.Tensor) -> None:
        """Fold the step in (eagerly, before the sampler runs): zero new rows, add host-table
        tokens, then the scheduled tokens read from ``input_ids`` (the step's device ids)."""
        counts, seen = self.counts.view(-1), self.seen.view(-1)
        if len(step.reset):
            rows = torch.from_numpy(step.reset).to(self.device)
            self.counts.index_fill_(0, rows, 0.0)
            self.seen.index_fill_(0, rows, 0.0)
        if len(step.host_index):
            index = torch.from_numpy(step.host_index).to(self.device)
            counts.index_add_(0, index, torch.from_numpy(step.host_output).to(self.device))
            seen.index_add_(0, index, torch.ones(len(step.host_index), dtype=seen.dtype, device=self.device))
        t = len(step.token_base)
        if not t:
            return
        base, weights = self._tokens
        base.numpy()[:t] = step.token_base
        weights.numpy()[0, :t] = step.token_output
        weights.numpy()[1, :t] = step.token_seen
        index = base[:t].to(self.device, non_blocking=True) + input_ids[:t].to(torch.int64)
        w = weights[:, :t].to(self.device, non_blocking=True)
        counts.index_add_(0, index, w[0])
        seen.index_add_(0, index, w[1])

    def apply(self, x: torch.Tensor, scratch: torch.Tensor) -> None:
        """Penalise the logits rows ``x`` ``[R, V]`` in place (capturable; ``scratch`` is a
        ``[R, V]`` float32 buffer it may overwrite). Each seen logit is divided by ``r`` or
        ``1 / r`` once (no ``r**2``, which overflowed float32 past ``r ~ 1.8e19`` and lost the
        logit below ``r ~ 2.4e-4``), and the result is clamped to float32's finite range, so
        any finite logits and accepted penalties give finite ones."""
        rows = x.shape[0]
        rep, pres, freq = (p[:rows].unsqueeze(1) for p in self.static["params"])
        slots = self.static["slots"][:rows]
        factor = self.plane[:rows]
        torch.index_select(self.seen, 0, slots, out=factor)
        factor.clamp_(max=1.0)                                     # 1 where seen, else 0
        torch.mul(factor, rep, out=scratch)                        # r where seen, else 0
        factor.neg_().add_(1.0).add_(scratch)                      # r where seen, else 1 (exactly)
        torch.gt(x, 0.0, out=scratch)                              # 1 where the logit is positive
        scratch.mul_(2.0).sub_(1.0)                                # 1 where positive, else -1
        factor.pow_(scratch)                                       # r where positive, 1 / r where not
        x.div_(factor)                                             # x / r, or x * r where not positive
        torch.index_select(self.counts, 0, slots, out=scratch)
        torch.clamp(scratch, max=1.0, out=factor).mul_(pres).addcmul_(scratch, freq)
        x.sub_(factor).clamp_(-_FLOAT32_MAX, _FLOAT32_MAX)

    def free(self, request_id: int) -> None:
        self.ledger.free(request_id)


__all__ = ["PenaltyState"]
