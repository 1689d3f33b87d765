"""graphrt.LLM with the transformers backend against transformers' own generation (issue 31).

One tiny random Llama (4 layers, 256 wide, built offline from its config class) and 32 greedy
requests of 24 to 96 prompt tokens, 32 new tokens each, run three ways in one process:

* ``graphrt``: ``graphrt.LLM(model_dir, model_impl="transformers")`` -- the transformers model
  through graphrt's paged attention and continuous batching, on the ``eager`` backend
  (``--backend cpu``: the recording graph) -- the model's own code, graphrt's runtime;
* ``generate``: transformers' ``model.generate`` on one left-padded batch of the 32 prompts
  (sdpa attention, its dynamic cache);
* ``generate_batch``: transformers' continuous batching with paged attention
  (``model.generate_batch``).

Tokens/s is generated tokens over the wall time of the call (warm: an untimed first round
builds graphs and caches), the median of the rounds, the three interleaved. Agreement: the
share of requests whose tokens equal graphrt's. Target (issue 31): graphrt >= 1.3x
``generate`` in tokens/s, with the same tokens.

Run: ``python benchmarks/bench_transformers.py [--rounds N] [--quick] [--backend cpu|eager]``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from bench_common import cpu_line, print_checks

NUM_REQUESTS = 32
PROMPT_LENGTHS = (24, 96)          # drawn uniformly in this range
MAX_NEW_TOKENS = 32
MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)
LLM_ARGS = dict(max_num_seqs=32, max_num_batched_tokens=1024, max_model_len=256, block_size=16)
TARGET = 1.3
#: transformers' continuous batching cache for this workload: 32 requests of at most 128 tokens.
CB_PAGE_SIZE, CB_NUM_BLOCKS, CB_MAX_BATCH_TOKENS = 32, 160, 1024


def build_model(root: Path) -> Path:
    """The tiny Llama, random seeded weights with O(1) logits, saved under ``root``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from graphrt.testing.transformers_zoo import randomize

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    randomize(model, 0)
    model.save_pretrained(root)
    return root


def prompts(seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = rng.integers(PROMPT_LENGTHS[0], PROMPT_LENGTHS[1] + 1, NUM_REQUESTS)
    return [rng.integers(3, MODEL["vocab_size"], int(n)).tolist() for n in lengths]


class Graphrt:
    name = "graphrt"

    def __init__(self, model_dir: Path, backend: str) -> None:
        import graphrt

        self.params = graphrt.SamplingParams(max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        self.llm = graphrt.LLM(str(model_dir), backend=backend, model_impl="transformers", **LLM_ARGS)

    def __call__(self, batch: list[list[int]]) -> list[list[int]]:
        return [o.token_ids for o in self.llm.generate(batch, self.params)]


class HFGenerate:
    name = "generate"

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          attn_implementation="sdpa").eval()

    def __call__(self, batch: list[list[int]]) -> list[list[int]]:
        torch, pad = self.torch, MODEL["pad_token_id"]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            # No EOS (as graphrt's ignore_eos and generate_batch's eos_token_id=-1): min_new_tokens would
            # instead ban the EOS token, and greedy decoding then differs wherever EOS is the argmax.
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS,
                                      do_sample=False, pad_token_id=pad, eos_token_id=-1)
        return out[:, width:].tolist()


class HFGenerateBatch:
    name = "generate_batch"

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          attn_implementation="sdpa").eval()
        self.config = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=-1,
                                       pad_token_id=MODEL["pad_token_id"])
        # Its paged cache sized for this workload: left to itself it sizes the cache from free memory
        # (0.9 of it), which on a CPU host took ~14 GB of a 24 GB machine.
        self.cb_config = ContinuousBatchingConfig(page_size=CB_PAGE_SIZE, num_blocks=CB_NUM_BLOCKS,
                                                  max_batch_tokens=CB_MAX_BATCH_TOKENS)

    def __call__(self, batch: list[list[int]]) -> list[list[int]]:
        with self.torch.no_grad():
            out = self.model.generate_batch(batch, generation_config=self.config,
                                           continuous_batching_config=self.cb_config, progress_bar=False)
        ordered = sorted(out.values(), key=lambda o: int(str(o.request_id).rsplit("_", 1)[-1]))
        return [list(o.generated_tokens)[:MAX_NEW_TOKENS] for o in ordered]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (median reported)")
    parser.add_argument("--quick", action="store_true", help="2 rounds")
    parser.add_argument("--backend", default="eager", choices=["cpu", "eager"],
                        help="graphrt's backend (default eager: on a CPU the recording graph replays "
                             "recorded ops from Python, slower than eager; it is for testing graphs)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for every arm (default 1: on a shared VM a two-thread pool waits "
                             "milliseconds per op for a descheduled peer, which swamps a tiny model)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rounds = 2 if args.quick else args.rounds
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    batch = prompts()
    generated = NUM_REQUESTS * MAX_NEW_TOKENS
    with tempfile.TemporaryDirectory(prefix="bench-transformers-") as root:
        model_dir = build_model(Path(root))
        arms: list[Any] = [Graphrt(model_dir, args.backend), HFGenerate(model_dir), HFGenerateBatch(model_dir)]
        tokens, seconds = {}, {a.name: [] for a in arms}
        for arm in arms:                              # untimed: graphs, caches, allocator
            tokens[arm.name] = arm(batch)
        for _ in range(rounds):
            for arm in arms:
                start = time.perf_counter()
                got = arm(batch)
                seconds[arm.name].append(time.perf_counter() - start)
                assert got == tokens[arm.name], f"{arm.name} is not deterministic"
    base = tokens["graphrt"]
    rate = {name: generated / statistics.median(s) for name, s in seconds.items()}
    print(f"transformers backend vs transformers' generation: {cpu_line()}; torch {torch.__version__}, "
          f"transformers {transformers.__version__}; torch threads {torch.get_num_threads()}")
    print(f"model: Llama, {MODEL['num_hidden_layers']} layers, {MODEL['hidden_size']} wide, vocab "
          f"{MODEL['vocab_size']}; {NUM_REQUESTS} requests of {PROMPT_LENGTHS[0]}-{PROMPT_LENGTHS[1]} prompt tokens, "
          f"{MAX_NEW_TOKENS} new tokens each (greedy); graphrt backend {args.backend}; median of {rounds} rounds\n")
    print(f"{'arm':16s} {'median s':>9s} {'tokens/s':>9s} {'graphrt x':>10s} {'same tokens':>12s}")
    for name in seconds:
        same = sum(a == b for a, b in zip(tokens[name], base))
        print(f"{name:16s} {statistics.median(seconds[name]):9.3f} {rate[name]:9.0f} "
              f"{rate['graphrt'] / rate[name]:10.2f} {same:>6d}/{NUM_REQUESTS}")
    ok = print_checks({
        f"graphrt >= {TARGET}x generate in tokens/s ({rate['graphrt'] / rate['generate']:.2f}x)":
            rate["graphrt"] >= TARGET * rate["generate"],
        "generate's tokens are graphrt's": tokens["generate"] == base,
    })
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
