"""The pieces without the ModelRunner: the two examples of docs/api.md run as written, and
the per-key wrappers keep their promises (replay reads the caller's buffers, nothing
unplanned is built, other shapes are refused)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import graphrt
from graphrt.core.errors import CacheMissError, InputError

API = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def examples() -> list[str]:
    text = API.read_text()
    section = text[text.index("## The pieces without the ModelRunner"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_section_has_a_torch_and_an_xla_example() -> None:
    found = examples()
    assert len(found) == 2 and 'select_backend("cpu")' in found[0] and 'select_backend("xla")' in found[1]


@pytest.mark.parametrize("index", [0, 1], ids=["cpu", "xla"])
def test_docs_example_runs(index: int) -> None:
    exec(compile(examples()[index], f"docs/api.md example {index}", "exec"), {"__name__": "docs_example"})


def _buffers_and_graphs(backend: str):
    buf = torch.zeros(8)
    weight = torch.arange(8.0)
    graphs = graphrt.select_backend(backend).graphs(lambda n: buf[:n] * weight[:n] + 1.0,
                                                    graphrt.GraphCache(strict=True))
    return buf, graphs


@pytest.mark.parametrize("backend", ["cpu", "eager"])
def test_torch_replay_reads_the_callers_buffers(backend: str) -> None:
    buf, graphs = _buffers_and_graphs(backend)
    graphs.build(4)
    graphs.cache.seal()
    buf.copy_(torch.arange(8.0))
    first = graphs(4).clone()
    buf.fill_(2.0)
    second = graphs(4)
    assert torch.equal(first, torch.arange(4.0) ** 2 + 1.0)
    assert torch.equal(second, torch.arange(4.0) * 2.0 + 1.0)


def test_torch_graphs_refuse_a_key_never_built() -> None:
    _, graphs = _buffers_and_graphs("cpu")
    graphs.build(4)
    graphs.cache.seal()
    with pytest.raises(CacheMissError, match="8"):
        graphs(8)


def test_xla_graphs_refuse_other_shapes_and_unbuilt_keys() -> None:
    jnp = pytest.importorskip("jax.numpy")
    graphs = graphrt.select_backend("xla").graphs(lambda x: x * 2.0, graphrt.GraphCache(strict=True))
    graphs.build("four", np.zeros(4, np.float32))
    graphs.cache.seal()
    assert np.array_equal(graphs("four", jnp.arange(4.0)), np.arange(4.0) * 2.0)
    with pytest.raises(InputError, match=r"args\[0\].*float32\[4\].*float32\[5\]"):
        graphs("four", np.zeros(5, np.float32))
    with pytest.raises(InputError, match=r"args\[0\].*float32\[4\].*int32\[4\]"):
        graphs("four", np.zeros(4, np.int32))
    with pytest.raises(CacheMissError):
        graphs("five", np.zeros(5, np.float32))
    assert graphs.cache.stats.entries == 1
