"""FlashInfer's filter kernels behind the torch sampler (backends/torch/sampling/flashinfer_sampling.py).

On a CPU a stand-in ``flashinfer.sampling`` is injected: its ``top_k_renorm_probs`` /
``top_p_renorm_probs`` keep FlashInfer's documented contract (probabilities ``[batch, vocab]``
that sum to 1, a per-row int32 ``top_k`` / float ``top_p``; the kept tokens renormalised) and
compute it by sorting. So these check the adapter's side: with the same noise the sampler draws
the tokens the threshold sampler draws; ``GRAPHRT_SAMPLER`` picks as documented; importing the
module imports no flashinfer. With the real flashinfer on a CUDA GPU (``gpu``-marked, skipped
elsewhere; not run on this machine): the same tokens as the threshold sampler.
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from graphrt import ConfigError
from graphrt.backends.torch.sampling import flashinfer_sampling as fs
from graphrt.backends.torch.sampling.sampler_ops import Workspace, sample_rows


def _fake_sampling() -> types.ModuleType:
    calls: list[str] = []

    def check(probs: torch.Tensor) -> None:
        assert probs.dtype == torch.float32 and probs.dim() == 2
        torch.testing.assert_close(probs.sum(dim=-1), torch.ones(probs.shape[0]), rtol=1e-4, atol=1e-4)

    def top_k_renorm_probs(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
        check(probs)
        assert top_k.dtype == torch.int32 and top_k.shape == probs.shape[:1]
        assert int(top_k.min()) >= 1 and int(top_k.max()) <= probs.shape[1]
        calls.append("top_k")
        kth = probs.sort(dim=-1, descending=True).values.gather(1, top_k.long().unsqueeze(1) - 1)
        out = torch.where(probs >= kth, probs, 0.0)
        return out / out.sum(dim=-1, keepdim=True)

    def top_p_renorm_probs(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        check(probs)
        assert top_p.shape == probs.shape[:1]
        calls.append("top_p")
        values = probs.sort(dim=-1, descending=True).values
        before = values.cumsum(dim=-1) - values
        last = (before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True) - 1
        out = torch.where(probs >= values.gather(1, last), probs, 0.0)
        return out / out.sum(dim=-1, keepdim=True)

    module = types.ModuleType("flashinfer.sampling")
    module.top_k_renorm_probs, module.top_p_renorm_probs, module.calls = top_k_renorm_probs, top_p_renorm_probs, calls
    return module


@pytest.fixture
def fake(monkeypatch):
    module = _fake_sampling()
    package = types.ModuleType("flashinfer")
    package.sampling = module
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.sampling", module)
    monkeypatch.delenv(fs.SAMPLER_ENV, raising=False)
    return module


def _inputs(rows: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3] * (rows // 4))
    top_k = torch.tensor([vocab, 40, 5, vocab] * (rows // 4))
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.6] * (rows // 4))
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.02] * (rows // 4))
    noise = torch.empty(rows, vocab).exponential_(generator=g)
    return logits, temperature, top_k, top_p, min_p, noise


def test_flashinfer_filters_draw_the_threshold_samplers_tokens(fake):
    rows, vocab = 64, 2000
    for seed in range(3):
        logits, t, k, p, mp, noise = _inputs(rows, vocab, seed)
        ws = Workspace(rows, vocab, logits.device)
        mine = sample_rows(logits, t, k, p, mp, noise.clone(), ws, wide=True)
        theirs = sample_rows(logits, t, k, p, mp, noise.clone(), ws, flashinfer=fake)
        assert torch.equal(mine, theirs), f"seed {seed}"
    assert fake.calls.count("top_k") == 3 and fake.calls.count("top_p") == 3


def test_the_sampler_picks_flashinfer_as_documented(fake, monkeypatch):
    cuda = torch.device("cuda")
    assert fs.flashinfer_sampling(cuda) is fake, "auto: FlashInfer on CUDA where it imports"
    assert fs.flashinfer_sampling(torch.device("cpu")) is None, "auto: not off CUDA"
    monkeypatch.setenv(fs.SAMPLER_ENV, "torch")
    assert fs.flashinfer_sampling(cuda) is None
    monkeypatch.setenv(fs.SAMPLER_ENV, "flashinfer")
    with pytest.raises(ConfigError, match="CUDA"):
        fs.flashinfer_sampling(torch.device("cpu"))
    monkeypatch.setenv(fs.SAMPLER_ENV, "fast")
    with pytest.raises(ConfigError, match="GRAPHRT_SAMPLER"):
        fs.flashinfer_sampling(cuda)
    monkeypatch.setitem(sys.modules, "flashinfer.sampling", None)     # not installed
    monkeypatch.setenv(fs.SAMPLER_ENV, "auto")
    assert fs.flashinfer_sampling(cuda) is None
    monkeypatch.setenv(fs.SAMPLER_ENV, "flashinfer")
    with pytest.raises(ConfigError, match="graphrt\\[flashinfer\\]"):
        fs.flashinfer_sampling(cuda)


def test_importing_the_adapter_imports_no_flashinfer():
    code = ("import sys, graphrt.backends.torch.sampling.sampler, graphrt.backends.torch.sampling.flashinfer_sampling; "
            "print('flashinfer' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.gpu
def test_real_flashinfer_draws_the_threshold_samplers_tokens():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    module = pytest.importorskip("flashinfer.sampling")
    rows, vocab = 256, 151_936
    logits, t, k, p, mp, noise = (x.cuda() for x in _inputs(rows, vocab, 0))
    ws = Workspace(rows, vocab, logits.device)
    mine = sample_rows(logits, t, k, p, mp, noise.clone(), ws, wide=True)
    theirs = sample_rows(logits, t, k, p, mp, noise.clone(), ws, flashinfer=module)
    assert (mine == theirs).float().mean().item() > 0.99, "FlashInfer's thresholds differ beyond rounding"
