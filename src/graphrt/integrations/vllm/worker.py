"""graphrt's vLLM worker on a CPU: vLLM's ``CPUWorker`` and ``CPUModelRunner`` with what a CPU
lacks for graphs.

* **Capture ahead of traffic.** vLLM's CPU worker never calls ``capture_model``. Here
  ``compile_or_warm_up_model`` does, after vLLM's own CPU warm-up: every key of vLLM's dispatcher
  (from its capture sizes; PIECEWISE first, then FULL, largest first) is warmed up and captured by
  vLLM's ``_warmup_and_capture`` -- its dummy runs, padding and forward context -- then graphrt's
  cache is sealed: a later capture is a :class:`~graphrt.core.errors.CacheMissError`.
* **FULL keys.** vLLM's GPU runner wraps the model in its ``CUDAGraphWrapper`` for FULL keys (a
  CUDA graph, hard-wired); its CPU runner wraps nothing. :class:`GraphrtCPUModelRunner` wraps the
  model in graphrt's wrapper where the cudagraph mode has FULL graphs, so vLLM's dispatcher can pick
  FULL keys on a CPU (with an attention backend that declares them: :mod:`.attention`).
* **Statistics.** Each step's real size goes to the session before the forward; the worker logs
  graphrt's statistics when it shuts down and answers ``collective_rpc("graphrt_stats")``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from graphrt.integrations.vllm.session import LOGGER, SESSION
from graphrt.integrations.vllm.wrapper import GraphrtGraphWrapper
from vllm.compilation.monitor import set_cudagraph_capturing_enabled
from vllm.config import CUDAGraphMode
from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

logger = logging.getLogger(LOGGER)


class GraphrtCPUModelRunner(CPUModelRunner):
    """vLLM's CPU model runner that captures its dispatcher's keys and can run FULL ones (the
    module docstring). It keeps no state of its own: the worker turns vLLM's runner into it."""

    def load_model(self, load_dummy_weights: bool = False) -> None:
        super().load_model(load_dummy_weights)
        mode = self.compilation_config.cudagraph_mode
        if mode is not None and mode.has_full_cudagraphs():
            self.model = GraphrtGraphWrapper(self.model, self.vllm_config, CUDAGraphMode.FULL)

    def get_model(self) -> torch.nn.Module:
        model = super().get_model()
        return model.unwrap() if isinstance(model, GraphrtGraphWrapper) else model

    def capture_model(self) -> int:
        """Capture every key of vLLM's dispatcher with vLLM's own warm-up and capture runs, then seal
        graphrt's cache (strict). Returns the bytes the graphs hold."""
        mode = self.compilation_config.cudagraph_mode
        if mode == CUDAGraphMode.NONE:
            return 0
        SESSION.configure(max_capture_size=self.compilation_config.max_cudagraph_capture_size or 0,
                          has_piecewise=mode.has_piecewise_cudagraphs(), mode_name=mode.name)
        start = time.perf_counter()
        set_cudagraph_capturing_enabled(True)
        try:
            for runtime_mode, descs in self.cudagraph_dispatcher.get_capture_descs():
                for desc in descs:
                    self._warmup_and_capture(desc, cudagraph_runtime_mode=runtime_mode)
        finally:
            set_cudagraph_capturing_enabled(False)
        self.maybe_remove_all_loras(self.lora_config)
        SESSION.seal()
        nbytes = SESSION.cache.stats.build_bytes
        logger.info("graphrt: vLLM's graphs captured in %.1f s, %.1f MiB", time.perf_counter() - start, nbytes / 2**20)
        return nbytes

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        SESSION.step.tokens = int(scheduler_output.total_num_scheduled_tokens)
        SESSION.step.reqs = len(scheduler_output.num_scheduled_tokens)
        return super().execute_model(scheduler_output, intermediate_tensors)


class GraphrtCPUWorker(cpu_worker.CPUWorker):
    """vLLM's CPU worker with graphrt's runner: captures in ``compile_or_warm_up_model``, logs
    graphrt's statistics at shutdown."""

    def init_device(self) -> None:
        SESSION.reset()          # a new engine in this process
        super().init_device()
        if type(self.model_runner) is not CPUModelRunner:
            from graphrt.core.errors import ConfigError

            raise ConfigError(f"graphrt's vLLM worker expects vLLM's CPUModelRunner, got "
                              f"{type(self.model_runner).__name__} (VLLM_USE_V2_MODEL_RUNNER?)")
        self.model_runner.__class__ = GraphrtCPUModelRunner

    def compile_or_warm_up_model(self) -> Any:
        times = super().compile_or_warm_up_model()
        self.model_runner.capture_model()
        return times

    def graphrt_stats(self) -> dict[str, Any]:
        """graphrt's statistics of this worker (``llm.collective_rpc("graphrt_stats")``)."""
        return SESSION.report()

    def graphrt_kit(self, seed: int = 0) -> None:
        """Check every traffic step's forward from now on (:mod:`.kit`: padding and KV properties)."""
        from graphrt.integrations.vllm.kit import StepProperties

        if getattr(self, "_graphrt_kit", None) is None:
            self._graphrt_kit = StepProperties(self.model_runner, seed=seed)
            self._graphrt_kit.install()

    def graphrt_kit_findings(self) -> dict[str, Any]:
        """What the checks found since the last call, and how many steps they checked."""
        kit = getattr(self, "_graphrt_kit", None)
        return kit.take() if kit is not None else {"findings": [], "steps": 0}

    def shutdown(self) -> None:
        logger.info("%s", SESSION.summary())
        super().shutdown()


__all__ = ["GraphrtCPUModelRunner", "GraphrtCPUWorker"]
