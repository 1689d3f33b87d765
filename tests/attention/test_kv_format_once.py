"""Whether a KV cache is scaled fp8 is decided once, when the attention backend is selected
(issue 44, the step's files): its dtype is fixed when the runner is built, so a float cache's
step never asks ``kv_quant.py``; an fp8 cache's still quantizes through it."""

from __future__ import annotations

import pytest
import torch

from graphrt import LLM, SamplingParams
from graphrt.layers.torch.attention.selector import select_attention
from support.step_paths import LIMITS, files_crossed

KV_QUANT = "layers/torch/attention/kv_quant.py"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_float_caches_step_never_asks_the_quantization_module(model_dir: str, kv_cache_dtype: str) -> None:
    llm = LLM(model_dir, backend="eager", kv_cache_dtype=kv_cache_dtype, **LIMITS)
    try:
        for prompt in ([1, 2, 3], [4, 5]):
            llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        for _ in range(3):
            llm.step()
        _, files = files_crossed(llm.step)
        fp8 = llm.runner.executor.attention.kv_fp8
    finally:
        llm.close()
    if kv_cache_dtype == "auto":
        assert KV_QUANT not in files and fp8 is False
    else:                                       # asked per call: fp8 caches quantize and dequantize
        assert KV_QUANT in files and fp8 is None


class _Model(torch.nn.Module):
    def attention_layers(self) -> list:
        return []


@pytest.mark.parametrize("kv_dtypes,decided", [((torch.bfloat16, torch.float32), False),
                                                ((torch.bfloat16, torch.float8_e4m3fn), None),
                                                ((torch.float8_e5m2,), None), ((), None)])
def test_the_selector_decides_float_only_where_every_group_is_float(kv_dtypes: tuple, decided: bool | None) -> None:
    """Caches of both kinds (a group that declares its own dtype) or unknown dtypes: the kernel asks."""
    backend = select_attention(_Model(), "cpu", torch.float32, 16, kv_dtypes[0] if kv_dtypes else None,
                               kv_dtypes=kv_dtypes)
    assert backend.kv_fp8 is decided
