"""The compatibility matrix of the transformers backend (tools/transformers_matrix.py).

* A sample of architectures runs through the matrix's own :func:`check_mode` -- the workload
  with chunked prefill, preemption and prefix-cache hits, every token checked against
  transformers' argmax -- dense (Llama, every single-rank mode), sliding window + soft-capping
  (Gemma 2), MoE on the grouped experts (Qwen2-MoE), MLA with V narrower than K (DeepSeek-V2),
  and one model refused with its reason (Doge's own attention mask, named with its module).
* TP=2 over gloo equals TP=1 (and transformers) on a dense and a MoE architecture (``slow``).
* docs/transformers-models.md parses, lists at least 40 architectures passing every mode, and
  agrees with what the sample found here.
* The kit's padding and KV-isolation properties hold on an MLA model (tests/test_transformers_backend.py
  runs them on Gemma 2 and Qwen2-MoE).

The full matrix is one command: ``python tools/transformers_matrix.py --docs
docs/transformers-models.md``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from transformers_matrix import MODES, check_mode, parse_page  # noqa: E402
from transformers_zoo import load_reference, tiny_checkpoint  # noqa: E402

PAGE = Path(__file__).resolve().parents[2] / "docs" / "transformers-models.md"
#: Architectures every mode of which must pass (the matrix's promise).
MIN_PASSING = 40
#: (architecture, modes) the fast sample runs.
SAMPLE = [
    ("llama", ("eager", "FULL_DECODE_ONLY", "PIECEWISE", "FULL_AND_PIECEWISE")),
    ("gemma2", ("eager", "FULL_AND_PIECEWISE")),
    ("qwen2_moe", ("FULL_AND_PIECEWISE",)),
    ("deepseek_v2", ("eager", "FULL_DECODE_ONLY")),
]
_FOUND: dict[tuple[str, str], bool] = {}


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = load_reference(str(tiny_checkpoint(arch)))
        return cache[arch]
    return get


@pytest.fixture(scope="module")
def single_rank(references):
    """``check_mode(arch, mode, reference)`` once per (arch, mode) in this module: the sample and
    the TP=2 test's TP=1 baseline are the same call (same arguments, same workload)."""
    cache = {}

    def get(arch, mode):
        if (arch, mode) not in cache:
            cache[arch, mode] = check_mode(arch, mode, references(arch))
        return cache[arch, mode]
    return get


@pytest.mark.parametrize("arch, mode", [(a, m) for a, modes in SAMPLE for m in modes])
def test_sample_passes_the_matrix_check(arch, mode, single_rank):
    result = single_rank(arch, mode)
    _FOUND[(arch, mode)] = result.passed
    assert result.passed, result.reason
    assert result.tokens is not None and len(result.tokens) > 0


def test_a_refused_model_fails_with_the_module_and_the_reason():
    result = check_mode("doge", "eager")
    assert not result.passed
    assert "model.layers.0.self_attn builds an attention mask of its own" in result.reason
    assert "Traceback" not in result.reason and "\n" not in result.reason
    _FOUND[("doge", "eager")] = False


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])
def test_tp2_over_gloo_equals_tp1(arch, references, single_rank):
    tp1 = single_rank(arch, "FULL_AND_PIECEWISE")
    assert tp1.passed, tp1.reason
    tp2 = check_mode(arch, "TP=2", references(arch), tp1.tokens)
    assert tp2.passed, tp2.reason
    assert tp2.tokens == tp1.tokens
    _FOUND[(arch, "TP=2")] = True


def test_the_page_lists_enough_passing_architectures():
    table = parse_page(PAGE.read_text(encoding="utf-8"))
    assert table, f"{PAGE} has no matrix table"
    assert all(set(cells) == set(MODES) for cells in table.values())
    passing = [arch for arch, cells in table.items() if all(cells.values())]
    assert len(passing) >= MIN_PASSING, f"{len(passing)} architectures pass every mode: {passing}"


def test_the_page_agrees_with_the_sample():
    """What this file found (the tests above, run first) is what the page says."""
    if not _FOUND:
        pytest.skip("run with the sample tests above")
    table = parse_page(PAGE.read_text(encoding="utf-8"))
    disagree = {key: found for key, found in _FOUND.items() if table.get(key[0], {}).get(key[1]) != found}
    assert not disagree, f"the page disagrees with these runs: {disagree}"


def test_kit_padding_and_kv_isolation_on_mla():
    from graphrt.models.torch.transformers_impl import load_transformers_model
    from graphrt.testing.conformance import run_conformance
    from graphrt.testing.runners import RunnerFactory

    path = tiny_checkpoint("deepseek_v2")
    factory = RunnerFactory(lambda: load_transformers_model(path), "cpu")
    results = run_conformance(factory=factory, properties=["padding_invisible", "kv_isolated"], examples=4,
                              report=None)
    assert [r.status for r in results] == ["PASS", "PASS"], [r.line() for r in results]
