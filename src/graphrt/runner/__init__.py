"""The runner and its warm-up: :class:`ModelRunner` (``model_runner.py``), what it opens
(``setup.py``), the serving keys it owns (``keys.py``: dispatcher, caches, plan memo), its step
plans (``plans.py``), optional step features (``features.py``), outputs beyond tokens
(``outputs.py``), weights and memory (``weights.py``), and warm-up: upfront (``warmup.py``), in the
background (``background.py``), re-fitted to traffic (``traffic.py``), remembered across restarts
(``capture_plan.py``), as one object (``warmup_plan.py``). See docs/architecture.md."""

from __future__ import annotations

from graphrt.core.cache import FailedBuild
from graphrt.core.sampling.batch import SamplingBatch, sampling_batch
from graphrt.runner.model_runner import ModelRunner
from graphrt.runner.plans import StepInfo

__all__ = ["FailedBuild", "ModelRunner", "SamplingBatch", "StepInfo", "sampling_batch"]
