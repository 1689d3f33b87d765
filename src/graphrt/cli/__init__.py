"""``graphrt`` command line: ``graphrt <subcommand> [flags]`` (also ``python -m graphrt.cli``).

Every subcommand is one entry of :data:`SUBCOMMANDS` (help line, flag adder, runner returning
the exit status: 0 done, 1 findings, 2 a usage error said in one line on stderr,
:mod:`graphrt.cli.usage`): ``plan``, ``bench``, ``demo``, ``conformance``, ``lint``. To add
one, write those two functions and add the entry.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np

from graphrt.backends.xla.buckets import XlaBuckets
from graphrt.core.buckets import BucketPolicy
from graphrt.config import GraphConfig, add_cli_args, from_cli_args
from graphrt.core.errors import BackendUnavailableError, ConfigError
from graphrt.cli.demo import demo_args, demo_run, add_engine_args, engine_kwargs
from graphrt.cli.lint import lint_args, lint_run
from graphrt.cli.usage import EXIT_FINDINGS, EXIT_OK, UsageError, run_user_code, usage_error
from graphrt.cli.plots import PolicyWaste, check_path, plot_plan, require_matplotlib


class Subcommand(NamedTuple):
    """One ``graphrt`` subcommand."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---------------------------------------------------------------------------------------- plan

def decode_trace(max_num_seqs: int, num_steps: int, seed: int) -> np.ndarray:
    """Decode batch sizes of a synthetic serving run, one per step: a ramp up, then steady
    levels (three lower quarters of ``max_num_seqs`` and saturation, jittered) joined by ramps.
    Seeded, so every run compares policies on the same trace."""
    rng = np.random.default_rng(seed)
    bands = np.linspace(1, max_num_seqs, 5).round().astype(np.int64)
    levels = [int(rng.integers(lo, hi + 1)) for lo, hi in zip(bands[:-2], bands[1:-1])]
    levels.append(max_num_seqs)
    level = int(rng.choice(levels))
    parts = [np.round(np.linspace(1, level, int(rng.integers(50, 200)))).astype(np.int64)]
    total = parts[0].shape[0]
    while total < num_steps:
        length = int(rng.integers(50, 400))
        if rng.random() < 0.6:
            jitter = max(1, level // 50)
            part = level + rng.integers(-jitter, jitter + 1, size=length)
        else:
            target = int(rng.choice(levels))
            part = np.round(np.linspace(level, target, length)).astype(np.int64)
            level = target
        parts.append(part)
        total += length
    return np.clip(np.concatenate(parts)[:num_steps], 1, max_num_seqs)


def _histogram(trace: np.ndarray) -> dict[int, int]:
    sizes, counts = np.unique(trace, return_counts=True)
    return {int(s): int(c) for s, c in zip(sizes, counts)}


def _sizes_preview(policy: BucketPolicy, head: int = 5, tail: int = 3) -> str:
    sizes = policy.sizes
    if len(sizes) <= head + tail:
        return " ".join(map(str, sizes))
    return f"{' '.join(map(str, sizes[:head]))} ... {' '.join(map(str, sizes[-tail:]))}"


def plan_policies(config: GraphConfig, counts: dict[int, int]) -> list[tuple[str, BucketPolicy]]:
    """The compared policies: the engines' defaults up to the capture limit, and exact fits
    (which see only sizes within it, so every policy leaves the same steps eager)."""
    cap = config.capture_policy().max_size
    vllm = BucketPolicy.vllm_default(cap)
    policies = [("vLLM default", vllm), ("SGLang default", BucketPolicy.sglang_default(cap)),
                ("powers of two", BucketPolicy.powers_of_two(cap))]
    within = {n: c for n, c in counts.items() if n <= cap}
    if within:
        for k in dict.fromkeys((len(vllm), 16, 8)):
            policies.append((f"fitted k={k}", BucketPolicy.fit(within, k)))
    return policies


def plan_rows(config: GraphConfig, counts: dict[int, int]) -> list[tuple[PolicyWaste, BucketPolicy]]:
    """Each compared policy's padding of a trace's batch-size histogram ``counts`` (the rows
    of :func:`plan_table` and of ``--plot``'s picture)."""
    real = sum(n * c for n, c in counts.items())
    rows = []
    for name, policy in plan_policies(config, counts):
        padded = policy.padded_total(counts)
        eager = sum(c for n, c in counts.items() if n > policy.max_size)
        rows.append((PolicyWaste(name, tuple(policy.sizes), padded, 100 * (padded - real) / padded, eager), policy))
    return rows


def plan_title(config: GraphConfig, trace: np.ndarray) -> str:
    """The first line of :func:`plan_table`: the trace and the limits."""
    return (f"Bucket plan: synthetic decode trace of {trace.shape[0]} steps, batch sizes "
            f"{int(trace.min())}..{int(trace.max())} (mean {trace.mean():.1f}), {int(trace.sum())} real tokens; "
            f"max_num_seqs={config.max_num_seqs}, max_num_batched_tokens={config.max_num_batched_tokens}")


def plan_table(config: GraphConfig, trace: np.ndarray) -> str:
    """Padding of ``trace`` under each policy, and the config's own capture / XLA sizes."""
    counts = _histogram(trace)
    lines = [plan_title(config, trace),
             "Fitted policies are fitted on this same trace (in-sample), within the capture limit. "
             "Eager steps run unpadded.", ""]
    head = (f"{'policy':<16}{'buckets':>8}{'padded tokens':>15}{'waste %':>9}{'eager steps':>13}"
            f"  sizes")
    lines += [head, "-" * (len(head) + 30)]
    for row, policy in plan_rows(config, counts):
        lines.append(f"{row.name:<16}{len(policy):>8}{row.padded_tokens:>15}{row.waste_percent:>9.2f}"
                     f"{row.eager_steps:>13}  {_sizes_preview(policy)}")
    lines += ["", "GraphConfig for these limits:"]
    xla = XlaBuckets.from_config(config)
    for label, policy in (("capture sizes (graph backends)", config.capture_policy()),
                          ("XLA token paddings", xla.tokens), ("XLA batch-size paddings", xla.batch_sizes)):
        lines.append(f"  {label:<32}{len(policy):>4} sizes: {_sizes_preview(policy, 8, 4)}")
    return "\n".join(lines)


def _plan_args(parser: argparse.ArgumentParser) -> None:
    add_cli_args(parser)
    trace = parser.add_argument_group("trace")
    trace.add_argument("--steps", type=int, default=4000, help="decode steps in the synthetic trace")
    trace.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also draw the padding waste per policy to this file (needs graphrt[plot]: matplotlib)")


def _plan_config(args: argparse.Namespace) -> GraphConfig:
    """The config of ``plan``'s flags, and its other flags checked (ConfigError), before any output:
    no matplotlib, no table either."""
    config = from_cli_args(args)
    if args.steps < 1:
        raise ConfigError("--steps must be >= 1")
    if args.plot:
        require_matplotlib()
        check_path(args.plot)
    return config


def _plan_run(args: argparse.Namespace) -> int:
    try:
        config = _plan_config(args)
    except ConfigError as e:
        return usage_error("plan", e)
    trace = decode_trace(config.max_num_seqs, args.steps, args.seed)
    print(plan_table(config, trace))
    if args.plot:
        counts = _histogram(trace)
        rows = [row for row, _ in plan_rows(config, counts)]
        print(f"\nplot: {plot_plan(rows, counts, args.plot, plan_title(config, trace))}")
    return EXIT_OK


# --------------------------------------------------------------------------------------- bench

#: Benchmark modules of ``benchmarks/`` run by ``graphrt bench``, in order. Each has
#: ``main(argv) -> dict``; a result with ``"all_pass": False`` fails ``--check-targets``.
BENCHMARKS: list[str] = ["bench_inputs", "bench_runner", "bench_xla", "bench_cuda", "bench_attention", "bench_context",
                         "bench_prefix_cache", "bench_overlap", "bench_capture", "bench_step_channel",
                         "bench_tensor_parallel", "bench_sampler", "bench_traffic", "bench_peer", "bench_refit"]


def benchmarks_dir() -> Path:
    """``benchmarks/`` of the source checkout this module lives in (may not exist)."""
    return Path(__file__).resolve().parents[2] / "benchmarks"


def _bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    parser.add_argument("--check-targets", action="store_true",
                        help="exit 1 when a benchmark misses one of its targets")
    _plan_args(parser)


def _bench_run(args: argparse.Namespace) -> int:
    directory = benchmarks_dir()
    missing = [name for name in BENCHMARKS if not (directory / f"{name}.py").is_file()]
    if missing:
        return usage_error("bench", f"benchmark scripts {missing} not found under {directory}; they ship with "
                                    "the source checkout, not the installed package. Run from a clone "
                                    "(pip install -e .) or `make bench`.")
    try:
        _plan_config(args)               # its flags are checked before minutes of benchmarks, not after
    except ConfigError as e:
        return usage_error("bench", e)
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))   # imported by name (not a package), as they import bench_common
    failed = []
    for name in BENCHMARKS:
        print(f"=== {name} ===")
        result = importlib.import_module(name).main(["--quick"] if args.quick else [])
        if isinstance(result, dict) and result.get("all_pass") is False:
            failed.append(name)
        print()
    print("=== plan ===")
    status = _plan_run(args)
    if failed:
        print(f"\nbenchmarks missing a target: {', '.join(failed)}")
    return status or (EXIT_FINDINGS if args.check_targets and failed else EXIT_OK)


# --------------------------------------------------------------------------------- conformance

def _conformance_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="a Hugging Face directory, or module:function returning a fresh model "
                             "that follows docs/models.md")
    parser.add_argument("--backend", default="cpu", help="backend name (cpu, eager, xla, cuda, npu, ...)")
    parser.add_argument("--examples", type=int, default=None,
                        help="examples per property (default: graphrt.testing.conformance.DEFAULT_EXAMPLES)")
    parser.add_argument("--property", dest="properties", action="append", default=None,
                        help="run only this property (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads while it runs (default 1: the kit's steps are small; "
                             "0 leaves them alone)")
    parser.add_argument("--reference", default=None,
                        help="your own step function, file.py:function or module:function: reference(step) -> "
                             "logits [reqs, vocab] or tokens [reqs]; adds the property matches_reference")
    add_cli_args(parser)


def _conformance_run(args: argparse.Namespace) -> int:
    from graphrt.config import GraphConfig
    from graphrt.testing.conformance import (DEFAULT_EXAMPLES, DEFAULT_THREADS, private_hypothesis_storage,
                                             run_conformance, summary)
    from graphrt.testing.loading import load_callable, load_model
    from graphrt.testing.runners import RunnerFactory

    fields = {k: getattr(args, k) for k in GraphConfig.model_fields if getattr(args, k, None) is not None}
    if args.examples is not None and args.examples < 1:
        return usage_error("conformance", f"--examples must be >= 1, got {args.examples}")
    if args.threads is not None and args.threads < 0:
        return usage_error("conformance", f"--threads must be >= 0 (0: as they are), got {args.threads}")
    model = run_user_code(f"loading the model {args.model!r}", lambda: load_model(args.model))
    if callable(model):                  # the kit builds a model per runner: a builder that raises is named
        model = functools.partial(run_user_code, f"the model builder {args.model}", model)
    reference = (run_user_code(f"loading the reference {args.reference!r}",
                               lambda: load_callable(args.reference, "--reference")) if args.reference else None)
    try:
        factory = RunnerFactory(model, args.backend, **fields)
    except ConfigError as e:
        return usage_error("conformance", e)
    examples = DEFAULT_EXAMPLES if args.examples is None else args.examples
    print(f"graphrt conformance: {args.model} on {args.backend}, {examples} examples per property"
          + (f", reference {args.reference}" if reference else ""))
    try:
        with private_hypothesis_storage():        # no .hypothesis/ in the current directory
            results = run_conformance(factory=factory, examples=examples, properties=args.properties, seed=args.seed,
                                      threads=DEFAULT_THREADS if args.threads is None else args.threads,
                                      reference=reference)
    except (ValueError, BackendUnavailableError) as e:
        return usage_error("conformance", e)
    print(summary(results))
    return EXIT_OK if all(r.passed for r in results) else EXIT_FINDINGS


# ---------------------------------------------------------------------------------------- main

SUBCOMMANDS: dict[str, Subcommand] = {
    "plan": Subcommand("compare bucket policies on a synthetic decode trace", _plan_args, _plan_run),
    "bench": Subcommand("run the host-side benchmarks, then print the bucket plan",
                        _bench_args, _bench_run),
    "demo": Subcommand("generate on a small random model and show what graphrt does per step",
                       demo_args, demo_run),
    "conformance": Subcommand("run graphrt.testing's padding and graph conformance properties on a model "
                              "and backend", _conformance_args, _conformance_run),
    "lint": Subcommand("name, per module, what in a model would stop or corrupt a graph capture, with the fix",
                       lint_args, lint_run),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``graphrt`` parser, one sub-parser per entry of :data:`SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(prog="graphrt", description="graphrt command line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, command in SUBCOMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.help, description=command.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit status."""
    args = build_parser().parse_args(argv)
    try:
        return SUBCOMMANDS[args.command].run(args)
    except UsageError as e:              # one line on stderr, exit 2, as argparse's own errors
        return usage_error(args.command, e)


__all__ = ["main", "build_parser", "add_engine_args", "engine_kwargs", "BENCHMARKS"]

