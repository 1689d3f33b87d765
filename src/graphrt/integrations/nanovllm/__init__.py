"""nano-vllm (GeeeekExplorer/nano-vllm) on graphrt: its ``LLMEngine``, ``Scheduler`` (chunked
prefill, preemption), ``BlockManager`` (prefix cache) and ``Sequence`` unchanged, its model runner
graphrt's, on any graphrt backend (``cpu``, ``xla``, ``cuda``, ...)::

    from graphrt import SamplingParams
    from graphrt.integrations.nanovllm import LLM

    llm = LLM(model_dir, backend="cpu", max_num_seqs=8, max_num_batched_tokens=1024)
    outs = llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=16))

``LLM`` / ``LLMEngine`` import nano-vllm on first use (:mod:`.engine`); importing this package
does not. :func:`unavailable_reason` says why they cannot here. docs/engines.md, "nano-vllm".
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

#: What nano-vllm needs here beyond graphrt's own dependencies (flash-attn only for its own runner).
NEEDS = {"nanovllm": "nano-vllm is not installed: pip install --no-deps -e <a nano-vllm checkout> "
                     "(--no-deps: its flash-attn needs CUDA, and graphrt's runner replaces what uses it)",
         "xxhash": "xxhash is not installed (nano-vllm's block manager hashes prefix blocks with it): "
                   "pip install xxhash",
         "transformers": "transformers is not installed (nano-vllm reads the config and tokenizer with it)"}


def unavailable_reason() -> str | None:
    """One sentence on why nano-vllm cannot run on graphrt here, or None."""
    for name, reason in NEEDS.items():
        if importlib.util.find_spec(name) is None:
            return reason
    return None


def __getattr__(name: str) -> Any:
    if name in ("LLM", "LLMEngine"):
        return getattr(importlib.import_module("graphrt.integrations.nanovllm.engine"), name)
    if name == "GraphrtModelRunner":
        return importlib.import_module("graphrt.integrations.nanovllm.runner").GraphrtModelRunner
    raise AttributeError(f"module 'graphrt.integrations.nanovllm' has no attribute {name!r}")


__all__ = ["LLM", "LLMEngine", "GraphrtModelRunner", "unavailable_reason"]
