"""What a torch executor hands out of a step beyond replaying it.

* :class:`SampledSlots` -- page-locked host copies of the sampler's outputs, used in turn; a
  step launched without waiting queues its copies and records an event, and a slot is reused
  only after its outputs were read, so step n + 1 never overwrites step n's.
* :class:`FutureInputs` -- the previous step's tokens written into ``input_ids`` on the device.
* :func:`prompt_logprobs` -- logprobs at chosen hidden rows, in chunks.

Events come from :meth:`DeviceGraphAPI.new_event` (complete when recorded on the CPU graph)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from graphrt.core import defaults
from graphrt.backends.torch.sampling.sampler import SamplerState, token_logprobs

#: Torch backends that dispatch asynchronously keep this many host copies of a step's sampled
#: outputs, so step n + 1's copy never overwrites step n's before the host has read it.
SAMPLED_OUTPUT_SLOTS = 2


class Sampled:
    """One step's sampled outputs: tokens (int64 ``[num_reqs]``) and, if its logprobs graph ran,
    its logprobs, in a host slot until read. Reading waits for the slot's event, once."""

    __slots__ = ("_slots", "_slot", "num_reqs", "has_logprobs", "_tokens", "_logprobs")

    def __init__(self, slots: "SampledSlots", slot: int, num_reqs: int) -> None:
        self._slots, self._slot, self.num_reqs = slots, slot, num_reqs
        self.has_logprobs = False
        self._tokens: np.ndarray | None = None
        self._logprobs: tuple[np.ndarray, ...] = ()

    def tokens(self) -> np.ndarray:
        """The sampled tokens on the host (waits for the device's copy)."""
        if self._tokens is None:
            self._take()
        return self._tokens

    def logprobs(self) -> tuple[np.ndarray, ...]:
        """``(logprob, rank, top logprobs, top ids)`` of the rows (waits for the device's copy)."""
        if self._tokens is None:
            self._take()
        return self._logprobs

    def _take(self) -> None:
        """Wait for the slot, copy its rows out and free it."""
        self._tokens, self._logprobs = self._slots.read(self._slot, self.num_reqs, self.has_logprobs)
        self._slots.release(self._slot, self)


class SampledSlots:
    """Host slots for the sampler's outputs of ``sampler``'s buffers (module doc)."""

    def __init__(self, sampler: SamplerState, new_event: Callable[[], Any], pin_memory: bool,
                 slots: int = SAMPLED_OUTPUT_SLOTS) -> None:
        self.sampler = sampler

        def host(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros(t.shape, dtype=t.dtype, pin_memory=pin_memory)

        self._tokens = [host(sampler.tokens) for _ in range(slots)]
        self._logprobs = [tuple(host(t) for t in sampler.logprobs) for _ in range(slots)]
        self._events = [new_event() for _ in range(slots)]
        self._holders: list[Sampled | None] = [None] * slots
        self._next = 0

    def launch(self, num_reqs: int) -> Sampled:
        """Queue the copy of the sampled tokens' first ``num_reqs`` rows into the next slot."""
        i = self._next
        self._next = (i + 1) % len(self._events)
        held = self._holders[i]
        if held is not None:        # more steps launched than slots, unread: read it before reuse
            held.tokens()
        self._tokens[i][:num_reqs].copy_(self.sampler.tokens[:num_reqs], non_blocking=True)
        self._events[i].record()
        handle = self._holders[i] = Sampled(self, i, num_reqs)
        return handle

    def add_logprobs(self, handle: Sampled) -> None:
        """Queue the copy of the logprobs graph's rows of ``handle``'s step into its slot too."""
        i, n = handle._slot, handle.num_reqs
        for dst, src in zip(self._logprobs[i], self.sampler.logprobs):
            dst[:n].copy_(src[:n], non_blocking=True)
        self._events[i].record()
        handle.has_logprobs = True

    def read(self, slot: int, num_reqs: int, logprobs: bool) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """Wait for ``slot``'s copies; copies of its first ``num_reqs`` rows (the slot is reused)."""
        self._events[slot].synchronize()
        tokens = self._tokens[slot][:num_reqs].numpy().copy()
        return tokens, tuple(t[:num_reqs].numpy().copy() for t in self._logprobs[slot]) if logprobs else ()

    def release(self, slot: int, handle: Sampled) -> None:
        if self._holders[slot] is handle:
            self._holders[slot] = None


class FutureInputs:
    """The previous sampled step's tokens into this step's static ``input_ids``, on the device.

    The host knows where each replaced token sits (the last scheduled position of each request
    whose ``future_rows`` entry is a row) and which row supplies it; only the values are on the
    device, in the sampler's ``tokens`` buffer. Positions then rows travel as one contiguous
    run of a page-locked buffer, copied with the step's inputs (so the same wait frees it)."""

    def __init__(self, input_ids: torch.Tensor, tokens: torch.Tensor, pin_memory: bool) -> None:
        max_reqs = tokens.shape[0]
        self.input_ids, self.tokens = input_ids, tokens
        self._host = torch.zeros(2 * max_reqs, dtype=torch.int64, pin_memory=pin_memory)
        self._host_np = self._host.numpy()
        same = input_ids.device.type == "cpu"
        self._device = self._host if same else self._host.to(input_ids.device)
        self._values = torch.zeros(max_reqs, dtype=torch.int64, device=input_ids.device)
        self._cast = torch.zeros(max_reqs, dtype=input_ids.dtype, device=input_ids.device)

    def write(self, rows: np.ndarray, query_start_loc: np.ndarray) -> None:
        """Queue the replacement of each request ``i`` with ``rows[i] >= 0``'s last scheduled
        token by the previous step's token at that row (after the step's input copies)."""
        take = np.flatnonzero(rows >= 0)
        n = len(take)
        if not n:
            return
        self._host_np[:n] = query_start_loc[take + 1] - 1
        self._host_np[n:2 * n] = rows[take]
        if self._device is not self._host:
            self._device[:2 * n].copy_(self._host[:2 * n], non_blocking=True)
        dst, src = self._device[:n], self._device[n:2 * n]
        torch.index_select(self.tokens, 0, src, out=self._values[:n])
        self._cast[:n].copy_(self._values[:n])
        self.input_ids.index_copy_(0, dst, self._cast[:n])


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    rows: np.ndarray, targets: np.ndarray, k: int,
                    chunk: int = defaults.PROMPT_LOGPROBS_CHUNK_ROWS) -> tuple[np.ndarray, ...]:
    """``(logprob, rank, top logprobs, top ids)`` of ``targets[j]`` at the hidden row ``rows[j]``
    (host arrays), the logits computed ``chunk`` rows at a time (eagerly; it waits for them)."""
    n, device = len(rows), hidden.device
    out = (np.empty(n, np.float32), np.empty(n, np.int64), np.empty((n, k), np.float32), np.empty((n, k), np.int64))
    with torch.no_grad():
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            index = torch.from_numpy(rows[start:stop]).to(device)
            logits = compute_logits(hidden.index_select(0, index))
            values = token_logprobs(logits, torch.from_numpy(targets[start:stop]).to(device), k)
            for dst, value in zip(out, values):
                dst[start:stop] = value.cpu().numpy()
    return out


class SampledOutputs:
    """What a torch executor hands out of a step besides the tokens it waits for: the tokens and
    logprobs of a step that did not wait (host slots behind an event, made on first use), prompt
    logprobs and the device logits. Held by the executor (``executor.outputs``), given the
    buffers it reads: the sampler's state, the logits and hidden outputs, the model's
    ``compute_logits``, and the device's event and pinning."""

    def __init__(self, sampler: SamplerState, logits_out: torch.Tensor, hidden_out: torch.Tensor,
                 compute_logits: Callable[[torch.Tensor], torch.Tensor], new_event: Callable[[], Any] | None,
                 pin_memory: bool) -> None:
        self.sampler, self.logits_out, self.hidden_out = sampler, logits_out, hidden_out
        self.compute_logits, self._new_event, self._pin = compute_logits, new_event, pin_memory
        self._slots: SampledSlots | None = None

    def launch(self, num_reqs: int) -> Sampled:
        """The sampled tokens of a step that does not wait, queued into a host slot."""
        if self._slots is None:
            self._slots = SampledSlots(self.sampler, self._new_event, self._pin)
        return self._slots.launch(num_reqs)

    def fetch_tokens(self, tokens: Sampled, num_reqs: int) -> np.ndarray:
        """The tokens of a ``sample(wait=False)`` step, waiting for their copy alone."""
        return tokens.tokens()

    def sample_logprobs(self, logits: Any, sampled: Any, num_reqs: int, *, padded_reqs: int | None = None,
                        entry: Any = None, wait: bool = True) -> Any:
        """Replay the logprobs graph (or run it eagerly) on the rows the sampler read and the tokens
        it wrote: host arrays ``(logprob, rank, top logprobs, top ids)`` of the real rows, or with
        ``wait=False`` their copy queued into ``sampled``'s slot (``sampled`` returned)."""
        with torch.no_grad():
            if entry is None:
                self.sampler.compute_logprobs(self.logits_out, padded_reqs or num_reqs)
            else:
                entry.graph.replay()
        if wait:
            return tuple(t[:num_reqs].cpu().numpy().copy() for t in self.sampler.logprobs)
        self._slots.add_logprobs(sampled)
        return sampled

    def fetch_logprobs(self, handle: Sampled, num_reqs: int) -> tuple[np.ndarray, ...]:
        """The logprobs of a ``sample_logprobs(wait=False)`` step, waiting for their copy."""
        return handle.logprobs()

    def prompt_logprobs(self, rows: np.ndarray, targets: np.ndarray, k: int) -> tuple[np.ndarray, ...]:
        """Logprobs of ``targets`` at the last forward's hidden rows ``rows`` (eager chunks)."""
        return prompt_logprobs(self.compute_logits, self.hidden_out, rows, targets, k)


def device_event(device: torch.device) -> Any:
    """An event marking when the staging copies of a step have run: the next step's padding
    overwrites the page-locked staging buffers, so the host waits for it (not for the
    replay) before returning. None where torch has no event for ``device``."""
    try:
        return torch.Event(device=device)
    except (RuntimeError, TypeError, AttributeError):
        return None


__all__ = ["FutureInputs", "Sampled", "SampledOutputs", "SampledSlots", "device_event", "prompt_logprobs"]
