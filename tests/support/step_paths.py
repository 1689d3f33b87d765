"""How many graphrt files a step and a runner's construction cross (issue 44's measures;
docs/architecture.md, 'One engine step, file by file').

A file is crossed when one of its functions runs (``sys.setprofile`` call events; module bodies,
that is imports, are not counted, and neither is the model's own forward: ``models/``). The step
is a warm decode step of 4 requests through ``graphrt.LLM`` (the engine's files listed apart from
the runtime's below ``ModelRunner.execute``); the construction is ``ModelRunner(...)`` without
warm-up, after one construction already imported everything.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any, Callable

import graphrt
from graphrt import LLM, ModelRunner, SamplingParams

SRC = os.path.dirname(graphrt.__file__)
#: The engine's files (the loop above the runner): a step's path is told as engine + runtime.
ENGINE = "engine" + os.sep
LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=16, progress=False)
#: The sampling of the measured steps: greedy, and a ``top_p`` step (random sampling, top-p filter).
SAMPLINGS = {"greedy": dict(temperature=0.0), "top_p": dict(temperature=0.8, top_p=0.9, seed=0)}


def files_crossed(fn: Callable[[], Any]) -> tuple[Any, collections.Counter[str]]:
    """``fn()``'s result and the graphrt files (relative to the package) whose functions it ran,
    with how many calls each; ``models/`` and module bodies excluded."""
    files: collections.Counter[str] = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(SRC) and code.co_name != "<module>":
                rel = os.path.relpath(code.co_filename, SRC)
                if not rel.startswith("models" + os.sep):
                    files[rel] += 1

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, files


def step_path(model_dir: str, backend: str, sampling: str) -> tuple[set[str], set[str]]:
    """(engine files, runtime files) one warm decode step of 4 requests crosses on ``backend``
    with ``sampling`` (a key of :data:`SAMPLINGS`)."""
    llm = LLM(model_dir, backend=backend, **LIMITS)
    try:
        params = SamplingParams(max_tokens=64, ignore_eos=True, **SAMPLINGS[sampling])
        for prompt in ([1, 2, 3], [4, 5], [6, 7, 8, 9], [10]):
            llm.add_request(prompt, params)
        for _ in range(6):
            llm.step()                  # the prefill and the first decodes: every path warm
        _, files = files_crossed(llm.step)
    finally:
        llm.close()
    engine = {f for f in files if f.startswith(ENGINE)}
    return engine, set(files) - engine


def construction_path(model_dir: str, backend: str) -> set[str]:
    """The files ``ModelRunner(model_dir, backend=backend, warmup=False)`` crosses (a second
    construction: the first imported what it imports lazily)."""
    ModelRunner(model_dir, backend=backend, warmup=False, **LIMITS).close()
    runner, files = files_crossed(lambda: ModelRunner(model_dir, backend=backend, warmup=False, **LIMITS))
    runner.close()
    return set(files)


if __name__ == "__main__":          # the figures for docs/architecture.md: python tests/support/step_paths.py
    from support.hf_models import tiny_hf_model_dir

    directory = str(tiny_hf_model_dir("qwen3"))
    for name in sys.argv[1:] or ("cpu", "eager", "xla"):
        for kind in SAMPLINGS:
            engine, runtime = step_path(directory, name, kind)
            print(f"{name} {kind}: {len(engine)} engine + {len(runtime)} runtime files: "
                  f"{sorted(engine)} {sorted(runtime)}")
        print(f"{name} construction: {len(construction_path(directory, name))} files")
