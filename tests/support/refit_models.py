"""What the refit, sleep / wake and live-buffer tests share: a small engine, the backends they
run on (``cuda-sim``: the CUDA adapter over a stand-in ``torch.cuda``, on the recording graph),
checkpoints mixed from two tiny random ones, and greedy tokens of a fresh engine."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import load_file, save_file

import graphrt
from graphrt.backends.torch.cuda import CudaGraphAPI, CudaGraphBackend
from support.device_fakes import FakeCuda

#: A small engine: two capture sizes, prefix caching on (a refit must forget the cached KV).
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4, num_kv_blocks=40,
              cudagraph_capture_sizes=[4, 32])
#: XLA: a grid of two token paddings, keys compiled when first needed (warm-up would compile them all).
XLA_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4, num_kv_blocks=40,
                  precompile_token_paddings=[16, 32], warmup=False)
GREEDY = graphrt.SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [40, 41]]


class SimCudaBackend(CudaGraphBackend):
    """The CUDA adapter on the CPU: its own code, a stand-in ``torch.cuda`` namespace."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.fake = FakeCuda()

    def graph_api(self) -> CudaGraphAPI:
        return CudaGraphAPI(self.device, self.fake)


def engine(name: str) -> dict[str, Any]:
    """The engine settings of backend ``name``."""
    return XLA_ENGINE if name == "xla" else ENGINE


def backend(name: str) -> Any:
    """``cpu``, ``eager``, ``cuda-sim`` (above) or ``xla``, as ``graphrt.LLM`` takes it."""
    return SimCudaBackend() if name == "cuda-sim" else name


def tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a one-file checkpoint, by name."""
    return load_file(str(Path(model_dir) / "model.safetensors"))


def mixed_checkpoint(tmp: Path, base: str | Path, other: str | Path, names: Iterable[str]) -> str:
    """A copy of checkpoint ``base`` with ``other``'s tensors under ``names``: what a fresh engine
    loads to compare with a partial refit."""
    out = Path(tmp) / f"mixed-{Path(base).name}"
    shutil.copytree(base, out, dirs_exist_ok=True)
    merged = tensors(base)
    theirs = tensors(other)
    merged.update({n: theirs[n] for n in names})
    save_file(merged, str(out / "model.safetensors"))
    return str(out)


def greedy_tokens(llm: graphrt.LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def fresh_tokens(model_dir: str | Path, name: str, prompts: list[list[int]] = PROMPTS, **kw: Any) -> list[list[int]]:
    """Greedy tokens of an engine built fresh from ``model_dir`` (closed afterwards; remembered
    per process for the same arguments: checkpoints are never rewritten in place)."""
    return [list(t) for t in _fresh(str(model_dir), name, tuple(map(tuple, prompts)), tuple(sorted(kw.items())))]


@functools.lru_cache(maxsize=None)
def _fresh(model_dir: str, name: str, prompts: tuple, kw: tuple) -> tuple:
    with graphrt.LLM(model_dir, backend=backend(name), **{**engine(name), **dict(kw)}) as llm:
        return tuple(map(tuple, greedy_tokens(llm, [list(p) for p in prompts])))
