"""The pieces without the ModelRunner: the examples of docs/api.md run as written, and the
per-key wrappers keep their promises (replay reads the caller's buffers, nothing unplanned is
built, other shapes are refused), count every call (hits, misses, padding, eager calls by
cause), honour strict mode on every backend, and capture PIECEWISE at declared attention
modules on the torch graph backends."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import graphrt
from graphrt.core.eager import EagerCause
from graphrt.core.errors import CacheMissError, InputError

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def examples() -> list[str]:
    text = API.read_text()
    section = text[text.index("## The pieces without the ModelRunner"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_section_has_torch_piecewise_and_xla_examples() -> None:
    found = examples()
    assert len(found) == 3 and 'select_backend("cpu")' in found[0] and 'select_backend("xla")' in found[2]
    assert "attention_layers=" in found[1] and 'mode="PIECEWISE"' in found[1]


@pytest.mark.parametrize("index", [0, 1, 2], ids=["cpu", "cpu-piecewise", "xla"])
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


# ---- statistics, strict mode and PIECEWISE, without a runner ---------------------------------

def _cpu_pieces(backend: str = "cpu", strict: bool = False):
    buf = torch.arange(16.0)
    return buf, graphrt.select_backend(backend).graphs(lambda n: buf[:n] * 2.0, graphrt.GraphCache(strict=strict))


def test_torch_pieces_count_hits_misses_padding_and_eager_calls_by_cause() -> None:
    buf, graphs = _cpu_pieces()
    for key in (8, 4):
        graphs.build(key)
    graphs.cache.put_failed(16, "captured nothing: a test's stand-in for a failed capture")
    graphs.cache.seal()
    assert torch.equal(graphs(8, num_tokens=5)[:5], buf[:5] * 2.0)
    graphs(4, num_tokens=4, num_reqs=2)
    missed = graphs(2, num_tokens=2)                      # never built, not strict: eager
    assert torch.equal(missed, buf[:2] * 2.0)
    graphs(16, num_tokens=9)                              # its build failed: eager
    graphs(8)                                             # no size given: a hit, no padding counted
    s = graphs.cache.stats
    assert (s.hits, s.misses, s.eager_steps, s.eager_tokens) == (3, 1, 2, 11)   # a failed build: no miss
    assert (s.real_tokens, s.padded_tokens, s.real_reqs, s.padded_reqs) == (20, 30, 2, 2)
    assert s.eager_by_cause[EagerCause.MISS].steps == 1 and s.eager_by_cause[EagerCause.MISS].tokens == 2
    assert s.eager_by_cause[EagerCause.CAPTURE_FAILED].tokens == 9
    assert s.per_key[8].hits == 2 and round(s.padding_waste, 4) == round(1 - 20 / 30, 4)


def test_eager_pieces_count_every_call_as_eager_and_honour_strict_mode() -> None:
    buf, graphs = _cpu_pieces("eager", strict=True)
    assert torch.equal(graphs.build(4), buf[:4] * 2.0)
    graphs.cache.seal()
    with pytest.raises(CacheMissError, match="8"):
        graphs(8)                                     # never built: strict refuses it, as on cpu
    assert torch.equal(graphs(4, num_tokens=3), buf[:4] * 2.0)
    s = graphs.cache.stats
    assert (s.hits, s.misses, s.eager_steps, s.real_tokens, s.padded_tokens) == (0, 1, 1, 3, 4)
    assert s.eager_by_cause[EagerCause.MODE].steps == 1 and s.eager_by_cause[EagerCause.MODE].tokens == 3


def test_sizes_are_checked_against_the_key() -> None:
    _, graphs = _cpu_pieces()
    graphs.build(4)
    with pytest.raises(InputError, match="num_tokens"):
        graphs(4, num_tokens=5)
    key = graphrt.BatchDescriptor(4, 2, False)
    named = graphrt.select_backend("cpu").graphs(lambda k: torch.ones(k.num_tokens), graphrt.GraphCache())
    named.build(key)
    named(key, num_tokens=3, num_reqs=2)
    with pytest.raises(InputError, match="num_reqs"):
        named(key, num_tokens=3, num_reqs=3)
    assert (named.cache.stats.padded_tokens, named.cache.stats.padded_reqs) == (4, 2)
    text = graphrt.select_backend("cpu").graphs(lambda k: torch.ones(2), graphrt.GraphCache())
    text.build("two")
    with pytest.raises(InputError, match="carries no size"):
        text("two", num_tokens=1)


def test_xla_pieces_count_hits_misses_and_padding() -> None:
    pytest.importorskip("jax")
    graphs = graphrt.select_backend("xla").graphs(lambda x: x * 2.0, graphrt.GraphCache())
    graphs.build(4, np.zeros(4, np.float32))
    graphs(4, np.ones(4, np.float32), num_tokens=3)
    with pytest.raises(graphrt.GraphrtError, match="build it first"):
        graphs(8, np.ones(8, np.float32), num_tokens=5)
    s = graphs.cache.stats
    assert (s.hits, s.misses, s.real_tokens, s.padded_tokens, s.eager_steps) == (1, 1, 3, 4, 0)


class _HostAttention(torch.nn.Module):
    """Reads a value on the host (``.item()``): no device graph can hold it, PIECEWISE runs it
    eagerly between the captured pieces."""

    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return h * float(scale.item())


def _piecewise_fn():
    torch.manual_seed(0)
    lin1, lin2, attn = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), _HostAttention()
    x, scale = torch.randn(16, 8), torch.ones(1)

    def fn(n: int) -> torch.Tensor:
        return lin2(attn(lin1(x[:n]), scale).relu())

    return fn, attn, x, scale


def test_piecewise_pieces_break_at_the_attention_layers() -> None:
    fn, attn, x, scale = _piecewise_fn()
    full = graphrt.select_backend("cpu").graphs(fn, graphrt.GraphCache())
    with pytest.raises(graphrt.GraphCaptureError):
        full.build(8)                               # the host read cannot be captured whole
    with pytest.raises(graphrt.ConfigError, match="attention_layers"):
        full.build(8, graphrt.RuntimeMode.PIECEWISE)
    graphs = graphrt.select_backend("cpu").graphs(fn, graphrt.GraphCache(strict=True), attention_layers=[attn])
    assert graphs.supports_piecewise and not full.supports_piecewise
    graphs.build(8, graphrt.RuntimeMode.PIECEWISE)
    graphs.cache.seal()
    assert "forward" not in vars(attn)               # the layer's own forward is back
    for value in (2.0, -0.5):                        # the engine refreshes its buffers, then replays
        x.normal_()
        scale.fill_(value)
        got = graphs(8, num_tokens=6).clone()
        with torch.no_grad():
            want = fn(8)
        assert torch.equal(got, want)
    entry = graphs.cache.lookup(8)
    assert entry.piecewise and len(entry.graphs) == 2
    assert graphs.cache.stats.hits == 2 and graphs.cache.stats.padded_tokens == 16
    eager = graphrt.select_backend("eager").graphs(fn, graphrt.GraphCache(), attention_layers=[attn])
    assert not eager.supports_piecewise and torch.equal(eager.build(8, graphrt.RuntimeMode.PIECEWISE), fn(8).detach())
