"""graphrt.testing, the conformance kit engines run on their own models.

* It passes on graphrt's reference Qwen3 on ``cpu``, ``eager`` and ``xla`` (few examples here;
  ``graphrt conformance`` runs as many as asked).
* It catches padding and KV bugs planted in the reference model's attention, each with a
  shrunk counterexample of at most 3 requests: a -1 slot used as a Python index (writes the
  last real KV slot), padded rows that come out NaN, and stale block-table rows read by
  attention (a plan buffer that keeps padded requests' rows from an earlier step); and
  attention that reads a token's own slot before storing its K/V.
* Its entry points: the CLI, the pytest plugin; ``import graphrt`` stays free of it.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import find, settings

from graphrt.core.forward_context import get_forward_context
from graphrt.models.torch.attention import PagedAttention, paged_attention_kernel
from graphrt.models.torch.loader import load_torch_model
from graphrt.testing.conformance import Result, check_property, run_conformance, summary
from graphrt.testing.runners import KIT_LIMITS, RunnerFactory
from graphrt.testing.strategies import steps
from hf_models import load_hf_model, tiny_hf_model_dir

EXAMPLES = 6
#: A small XLA grid: every compile costs about a second here.
XLA_GRID = dict(precompile_token_paddings=[16, 32], precompile_bs_paddings=[4])
#: Properties with nothing to check on a backend: XLA has no eager path and no static buffers.
NOT_APPLICABLE = {"xla": {"replay_matches_eager", "addresses_stable"}}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: the tiny model's matmuls gain nothing from more, and on a shared
    machine a second thread mostly waits for a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model_dir() -> str:
    return str(tiny_hf_model_dir("qwen3"))


@functools.lru_cache(maxsize=None)
def hf_model() -> torch.nn.Module:
    return load_hf_model(model_dir())


def hf_reference(step) -> torch.Tensor:
    """A user's plain eager loop: transformers' forward of each request's tokens so far, the
    logits of its last token (``--reference test_testing_kit:hf_reference``)."""
    with torch.no_grad():
        return torch.stack([hf_model()(input_ids=torch.as_tensor(seq, dtype=torch.long)[None]).logits[0, -1]
                            for seq in step.sequences()])


def hf_reference_tokens(step) -> np.ndarray:
    """The same loop's greedy tokens only."""
    return hf_reference(step).argmax(-1).numpy()


@pytest.mark.parametrize("backend", ["cpu", "eager", "xla"])
def test_the_kit_passes_on_the_reference_model(backend: str) -> None:
    """Every property holds, the user's reference (transformers) included."""
    if backend == "xla":
        pytest.importorskip("jax")
    lines: list[str] = []
    results = run_conformance(model_dir(), backend, examples=EXAMPLES, report=lines.append, reference=hf_reference,
                              **(XLA_GRID if backend == "xla" else {}))
    assert "matches_reference" in [r.name for r in results]
    assert [r.name for r in results if not r.passed] == [], "\n".join(lines)
    assert all(r.examples >= 1 for r in results if r.applicable)
    assert lines[0].startswith("warm-up: ") and len(lines) == len(results) + 1
    na = NOT_APPLICABLE.get(backend, set())
    statuses = {line.split()[1]: line.split()[0] for line in lines[1:]}
    assert statuses == {r.name: "N/A" if r.name in na else "PASS" for r in results}, "\n".join(lines)
    assert all(r.examples == 0 and "not applicable" in r.note for r in results if r.name in na)


def test_the_summary_counts_not_applicable_properties_apart() -> None:
    held, na = Result("kv_isolated", 6, 1.0), Result("addresses_stable", 0, 0.1, note="not applicable: no buffers")
    failed = Result("padding_invisible", 2, 1.0, error="padding is visible", counterexample="Step: ...")
    assert (held.status, na.status, failed.status) == ("PASS", "N/A", "FAIL")
    assert na.line().startswith("N/A  addresses_stable") and "(not applicable: no buffers)" in na.line()
    assert summary([held, na]) == "1 of 1 properties hold, 1 not applicable"
    assert summary([held, na, failed]) == "1 of 2 properties hold, 1 not applicable; failed: padding_invisible"
    assert summary([held]) == "1 of 1 properties hold"


# ---- planted bugs ---------------------------------------------------------------------------

class NegativeSlotAsIndex(PagedAttention):
    """Stores K/V by indexing the cache's real slots with the slot mapping: a padded token's
    slot -1 wraps around to the last real slot (the trash row is not part of its view)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        cache, t = self.kv_cache, q.shape[0]
        slots = cache[:, :-1]
        slots[0][meta.slot_mapping] = k.reshape(t, cache.shape[2], cache.shape[3]).to(cache.dtype)
        slots[1][meta.slot_mapping] = v.reshape(t, cache.shape[2], cache.shape[3]).to(cache.dtype)
        nowhere = torch.full_like(meta.slot_mapping, -1)         # the kernel's own store: trash row
        return paged_attention_kernel(q, k, v, cache, nowhere, meta.query_start_loc, meta.seq_lens,
                                      meta.block_table, meta.token_req_idx, meta.block_size, self.scale)


class UnguardedSoftmax(PagedAttention):
    """Softmax over every masked score without the guard for rows that have no key at all: a
    padded request's tokens (seq_len 0) come out NaN."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        out = paged_attention_kernel(q, k, v, self.kv_cache, meta.slot_mapping, meta.query_start_loc,
                                     meta.seq_lens, meta.block_table, meta.token_req_idx, meta.block_size,
                                     self.scale)
        has_key = meta.seq_lens.index_select(0, meta.token_req_idx) > 0
        return torch.where(has_key[:, None], out, out * float("nan"))   # softmax(all -inf) = NaN


class StalePlan(PagedAttention):
    """Keeps its own block table and lengths (a FlashInfer-style plan) and refreshes only the
    rows of requests with tokens: padded requests read an earlier step's stale rows."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        r, width = meta.block_table.shape
        if getattr(self, "plan_table", None) is None:
            self.plan_table = torch.zeros(KIT_LIMITS["max_num_batched_tokens"], width, dtype=meta.block_table.dtype)
            self.plan_lens = torch.zeros(KIT_LIMITS["max_num_batched_tokens"], dtype=meta.seq_lens.dtype)
        live = meta.seq_lens > 0
        self.plan_table[:r].copy_(torch.where(live[:, None], meta.block_table, self.plan_table[:r]))
        self.plan_lens[:r].copy_(torch.where(live, meta.seq_lens, self.plan_lens[:r]))
        return paged_attention_kernel(q, k, v, self.kv_cache, meta.slot_mapping, meta.query_start_loc,
                                      self.plan_lens[:r], self.plan_table[:r], meta.token_req_idx,
                                      meta.block_size, self.scale)


class ReadBeforeStore(PagedAttention):
    """Attends first and stores the step's K/V afterwards: a token reads whatever its own
    slot held before the step (the kit plants NaN there)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        cache, t = self.kv_cache, q.shape[0]
        nowhere = torch.full_like(meta.slot_mapping, -1)
        out = paged_attention_kernel(q, k, v, cache, nowhere, meta.query_start_loc, meta.seq_lens,
                                     meta.block_table, meta.token_req_idx, meta.block_size, self.scale)
        real = meta.slot_mapping >= 0
        cache[0, meta.slot_mapping[real]] = k.reshape(t, cache.shape[2], cache.shape[3])[real].to(cache.dtype)
        cache[1, meta.slot_mapping[real]] = v.reshape(t, cache.shape[2], cache.shape[3])[real].to(cache.dtype)
        return out


def planted(attention: type[PagedAttention]) -> torch.nn.Module:
    """graphrt's reference Qwen3 with ``attention`` in every layer."""
    model = load_torch_model(model_dir(), dtype=torch.float32, device="cpu")
    for layer in model.attention_layers():
        layer.__class__ = attention
    return model


# (attention, the property that must catch it, a fragment of its message)
PLANTED = {
    "negative slot as index": (NegativeSlotAsIndex, "kv_isolated", "outside the step's real slots"),
    "padded rows NaN": (UnguardedSoftmax, "kv_isolated", "finite"),
    "stale block-table rows": (StalePlan, "kv_isolated", "finite"),
    "read before store": (ReadBeforeStore, "kv_isolated", "finite"),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_bug_is_caught_and_shrunk(bug: str) -> None:
    attention, prop, fragment = PLANTED[bug]
    factory = RunnerFactory(functools.partial(planted, attention), "cpu", mode="FULL")
    result = check_property(prop, factory, examples=40)
    assert not result.passed, f"{bug} was not caught"
    assert fragment in result.error, result.line()
    requests = int(result.counterexample.split(" request(s)")[0].rsplit(" ", 1)[-1])
    assert requests <= 3, result.line()


class ItemReadingModel(torch.nn.Module):
    """graphrt's reference Qwen3 plus a ``.item()`` in its forward: a host sync no graph can
    hold, so every capture fails (strict mode raises GraphCaptureError at warm-up)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.inner(input_ids, positions)
        return hidden * (1.0 if positions.max().item() >= 0 else 0.0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)

    def attention_layers(self) -> list[torch.nn.Module]:
        return self.inner.attention_layers()

    def kv_cache_spec(self) -> tuple[int, int, int]:
        return self.inner.kv_cache_spec()


#: torch's intra-op threads at each build of :func:`recording_model` / :func:`item_reading_model`
#: (the kit builds a runner's model inside its warm-up).
THREADS_SEEN: list[int] = []


def recording_model() -> torch.nn.Module:
    """``--model test_testing_kit:recording_model`` (this module is importable by name): the
    reference Qwen3, noting torch's threads as it is built."""
    THREADS_SEEN.append(torch.get_num_threads())
    return load_torch_model(model_dir(), dtype=torch.float32, device="cpu")


def item_reading_model() -> torch.nn.Module:
    """``--model test_testing_kit:item_reading_model``: :class:`ItemReadingModel`."""
    return ItemReadingModel(recording_model())


def test_a_capture_failure_in_strict_mode_is_a_fail_line(capsys: pytest.CaptureFixture[str]) -> None:
    """``--strict`` and a model no graph can hold: each property is a FAIL line naming the
    capture error (not a traceback), the summary counts them, the exit status is 1."""
    from graphrt.cli import main

    status = main(["conformance", "--model", "test_testing_kit:item_reading_model", "--backend", "cpu",
                   "--strict", "--examples", "2", "--property", "kv_isolated", "--property", "bad_input_rejected"])
    out = capsys.readouterr().out
    assert status == 1, out
    assert "warm-up: failed" in out and "GraphCaptureError" in out, out
    for name in ("kv_isolated", "bad_input_rejected"):
        line = next(line for line in out.splitlines() if line.startswith(f"FAIL {name} "))
        error = out.split(line, 1)[1].splitlines()[1]
        assert "warm-up failed: GraphCaptureError" in error and "`.item()`" in error, out
    assert "0 of 2 properties hold; failed: kv_isolated, bad_input_rejected" in out


class DoubledScale(PagedAttention):
    """Attention with twice the softmax scale: wrong the same way at every shape, padded or
    not, replayed or eager, so only a reference can see it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        return paged_attention_kernel(q, k, v, self.kv_cache, meta.slot_mapping, meta.query_start_loc,
                                      meta.seq_lens, meta.block_table, meta.token_req_idx, meta.block_size,
                                      2 * self.scale)


def test_a_reference_catches_a_bug_padding_cannot_see() -> None:
    factory = RunnerFactory(functools.partial(planted, DoubledScale), "cpu", mode="FULL")
    assert check_property("padding_invisible", factory, examples=EXAMPLES).passed
    result = check_property("matches_reference", factory, examples=20, reference=hf_reference)
    assert not result.passed, "a doubled softmax scale was not caught"
    assert "against the reference: logits differ" in result.error, result.line()
    assert result.counterexample.count("Step:") <= 3 and " 1 request(s)" in result.counterexample, result.line()
    wrong = check_property("matches_reference", factory, examples=2, reference=lambda step: np.zeros(3))
    assert "InputError: reference: returned an array of shape (3,)" in wrong.error, wrong.line()


# ---- strategies -----------------------------------------------------------------------------

def test_steps_shrink_to_few_requests_and_tokens() -> None:
    factory = RunnerFactory(model_dir(), "eager")
    args = dict(config=factory.config, num_kv_blocks=factory.num_kv_blocks, vocab_size=128)
    # No example database: a saved example from an earlier run would be the start of the
    # shrink, which may then stop short of the minimal step.
    two = find(steps(**args), lambda s: s.num_reqs >= 2, settings=settings(database=None))
    assert two.num_reqs == 2 and two.num_tokens == 2 and two.num_computed_tokens.tolist() == [0, 0]
    assert two.req_rows.tolist() == [0, 1] and (two.block_table[two.req_rows, 1:] == 0).all()


# ---- entry points ---------------------------------------------------------------------------

def test_the_cli_prints_one_line_per_property(capsys: pytest.CaptureFixture[str]) -> None:
    from graphrt.cli import main

    assert main(["conformance", "--model", model_dir(), "--backend", "eager", "--examples", "3",
                 "--property", "kv_isolated", "--property", "bad_input_rejected", "--property", "matches_reference",
                 "--reference", "test_testing_kit:hf_reference_tokens"]) == 0
    out = capsys.readouterr().out
    assert "PASS kv_isolated" in out and "PASS bad_input_rejected" in out and "PASS matches_reference" in out
    assert "3 of 3 properties hold" in out


def test_the_pytest_entry_runs_the_suite(capsys: pytest.CaptureFixture[str]) -> None:
    """``pytest --pyargs graphrt.testing.conformance`` with the plugin's options (in-process:
    a second interpreter would spend most of this test importing torch)."""
    status = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "graphrt.testing.plugin",
                          "--pyargs", "graphrt.testing.conformance", "--graphrt-model", model_dir(),
                          "--graphrt-backend", "eager", "--graphrt-examples", "2",
                          "-k", "kv_isolated or bad_input or test_matches_reference"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "2 passed, 1 skipped" in out, out          # no reference given: not applicable


def run_pytest(*args: str) -> int:
    """The conformance suite's pytest entry, in-process, with the plugin loaded by hand."""
    return pytest.main(["-q", "-p", "no:cacheprovider", "-p", "graphrt.testing.plugin",
                        "--pyargs", "graphrt.testing.conformance", *args])


def test_the_pytest_plugin_pins_threads_and_takes_options_and_ini_keys(tmp_path, capsys) -> None:
    """Without a thread setting the suite pins torch to one thread (a busy machine ran it 4x
    slower unpinned) and restores it; every setting is an option and an ini key, relative
    paths in ini keys are relative to the ini file, and the suite runs once per backend."""
    THREADS_SEEN.clear()
    torch.set_num_threads(2)
    try:
        status = run_pytest("--graphrt-model", "test_testing_kit:recording_model", "--graphrt-backend", "eager",
                            "--graphrt-examples", "2", "--graphrt-reference", "test_testing_kit:hf_reference",
                            "-k", "bad_input or test_matches_reference")
        out = capsys.readouterr().out
        assert status == 0 and "2 passed" in out, out
        assert THREADS_SEEN == [1] and torch.get_num_threads() == 2

        (tmp_path / "strict_model.py").write_text("from test_testing_kit import item_reading_model as build\n")
        ini = tmp_path / "pytest.ini"
        ini.write_text("[pytest]\ngraphrt_model = strict_model.py:build\ngraphrt_backend = cpu\n"
                       "graphrt_examples = 1\ngraphrt_threads = 3\ngraphrt_strict = true\n")
        status = run_pytest("-c", str(ini), "-k", "bad_input")
        out = capsys.readouterr().out
        assert status == 1 and "1 failed" in out, out
        assert "FAIL bad_input_rejected" in out and "warm-up failed: GraphCaptureError" in out, out
        assert THREADS_SEEN == [1, 3] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)

    ini.write_text("[pytest]\ngraphrt_model = strict_model.py:build\ngraphrt_backend = eager xla\n")
    assert run_pytest("-c", str(ini), "--collect-only", "-k", "kv_isolated") == 0
    assert "test_kv_isolated[eager]" in (out := capsys.readouterr().out) and "test_kv_isolated[xla]" in out, out
    assert run_pytest("-c", str(ini), "--collect-only", "-k", "kv_isolated", "--graphrt-backend", "cpu,eager",
                      "--graphrt-backend", "xla") == 0
    out = capsys.readouterr().out
    assert all(f"test_kv_isolated[{b}]" in out for b in ("cpu", "eager", "xla")), out
    ini.write_text("[pytest]\ngraphrt_threads = many\n")
    assert run_pytest("-c", str(ini), "--collect-only") == pytest.ExitCode.USAGE_ERROR
    assert "graphrt_threads: expected an integer, got 'many'" in capsys.readouterr().err


def test_the_docs_example_model_passes(tmp_path) -> None:
    """docs/testing.md's user-written model and attention, run as the page says."""
    (tmp_path / "my_model.py").write_text(docs_example_code())
    results = run_conformance(f"{tmp_path / 'my_model.py'}:build", "cpu", examples=3, report=None)
    assert [r.name for r in results if not r.passed] == [], [r.line() for r in results]


def docs_example_code() -> str:
    """docs/testing.md's complete example: a user's model with its own attention."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "testing.md").read_text()
    return text.split("## A complete example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


@pytest.fixture
def forget_modules():
    """Names of modules a test loads from its own files, dropped from ``sys.modules`` after it."""
    names: list[str] = []
    yield names
    for name in names:
        sys.modules.pop(name, None)


def test_a_model_file_imports_its_sibling_modules(tmp_path, capsys, forget_modules) -> None:
    """``--model file.py:fn`` whose file imports a module beside it, at load time and inside
    the builder, works without PYTHONPATH, and leaves ``sys.path`` as it was."""
    from graphrt.cli import main

    forget_modules += ["kit_sibling_attention", "kit_sibling_seed", "kit_sibling_model"]
    (tmp_path / "kit_sibling_attention.py").write_text(docs_example_code())
    (tmp_path / "kit_sibling_seed.py").write_text("SEED = 0\n")
    (tmp_path / "kit_sibling_model.py").write_text(
        "import torch\n\nfrom kit_sibling_attention import TinyLM\n\n\n"
        "def build():\n    from kit_sibling_seed import SEED\n\n"
        "    torch.manual_seed(SEED)\n    return TinyLM().eval()\n")
    path = list(sys.path)
    assert main(["conformance", "--model", f"{tmp_path / 'kit_sibling_model.py'}:build", "--backend", "eager",
                 "--examples", "2", "--property", "bad_input_rejected"]) == 0
    assert "PASS bad_input_rejected" in capsys.readouterr().out
    assert sys.path == path


def test_import_graphrt_stays_free_of_the_kit() -> None:
    code = ("import sys, graphrt; heavy = {'hypothesis', 'pytest', 'torch', 'jax', 'graphrt.testing'}; "
            "print(sorted(heavy & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert np.int32  # the kit's steps are numpy arrays
