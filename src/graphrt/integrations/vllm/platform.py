"""The platform :func:`graphrt.integrations.vllm.register` hands vLLM: vLLM's own CPU platform,
answering its static-graph questions with graphrt's wrapper and keeping the graph settings vLLM
resolved (its CPU platform would wipe them).

On a CPU, vLLM's ``CpuPlatform.check_and_update_config`` empties the capture sizes and turns
``VLLM_COMPILE`` into a Dynamo trace with Inductor: vLLM has no graphs there. Here the mode, the
capture sizes and the cudagraph mode vLLM had resolved (from the user's settings or its
optimisation level's defaults) are put back after it, with the ``eager`` compile backend (Inductor's
CPU kernels are C++ the recording graph cannot see, so a replay would skip them), and the worker
is graphrt's (:mod:`.worker`: it captures in ``capture_model`` and can run FULL keys). Options
graphrt cannot honour raise :class:`~graphrt.core.errors.ConfigError` when the engine starts.
"""

from __future__ import annotations

import logging
from typing import Any

from graphrt.core.errors import ConfigError
from graphrt.integrations.vllm.session import LOGGER
from vllm.platforms.cpu import CpuPlatform

logger = logging.getLogger(LOGGER)

WRAPPER = "graphrt.integrations.vllm.wrapper.GraphrtGraphWrapper"
CPU_WORKER = "graphrt.integrations.vllm.worker.GraphrtCPUWorker"
ATTENTION = "graphrt.integrations.vllm.attention.GraphrtAttentionBackend"
ATTENTION_NAME = "GRAPHRT"
VLLM_CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
#: vLLM's fusion passes (``compilation_config.pass_config``) that exist only on CUDA / ROCm / XPU; its
#: optimisation levels turn some on where custom ops run, as they do with the eager backend.
FUSION_PASSES = ("fuse_norm_quant", "fuse_act_quant", "fuse_allreduce_rms", "fuse_attn_quant", "fuse_act_padding",
                 "fuse_mla_dual_rms_norm", "fuse_rope_kvcache", "fuse_qk_norm_rope_kvcache",
                 "enable_qk_norm_rope_fusion", "fuse_rope_kvcache_cat_mla")


def _modes() -> tuple[Any, Any]:
    """vLLM's ``CompilationMode`` and ``CUDAGraphMode``, imported when a hook runs: this module is
    imported while ``vllm.config`` itself is still importing (it resolves the platform)."""
    from vllm.config import CompilationMode, CUDAGraphMode

    return CompilationMode, CUDAGraphMode


def graph_settings(vllm_config: Any) -> dict[str, Any]:
    """What vLLM resolved about graphs before its platform hook runs."""
    cc = vllm_config.compilation_config
    return {"mode": cc.mode, "cudagraph_mode": cc.cudagraph_mode, "backend": cc.backend,
            "sizes": list(cc.cudagraph_capture_sizes or []), "max_size": cc.max_cudagraph_capture_size}


def refuse_unsupported(vllm_config: Any, settings: dict[str, Any]) -> None:
    """ConfigError for a setting graphrt cannot honour under vLLM, naming it and the way out."""
    cc = vllm_config.compilation_config
    CompilationMode, _ = _modes()
    if vllm_config.use_v2_model_runner:
        raise ConfigError("graphrt's vLLM plugin runs vLLM's V1 model runner (its worker subclasses it); "
                          "unset VLLM_USE_V2_MODEL_RUNNER or set it to 0")
    if cc.use_inductor_graph_partition:
        raise ConfigError("compilation_config.use_inductor_graph_partition: graphrt's graphs wrap vLLM's fx "
                          "split (Dynamo partition); Inductor's partitions run C++ kernels a CPU recording graph "
                          "cannot see. Leave it off")
    if vllm_config.speculative_config is not None:
        raise ConfigError("speculative decoding with graphrt's vLLM plugin: the drafter's graphs are not wrapped "
                          "by graphrt (untested); drop speculative_config or VLLM_PLUGINS=graphrt")
    worker = vllm_config.parallel_config.worker_cls
    if worker not in ("auto", VLLM_CPU_WORKER, CPU_WORKER):
        raise ConfigError(f"parallel_config.worker_cls={worker!r}: graphrt's graphs need graphrt's worker "
                          f"({CPU_WORKER}, a subclass of vLLM's CPUWorker: it captures before traffic and runs FULL "
                          "keys); leave worker_cls 'auto', or subclass that worker")
    if settings["mode"] == CompilationMode.VLLM_COMPILE and settings["backend"] not in ("eager", ""):
        raise ConfigError(f"compilation_config.backend={settings['backend']!r}: on a CPU graphrt's recording graph "
                          "replays aten ops, and Inductor's CPU kernels are C++ it cannot see (a replay would skip "
                          "them); use backend 'eager' (the plugin's default)")


def register_attention() -> None:
    """Name graphrt's attention ``GRAPHRT`` among vLLM's attention backends (vLLM looks a layer's
    backend up by its name), once per process."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if ATTENTION_NAME not in AttentionBackendEnum.__members__:
        register_backend(ATTENTION_NAME, ATTENTION)


class GraphrtCpuPlatform(CpuPlatform):
    """vLLM's CPU platform with graphs: graphrt's recording graph (the module docstring)."""

    @classmethod
    def get_compile_backend(cls) -> str:
        return "eager"

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return True

    @classmethod
    def get_static_graph_wrapper_cls(cls) -> str:
        return WRAPPER

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        CompilationMode, CUDAGraphMode = _modes()
        settings = graph_settings(vllm_config)
        graphs = (settings["mode"] == CompilationMode.VLLM_COMPILE and settings["cudagraph_mode"] is not None
                  and settings["cudagraph_mode"] != CUDAGraphMode.NONE and settings["sizes"])
        if graphs:
            refuse_unsupported(vllm_config, settings)
        super().check_and_update_config(vllm_config)
        cc = vllm_config.compilation_config
        if not graphs or cc.mode == CompilationMode.NONE:      # enforce_eager, NONE, or LoRA (vLLM's CPU rule)
            cc.cudagraph_mode = CUDAGraphMode.NONE
            return
        cc.mode = CompilationMode.VLLM_COMPILE
        cc.backend = "eager"
        cc.cudagraph_capture_sizes = settings["sizes"]
        cc.max_cudagraph_capture_size = settings["max_size"]
        for name in FUSION_PASSES:
            if hasattr(cc.pass_config, name):
                setattr(cc.pass_config, name, False)
        parallel = vllm_config.parallel_config
        if parallel.worker_cls == VLLM_CPU_WORKER:     # vLLM's CPU hook turned "auto" into its own worker
            parallel.worker_cls = CPU_WORKER
        logger.info("graphrt: vLLM runs on graphrt's recording graphs: cudagraph_mode %s, capture sizes %s",
                    cc.cudagraph_mode.name, settings["sizes"])

    @classmethod
    def get_attn_backend_cls(cls, selected_backend: Any, attn_selector_config: Any, num_heads: int | None = None) -> str:
        """graphrt's paged attention where FULL graphs are on (vLLM's CPU attention cannot be held in
        one: it declares ``AttentionCGSupport.NEVER``), vLLM's CPU attention otherwise."""
        from vllm.config import get_current_vllm_config

        mode = get_current_vllm_config().compilation_config.cudagraph_mode
        if mode is not None and mode.has_full_cudagraphs() and not attn_selector_config.use_mla:
            register_attention()
            return ATTENTION
        return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)


__all__ = ["GraphrtCpuPlatform", "refuse_unsupported"]
