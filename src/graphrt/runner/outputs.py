"""A step's outputs beyond its tokens: logprobs, prompt logprobs, and the last step's readouts.

Only a step asking for logprobs comes here (it returns a :class:`StepOutput`). Sampled tokens'
logprobs come from a logprobs graph run right after the sampler (built at warm-up when
``max_logprobs > 0``); prompt logprobs from the forward's hidden rows, computed at launch, so
such a step waits for its forward. See docs/sampling.md.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from graphrt.backends.base import Executor, SamplingBatch
from graphrt.core.cache import GraphCache
from graphrt.core.dispatch import sampler_key
from graphrt.core.errors import InputError
from graphrt.core.inputs.fields import ModelInputs
from graphrt.core.future_tokens import PendingTokens
from graphrt.core.graph_modes import RuntimeMode
from graphrt.core.sampling.logprobs import StepOutput, TokenLogprobs
from graphrt.core.sampling.batch import check_logprobs_limit, logprobs as logprobs_count
from graphrt.runner.plans import (LOGPROBS, LastStep, StepArgs, StepInfo, StepPlan, plan_sampler,
                                  sampler_entry)


class StepOutputs:
    """The runner's logprobs and prompt logprobs, and its last step's readouts; ``build_missing``
    builds a logprobs graph an executor without an eager path lacks.

    Readouts describe whichever step ran last: read them from the thread that drives the runner."""

    def __init__(self, executor: Executor, sampler_cache: GraphCache, max_logprobs: int,
                 build_missing: Callable[..., Any]) -> None:
        self.executor, self.sampler_cache, self.max_logprobs = executor, sampler_cache, max_logprobs
        self.top = min(max_logprobs, executor.vocab_size)     # top columns the graphs compute
        self._build_missing = build_missing
        #: The last step, kept by the runner (None before the first).
        self.last: LastStep | None = None

    # ---- the last step's readouts ----------------------------------------------------
    def last_step(self) -> StepInfo | None:
        """What the last step ran as (``runner.last_step``; built on demand: a step keeps a tuple)."""
        if self.last is None:
            return None
        plan, t, r, seconds = self.last
        return StepInfo(plan.dispatch, plan.mode, plan.key, t, r, plan.eager_reason, seconds, plan.eager_cause,
                        plan.wanted)

    def hidden_states(self, num_tokens: int | None = None) -> np.ndarray:
        """The last step's hidden states of its real tokens (a copy: the next step reuses the buffer)."""
        return np.array(self.executor.hidden_states(num_tokens or self.last.num_tokens), copy=True)

    def logits(self) -> np.ndarray:
        """The last step's logits at each real request's last token (a copy)."""
        return np.array(self.executor.logits(self.last.num_reqs), copy=True)

    def device_logits(self) -> Any:
        """The last step's logits on the device, its bucket's rows: a torch view (until the next
        step) or XLA's array."""
        return self.executor.device_logits(self.last.plan.padded_reqs)

    def position_logits(self) -> np.ndarray:
        """With ``num_speculative_tokens = k > 0``: the last step's logits at each real request's
        last ``1 + k`` scheduled positions, ``[R, 1 + k, V]`` (a copy). In a verification step row
        ``j`` is the target's distribution after position ``j`` (draft ``j + 1`` is accepted when
        row ``j`` samples it); rows before a request's first scheduled token are unspecified."""
        return np.array(self.executor.position_logits(self.last.num_reqs), copy=True)

    # ---- logprobs --------------------------------------------------------------------

    def check(self, sampling: SamplingBatch | None, prompt_logprobs: Any, num_reqs: int) -> np.ndarray | None:
        """Refuse a logprobs count above ``max_logprobs`` (in the batch or ``prompt_logprobs``),
        before anything is written; ``prompt_logprobs`` as int64 ``[num_reqs]`` (-1: none)."""
        if sampling is not None and sampling.max_num_logprobs is not None:
            check_logprobs_limit(sampling.max_num_logprobs, self.max_logprobs)
        if prompt_logprobs is None:
            return None
        try:
            values = list(prompt_logprobs)
        except TypeError:
            raise InputError("prompt_logprobs", f"must be one None or integer >= 0 per request, got "
                                                f"{prompt_logprobs!r}") from None
        if len(values) != num_reqs:
            raise InputError("prompt_logprobs", f"{len(values)} rows for {num_reqs} requests")
        counts = [logprobs_count(v, f"prompt_logprobs[{i}]") for i, v in enumerate(values)]
        for i, c in enumerate(counts):
            check_logprobs_limit(c, self.max_logprobs, f"prompt_logprobs[{i}]")
        return np.array([-1 if c is None else c for c in counts], np.int64)

    def finish(self, plan: StepPlan, padded: ModelInputs, logits: Any, sampling: SamplingBatch | None, wait: bool,
               prompt_counts: np.ndarray | None, step: StepArgs) -> tuple[Any, Any]:
        """After the forward: prompt logprobs, then the sampler and the logprobs graph. Returns
        ``(result, (sampler output, requests) for future tokens, or None)``; the result is a
        :class:`StepOutput`, or a :class:`PendingTokens` with ``wait=False`` when asynchronous."""
        prompt = None if prompt_counts is None else self.prompt(
            prompt_counts, padded, step.token_ids, step.req_rows, step.num_computed_tokens, step.num_scheduled_tokens)
        if sampling is None:
            return StepOutput(None, None, prompt), None
        out, sampled = self.sample(plan, logits, sampling.num_reqs, sampling, wait, prompt)
        return out, (sampled, sampling.num_reqs)

    def prompt(self, counts: np.ndarray, padded: ModelInputs, token_ids: np.ndarray, req_rows: np.ndarray,
               num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray) -> list[TokenLogprobs | None]:
        """Per request, the logprobs of the table's next token at each scheduled position (None where
        it asked none); the last forward's hidden rows, read right after it ran."""
        wanted = np.flatnonzero(counts >= 0)
        if not len(wanted):
            return [None] * len(counts)
        starts = padded.query_start_loc[wanted].astype(np.int64)
        lengths = np.asarray(num_scheduled_tokens, np.int64)[wanted]
        rows = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
        width, vocab = token_ids.shape[1], self.executor.vocab_size
        targets = []
        for i, n in zip(wanted, lengths):
            first = int(num_computed_tokens[i]) + 1       # the token after each scheduled position
            next_ids = np.zeros(n, np.int64)
            known = token_ids[req_rows[i], first:min(first + n, width)]
            next_ids[:len(known)] = known
            targets.append(np.clip(next_ids, 0, vocab - 1))   # past the table's tokens: unspecified
        targets_all = np.concatenate(targets)
        arrays = self.executor.prompt_logprobs(rows, targets_all, self.top)
        out: list[TokenLogprobs | None] = [None] * len(counts)
        start = 0
        for i, n, tgt in zip(wanted, lengths, targets):
            part = tuple(a[start:start + n] for a in arrays)
            out[i] = TokenLogprobs.of(tgt, part, np.full(n, counts[i], np.int64))
            start += n
        return out

    def sample(self, plan: StepPlan, logits: Any, num_reqs: int, sampling: SamplingBatch, wait: bool,
               prompt: list[TokenLogprobs | None] | None) -> tuple[Any, Any]:
        """Sample the step (and its logprobs graph when asked): ``(result, sampler output)``; the
        result is a :class:`StepOutput`, or a :class:`PendingTokens` with ``wait=False``."""
        ex, r = self.executor, num_reqs
        entry = plan_sampler(plan, sampler_key(sampling, plan.padded_reqs, ex.vocab_size), self.sampler_cache).entry
        on_device = ex.capabilities.async_execution
        sampled = ex.sample(logits, r, sampling, padded_reqs=plan.padded_reqs, entry=entry, wait=not on_device)
        handle = None
        if sampling.logprobs is not None:
            handle = ex.sample_logprobs(logits, sampled, r, padded_reqs=plan.padded_reqs,
                                        entry=self._logprobs_entry(plan, r), wait=not on_device)
        counts = sampling.logprobs

        def result() -> StepOutput:
            tokens = ex.fetch_tokens(sampled, r) if on_device else sampled
            arrays = None if handle is None else ex.fetch_logprobs(handle, r) if on_device else handle
            return StepOutput(tokens, None if arrays is None else TokenLogprobs.of(tokens, arrays, counts), prompt)

        return (result() if wait or not on_device else PendingTokens(result)), sampled

    def _logprobs_entry(self, plan: StepPlan, num_reqs: int) -> Any:
        """The plan's logprobs graph (built now where the executor has no eager path), its use
        counted like the sampler's."""
        got = plan.sampler[LOGPROBS]
        if plan.mode is not RuntimeMode.FULL:
            return got.entry
        if got.entry is None and not self.executor.capabilities.eager_fallback:
            entry = self._build_missing(self.sampler_cache, got.key, RuntimeMode.FULL, got.key)
            got = plan.sampler[LOGPROBS] = sampler_entry(self.sampler_cache, got.key, entry, None, None,
                                                         plan.tally.real_reqs)
        if num_reqs == got.tally.real_reqs:
            got.tally.steps += 1            # counted like the sampler's (ModelRunner._run)
        else:
            self.sampler_cache.record_as(got.tally, real_tokens=0, real_reqs=num_reqs)
        return got.entry


__all__ = ["StepOutput", "StepOutputs"]
