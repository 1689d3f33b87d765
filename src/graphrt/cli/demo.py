"""``graphrt demo``: a tiny model through graphrt.LLM step by step, and the engine's flags
(``--plot FILE.png`` draws the warm-up report: :mod:`graphrt.cli.plots`).

``add_engine_args`` / ``engine_kwargs`` are graphrt.LLM's scheduling flags for any parser
(re-exported by :mod:`graphrt.cli`).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from graphrt.cli.usage import EXIT_OK, usage_error
from graphrt.config import add_cli_args, from_cli_args
from graphrt.core.errors import ConfigError, GraphrtError
from graphrt.cli.plots import check_path, plot_warmup, require_matplotlib
from graphrt.cli import multinode
from graphrt.engine.launch import add_launch_args, launch_requested


def demo_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``graphrt demo``."""
    parser.add_argument("--backend", default="auto", help="cuda, npu, xla, cpu, eager or auto")
    parser.add_argument("--model-dir", default=None,
                        help="a Hugging Face directory (default: a random tiny Qwen3 written to a temp dir)")
    parser.add_argument("--arch", default="qwen3", choices=["qwen3", "llama"])
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="> 1: generate through that many engine processes (graphrt.DataParallelLLM)")
    parser.add_argument("--load-balance-method", default="round_robin", choices=["round_robin", "shortest_queue"])
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also draw the warm-up report (capture time and bytes per key) to this file "
                             "(needs graphrt[plot]: matplotlib)")
    add_cli_args(parser)
    add_engine_args(parser)
    add_launch_args(parser)


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """graphrt.LLM's scheduling flags (vLLM's and SGLang's names); ``engine_kwargs`` reads them."""
    from graphrt.core import defaults
    from graphrt.engine.schedule_policy import POLICIES
    from graphrt.engine.watchdog import ACTIONS

    group = parser.add_argument_group("engine")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=defaults.DEFAULT_ENABLE_PREFIX_CACHING,
                       help="share the KV of cached full-block prompt prefixes between requests")
    group.add_argument("--schedule-policy", choices=POLICIES, default=defaults.DEFAULT_SCHEDULE_POLICY,
                       help="order in which waiting requests are admitted")
    group.add_argument("--schedule-conservativeness", type=float,
                       default=defaults.DEFAULT_SCHEDULE_CONSERVATIVENESS,
                       help="> 0: admit only while estimated KV (input + clipped max_tokens) fits")
    group.add_argument("--decode-log-interval", type=int, default=defaults.DEFAULT_DECODE_LOG_INTERVAL,
                       help="log a 'Decode batch.' line every this many decode steps")
    group.add_argument("--watchdog-timeout", type=float, default=defaults.DEFAULT_WATCHDOG_TIMEOUT,
                       help="fail a forward still running after this many seconds (0: no watchdog)")
    group.add_argument("--watchdog-action", choices=ACTIONS, default=defaults.DEFAULT_WATCHDOG_ACTION,
                       help="after logging every thread's stack: raise in the engine, or kill the process")
    group.add_argument("--disable-overlap-schedule", action="store_true",
                       default=defaults.DEFAULT_DISABLE_OVERLAP_SCHEDULE,
                       help="wait for each step's tokens before scheduling the next (xla, cuda and npu overlap by default)")
    return parser


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The graphrt.LLM keywords of the flags ``add_engine_args`` added."""
    return {"enable_prefix_caching": args.enable_prefix_caching, "schedule_policy": args.schedule_policy,
            "schedule_conservativeness": args.schedule_conservativeness,
            "decode_log_interval": args.decode_log_interval,
            "watchdog_timeout": args.watchdog_timeout, "watchdog_action": args.watchdog_action,
            "disable_overlap_schedule": args.disable_overlap_schedule}


def demo_run(args: argparse.Namespace) -> int:
    """``graphrt demo``: a few generated steps on a tiny model, with what each step ran as."""
    import logging
    import tempfile

    import graphrt
    from graphrt.models.random_checkpoint import write_random_checkpoint
    from graphrt.registry import canonical_name

    try:                                 # every flag checked before any output or loading
        if args.num_prompts < 1:
            raise ConfigError(f"--num-prompts must be >= 1, got {args.num_prompts}")
        if args.data_parallel_size < 1:
            raise ConfigError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
        if args.backend != "auto":
            canonical_name(args.backend)     # an unknown name: ValueError listing the valid ones
        params = graphrt.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                        ignore_eos=True, seed=args.seed if args.temperature > 0 else None)
        if args.plot:                    # before loading anything: a missing matplotlib fails fast
            if args.data_parallel_size > 1:
                raise ConfigError("--plot: the warm-up report is per engine; not with --data-parallel-size > 1")
            require_matplotlib()
            check_path(args.plot)
        world = multinode.start(args) if launch_requested(args) else None   # the process group
    except (GraphrtError, ValueError) as e:
        return usage_error("demo", e)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if world is not None:
        if world.rank != 0:
            return multinode.follow(args)
        try:
            return _demo_on(args, args.model_dir, params)
        finally:
            multinode.finish(args)
    print("backends:")
    for name, reason in graphrt.available_backends().items():
        print(f"  {name:<6} {'available' if reason is None else reason}")
    # The random checkpoint lives only as long as the demo: each run used to leave its weights in /tmp.
    with tempfile.TemporaryDirectory(prefix="graphrt-demo-") as scratch:
        model_dir = args.model_dir or str(write_random_checkpoint(scratch, args.arch, seed=args.seed))
        return _demo_on(args, model_dir, params)


def _demo_on(args: argparse.Namespace, model_dir: str, params: Any) -> int:
    """The demo's engine on ``model_dir``: built from the flags, run, its steps printed."""
    import graphrt

    try:
        demo_defaults = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 256}
        if args.cudagraph_capture_sizes is None and args.max_cudagraph_capture_size is None:
            # Capture up to the token budget so prefill steps show graphs too.
            demo_defaults["max_cudagraph_capture_size"] = (args.max_num_batched_tokens
                                                           or demo_defaults["max_num_batched_tokens"])
        config = from_cli_args(args, **{k: v for k, v in demo_defaults.items()
                                        if getattr(args, k, None) is None})
    except ConfigError as e:
        return usage_error("demo", e)
    if args.data_parallel_size > 1:
        return _demo_data_parallel(args, model_dir, config)
    try:                                 # a model directory, backend or engine flag it refuses
        llm = graphrt.LLM(model_dir, backend=args.backend, config=config, progress=True, **engine_kwargs(args))
    except (GraphrtError, ValueError) as e:
        return usage_error("demo", e)
    runner = llm.runner
    print(f"\nmodel {model_dir}\nbackend {runner.backend.name}, graph mode {runner.mode.value}, "
          f"{runner.num_kv_blocks} KV blocks of {config.block_size} tokens")
    print(f"\nwarm-up: {len(runner.warmup_report)} entries, largest first")
    print(f"  {'key':<44} {'seconds':>8} {'KiB':>9}")
    for row in runner.warmup_report:
        print(f"  {row['key']:<44} {row['seconds']:>8.3f} {row['bytes'] / 1024:>9.1f}")
    if args.plot:
        report = runner.warmup_report
        title = (f"graphrt demo: {runner.backend.name} warm-up, graph mode {runner.mode.value}, {len(report)} entries, "
                 f"{sum(r['seconds'] for r in report):.2f} s, {sum(r['bytes'] for r in report) / 2**20:.1f} MiB")
        print(f"  plot: {plot_warmup(report, args.plot, title)}")
    rng = np.random.default_rng(args.seed)
    vocab = runner.vocab_size
    lengths = rng.integers(1, config.max_num_batched_tokens * 2, args.num_prompts)
    for n in lengths:
        llm.add_request(rng.integers(0, vocab, int(n)).tolist(), params)
    print(f"\n{args.num_prompts} prompts of {lengths.min()}..{lengths.max()} tokens, "
          f"{args.max_tokens} new tokens each\n")
    print(f"  {'step':>4} {'reqs':>4} {'tokens':>6} {'mode':<9} {'padded key':<36} {'ms':>7}  eager because")
    step = 0
    while llm.has_unfinished():
        llm.step()
        info = runner.last_step
        print(f"  {step:>4} {info.num_reqs:>4} {info.num_tokens:>6} {info.mode.value:<9} "
              f"{str(info.key):<36} {info.seconds * 1e3:>7.2f}  {info.eager_reason or ''}")
        step += 1
    stats = llm.stats
    print("\nstatistics:")
    for k in ("hits", "misses", "entries", "eager_steps", "eager_tokens", "real_tokens", "padded_tokens",
              "padding_waste", "build_seconds", "build_bytes", "preemptions"):
        print(f"  {k:<14} {stats[k]}")
    print("  eager by cause (steps / tokens):")
    for cause, n in stats["eager_by_cause"].items():
        print(f"    {cause:<22} {n['steps']:>5} / {n['tokens']}")
    print(f"  {runner.stats.summary()}")
    print(f"  {runner.graph_memory.summary()}")
    llm.close()                 # tensor parallel: the other ranks return
    return EXIT_OK


def _demo_data_parallel(args: argparse.Namespace, model_dir: str, config: Any) -> int:
    """The demo's prompts through ``data_parallel_size`` engine processes: who served what."""
    import graphrt

    rng = np.random.default_rng(args.seed)
    params = graphrt.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True)
    try:
        dp = graphrt.DataParallelLLM(model_dir, data_parallel_size=args.data_parallel_size,
                                     load_balance_method=args.load_balance_method, backend=args.backend,
                                     config=config, **engine_kwargs(args))
    except (GraphrtError, ValueError) as e:
        return usage_error("demo", e)
    with dp:
        prompts = [rng.integers(0, 100, int(n)).tolist() for n in rng.integers(1, 64, args.num_prompts)]
        t0 = time.perf_counter()
        outs = dp.generate(prompts, params)
        seconds = time.perf_counter() - t0
        print(f"\n{len(outs)} prompts answered in order in {seconds:.2f} s by {args.data_parallel_size} "
              f"engines ({args.load_balance_method}):")
        for w in dp.stats["workers"]:
            print(f"  rank {w['rank']} pid {w['pid']}: {w['requests']} requests, "
                  f"{w['engine']['hits']} graph hits, {w['engine']['eager_steps']} eager steps")
    return EXIT_OK


__all__ = ["add_engine_args", "demo_args", "demo_run", "engine_kwargs"]
