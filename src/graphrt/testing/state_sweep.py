"""The state-isolation sweep: thousands of drawn steps on tiny hybrid models, one command.

``python -m graphrt.testing.state_sweep --steps 10000`` draws seeded steps for tiny random Mamba2,
Granite-4-H, Qwen3-Next, Jamba, Mamba, Falcon-Mamba, LFM2, RecurrentGemma and MiniMax checkpoints (``--archs``: some of
them)
and checks each with
:func:`~graphrt.testing.properties.state_writes_confined` (or ``--property state_isolated``, about
7 runs a step). Draws span FULL, PIECEWISE and eager modes, XLA, speculative ``1 + k`` steps and
restarts; one line per configuration, exit status 1 on any violation. docs/hybrid.md has figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

_MAMBA1: dict[str, Any] = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, state_size=8, conv_kernel=4,
                               expand=2, time_step_rank=8, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                               tie_word_embeddings=False)
#: Tiny hybrid configs (transformers' own field names): Mamba2 only; Granite-4-H (Mamba2 +
#: attention, shared MLP + experts); Qwen3-Next (gated delta nets + gated attention). Chunks
#: of 4 tokens, so a prefill of a few tokens crosses several SSD / delta-rule chunks.
HYBRID_CONFIGS: dict[str, dict[str, Any]] = {
    "mamba2": dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16,
                   n_groups=2, chunk_size=4, conv_kernel=4, expand=2, bos_token_id=1, eos_token_id=2,
                   pad_token_id=0, tie_word_embeddings=False),
    "granite": dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2,
                    layer_types=["linear_attention", "full_attention", "linear_attention"],
                    mamba_n_heads=4, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=4, mamba_expand=2,
                    mamba_d_conv=4, shared_intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                    position_embedding_type="rope", embedding_multiplier=2.0, residual_multiplier=0.5,
                    logits_scaling=3.0, attention_multiplier=0.2, max_position_embeddings=256,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False),
    "qwen3_next": dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       layer_types=["linear_attention", "full_attention"],
                       linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=1,
                       mlp_only_layers=[], partial_rotary_factor=0.25, max_position_embeddings=256,
                       linear_chunk_size=4, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                       tie_word_embeddings=False),
    # Mamba1 (selective scan): Mamba, Falcon-Mamba (RMS-normed dt, B, C) and Jamba (Mamba1 layers 0
    # and 2, attention at 1 with experts), all through the Transformers backend
    "mamba": dict(_MAMBA1),
    "falcon_mamba": dict(_MAMBA1, mixer_rms_eps=1e-6),
    "jamba": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, attn_layer_period=3, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
                  mamba_expand=2, mamba_dt_rank=8, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False),
    # LFM2: gated short convolutions (layers 0 and 2) beside attention, biased projections
    "lfm2": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3,
                 conv_bias=True, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                 tie_word_embeddings=False),
    # RecurrentGemma: RG-LRU blocks (layers 0 and 2, lru_width 48 != hidden) beside local attention of
    # a window of 6 (shorter than the prompts), half-rotary, logits soft-capped
    "recurrent_gemma": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, lru_width=48,
                            attention_window_size=6, conv1d_width=4, logits_soft_cap=30.0,
                            block_types=["recurrent", "attention", "recurrent"], bos_token_id=1, eos_token_id=2,
                            pad_token_id=0, tie_word_embeddings=False),
    # MiniMax: lightning (linear) attention at layers 0 and 2 beside full attention, experts in every
    # layer; transformers' blocks of 4 tokens, so its own prefill crosses several
    "minimax": dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16,
                    layer_types=["linear_attention", "full_attention", "linear_attention"], block_size=4,
                    num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=1,
                    eos_token_id=2, pad_token_id=0, tie_word_embeddings=False),
}
#: transformers' config class of each.
HYBRID_CONFIG_CLASSES = {"mamba2": "Mamba2Config", "granite": "GraniteMoeHybridConfig",
                         "qwen3_next": "Qwen3NextConfig", "mamba": "MambaConfig", "falcon_mamba": "FalconMambaConfig",
                         "jamba": "JambaConfig", "lfm2": "Lfm2Config",
                         "recurrent_gemma": "RecurrentGemmaConfig", "minimax": "MiniMaxConfig"}

#: (model, backend, graph mode, speculative tokens) and its share of the draws;
#: FULL_AND_PIECEWISE breaks mixed steps at the recurrent layers.
SWEEP: tuple[tuple[str, str, str, int, int], ...] = (
    ("granite", "cpu", "FULL", 0, 3), ("granite", "cpu", "FULL", 2, 3),
    ("granite", "cpu", "FULL_AND_PIECEWISE", 0, 3), ("mamba2", "cpu", "FULL", 0, 2),
    ("mamba2", "cpu", "FULL_AND_PIECEWISE", 2, 3), ("qwen3_next", "cpu", "FULL", 1, 3),
    ("qwen3_next", "cpu", "FULL_AND_PIECEWISE", 0, 3), ("granite", "eager", "NONE", 1, 1),
    ("granite", "xla", "FULL", 1, 1), ("mamba2", "xla", "FULL", 0, 1),
    # Mamba1 through the Transformers backend (selective scan; Jamba with attention and experts)
    ("jamba", "cpu", "FULL", 1, 2), ("jamba", "cpu", "FULL_AND_PIECEWISE", 0, 2),
    ("mamba", "cpu", "FULL_AND_PIECEWISE", 2, 2), ("falcon_mamba", "cpu", "FULL", 0, 1),
    # LFM2's short convolutions through the Transformers backend
    ("lfm2", "cpu", "FULL", 1, 2), ("lfm2", "cpu", "FULL_AND_PIECEWISE", 0, 2),
    # RecurrentGemma's RG-LRU blocks through the Transformers backend
    ("recurrent_gemma", "cpu", "FULL", 1, 2), ("recurrent_gemma", "cpu", "FULL_AND_PIECEWISE", 0, 2),
    # MiniMax's lightning attention through the Transformers backend
    ("minimax", "cpu", "FULL", 1, 2), ("minimax", "cpu", "FULL_AND_PIECEWISE", 0, 2),
)
#: XLA's token x batch-size grid for the sweep (every bucket is compiled at warm-up).
XLA_GRID: dict[str, Any] = dict(precompile_token_paddings=[16, 32], precompile_bs_paddings=[4])
#: Graph backends' capture sizes: few, so that most drawn steps are padded (and warm-up is short).
CAPTURE_SIZES: list[int] = [2, 8, 32]
#: Steps between two progress lines of a configuration.
PROGRESS_EVERY = 250


def hybrid_hf_config(arch: str, **overrides: Any) -> Any:
    """The transformers config of the tiny ``arch`` model (:data:`HYBRID_CONFIGS`)."""
    import transformers

    return getattr(transformers, HYBRID_CONFIG_CLASSES[arch])(**{**HYBRID_CONFIGS[arch], **overrides})


@functools.lru_cache(maxsize=None)
def _checkpoint(arch: str, seed: int, overrides_json: str) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from graphrt.testing.random_weights import saved_random_model

    config = hybrid_hf_config(arch, **json.loads(overrides_json))
    return saved_random_model(lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32),
                              f"{arch}-seed{seed}-", seed)


def hybrid_checkpoint(arch: str, *, seed: int = 0, **overrides: Any) -> Path:
    """A checkpoint directory of the tiny ``arch`` hybrid model with seeded random weights, built
    once per process per arguments (read-only)."""
    return _checkpoint(arch, seed, json.dumps(overrides, sort_keys=True))


@dataclass
class SweepLine:
    """One configuration's draws."""

    config: tuple[str, str, str, int]
    steps: int = 0
    seconds: float = 0.0
    kinds: Counter = field(default_factory=Counter)
    violation: str | None = None

    def line(self) -> str:
        """``PASS granite cpu FULL k=2  1305 steps  275.8 s  (FULL mixed 1305, ...)``."""
        arch, backend, mode, k = self.config
        kinds = ", ".join(f"{n} {name}" for name, n in sorted(self.kinds.items()))
        status = "PASS" if self.violation is None else "FAIL"
        text = f"{status} {arch:<10} {backend:<5} {mode:<18} k={k}  {self.steps:>6} steps {self.seconds:>7.1f} s  ({kinds})"
        return text if self.violation is None else f"{text}\n  {self.violation}"


def classify(runner: Any, step: Any) -> list[str]:
    """The kinds of a step just run: graph mode and decode / mixed, ``K+1`` (a verification step),
    ``padded``, ``restart`` (a request at position 0 in a slot: preempted or new)."""
    info = runner.last_step
    mode = info.mode.value
    out = [f"{mode} {'decode' if info.key.uniform_decode else 'mixed'}" if mode == "FULL" else mode]
    q = runner.config.decode_query_len
    if q > 1 and bool((step.num_scheduled_tokens == q).all()):
        out.append("K+1")
    if info.key.num_tokens > step.num_tokens or (info.key.num_reqs or step.num_reqs) > step.num_reqs:
        out.append("padded")
    if (step.num_computed_tokens == 0).any():
        out.append("restart")
    return out


def factory_for(arch: str, backend: str, mode: str, k: int) -> Any:
    """The kit's runner factory of one sweep configuration."""
    from graphrt.testing.runners import RunnerFactory

    model = str(hybrid_checkpoint(arch))
    if backend == "xla":
        return RunnerFactory(model, backend, num_speculative_tokens=k, **XLA_GRID)
    return RunnerFactory(model, backend, mode=mode, num_speculative_tokens=k, cudagraph_capture_sizes=CAPTURE_SIZES)


def sweep_config(config: tuple[str, str, str, int], steps: int, *, seed: int = 0,
                 check: Callable[[Any, Any], None] | None = None,
                 progress: Callable[[str], None] | None = None, shrink: bool = True) -> SweepLine:
    """``steps`` drawn steps of one configuration checked by ``check`` (default
    ``state_writes_confined``); the first violation is shrunk (unless ``shrink=False``) and ends
    the draws. ``progress`` gets a line every :data:`PROGRESS_EVERY` steps."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hypothesis_seed

    from hypothesis.errors import Flaky

    from graphrt.testing.conformance import failure_text, kit_threads, strategy_for
    from graphrt.testing.properties import state_writes_confined

    prop = check or state_writes_confined
    result = SweepLine(config)
    start = time.perf_counter()
    factory = factory_for(*config)
    runner = factory()
    failing: list[Any] = []

    @hypothesis_seed(seed)
    @settings(max_examples=steps, deadline=None, database=None, verbosity=Verbosity.quiet,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False, print_blob=False,
              phases=(Phase.generate, Phase.shrink) if shrink else (Phase.generate,))
    @given(strategy_for("step", factory))
    def draw(step: Any) -> None:
        try:
            prop(factory, step)
        except BaseException:
            failing[:] = [step]
            raise
        if not failing:
            result.steps += 1
            result.kinds.update(classify(runner, step))
            if progress is not None and result.steps % PROGRESS_EVERY == 0:
                result.seconds = time.perf_counter() - start
                progress(f"  ... {result.line()}")

    with kit_threads(factory, 1):
        try:
            draw()
        except (AssertionError, Flaky) as exc:       # a flaky example: a line naming the cause, no traceback
            result.violation = f"{failure_text(exc).strip()}\n  counterexample: {failing[0]!r}"
    result.seconds = time.perf_counter() - start
    return result


def run_sweep(total: int, *, seed: int = 0, report: Callable[[str], None] | None = print,
              configs: Sequence[tuple[str, str, str, int, int]] = SWEEP,
              check: Callable[[Any, Any], None] | None = None) -> list[SweepLine]:
    """At least ``total`` drawn steps over ``configs`` (each its share), one line each."""
    shares = sum(c[-1] for c in configs)
    lines = []
    for i, (*config, share) in enumerate(configs):
        line = sweep_config(tuple(config), max(1, -(-total * share // shares)), seed=seed + i, check=check,
                            progress=report)
        lines.append(line)
        if report is not None:
            report(line.line())
    return lines


def totals(lines: Sequence[SweepLine]) -> str:
    """``10003 steps, 0 violations, 1234.5 s (FULL decode 2345, ...)``."""
    kinds: Counter = Counter()
    for line in lines:
        kinds.update(line.kinds)
    bad = sum(line.violation is not None for line in lines)
    return (f"{sum(x.steps for x in lines)} steps, {bad} violations, {sum(x.seconds for x in lines):.1f} s  ("
            + ", ".join(f"{name} {n}" for name, n in sorted(kinds.items())) + ")")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m graphrt.testing.state_sweep [--steps N] [--seed S]``: 0 if no violation."""
    parser = argparse.ArgumentParser(prog="python -m graphrt.testing.state_sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10_000, help="drawn steps in all (default 10000)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed of the first configuration")
    parser.add_argument("--archs", nargs="+", choices=sorted(HYBRID_CONFIGS),
                        help="only the configurations of these models (default: every one)")
    parser.add_argument("--property", choices=("state_writes_confined", "state_isolated"), default="state_writes_confined",
                        help="the check of each step: one run with NaN in unread entries (default), or the "
                             "whole state_isolated (about 7 runs a step)")
    args = parser.parse_args(argv)
    from graphrt.testing import properties

    configs = [c for c in SWEEP if args.archs is None or c[0] in args.archs]
    print(f"state sweep: {args.steps} drawn steps over {len(configs)} configurations, {args.property} on each",
          flush=True)
    from graphrt.testing.conformance import private_hypothesis_storage

    with private_hypothesis_storage():            # no .hypothesis/ in the current directory
        lines = run_sweep(args.steps, seed=args.seed, report=lambda s: print(s, flush=True),
                          check=getattr(properties, args.property), configs=configs)
    print(totals(lines))
    return 0 if all(x.violation is None for x in lines) else 1


__all__ = ["HYBRID_CONFIGS", "SWEEP", "SweepLine", "classify", "hybrid_checkpoint", "hybrid_hf_config",
           "run_sweep", "sweep_config", "totals"]


if __name__ == "__main__":
    raise SystemExit(main())
