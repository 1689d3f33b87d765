"""Data-parallel graph agreement: ranks that step together replay the same bucket.

Data-parallel ranks of one expert-parallel MoE model (or any model whose forward runs a
collective across the DP ranks) must enter every step together and with the same shapes:
an all-to-all in a captured graph of 16 tokens cannot meet one of 32. So before each step
the ranks agree on its shape -- the largest token count, the largest request count, uniform
decode only if every rank's step is one, the most LoRA adapters -- through one small
collective (:class:`StepAgreement`), and each rank pads its own step to the bucket of that
shape. A rank with nothing scheduled calls :meth:`DataParallelMethods.execute_dummy`: it
agrees with (0, 0) and runs the agreed bucket on padding only, which writes no KV slot and
samples nothing.

Independent data-parallel engines (``graphrt.DataParallelLLM``, dense models) never need
this: their forwards share nothing, so each picks its own bucket.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from graphrt.core.errors import ConfigError
from graphrt.core.fields import FIELD_DTYPES, ModelInputs
from graphrt.core.lora import NO_LORA


class StepAgreement(Protocol):
    """One collective per step over the data-parallel group (the torch one:
    ``graphrt.backends.torch.dp_agreement.TorchStepAgreement``)."""

    def agree(self, num_tokens: int, num_reqs: int, uniform_decode: bool, num_loras: int
              ) -> tuple[int, int, bool, int]:
        """(max tokens, max requests, every rank uniform, max adapters) over the group."""


def empty_inputs(table_width: int) -> ModelInputs:
    """A step of no request and no token, for the padder to grow into a dummy step."""
    def empty(name: str, *shape: int) -> np.ndarray:
        return np.zeros(shape, FIELD_DTYPES[name])
    return ModelInputs(empty("input_ids", 0), empty("positions", 0), empty("slot_mapping", 0),
                       empty("query_start_loc", 1), empty("seq_lens", 0), empty("num_computed_tokens", 0),
                       empty("block_table", 0, table_width), 0, 0, 0, 0, True)


class DataParallelMethods:
    """ModelRunner's side of the agreement (a mixin over its dispatcher, plans and executor)."""

    step_agreement: StepAgreement | None

    def _agreed_shape(self, t: int, r: int, uniform: bool, n: int, lora_ids: np.ndarray | None
                      ) -> tuple[int, int, bool, int, np.ndarray | None]:
        """The (tokens, requests, uniform, adapters) every rank's step is dispatched as -- its
        own without an agreement -- and this rank's adapter ids: none for each request where
        another rank's adapters gave the key adapter slots."""
        if self.step_agreement is None:
            return t, r, uniform, n, lora_ids
        t, r_all, uniform, n_all = self.step_agreement.agree(t, r, uniform, n)
        if n_all and not n:
            lora_ids = self._lora.check(np.full(r, NO_LORA, np.int32), r)[0]
        return t, r_all, uniform, n_all, lora_ids

    def execute_dummy(self) -> None:
        """Join a step with nothing scheduled on this rank: agree, then run the agreed bucket
        on padding only (no KV slot written, nothing sampled). Nothing runs when no rank has
        work. Needs ``step_agreement``."""
        if self.step_agreement is None:
            raise ConfigError("execute_dummy needs a ModelRunner built with step_agreement= "
                              "(data-parallel ranks that step together)")
        with self._lock:
            t, r, uniform, n = self.step_agreement.agree(0, 0, True, 0)
            if t == 0:
                return
            plan = self._plan(t, r, uniform, n)
            padded = self.padder.pad(self._empty_step(), num_tokens=plan.key.num_tokens,
                                     num_reqs=plan.padded_reqs, out=self.executor.host_buffers)
            if self._lora is not None:              # every padded token: no adapter
                none = np.zeros(0, np.int32)
                self._lora.write(self._lora.check(none, 0)[0], none, 0, plan.key.num_tokens)
            self.cache.record_step(real_tokens=0, padded_tokens=plan.key.num_tokens, real_reqs=0,
                                   padded_reqs=plan.padded_reqs, eager_reason=plan.eager_reason,
                                   eager_cause=plan.eager_cause, key=plan.cache_key, hit=plan.hit)
            self.executor.run(plan.mode, plan.key, plan.entry, padded)
            self._last = (plan, 0, 0, 0.0)

    def _empty_step(self) -> ModelInputs:
        empty = getattr(self, "_empty", None)
        if empty is None:
            empty = self._empty = empty_inputs(self.config.max_blocks_per_req)
        return empty


__all__ = ["DataParallelMethods", "StepAgreement", "empty_inputs"]
