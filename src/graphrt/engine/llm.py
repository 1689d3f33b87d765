"""``graphrt.LLM``: the embedded default engine -- scheduler, block allocator, ModelRunner.

It makes the library usable end to end and is how the parity tests drive real models::

    llm = graphrt.LLM(model_dir, backend="cpu", max_num_seqs=8)
    outs = llm.generate([[1, 2, 3]], graphrt.SamplingParams(max_tokens=8))
    outs[0].token_ids

Warm-up (capture / precompile) happens in the constructor.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from graphrt.core import defaults
from graphrt.config import GraphConfig
from graphrt.engine.block_allocator import BlockAllocator
from graphrt.engine.scheduler import Request, ScheduledStep, Scheduler, Status
from graphrt.core.errors import InputError
from graphrt.runner import ModelRunner, sampling_batch
from graphrt.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """A finished request: its prompt, the generated ids only, and why it stopped."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS), "length" (max_tokens or max_model_len)


class LLM:
    """Continuous batching over a :class:`ModelRunner`."""

    def __init__(self, model: Any, backend: Any = "auto", *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 block_size: int = defaults.DEFAULT_BLOCK_SIZE, num_kv_blocks: int | None = None,
                 strict: bool = False, dtype: Any = None, progress: bool = False,
                 config: GraphConfig | None = None, **graph_fields: Any) -> None:
        from graphrt.registry import select_backend
        backend_obj = select_backend(backend) if isinstance(backend, str) else backend
        if isinstance(model, str) or hasattr(model, "__fspath__"):
            model = backend_obj.load_model(str(model), dtype)
        model_len = _model_max_len(model)
        if max_model_len is None:
            max_model_len = min(model_len or defaults.DEFAULT_MAX_MODEL_LEN, defaults.DEFAULT_MAX_MODEL_LEN)
        if config is None:
            config = GraphConfig.create(max_num_seqs=max_num_seqs,
                                        max_num_batched_tokens=max_num_batched_tokens,
                                        max_model_len=max_model_len, block_size=block_size,
                                        strict=strict, **graph_fields)
        self.config = config
        self.runner = ModelRunner(model, config, backend=backend_obj, num_kv_blocks=num_kv_blocks,
                                  progress=progress)
        cfg = self.config
        self.eos_token_ids = frozenset(_model_eos(model))
        self.allocator = BlockAllocator(self.runner.num_kv_blocks)
        self.scheduler = Scheduler(max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   block_size=cfg.block_size, allocator=self.allocator)
        self.token_table = np.zeros((cfg.max_num_seqs, cfg.max_model_len), dtype=np.int32)
        self.block_table = np.zeros((cfg.max_num_seqs, cfg.max_blocks_per_req), dtype=np.int32)
        self._ids = itertools.count()
        self._finished: list[Request] = []

    # ---- requests ------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue one request; bad input raises InputError and changes nothing."""
        params = params or SamplingParams()
        self._validate(prompt_token_ids, params, "prompt_token_ids")
        return self._enqueue(prompt_token_ids, params)

    def _enqueue(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
        """Queue an already validated request."""
        req = Request(next(self._ids), [int(t) for t in prompt_token_ids], params)
        self.scheduler.add(req)
        return req.request_id

    def _validate(self, prompt: Sequence[int], params: SamplingParams, where: str) -> None:
        """Refuse a request before it is queued: params not a SamplingParams (which checked
        its own fields), a prompt that is not a flat sequence of integer token ids, or one
        that cannot fit. Raises InputError naming ``where``."""
        cfg = self.config
        if not isinstance(params, SamplingParams):
            raise InputError("sampling_params", f"expected graphrt.SamplingParams, got {type(params).__name__}")
        try:
            ids = np.asarray(prompt)
        except (ValueError, TypeError):   # ragged nesting
            raise InputError(where, "must be a flat sequence of integer token ids, got a ragged "
                                    "nested sequence") from None
        if ids.ndim != 1:
            raise InputError(where, "must be a flat sequence of integer token ids, got "
                                    + (f"{ids.ndim}-D nested sequences" if ids.ndim > 1 else repr(prompt)))
        if len(ids) == 0:
            raise InputError(where, "empty prompt: at least one token is needed")
        if ids.dtype.kind not in "iu":
            raise InputError(where, f"token ids must be integers, got {ids.dtype}")
        if len(ids) >= cfg.max_model_len:
            raise InputError(where, f"prompt of {len(ids)} tokens leaves no room to generate within "
                                    f"max_model_len={cfg.max_model_len}")
        vocab = self.runner.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            raise InputError(where, f"token id {bad} outside the vocabulary [0, {vocab})")
        total = min(len(prompt) + params.max_tokens, cfg.max_model_len)
        blocks = -(-total // cfg.block_size)
        if blocks > self.allocator.capacity:
            raise InputError(where, f"needs {blocks} KV blocks for {total} tokens but the cache holds "
                                    f"{self.allocator.capacity}; lower max_tokens or add KV blocks")

    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order.

        Every prompt is validated before any is queued, so a bad one raises InputError
        (naming its index) and leaves the engine serving as before.
        """
        prompts = list(prompt_token_ids)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InputError("sampling_params", f"{len(params)} params for {len(prompts)} prompts")
        for i, (p, sp) in enumerate(zip(prompts, params)):
            self._validate(p, sp, f"prompt_token_ids[{i}]")
        ids = [self._enqueue(p, sp) for p, sp in zip(prompts, params)]
        wanted = set(ids)
        done: dict[int, RequestOutput] = {}
        while wanted - done.keys():
            for out in self.step():
                if out.request_id in wanted:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    # ---- the loop ------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the requests that finished in it."""
        step = self.scheduler.schedule()
        if not step.requests:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress: a request cannot fit in the KV cache")
            return []
        self._write_tables(step)
        rows = np.fromiter((r.row for r in step.requests), dtype=np.int32, count=len(step))
        computed = np.fromiter((r.num_computed_tokens for r in step.requests), dtype=np.int32,
                               count=len(step))
        scheduled = np.asarray(step.num_scheduled, dtype=np.int32)
        samples = [r.num_computed_tokens + n == r.num_tokens for r, n in zip(step.requests, scheduled)]
        params = [r.params if s else _without_seed(r.params) for r, s in zip(step.requests, samples)]
        batch = sampling_batch(params, [r.request_id for r in step.requests], self.runner.vocab_size)
        tokens = self.runner.execute(token_ids=self.token_table, block_table=self.block_table,
                                     req_rows=rows, num_computed_tokens=computed,
                                     num_scheduled_tokens=scheduled, sampling=batch)
        finished = []
        for req, n, sampled, tok in zip(step.requests, step.num_scheduled, samples, tokens):
            req.num_computed_tokens += n
            if sampled:
                req.output_token_ids.append(int(tok))
                reason = self._stop_reason(req, int(tok))
                if reason is not None:
                    self.scheduler.finish(req, reason)
                    self.runner.free_request(req.request_id)
                    finished.append(RequestOutput(req.request_id, req.prompt_token_ids,
                                                  list(req.output_token_ids), reason))
        return finished

    def _write_tables(self, step: ScheduledStep) -> None:
        """Write what the persistent tables lack: new token ids and newly allocated blocks.

        Rows persist between steps, so a decode step writes one token per request, and a
        row freshly (re)assigned to a request is cleared once.
        """
        for req, n in zip(step.requests, step.num_scheduled):
            row = req.row
            end = req.num_computed_tokens + n
            if req.tokens_in_row < end:
                self.token_table[row, req.tokens_in_row:end] = req.tokens(req.tokens_in_row, end)
                req.tokens_in_row = end
            if req.blocks_in_row < len(req.blocks):
                if req.blocks_in_row == 0:
                    self.block_table[row] = 0
                self.block_table[row, req.blocks_in_row:len(req.blocks)] = req.blocks[req.blocks_in_row:]
                req.blocks_in_row = len(req.blocks)

    def _stop_reason(self, req: Request, token: int) -> str | None:
        if not req.params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    @property
    def stats(self) -> dict[str, Any]:
        """Runner cache statistics plus scheduler counters."""
        out = self.runner.stats.as_dict()
        out["preemptions"] = self.scheduler.num_preemptions
        out["kv_blocks"] = self.runner.num_kv_blocks
        return out


def _without_seed(params: SamplingParams) -> SamplingParams:
    """Params for a step in which a request samples nothing (a partial prefill chunk): the
    same filters, no seed, so the request's seeded generator is not advanced."""
    return params if params.seed is None else dataclasses.replace(params, seed=None)


def _model_config(model: Any) -> Any:
    return getattr(model, "config", None)


def _model_max_len(model: Any) -> int | None:
    cfg = _model_config(model)
    return getattr(cfg, "max_position_embeddings", None)


def _model_eos(model: Any) -> tuple[int, ...]:
    cfg = _model_config(model)
    return tuple(getattr(cfg, "eos_token_id", ()) or ())


__all__ = ["LLM", "RequestOutput", "Status"]
