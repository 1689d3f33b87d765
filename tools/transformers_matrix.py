"""The compatibility matrix of graphrt's transformers backend: each architecture, each mode.

For a tiny random model of each architecture, :func:`check_mode` runs one workload through
``graphrt.LLM(model_impl="transformers")`` in one mode and says ``pass`` or why not. The workload
forces prefix hits, chunked prefill and preemption (and checks they happened); modes are
``eager``, the three ``cpu`` graph modes (strict) and ``TP=2``. ``pass``: every greedy token is
transformers' own argmax (exact ties allowed), and TP=2's tokens are TP=1's.

``python tools/transformers_matrix.py`` runs every architecture (a subprocess each) and writes
docs/transformers-models.md; tests/backends/test_transformers_matrix.py runs a sample. A developer
tool, outside the installed package (with :mod:`transformers_zoo` beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Sequence

#: The modes, in the page's column order.
MODES = ("eager", "FULL_DECODE_ONLY", "PIECEWISE", "FULL_AND_PIECEWISE", "TP=2")
#: The workload (module docstring).
PROMPT_LENGTHS = (1, 3, 7, 13, 21, 40)
SHARED_PREFIX = 16
MAX_TOKENS = 6
LLM_ARGS: dict[str, Any] = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=4,
                                cudagraph_capture_sizes=[4, 8, 16], num_kv_blocks=24, schedule_conservativeness=0.0)
#: A generated token may trail transformers' argmax by this much (exact ties between logits).
TIE_TOLERANCE = 1e-4
SEED = 7


@dataclass
class ModeResult:
    """One architecture in one mode: ``pass`` or ``fail`` with the reason (first line)."""

    arch: str
    mode: str
    status: str
    reason: str = ""
    seconds: float = 0.0
    tokens: list[list[int]] | None = None     # what it generated (TP=2 is compared with TP=1's)

    @property
    def passed(self) -> bool:
        return self.status == "pass"


def workload(vocab: int) -> list[list[int]]:
    """The prompts (module docstring), drawn from ids 3 .. vocab - 1."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    prompts = [[int(t) for t in rng.integers(3, vocab, size=n)] for n in PROMPT_LENGTHS]
    prefix = [int(t) for t in rng.integers(3, vocab, size=SHARED_PREFIX)]
    prompts += [prefix + [int(t) for t in rng.integers(3, vocab, size=n)] for n in (5, 9)]
    return prompts


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return " ".join(text.split())[:600]


def run_workload(model_dir: str, mode: str) -> tuple[list[list[int]], dict[str, Any], list[list[int]]]:
    """Run the workload through graphrt.LLM in ``mode``: (prompts, stats, generated tokens)."""
    import graphrt
    from graphrt.models.model_impl import read_config_json

    raw = read_config_json(model_dir)
    prompts = workload(int(raw.get("vocab_size") or raw.get("text_config", {}).get("vocab_size")))
    kwargs = dict(LLM_ARGS, model_impl="transformers")
    if mode == "eager":
        backend = "eager"
    else:
        backend, kwargs["strict"] = "cpu", True
        kwargs["mode"] = "FULL_AND_PIECEWISE" if mode in ("TP=2", "TP=1") else mode
        if mode == "TP=2":
            kwargs["tensor_parallel_size"] = 2
    with graphrt.LLM(model_dir, backend=backend, **kwargs) as llm:
        outs = llm.generate(prompts, graphrt.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        stats = dict(llm.stats, prefix_caching=llm.prefix_cache is not None)
    return prompts, stats, [o.token_ids for o in outs]


def check_tokens(reference: Any, prompts: Sequence[list[int]], tokens: Sequence[list[int]]) -> str | None:
    """None when every token is transformers' argmax of its sequence, else the first that is not."""
    from transformers_zoo import reference_logits, reference_offset

    offset = reference_offset(reference)
    for i, (prompt, generated) in enumerate(zip(prompts, tokens)):
        if len(generated) != MAX_TOKENS:
            return f"request {i} generated {len(generated)} tokens, not {MAX_TOKENS}"
        logits = reference_logits(reference, (prompt + generated)[:-1], offset)
        for j, tok in enumerate(generated):
            row = logits[len(prompt) - 1 + j]
            if not bool(row[tok] >= row.max() - TIE_TOLERANCE):
                return (f"request {i} (prompt of {len(prompt)}), token {j}: graphrt chose {tok} "
                        f"(logit {float(row[tok]):.5f}), transformers' argmax is {int(row.argmax())} "
                        f"(logit {float(row.max()):.5f})")
    return None


def check_stats(mode: str, stats: dict[str, Any]) -> str | None:
    """None when the workload did what it claims and the mode graphed what it should, else why not."""
    if stats.get("preemptions", 0) == 0:
        return "the workload preempted no request (the check needs preemption)"
    if stats.get("prefix_cache_hit_tokens", 0) == 0 and stats.get("prefix_caching", True):
        return "the workload hit no prefix-cache block"     # (a hybrid runs without: docs/hybrid.md)
    if mode == "eager":
        return None if stats.get("entries", 0) == 0 else "the eager backend built graphs"
    causes = stats.get("eager_by_cause", {})
    unplanned = {k: v["steps"] for k, v in causes.items() if k != "mode" and v["steps"]}
    if unplanned or stats.get("hits", 0) == 0:
        return f"steps ran eagerly that {mode} graphs ({unplanned}; replays: {stats.get('hits', 0)})"
    return None


def check_mode(arch: str, mode: str, reference: Any = None, tp1_tokens: Sequence[list[int]] | None = None
               ) -> ModeResult:
    """``arch`` in ``mode``: pass, or fail with the reason. ``reference``: transformers' model of the
    checkpoint (loaded here when None); ``tp1_tokens``: TP=2 must equal them (run here when None)."""
    from transformers_zoo import load_reference, tiny_checkpoint

    start = time.perf_counter()
    tokens = None
    try:
        model_dir = str(tiny_checkpoint(arch))
        prompts, stats, tokens = run_workload(model_dir, mode)
        reference = reference if reference is not None else load_reference(model_dir)
        problem = check_tokens(reference, prompts, tokens) or check_stats(mode, stats)
        if problem is None and mode == "TP=2":
            if tp1_tokens is None:
                tp1_tokens = run_workload(model_dir, "TP=1")[2]
            if [list(t) for t in tp1_tokens] != [list(t) for t in tokens]:
                problem = "TP=2's tokens differ from TP=1's"
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        problem = _first_line(exc)
    seconds = round(time.perf_counter() - start, 1)
    return ModeResult(arch, mode, "fail" if problem else "pass", problem or "", seconds, tokens)


def check_arch(arch: str, modes: Sequence[str] = MODES) -> list[ModeResult]:
    """Every mode of ``arch`` (one reference model for all); a build failure fails every mode with it."""
    from transformers_zoo import load_reference, tiny_checkpoint

    try:
        reference = load_reference(str(tiny_checkpoint(arch)))
    except Exception as exc:  # noqa: BLE001
        return [ModeResult(arch, m, "fail", f"the tiny model cannot be built: {_first_line(exc)}") for m in modes]
    results: list[ModeResult] = []
    for mode in modes:
        tp1 = next((r.tokens for r in results if r.mode == "FULL_AND_PIECEWISE" and r.passed), None)
        results.append(check_mode(arch, mode, reference, tp1 if mode == "TP=2" else None))
    return results


# ---- the full matrix and its page --------------------------------------------------------------

def _run_one(arch: str, timeout: float) -> list[ModeResult]:
    """``check_arch`` in a fresh interpreter (isolation from crashes, leaks and hangs)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", arch]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return [ModeResult(arch, m, "fail", f"no result within {timeout:.0f} s") for m in MODES]
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return [ModeResult(**r) for r in json.loads(line)["results"]]
    tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-1:])[:400]
    return [ModeResult(arch, m, "fail", f"the check process exited {done.returncode}: {tail}") for m in MODES]


def run_matrix(archs: Sequence[str] | None = None, jobs: int = 2, timeout: float = 900.0,
               progress: bool = True) -> tuple[dict[str, list[ModeResult]], dict[str, str]]:
    """(results by architecture, architectures not built and why) for ``archs`` (default: all)."""
    from transformers_zoo import architectures

    known = architectures()
    skipped = {a: why for a, why in known.items() if why and (archs is None or a in archs)}
    todo = [a for a, why in known.items() if why is None and (archs is None or a in archs)]
    results: dict[str, list[ModeResult]] = {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for arch, res in zip(todo, pool.map(lambda a: _run_one(a, timeout), todo)):
            results[arch] = res
            if progress:
                print(f"{arch:28s} " + " ".join(f"{r.mode}={r.status}" for r in res), flush=True)
    return results, skipped


def _cell(result: ModeResult, notes: dict[str, int]) -> str:
    if result.passed:
        return "pass"
    note = notes.setdefault(result.reason, len(notes) + 1)
    return f"[{note}](#reason-{note})"


def render_page(results: dict[str, list[ModeResult]], skipped: dict[str, str], command: str) -> str:
    """docs/transformers-models.md from the results (:func:`run_matrix`)."""
    import platform

    import torch
    import transformers

    passing = sorted(a for a, rs in results.items() if all(r.passed for r in rs))
    notes: dict[str, int] = {}
    rows = []
    for arch in sorted(results):
        cells = [_cell(r, notes) for r in results[arch]]
        rows.append(f"| `{arch}` | " + " | ".join(cells) + " |")
    lines = [
        "# Transformers models: the compatibility matrix",
        "",
        "<!-- generated by `" + command + "`; do not edit by hand -->",
        "",
        "graphrt runs transformers causal LMs through its own paged attention "
        "(`graphrt.LLM(model_dir, model_impl=\"transformers\")`, docs/models.md, \"Any transformers "
        "decoder\"). This page is the result of running every causal-LM architecture of the installed "
        "transformers whose class declares `_supports_attention_backend` (or defines a recurrent mixer that "
        "graphrt routes: docs/hybrid.md) -- a tiny random model of each, "
        "built offline from its config class (2 layers, 64 wide; a sliding and a full layer where the "
        "config has `layer_types`; 4 experts, 2 routed, for MoE) -- through one workload in each mode "
        "(`tools/transformers_matrix.py`: prompts of 1 to 40 tokens, chunked prefill, preemption, "
        "prefix-cache hits, greedy decoding).",
        "",
        "* **pass**: every generated token equals transformers' own argmax for the same sequence "
        "(float32, eager attention, teacher-forced); in the graph modes every step the mode graphs "
        "replayed a captured graph (strict mode: a key that cannot be captured fails with its reason); "
        "TP=2 gave TP=1's tokens.",
        "* **eager**: the eager backend; **FULL_DECODE_ONLY / PIECEWISE / FULL_AND_PIECEWISE**: the `cpu` "
        "recording-graph backend in that graph mode; **TP=2**: `cpu`, FULL_AND_PIECEWISE, two ranks over gloo.",
        "* A numbered cell is a failure; its reason, as graphrt raised it, is listed below the table.",
        "",
        f"Run with transformers {transformers.__version__}, torch {torch.__version__}, Python "
        f"{platform.python_version()}: **{len(passing)} of {len(results)} architectures built pass every "
        f"mode**; {len(skipped)} more are not built (listed at the end).",
        "",
        "| architecture | " + " | ".join(MODES) + " |",
        "|---|" + "---|" * len(MODES),
        *rows,
        "",
        "## Reasons",
        "",
    ]
    for reason, number in notes.items():
        lines.append(f"<a id=\"reason-{number}\"></a>**{number}.** {reason}")
        lines.append("")
    lines += ["## Not built", "", "| architecture | why |", "|---|---|"]
    lines += [f"| `{a}` | {why.splitlines()[0][:300]} |" for a, why in sorted(skipped.items())]
    lines.append("")
    return "\n".join(lines)


def parse_page(text: str) -> dict[str, dict[str, bool]]:
    """The page's table as ``{arch: {mode: passed}}`` (for checking it against the tests' results)."""
    out: dict[str, dict[str, bool]] = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            arch = cells[0].strip("`")
            if len(cells) == len(MODES) + 1:
                out[arch] = {m: c == "pass" for m, c in zip(MODES, cells[1:])}
    return out


def merge_results(paths: Sequence[str]) -> tuple[dict[str, list[ModeResult]], dict[str, str]]:
    """The results of several ``--json`` files as one matrix: a later file's architectures replace an
    earlier's (a rerun of some architectures after a fix, over a full run)."""
    results: dict[str, list[ModeResult]] = {}
    skipped: dict[str, str] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        results.update({a: [ModeResult(**r) for r in rs] for a, rs in data["results"].items()})
        skipped.update(data.get("skipped", {}))
    return results, {a: why for a, why in skipped.items() if a not in results}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/transformers_matrix.py",
                                     description="graphrt's transformers backend, every architecture in every mode")
    parser.add_argument("--archs", nargs="+", help="architectures (model types) to run; default: all")
    parser.add_argument("--jobs", type=int, default=2, help="architectures checked at once (default 2)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per architecture")
    parser.add_argument("--docs", help="write the page here (e.g. docs/transformers-models.md)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--from-json", nargs="+", metavar="JSON",
                        help="run nothing: merge these --json results (a later file's architectures replace an "
                             "earlier's) and write --docs / --json from them")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        import logging

        import torch
        warnings.filterwarnings("ignore")
        logging.disable(logging.WARNING)
        torch.set_num_threads(1)
        print(json.dumps({"results": [asdict(r) for r in check_arch(args.one)]}), flush=True)
        return 0
    if args.from_json:
        results, skipped = merge_results(args.from_json)
    else:
        results, skipped = run_matrix(args.archs, args.jobs, args.timeout)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"results": {a: [asdict(r) for r in rs] for a, rs in results.items()}, "skipped": skipped}, f,
                      indent=1)
    if args.docs:
        command = "python tools/transformers_matrix.py --docs " + args.docs
        if args.from_json:
            command += " --from-json " + " ".join(os.path.basename(p) for p in args.from_json)
        with open(args.docs, "w", encoding="utf-8") as f:
            f.write(render_page(results, skipped, command))
    passing = sum(all(r.passed for r in rs) for rs in results.values())
    print(f"{passing} of {len(results)} architectures pass every mode")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
