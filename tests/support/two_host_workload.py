"""The two-"host" check's workload: 8 concurrent greedy requests, prompts longer than the
token budget (chunked prefill)."""

from __future__ import annotations

from graphrt import SamplingParams
from support.hf_models import random_prompts

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64, block_size=4,
              cudagraph_capture_sizes=[8, 16], num_kv_blocks=80)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def prompts() -> list[list[int]]:
    return random_prompts((3, 21, 11, 30, 5, 17, 8, 26), seed=42)
