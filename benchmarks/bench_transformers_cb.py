"""transformers' continuous batching on graphrt against its own eager run and its own graph path
(issue 40).

Two tiny random Llamas built offline from their config class -- ``tiny`` (2 layers, 64 wide,
vocabulary 128: a step costs mostly host overhead) and ``small`` (4 layers, 256 wide, vocabulary
2048: on a CPU a step costs mostly its attention over the cache) -- and 16 greedy requests of 16
to 96 prompt tokens, 32 new tokens each, served by transformers' ``ContinuousBatchingManager``
four ways in one process, each arm its own model and persistent manager:

* ``eager CB``: transformers as it is on a CPU (no accelerator graph: every step eager);
* ``CB on graphrt``: ``graphrt.integrations.transformers_cb.enable(model, backend="cpu")`` --
  the same manager, each step padded to a graphrt key (graphrt's token buckets x context
  buckets: every 256 cache tokens, 32 of them, then doubling) and replayed from graphrt's
  recording graph, each key captured on first use;
* ``CB on graphrt, doubling contexts``: the same with ``context_buckets`` 256 doubling (those of
  graphrt's own runner): fewer keys, more attention over padding;
* ``CB own graphs -> recording graph``: transformers' own graph path, its five accelerator-graph
  functions pointed at graphrt's recording graph (the issue's experiment): its coarse padding
  intervals (queries to multiples of 64 tokens, cache reads to multiples of 16384 tokens, capped
  at the whole cache), its keys, its capture on first use.

A round submits the 16 requests to the running manager and waits for the last result; tokens/s is
generated tokens over the round's wall time, the median of the rounds (interleaved arms; one
untimed round first captures the graphs); tokens/cpu-s the same over the CPU time of the
manager's generation thread, which a loaded machine inflates less. ``generate_batch`` adds the same start and stop to
every arm (about 1.5 s here, most of it transformers' ``gc.collect`` at stop), so rounds run on
a started manager. Agreement: requests whose tokens equal the eager run's. Target (issue 40):
CB on graphrt >= eager CB in tokens/s, the same tokens.

Run: ``python benchmarks/bench_transformers_cb.py [--model tiny|small|both] [--rounds N] [--quick] [--threads T]``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
import warnings
from typing import Any, Iterator

from bench_common import cpu_line, print_checks

NUM_REQUESTS = 16
PROMPT_LENGTHS = (16, 96)          # drawn uniformly in this range
MAX_NEW_TOKENS = 32
COMMON = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
MODELS = {"tiny": dict(COMMON, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16),
          "small": dict(COMMON, vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                        head_dim=64)}
#: transformers' paged cache for this workload (16 requests of at most 128 tokens) and its step budget.
CB = dict(page_size=32, num_blocks=96, max_batch_tokens=256, max_requests_per_batch=NUM_REQUESTS)


#: The smallest context bucket of the ``doubling contexts`` arm.
CONTEXT_START = 256


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = rng.integers(PROMPT_LENGTHS[0], PROMPT_LENGTHS[1] + 1, NUM_REQUESTS)
    return [rng.integers(3, vocab, int(n)).tolist() for n in lengths]


def build_model(sizes: dict) -> Any:
    """A tiny Llama, random seeded weights with O(1) logits, eager attention (paged on CB)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from graphrt.testing.random_weights import randomize

    torch.manual_seed(0)
    config = LlamaConfig(**sizes)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)
    randomize(model, 0)
    return model.eval()


@contextlib.contextmanager
def own_graphs_on_recording_graph() -> Iterator[None]:
    """transformers' accelerator-graph API pointed at graphrt's recording graph: the decision in
    ``decide_use_cuda_graphs`` (its graph-name probe) and the four functions its runner calls."""
    from transformers.generation.continuous_batching import initialization, model_runner

    from graphrt.backends.torch import recording_graph as rg

    replaced = {
        (initialization, "get_accelerator_graph_name"): lambda: "RecordingGraph",
        (model_runner, "create_accelerator_graph"): rg.RecordingGraph,
        (model_runner, "accelerator_graph_capture_context"):
            lambda graph, stream, pool: rg.recording_graph(graph, pool),
        (model_runner, "get_memory_pools"): lambda: (None, rg.graph_pool_handle()),
        (model_runner, "memory_pool_context"): lambda pool: contextlib.nullcontext(),
    }
    saved = {key: getattr(*key) for key in replaced}
    for (module, name), value in replaced.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


class Arm:
    """One model and its started, persistent continuous-batching manager."""

    def __init__(self, name: str, sizes: dict, graphrt_options: dict | None, own_graphs: bool) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        from graphrt.integrations import transformers_cb

        self.name, self.own_graphs, self.on_graphrt = name, own_graphs, graphrt_options is not None
        self.model = build_model(sizes)
        if graphrt_options is not None:
            transformers_cb.enable(self.model, backend="cpu", **graphrt_options)
        config = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=-1,
                                  pad_token_id=sizes["pad_token_id"])
        cb = ContinuousBatchingConfig(**CB, use_cuda_graph=own_graphs)
        self.manager = self.model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
        start = time.perf_counter()
        self.manager.warmup()
        self.manager.start()
        self.warmup_s = time.perf_counter() - start

    def thread_cpu_s(self) -> float:
        """CPU seconds the manager's generation thread has used: unlike wall time, not inflated
        while other processes of a shared machine hold the cores."""
        return time.clock_gettime(time.pthread_getcpuclockid(self.manager._generation_thread.ident))

    def __call__(self, batch: list[list[int]]) -> list[list[int]]:
        ids = self.manager.add_requests(inputs=batch, max_new_tokens=MAX_NEW_TOKENS)
        done: dict[str, list[int]] = {}
        while len(done) < len(ids):
            result = self.manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError(f"{self.name}: no result within 60 s")
            if result.is_finished():
                done[result.request_id] = list(result.generated_tokens)
        return [done[i] for i in ids]

    def graph_line(self) -> str:
        """Graphs captured, steps that replayed one, padding: from graphrt's statistics, or from
        transformers' graph buffer for its own path."""
        if self.own_graphs:
            graphs = self.manager.batch_processor.inputs_and_outputs.graphs._storage
            return f"{len(graphs)} graphs (its keys)"
        from graphrt.integrations import transformers_cb

        if not self.on_graphrt:
            return "no graph"
        s, reads = transformers_cb.stats(self.model), transformers_cb.runner_of(self.model).reads
        return (f"{s.entries} graphs, {s.hits}/{s.steps} steps replayed, padding {100 * s.padding_waste:.0f}% "
                f"of tokens, {100 * reads.padding_waste:.0f}% of cache reads")

    def close(self) -> None:
        self.manager.stop(block=True)
        self.manager.destroy()


def run(model: str, rounds: int) -> dict[str, Any]:
    """The four arms on ``model``, interleaved: tokens, warm-up, first and timed rounds, graphs."""
    sizes = MODELS[model]
    batch = prompts(sizes["vocab_size"])
    top = CB["page_size"] * CB["num_blocks"]
    doubling = [CONTEXT_START << k for k in range(top.bit_length()) if CONTEXT_START << k < top]
    with own_graphs_on_recording_graph():
        arms = [Arm("eager CB", sizes, None, False), Arm("CB on graphrt", sizes, {}, False),
                Arm("CB on graphrt, doubling contexts", sizes, {"context_buckets": doubling}, False),
                Arm("CB own graphs -> recording graph", sizes, None, True)]
        try:
            tokens, first, seconds, cpu = {}, {}, {a.name: [] for a in arms}, {a.name: [] for a in arms}
            for arm in arms:                          # untimed: captures each arm's graphs
                start = time.perf_counter()
                tokens[arm.name] = arm(batch)
                first[arm.name] = time.perf_counter() - start
            for _ in range(rounds):
                for arm in arms:
                    start, start_cpu = time.perf_counter(), arm.thread_cpu_s()
                    got = arm(batch)
                    seconds[arm.name].append(time.perf_counter() - start)
                    cpu[arm.name].append(arm.thread_cpu_s() - start_cpu)
                    assert got == tokens[arm.name], f"{arm.name} is not deterministic"
            return {"tokens": tokens, "first": first, "seconds": seconds, "cpu": cpu,
                    "graphs": {a.name: a.graph_line() for a in arms}, "warmup": {a.name: a.warmup_s for a in arms}}
        finally:
            for arm in arms:
                arm.close()


def report(model: str, result: dict[str, Any], rounds: int) -> dict[str, bool]:
    """The table of one model and its checks."""
    sizes, seconds, tokens = MODELS[model], result["seconds"], result["tokens"]
    generated = NUM_REQUESTS * MAX_NEW_TOKENS
    base = tokens["eager CB"]
    rate = {name: generated / statistics.median(s) for name, s in seconds.items()}
    cpu_rate = {name: generated / statistics.median(s) for name, s in result["cpu"].items()}
    print(f"\nmodel {model}: Llama, {sizes['num_hidden_layers']} layers, {sizes['hidden_size']} wide, vocab "
          f"{sizes['vocab_size']}, paged eager attention; {NUM_REQUESTS} requests of {PROMPT_LENGTHS[0]}-"
          f"{PROMPT_LENGTHS[1]} prompt tokens, {MAX_NEW_TOKENS} new tokens each (greedy); cache {CB}; "
          f"median of {rounds} rounds")
    print(f"{'arm':34s} {'warm-up s':>9s} {'1st round s':>11s} {'median s':>9s} {'tokens/s':>9s} "
          f"{'x eager':>8s} {'tokens/cpu-s':>12s} {'x eager':>8s} {'same tokens':>12s}  graphs")
    for name in seconds:
        same = sum(a == b for a, b in zip(tokens[name], base))
        print(f"{name:34s} {result['warmup'][name]:9.2f} {result['first'][name]:11.2f} "
              f"{statistics.median(seconds[name]):9.3f} {rate[name]:9.0f} {rate[name] / rate['eager CB']:8.2f} "
              f"{cpu_rate[name]:12.0f} {cpu_rate[name] / cpu_rate['eager CB']:8.2f} "
              f"{same:>7d}/{NUM_REQUESTS}  {result['graphs'][name]}")
    ratio = rate["CB on graphrt"] / rate["eager CB"]
    return {f"{model}: CB on graphrt >= eager CB in tokens/s ({ratio:.2f}x wall, "
            f"{cpu_rate['CB on graphrt'] / cpu_rate['eager CB']:.2f}x per CPU second)": ratio >= 1.0,
            f"{model}: every arm's tokens are the eager run's": all(t == base for t in tokens.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="both", choices=[*MODELS, "both"])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (median reported)")
    parser.add_argument("--quick", action="store_true", help="2 rounds")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for every arm (default 1: on a shared VM a two-thread pool waits "
                             "milliseconds per op for a descheduled peer, which swamps a tiny model)")
    args = parser.parse_args()
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(args.threads)
    rounds = 2 if args.quick else args.rounds
    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    print(f"transformers' continuous batching on graphrt: {cpu_line()}; torch {torch.__version__}, "
          f"transformers {transformers.__version__}; torch threads {torch.get_num_threads()}")
    checks: dict[str, bool] = {}
    for model in (MODELS if args.model == "both" else [args.model]):
        checks.update(report(model, run(model, rounds), rounds))
    return 0 if print_checks(checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
