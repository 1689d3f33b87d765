"""Ascend ACL graph limits: how many graphs the device's streams allow (vllm-ascend's formula).

Every ACL graph takes streams (PIECEWISE: one per piece at least) of the 1800 usable
(``ACL_MAX_CAPTURE_SIZE``); :func:`limit_policy` cuts a bucket policy to
:func:`capture_budget` (keeping the smallest and largest size) and logs it. Imports neither
torch nor torch_npu."""

from __future__ import annotations

import logging
import math
import os

from graphrt.core.buckets import BucketPolicy
from graphrt.core.errors import ConfigError

#: Ascend ACL graph: at most this many captured graphs (2048 streams, 248 kept spare).
ACL_MAX_CAPTURE_SIZE = 1800
#: Ascend A3 / FFTS+ path: streams each communication group may take.
ACL_STREAMS_PER_COMM_GROUP = 40
#: Ascend: environment variable and value selecting HCCL's AIV expansion mode (vllm-ascend's ACL graph setup).
ACL_AIV_ENV = "HCCL_OP_EXPANSION_MODE"
ACL_AIV_VALUE = "AIV"

logger = logging.getLogger(__name__)


def aiv_mode_from_env() -> bool:
    """Whether HCCL expands collectives in AIV mode (``HCCL_OP_EXPANSION_MODE=AIV``)."""
    return os.environ.get(ACL_AIV_ENV) == ACL_AIV_VALUE


def capture_budget(num_hidden_layers: int, tp_size: int = 1, dp_size: int = 1,
                   expert_parallel: bool = False, aiv_mode: bool = False, draft_layers: int = 0,
                   *, moe: bool | None = None, max_graphs: int = ACL_MAX_CAPTURE_SIZE) -> int:
    """Most capture sizes the ACL stream budget allows for this model and parallel layout.

    Each graph needs ``num_hidden_layers + 1`` streams (plus ``draft_layers + 1`` with a draft
    model). With ``aiv_mode`` (A2, ``HCCL_OP_EXPANSION_MODE=AIV``) each communication group and
    expert parallelism multiply the streams per graph; otherwise (A3's default) each group costs
    ``ACL_STREAMS_PER_COMM_GROUP`` plus two per graph. ``moe`` defaults to ``expert_parallel``.
    Returns 0 when not even one graph fits.
    """
    if num_hidden_layers < 1:
        raise ConfigError(f"num_hidden_layers must be >= 1, got {num_hidden_layers}")
    if tp_size < 1 or dp_size < 1 or draft_layers < 0:
        raise ConfigError(f"tp_size and dp_size must be >= 1 and draft_layers >= 0, got "
                          f"{tp_size}, {dp_size}, {draft_layers}")
    is_moe = expert_parallel if moe is None else moe
    per_graph = num_hidden_layers + 1
    if draft_layers:
        per_graph += draft_layers + 1
    comm_groups = int(dp_size > 1) + int(tp_size > 1)
    available = max_graphs
    if aiv_mode:
        factor = 1 + comm_groups + int(expert_parallel)
        if is_moe:
            factor += int(dp_size > 1)
        else:
            available -= factor * per_graph
        return max(math.floor(available / per_graph / factor), 0)
    available -= comm_groups * ACL_STREAMS_PER_COMM_GROUP
    return max(math.floor(available / per_graph / (1 + comm_groups * 2)), 0)


def limit_policy(policy: BucketPolicy, num_hidden_layers: int, **parallel: int | bool) -> BucketPolicy:
    """``policy`` cut to :func:`capture_budget` sizes (keeping the smallest and largest),
    logged either way.

    ``parallel`` takes :func:`capture_budget`'s keyword arguments; ``aiv_mode`` defaults to
    the environment. Returns ``policy`` itself when its sizes already fit.
    """
    parallel.setdefault("aiv_mode", aiv_mode_from_env())
    budget = capture_budget(num_hidden_layers, **parallel)
    if budget < 1:
        logger.warning("graphrt: the ACL stream budget fits no graph of a %d-layer model (%s); "
                       "capturing only the largest size %d -- use graph mode NONE if capture "
                       "fails", num_hidden_layers, parallel, policy.max_size)
        budget = 1
    if len(policy) <= budget:
        logger.info("graphrt: ACL stream budget allows %d capture sizes for %d layers; all %d "
                    "configured sizes fit", budget, num_hidden_layers, len(policy))
        return policy
    limited = policy.limit_to(budget)
    logger.info("graphrt: ACL stream budget allows %d capture sizes for %d layers (%s); "
                "limiting %d sizes to %s", budget, num_hidden_layers,
                ", ".join(f"{k}={v}" for k, v in parallel.items()), len(policy), list(limited.sizes))
    return limited
