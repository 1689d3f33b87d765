"""Adding an attention kernel touches one file and the selector: a toy kernel
(tests/support/toy_attention.py) registered by name runs graphrt's conformance kit, in graphs
and eagerly, against transformers' logits."""

from __future__ import annotations

import pytest
import torch

from graphrt.layers.torch.attention.selector import (register_attention_kernel, select_attention,
                                                     unregister_attention_kernel)
from graphrt.models.torch.loader import load_torch_model
from graphrt.testing.conformance import run_conformance
from support.kit_models import hf_reference, model_dir
from support.toy_attention import ToyAttentionBackend, make_toy_backend


@pytest.fixture
def toy_kernel(monkeypatch):
    register_attention_kernel("toy", make_toy_backend)
    monkeypatch.setenv("GRAPHRT_ATTENTION", "toy")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    unregister_attention_kernel("toy")


def test_a_toy_kernel_added_in_one_file_and_registered_passes_the_kit(toy_kernel):
    chosen = select_attention(load_torch_model(model_dir()), "cpu", torch.float32, 16, torch.float32)
    assert isinstance(chosen, ToyAttentionBackend)                             # the selector chose it by name
    before = ToyAttentionBackend.calls
    lines: list[str] = []
    results = run_conformance(model_dir(), "cpu", examples=4, report=lines.append, reference=hf_reference,
                              properties=["padding_invisible", "replay_matches_eager", "kv_isolated",
                                          "matches_reference"])
    assert [r.name for r in results if not r.passed] == [], "\n".join(lines)
    assert all(r.examples >= 1 for r in results), "\n".join(lines)
    assert ToyAttentionBackend.calls > before                                  # its attend ran in the layers
