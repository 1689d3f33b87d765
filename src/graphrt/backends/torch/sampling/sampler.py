"""The torch sampler: greedy, temperature, top-k, top-p and min-p, with static shapes.

Its own graph, apart from the forward (as sglang-jax jits its sampler): rows of the logits buffer,
per-request parameters and a noise buffer the runner fills (device RNG, or a request's seeded
generator), so the graph holds no RNG state and seeding is exact. The draw is
``argmax(probs / noise)``, ``noise ~ Exp(1)``, over the tokens the filters keep
(:mod:`graphrt.backends.torch.sampling.sampler_ops`)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from graphrt.core.errors import GraphrtError
from graphrt.core.sampling.batch import write_sampling_rows
from graphrt.backends.torch.sampling.flashinfer_sampling import DEVICE_TYPES, SAMPLER_ENV, flashinfer_sampling
from graphrt.backends.torch.sampling.penalties import PenaltyState
from graphrt.backends.torch.sampling.sampler_ops import Workspace, sample_rows


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """Argmax per row (int64)."""
    return logits.argmax(dim=-1)


def random_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, noise: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row; rows with temperature 0 are greedy (a workspace of its own: for
    callers outside an executor; the executor's sampler reuses its buffers).

    ``top_k`` holds the vocabulary size where disabled; ``top_p`` holds 1.0 where disabled,
    ``min_p`` 0 (or None). Any top_k is exact (the wide search runs). ``noise`` is clamped in
    place to ``defaults.SAMPLER_MIN_NOISE``."""
    rows, vocab = logits.shape
    ws = Workspace(rows, vocab, logits.device)
    return sample_rows(logits, temperature, top_k, top_p, min_p, noise, ws, wide=True)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Per row of ``logits`` ``[N, V]``: the logprob of ``tokens[i]`` under ``log_softmax`` in float32,
    its rank (1 + tokens more likely) and the ``k`` largest logprobs with their ids, descending.
    Static shapes, nothing read on the host: capturable."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens.long().unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top = torch.topk(logprobs, k, dim=-1)
    return chosen.squeeze(1), ranks, top.values, top.indices


def token_logprobs_into(logits: torch.Tensor, tokens: torch.Tensor, k: int, ws: Workspace) -> tuple[torch.Tensor, ...]:
    """:func:`token_logprobs` with its ``[N, V]`` intermediates in ``ws``'s buffers (the same
    ``log_softmax`` kernel, so the same values): the logprobs graph holds no row of the vocabulary."""
    rows = logits.shape[0]
    logprobs, above = ws.probs[:rows], ws.scratch[:rows]
    torch.log_softmax(logits.float(), dim=-1, out=logprobs)
    chosen = logprobs.gather(1, tokens.long().unsqueeze(1))
    torch.gt(logprobs, chosen, out=above)
    ranks = above.sum(dim=-1).to(torch.int64) + 1
    top = torch.topk(logprobs, k, dim=-1)
    return chosen.squeeze(1), ranks, top.values, top.indices


class SamplerState:
    """The sampler's static buffers: per-row temperature / top-k / top-p / min-p (host staging
    and device copies), the noise, the workspace (:class:`Workspace`), the sampled tokens, and
    each seeded request's generator.

    :meth:`compute` reads only these buffers and a logits buffer, so a graph captures it;
    :meth:`write` fills them for a step before the compute or its replay."""

    def __init__(self, max_reqs: int, vocab_size: int, device: torch.device, pin_memory: bool,
                 max_logprobs: int = 0, max_tokens: int = 0, penalties: bool = False) -> None:
        self.vocab_size, self.device = vocab_size, device
        self._max_reqs, self._max_tokens, self._pin = max_reqs, max_tokens, pin_memory
        #: Repetition / presence / frequency penalties' device state, made by the first batch
        #: that asks (or here with ``penalties``: their graphs are built at warm-up).
        self.penalties: PenaltyState | None = None
        self._penalty_step: Any = None      # the next penalised step's ledger entry (plan_penalties)
        if penalties:
            self.penalty_state()
        self._host = {"temperature": torch.zeros(max_reqs, dtype=torch.float32, pin_memory=pin_memory),
                      "top_k": torch.zeros(max_reqs, dtype=torch.int64, pin_memory=pin_memory),
                      "top_p": torch.ones(max_reqs, dtype=torch.float32, pin_memory=pin_memory),
                      "min_p": torch.zeros(max_reqs, dtype=torch.float32, pin_memory=pin_memory)}
        self._host_np = {k: t.numpy() for k, t in self._host.items()}
        #: The (frozen) batch and row counts whose parameters the buffers hold: a step of the same
        #: batch writes only its noise.
        self._written: tuple[Any, int, int] | None = None
        self.static = (self._host if device.type == "cpu" else
                       {k: t.to(device) for k, t in self._host.items()})
        self.noise = torch.ones(max_reqs, vocab_size, dtype=torch.float32, device=device)
        self.tokens = torch.zeros(max_reqs, dtype=torch.int64, device=device)
        #: The filters' and the logprobs graph's ``[max_reqs, vocab]`` buffers, shared by every graph.
        self.work = Workspace(max_reqs, vocab_size, device)
        #: FlashInfer's sampling module where the top-k / top-p filters run on its kernels (CUDA
        #: with graphrt[flashinfer]; :mod:`~graphrt.backends.torch.sampling.flashinfer_sampling`), else None.
        self.flashinfer = (flashinfer_sampling(device) if device.type in DEVICE_TYPES or SAMPLER_ENV in os.environ
                           else None)
        #: The logprobs graph's outputs (``max_logprobs > 0``): each row's sampled-token logprob and
        #: rank, and its top logprobs and their ids (:func:`token_logprobs`).
        self.top_k = min(max_logprobs, vocab_size)
        self.logprobs = ((torch.zeros(max_reqs, dtype=torch.float32, device=device),
                          torch.zeros(max_reqs, dtype=torch.int64, device=device),
                          torch.zeros(max_reqs, self.top_k, dtype=torch.float32, device=device),
                          torch.zeros(max_reqs, self.top_k, dtype=torch.int64, device=device))
                         if max_logprobs else ())
        # A seeded request's noise comes from its own generator, keyed by all 64 bits of its
        # seed. torch's CPU generator (mt19937) keeps only the low 32, so on a CPU device the
        # noise is drawn by numpy's Philox (128-bit key) straight into this buffer; other
        # devices' torch generators (CUDA's Philox) take a 64-bit seed whole.
        self._host_noise = self.noise.numpy() if device.type == "cpu" else None
        self._generators: dict[int, torch.Generator | np.random.Generator] = {}

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the buffers every sampler graph shares (noise, workspace, penalty state),
        held outside the graphs' own memory."""
        penalties = 0 if self.penalties is None else self.penalties.nbytes
        return self.noise.numel() * self.noise.element_size() + self.work.nbytes + penalties

    def penalty_state(self) -> PenaltyState:
        """The penalties' device state, made on first use."""
        if self.penalties is None:
            self.penalties = PenaltyState(self._max_reqs, self.vocab_size, self._max_tokens, self.device, self._pin)
        return self.penalties

    def plan_penalties(self, sampling: Any, token_ids: np.ndarray, req_rows: np.ndarray,
                       num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray, rows: int) -> None:
        """Plan a penalised batch's token counts (host only, before the step runs;
        :meth:`fold_penalties` folds them in after the forward wrote the step's ``input_ids``)."""
        self._penalty_step = self.penalty_state().ledger.plan(sampling, token_ids, req_rows, num_computed_tokens,
                                                              num_scheduled_tokens, rows)

    def fold_penalties(self, sampling: Any, num_reqs: int, rows: int, input_ids: torch.Tensor) -> None:
        """Write the planned step's penalty parameters and count its ``input_ids`` in."""
        step, self._penalty_step = self._penalty_step, None
        if step is None:
            raise GraphrtError("a penalised batch reached sample() without prepare_penalties()")
        state = self.penalty_state()
        state.write(sampling, step, num_reqs, rows)
        state.update(step, input_ids)

    def compute(self, logits: torch.Tensor, rows: int, greedy: bool, wide: bool = False,
                penalties: bool = False) -> None:
        """Sample ``rows`` rows of ``logits`` into :attr:`tokens` (capturable); ``wide``: some
        row's top_k is past the candidates (:mod:`~graphrt.backends.torch.sampling.sampler_ops`);
        ``penalties``: a copy of the rows is penalised first (greedy rows take its argmax)."""
        logits = logits[:rows]
        if penalties:
            x = self.work.probs[:rows]
            x.copy_(logits)
            self.penalty_state().apply(x, self.work.scratch[:rows])
            logits = x
        if greedy:
            self.tokens[:rows].copy_(greedy_sample(logits))
        else:
            s = self.static
            self.tokens[:rows].copy_(sample_rows(logits, s["temperature"][:rows], s["top_k"][:rows],
                                                 s["top_p"][:rows], s["min_p"][:rows], self.noise[:rows],
                                                 self.work, wide=wide, flashinfer=self.flashinfer))

    def compute_logprobs(self, logits: torch.Tensor, rows: int) -> None:
        """The logprobs of ``rows`` rows of ``logits`` and of the tokens just sampled into
        :attr:`logprobs` (capturable: the logprobs graph)."""
        values = token_logprobs_into(logits[:rows], self.tokens[:rows], self.top_k, self.work)
        for out, value in zip(self.logprobs, values):
            out[:rows].copy_(value)

    def write(self, sampling: Any, num_reqs: int, rows: int) -> None:
        """A random step's parameters into the buffers (padded rows greedy, filters off; not
        again while the same batch samples at the same rows), then fresh Exp(1) noise: the device
        RNG, or the request's own seeded generator."""
        written = self._written
        if written is None or written[0] is not sampling or written[1] != num_reqs or written[2] != rows:
            write_sampling_rows(sampling, num_reqs, rows, self.vocab_size, self._host_np)
            if self.static is not self._host:
                for k, t in self.static.items():
                    t[:rows].copy_(self._host[k][:rows], non_blocking=True)
            self._written = (sampling, num_reqs, rows)
        self.noise[:num_reqs].exponential_()
        for i, seed, rid in sampling.seeded:       # the seeded rows only (found once per batch)
            gen = self._generators.get(rid)
            if gen is None:
                gen = self._generators[rid] = self._seeded_generator(seed)
            if self._host_noise is not None:
                gen.standard_exponential(dtype=np.float32, out=self._host_noise[i])
            else:
                self.noise[i].exponential_(generator=gen)

    def _seeded_generator(self, seed: int) -> torch.Generator | np.random.Generator:
        """A generator whose stream depends on every bit of ``seed`` (a SamplingBatch has
        checked it is an integer in [0, 2**64))."""
        if self._host_noise is not None:
            return np.random.Generator(np.random.Philox(key=seed))
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        return gen

    def free_request(self, request_id: int) -> None:
        self._generators.pop(request_id, None)
        if self.penalties is not None:
            self.penalties.free(request_id)
