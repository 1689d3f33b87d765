"""docs/testing.md's planted-bug table, seam side: each bug an author makes at the attention seam,
run through the conformance kit in strict mode, ends as FAIL lines naming what was wrong (a
capture refused or a runner refused), never a traceback and never a PASS. (The kit's own rows
-- a -1 slot used as an index, NaN padded rows, a stale plan, a read before the store, a doubled
scale -- are tests/kit/test_testing_kit.py's; a before_replay that declares nothing is made
harmless, tests/attention/test_seam_guards.py.)
"""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest
import torch

import graphrt
from graphrt import KVCacheSpec
from graphrt.backends.torch.cpu import CpuGraphBackend
from graphrt.testing.conformance import run_conformance
from support.hf_models import tiny_hf_model_dir
from support.seam_bugs import SimCuda, apart_executor, planted_model
from support.planned_backend import planned_model
from support.user_attention import DenseBackend, dense_model, extra_input_model


def _lying_spec() -> torch.nn.Module:
    model = CpuGraphBackend().load_model(str(tiny_hf_model_dir("qwen3")))
    model.kv_cache_spec = lambda: KVCacheSpec.uniform(2, 4, 16)          # the layers keep 2 KV heads
    return model


def _keys_query_len() -> torch.nn.Module:
    class KeysQueryLen(DenseBackend):
        def keyed_host_values(self, device: Any, dtype: Any) -> tuple[str, ...]:
            return ("max_query_len",)
    model = dense_model()
    model.attention_backend = KeysQueryLen()
    return model


def _unholdable_fill() -> torch.nn.Module:
    model = extra_input_model()
    model.extra_inputs = {"embeds": graphrt.ExtraInput("token", (model.config.hidden_size,), "int32", float("nan"))}
    return model


#: name -> (model factory, kit settings, what the FAIL line names)
BUGS: dict[str, tuple[Callable[[], Any], dict[str, Any], str]] = {
    "undeclared keyed value": (lambda: dense_model(declare=False), {},
                               r"GraphCaptureError: .*'user-dense' read the host value 'max_seq_len' in build"),
    "refreshed value stashed for build": (lambda: planted_model("stashed-width"), {},
                                          r"'stashed-width': the metadata of .* depends on what before_replay left"),
    "np.from_dlpack in build": (lambda: planted_model("dlpack-width"), {}, r"numpy\.from_dlpack"),
    "vars(host) in build": (lambda: planted_model("vars-width"), {}, r"'vars-width' read the host values' __dict__"),
    "int(tensor) in build": (lambda: planted_model("item-width"), {}, r"`int\(t\)` .* reads a device value"),
    "step.on_host in build": (lambda: planted_model("on-host-width"), {"apart": True},
                              r"'on-host-width' read step\.on_host"),
    "undeclared value in before_replay": (lambda: planned_model(device_value=False), {},
                                          r"'planned-paged' read the host value 'seq_lens' in before_replay"),
    "refreshed value as a Python number": (lambda: planned_model(device_value=False, declared=True), {},
                                           r"bakes in host values that differ .* aten\.mul"),
    "KV spec the layers contradict": (_lying_spec, {}, r"ConfigError: kv_cache_spec\.groups\[0\]\.num_kv_heads: 4, "
                                                       r"but attention layer 0 \(PagedAttention\) has num_kv_heads 2"),
    "fp8 cache for a float kernel": (dense_model, {"kv_cache_dtype": "fp8"},
                                     r"ConfigError: kv_cache_spec\.groups\[0\]\.dtype: float8_e4m3fn, but attention "
                                     r"backend 'user-dense'"),
    "metadata of the wrong rows": (lambda: dense_model(wrong_shapes=True), {},
                                   r"ConfigError: attention backend 'user-dense' built metadata field 'trash_row'"),
    "a key no graph holds": (_keys_query_len, {}, r"ConfigError: .*keys on \['max_query_len'\]"),
    "extra-input fill its dtype cannot hold": (_unholdable_fill, {},
                                               r"ConfigError: .*extra_inputs\['embeds'\]\.fill: nan cannot be held by "
                                               r"int32"),
}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_seam_bug_is_a_fail_line_naming_it(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    make, settings, named = BUGS[bug]
    settings = dict(settings)
    backend: Any = "cpu"
    if settings.pop("apart", False):            # a device apart from the host: the CUDA adapter's code
        apart_executor(monkeypatch)
        backend = SimCuda()
    lines: list[str] = []
    results = run_conformance(make, backend, examples=1, report=lines.append, strict=True, mode="FULL",
                              properties=["padding_invisible", "kv_isolated"], **settings)
    assert lines[0].startswith("warm-up: failed") and re.search(named, lines[0]), lines[0]
    assert [r.status for r in results] == ["FAIL", "FAIL"]
    assert all(re.search(named, r.line()) for r in results), [r.line() for r in results]
