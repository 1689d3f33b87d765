"""One vLLM engine run in its own process, for tests/engines/test_vllm.py.

vLLM resolves its platform once per process (and the plugin only when ``VLLM_PLUGINS`` names it),
so every configuration runs in a fresh interpreter: ``python -m support.vllm_engine SPEC_JSON``
(cwd: tests/) runs each model of the spec with the same engine settings, greedy, and prints one
line ``RESULT <json>``: per model the tokens of every request, and graphrt's statistics where the
plugin was active (None where it was not: vLLM ran stock). The spec's keys: ``models`` (checkpoint
directories), ``prompts`` (token ids), ``max_tokens`` (one per prompt), ``engine`` (vLLM ``LLM``
keywords), ``version`` (a vLLM version to pretend, for the plugin's range check), ``plant`` (the
name of a function here run before the engine starts: a planted bug), ``after_init`` (the name of a
function here each worker runs once the engine is up, through ``collective_rpc``), ``kit`` (run
:func:`graphrt.integrations.vllm.kit.check_engine` instead of the prompts: its findings or the
steps it checked), ``env`` (environment variables to set first; None unsets one).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

#: vLLM settings every run shares: one engine process, a small KV cache, CPU threads left alone.
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO",
       "TOKENIZERS_PARALLELISM": "false"}


def generate(llm: Any, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def plugin_stats() -> dict[str, Any] | None:
    """graphrt's statistics if the plugin ran this engine (the worker's ``graphrt_stats``), else None."""
    from vllm.platforms import current_platform

    if not type(current_platform).__module__.startswith("graphrt."):
        return None
    from graphrt.integrations.vllm.session import SESSION

    return SESSION.report()


def plant_host_sync_in_attention() -> None:
    """A planted bug: graphrt's vLLM attention reads a tensor on the host (``.item()``) each call --
    harmless eagerly, a host sync a FULL graph cannot hold."""
    from graphrt.integrations.vllm.attention import GraphrtAttentionImpl

    forward = GraphrtAttentionImpl.forward

    def forward_with_host_sync(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if attn_metadata is not None:
            int(attn_metadata.seq_lens.max().item())
        return forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)

    GraphrtAttentionImpl.forward = forward_with_host_sync


def plant_padded_kv_write() -> None:
    """A planted bug: graphrt's vLLM attention has padded tokens write the row after the step's last
    slot (a real, unused slot) instead of vLLM's null block."""
    from graphrt.integrations.vllm.attention import GraphrtAttentionImpl

    GraphrtAttentionImpl.write_slots = staticmethod(lambda slots: torch.where(slots < 0, slots.max() + 1, slots))


def ask_for_an_uncaptured_key(worker: Any) -> None:
    """After warm-up, make vLLM's dispatcher send 3-token steps to a PIECEWISE key of 3 tokens,
    which was never captured (vLLM's capture sizes pad 3 to 4)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    dispatcher = worker.model_runner.cudagraph_dispatcher
    dispatcher._bs_to_padded_graph_size[3] = 3
    dispatcher.add_cudagraph_key(CUDAGraphMode.PIECEWISE, BatchDescriptor(num_tokens=3))


def main(spec: dict[str, Any]) -> dict[str, Any]:
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    for name, value in (spec.get("env") or {}).items():     # None: unset
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if spec.get("version"):
        from vllm import version

        version.__version__ = spec["version"]
    if spec.get("plant"):
        globals()[spec["plant"]]()
    from vllm import LLM

    results = {}
    for model in spec["models"]:
        llm = LLM(model=model, **spec["engine"])
        if spec.get("after_init"):
            llm.collective_rpc(globals()[spec["after_init"]])
        from vllm.platforms import current_platform

        if spec.get("kit"):
            from graphrt.integrations.vllm.kit import check_engine

            try:
                results[model] = {"kit_steps": check_engine(llm, max_examples=spec["kit"]), "findings": None}
            except AssertionError as finding:
                results[model] = {"kit_steps": None, "findings": str(finding)}
        else:
            tokens = generate(llm, spec["prompts"], spec["max_tokens"])
            results[model] = {"tokens": tokens, "stats": plugin_stats(), "platform": type(current_platform).__name__}
        llm.llm_engine.engine_core.shutdown()
        del llm
    return results


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
