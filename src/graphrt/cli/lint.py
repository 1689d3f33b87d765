"""``graphrt lint MODEL``: one forward of a model under the capture checks, on a CPU, and every
host sync, data-dependent shape and baked host value named under its module, with the fix
(:mod:`graphrt.backends.torch.capture.capture_lint` says what is checked and how).

``MODEL`` is a Hugging Face directory (graphrt's reference model for it; ``--transformers``: the
stock transformers class, as a Transformers-backend model runs) or ``module:function`` /
``file.py:function`` returning a model. A model with ``compute_logits`` (graphrt's model
protocol, docs/models.md) runs one mixed step of two requests through an eager
:class:`~graphrt.ModelRunner` twice, a step of another shape between; any other module is
called as ``model(input_ids=ids[None], use_cache=False)``, likewise. Each finding names the
module, and the file and line that issued the op. Exit status (:mod:`graphrt.cli.usage`): 0 clean, 1 findings, 2 a usage
error, one line on stderr: a spec that does not load, a builder that raises or returns no
``torch.nn.Module``, a directory that does not load, a forward that raises.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from graphrt.cli.usage import EXIT_FINDINGS, EXIT_OK, UsageError, run_user_code

#: The lint's steps: two requests with this many tokens each, their contexts swapped between runs;
#: between the two runs, one request of LINT_BETWEEN tokens (another shape).
LINT_LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=16)
LINT_SCHEDULED, LINT_COMPUTED, LINT_BETWEEN = 4, (8, 20), 7


def lint_model(model: Any, *, seed: int = 0) -> Any:
    """The :class:`~graphrt.backends.torch.capture.capture_lint.LintReport` of a torch model (built)."""
    import torch

    from graphrt.backends.torch.capture.capture_lint import lint_forward

    if hasattr(model, "compute_logits"):
        return lint_forward(model, *_runner_steps(model))
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 128))
    rng = np.random.default_rng(seed)
    ids = [torch.as_tensor(rng.integers(3, vocab, n), dtype=torch.long)[None] for n in (16, 16, LINT_BETWEEN)]
    model.eval()
    return lint_forward(model, lambda i: model(input_ids=ids[i], use_cache=False),
                        lambda: model(input_ids=ids[2], use_cache=False))


def _runner_steps(model: Any) -> tuple[Any, Any]:
    """``run(i)``: step ``i`` of two, through an eager runner: the same shape (two requests of
    ``LINT_SCHEDULED`` tokens, the same longest context), other contents and context lengths;
    and ``between()``: one request of ``LINT_BETWEEN`` tokens, a step of another shape."""
    from graphrt.runner import ModelRunner

    runner = ModelRunner(model, backend="eager", warmup=False, progress=False, **LINT_LIMITS)
    vocab = runner.vocab_size
    rows = LINT_LIMITS["max_num_seqs"]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(rows, LINT_LIMITS["max_model_len"]), dtype=np.int32)
    width = runner.config.max_blocks_per_req
    table = (np.arange(rows * width, dtype=np.int32).reshape(rows, width) + 1)

    def run(i: int) -> None:
        computed = np.array(LINT_COMPUTED if i == 0 else LINT_COMPUTED[::-1], np.int32)
        runner.execute(token_ids=np.roll(tokens, i, axis=1), block_table=table, req_rows=np.array([0, 1], np.int32),
                       num_computed_tokens=computed, num_scheduled_tokens=np.full(2, LINT_SCHEDULED, np.int32))

    def between() -> None:
        runner.execute(token_ids=tokens, block_table=table, req_rows=np.array([2], np.int32),
                       num_computed_tokens=np.zeros(1, np.int32),
                       num_scheduled_tokens=np.array([LINT_BETWEEN], np.int32))
    return run, between


def _load(spec: str, transformers: bool) -> Any:
    """The torch model ``spec`` names, or :class:`~graphrt.cli.usage.UsageError` saying what was
    wrong: the spec, the builder (what it raised or returned) or the directory."""
    import torch

    from graphrt.testing.loading import load_model

    loaded = run_user_code(f"loading the model {spec!r}", lambda: load_model(spec))
    if callable(loaded):
        model = run_user_code(f"the model builder {spec}", loaded)
        if not isinstance(model, torch.nn.Module):
            shown = repr(model)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise UsageError(f"the model builder {spec} returned {type(model).__name__} ({shown}), "
                             "not a torch.nn.Module")
        return model
    if transformers:
        from transformers import AutoModelForCausalLM

        def load(path):
            return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False)   # never a stdin prompt
    else:
        from graphrt.models.torch.loader import load_torch_model

        load = load_torch_model
    return run_user_code(f"loading the model directory {spec}", lambda: load(loaded))


def lint_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a Hugging Face directory, or module:function / file.py:function returning a "
                                      "torch model")
    parser.add_argument("--transformers", action="store_true",
                        help="lint the stock transformers class of the directory (as the Transformers backend runs "
                             "it), not graphrt's reference model")


def lint_run(args: argparse.Namespace) -> int:
    """``graphrt lint``: the report on stdout; exit 0 clean, 1 findings; a
    :class:`~graphrt.cli.usage.UsageError` (exit 2, one line on stderr) when there is no report:
    the model could not be loaded or built, or its forward raised."""
    model = _load(args.model, args.transformers)
    report = run_user_code(f"one forward of {args.model} ({type(model).__name__})", lambda: lint_model(model))
    print(f"graphrt lint: {args.model} ({type(model).__name__}), one forward under the capture checks")
    print(report)
    return EXIT_OK if report.clean else EXIT_FINDINGS


__all__ = ["LINT_LIMITS", "lint_args", "lint_model", "lint_run"]
