"""The torch step agreement of data-parallel ranks: one all-reduce of five integers per step.

See :mod:`graphrt.core.dp_agreement` for why ranks that step together agree on a step's
shape. The collective runs on the group it is given; a gloo (CPU) group keeps it off the
device stream, as SGLang's and vLLM's DP metadata all-reduces do, and an NCCL group gets a
device tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from graphrt.core.dispatch import DispatchShape
from graphrt.core.errors import ConfigError


class TorchStepAgreement:
    """``agree(tokens, requests, uniform, adapters, context)`` -> the maxima over ``group``, a
    :class:`~graphrt.core.dispatch.DispatchShape` (uniform only if every rank's step is a uniform
    decode; a context above every bucket, -1, is the largest)."""

    def __init__(self, group: Any = None) -> None:
        if not dist.is_initialized():
            raise ConfigError("TorchStepAgreement needs torch.distributed initialised: init_process_group "
                              "first, then pass the data-parallel group (a gloo group keeps it off the GPU)")
        self.group = group
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        self._values = torch.zeros(5, dtype=torch.int64, device=device)    # one buffer, every step
        self._host = torch.zeros(5, dtype=torch.int64)

    def agree(self, num_tokens: int, num_reqs: int, uniform_decode: bool, num_loras: int, context: int = 0
              ) -> DispatchShape:
        host = self._host
        host[0], host[1], host[2], host[3] = num_tokens, num_reqs, 0 if uniform_decode else 1, num_loras
        host[4] = _ABOVE if context < 0 else context
        self._values.copy_(host)
        dist.all_reduce(self._values, op=dist.ReduceOp.MAX, group=self.group)
        t, r, mixed, n, c = self._values.tolist()
        return DispatchShape(int(t), int(r), not mixed, int(n), -1 if c == _ABOVE else int(c))


#: A context above every bucket, as the all-reduce's maximum.
_ABOVE = 2**62


__all__ = ["TorchStepAgreement"]
