"""Helpers every benchmark shares: the machine line, median / p90 summaries, a tiny model and
its prompts.

Not a benchmark itself (``graphrt bench`` runs the scripts listed in ``graphrt.cli.BENCHMARKS``).
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_line() -> str:
    """``<model>, <n> CPU cores``: how a report names this machine."""
    return f"{cpu_model()}, {os.cpu_count()} CPU cores"


def summarise(ns: Sequence[int] | np.ndarray) -> dict[str, float]:
    """Median and p90 of nanosecond samples, in microseconds, and the sample count."""
    arr = np.asarray(ns, dtype=np.float64)
    return {"median_us": float(np.median(arr)) / 1e3, "p90_us": float(np.percentile(arr, 90)) / 1e3,
            "n": int(arr.shape[0])}


def build_model_dir(root: Path, *, vocab: int, hidden: int, layers: int, max_model_len: int,
                    seed: int = 0) -> Path:
    """Save a tiny random-weight Qwen3 checkpoint (config.json + safetensors) under ``root``."""
    from graphrt.models.random_checkpoint import write_random_checkpoint

    return write_random_checkpoint(root / "tiny-qwen3", "qwen3", seed=seed, vocab_size=vocab,
                                   hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=hidden // 4,
                                   max_position_embeddings=4 * max_model_len)


@contextlib.contextmanager
def tiny_model_dir(prefix: str, **sizes: int) -> Iterator[Path]:
    """A tiny random Qwen3 (``build_model_dir(root, **sizes)``) in a temporary directory that is
    removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield build_model_dir(root, **sizes)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` ids drawn from ``[3, vocab)`` (the lowest ids left out, as
    special tokens usually sit there), seeded: every run and arm gets the same prompts."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, length).tolist() for _ in range(count)]


def print_checks(checks: dict[str, bool]) -> bool:
    """Print one PASS / FAIL line per check; whether all passed."""
    print("\n" + "\n".join(f"{'PASS' if ok else 'FAIL'}  {label}" for label, ok in checks.items()))
    return all(checks.values())
