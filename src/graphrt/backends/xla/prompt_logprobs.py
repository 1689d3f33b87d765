"""Prompt logprobs on the XLA backend: logprobs at chosen rows of the last forward's hidden states.

A program taking the ``[T_pad, H]`` hidden states would compile per token bucket, so the chosen
rows go to the host and back through one fixed-shape program,
``defaults.PROMPT_LOGPROBS_CHUNK_ROWS`` at a time: the logits, then
:func:`~graphrt.backends.xla.sampler.token_logprobs`. Compiled at first use, counted in
``stats.compiles``, not as an unplanned key."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from graphrt.backends.xla.compile import thread_compiles
from graphrt.backends.xla.compile_ledger import CompileLedger
from graphrt.core import defaults
from graphrt.core.errors import InputError


class PromptLogprobs:
    """The prompt-logprobs program of ``programs`` (``XlaPrograms.prompt_logprobs``) and its calls."""

    def __init__(self, programs: Any, ledger: CompileLedger, chunk: int = defaults.PROMPT_LOGPROBS_CHUNK_ROWS) -> None:
        self.programs, self.ledger, self.chunk = programs, ledger, chunk
        self._compiled: Any = None

    def _program(self, width: int, dtype: Any) -> Any:
        """The program compiled for ``[chunk, width]`` hidden rows (once)."""
        if self._compiled is None:
            p = self.programs
            if p.prompt_logprobs is None:
                raise InputError("prompt_logprobs", "max_logprobs is 0: logprobs are off")
            before = thread_compiles()
            self._compiled = p.prompt_logprobs.lower(
                p.weights, jax.ShapeDtypeStruct((self.chunk, width), dtype),
                jax.ShapeDtypeStruct((self.chunk,), jnp.int32)).compile()
            self.ledger.stats.compiles += thread_compiles() - before
        return self._compiled

    def __call__(self, hidden: jax.Array, rows: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, ...]:
        """``(logprob, rank, top logprobs, top ids)`` of ``targets[j]`` at hidden row ``rows[j]``."""
        host = np.asarray(hidden)[rows]
        n, c = len(rows), self.chunk
        program = self._program(host.shape[1], host.dtype)
        k = self.programs.max_logprobs
        out = (np.empty(n, np.float32), np.empty(n, np.int64), np.empty((n, k), np.float32), np.empty((n, k), np.int64))
        for start in range(0, n, c):
            stop = min(start + c, n)
            block = np.zeros((c, host.shape[1]), host.dtype)
            block[:stop - start] = host[start:stop]
            ids = np.zeros(c, np.int32)
            ids[:stop - start] = targets[start:stop]
            for dst, value in zip(out, program(self.programs.weights, block, ids)):
                dst[start:stop] = np.asarray(value)[:stop - start]
        return out


__all__ = ["PromptLogprobs"]
