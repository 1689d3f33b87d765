"""Numbers are numbers and flags are flags (issue 46, item 14).

* Every field of ``GraphConfig``, read off its annotation (a field added later is covered too):
  an integer field refuses ``"5"``, ``True`` and ``5.0``, a list of sizes ``["4"]``, ``[True]``
  and ``[4.0]``, a flag ``1`` and ``"yes"`` -- a ``ConfigError`` naming the field (pydantic's lax
  mode took ``refit_interval="5"`` as 5 and ``True`` as 1). What the CLI passes (argparse's typed
  values), numpy integers, tuples of sizes, a mode's name and a config's own dump still build.
* ``ModelRunner``'s ``num_kv_blocks`` / ``kv_cache_memory`` and ``LLM``'s
  ``schedule_conservativeness`` refuse strings and bools (a raw ``TypeError``, or taken) before
  the model is loaded.
* LoRA slots that do not fit in the memory available now are a ``ConfigError`` naming
  ``max_lora_rank`` or ``max_loras``, both values and the bytes, before they are allocated (the
  allocator's raw error before).
"""

from __future__ import annotations

import argparse
import re
import typing
from typing import Annotated, Any

import numpy as np
import pytest

import graphrt
from graphrt import ConfigError, GraphConfig, InputError
from graphrt.backends.torch.backend import TorchBackend
from graphrt.config import add_cli_args, from_cli_args
from graphrt.core import memory_bounds
from graphrt.models.torch import lora as torch_lora
from support.hf_models import tiny_hf_model_dir

SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4)


def _kind(annotation: Any) -> str | None:
    """'int', 'bool' or 'list' for a field of that type (Optional / Annotated unwrapped)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Union:
        return _kind(next(a for a in args if a is not type(None)))
    if typing.get_origin(annotation) is Annotated:
        return _kind(args[0])
    if typing.get_origin(annotation) is list:
        return "list"
    return {int: "int", bool: "bool"}.get(annotation)


BAD_VALUES = {"int": ["5", True, 5.0, b"5"], "list": [["4"], [True], [4.0]], "bool": [1, 0, "yes", 1.0]}
CASES = [(name, value) for name, info in GraphConfig.model_fields.items() if _kind(info.annotation)
         for value in BAD_VALUES[_kind(info.annotation)]]


def test_the_fields_are_read_off_the_annotations():
    kinds = {name: _kind(info.annotation) for name, info in GraphConfig.model_fields.items()}
    assert kinds["refit_interval"] == kinds["refit_max_buckets"] == kinds["max_num_seqs"] == "int"
    assert kinds["cudagraph_capture_sizes"] == "list" and kinds["enforce_eager"] == "bool"


@pytest.mark.parametrize("name, value", CASES, ids=[f"{n}={v!r}" for n, v in CASES])
def test_a_number_or_flag_of_the_wrong_type_is_refused_naming_the_field(name, value):
    with pytest.raises(ConfigError) as err:
        GraphConfig.create(**{name: value})
    assert re.match(rf"{name}(\.0)?: ", str(err.value)), str(err.value)


@pytest.mark.parametrize("value", ["64", True, 64.0])
def test_llm_refuses_a_refit_interval_that_is_not_an_integer_before_loading(value, monkeypatch):
    monkeypatch.setattr(TorchBackend, "load_model", lambda *a, **k: pytest.fail("loaded before the check"))
    with pytest.raises(ConfigError, match=r"^refit_interval: .*must be an integer"):
        graphrt.LLM(str(tiny_hf_model_dir("qwen3")), backend="eager", refit_interval=value, **SMALL)


def test_what_the_cli_and_python_callers_pass_still_builds():
    parser = add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--refit-interval", "0",
                              "--refit-max-buckets", "3", "--cudagraph-capture-sizes", "4", "8", "--mode",
                              "PIECEWISE", "--enforce-eager", "--piecewise-capture", "fx", "--max-lora-rank", "8"])
    c = from_cli_args(args)
    assert (c.max_num_seqs, c.refit_max_buckets, c.cudagraph_capture_sizes, c.enforce_eager) == (4, 3, [4, 8], True)
    assert c.mode is graphrt.GraphMode.PIECEWISE and c.max_lora_rank == 8
    c = GraphConfig.create(mode="FULL_DECODE_ONLY", cudagraph_capture_sizes=(np.int64(4), 8), max_num_seqs=np.int32(4),
                           refit_interval=np.int64(0), refit_max_buckets=np.uint8(2), max_num_batched_tokens=64)
    assert c.cudagraph_capture_sizes == [4, 8] and type(c.refit_max_buckets) is int
    for dumped in (c.model_dump(), c.model_dump(mode="json")):      # a worker's copy, a JSON round trip
        assert GraphConfig.create(**dumped) == c


RUNNER_BAD = [("num_kv_blocks", "64"), ("num_kv_blocks", True), ("num_kv_blocks", 64.0),
              ("kv_cache_memory", "1000000"), ("kv_cache_memory", True), ("kv_cache_memory", float("nan"))]


@pytest.mark.parametrize("name, value", RUNNER_BAD, ids=[f"{n}={v!r}" for n, v in RUNNER_BAD])
def test_runner_size_keywords_refuse_strings_bools_and_floats_before_loading(name, value, monkeypatch):
    monkeypatch.setattr(TorchBackend, "load_model", lambda *a, **k: pytest.fail("loaded before the check"))
    with pytest.raises(InputError) as err:
        graphrt.ModelRunner(str(tiny_hf_model_dir("qwen3")), backend="eager", progress=False, **{name: value}, **SMALL)
    assert err.value.field == name and repr(value) in str(err.value), str(err.value)


@pytest.mark.parametrize("value", ["0.5", True, float("inf")])
def test_llm_schedule_conservativeness_refuses_strings_and_bools_before_loading(value, monkeypatch):
    monkeypatch.setattr(TorchBackend, "load_model", lambda *a, **k: pytest.fail("loaded before the check"))
    with pytest.raises(InputError) as err:
        graphrt.LLM(str(tiny_hf_model_dir("qwen3")), backend="eager", schedule_conservativeness=value, **SMALL)
    assert err.value.field == "schedule_conservativeness"


# ---- LoRA slots against the memory available now ---------------------------------------------------

#: (max_loras, max_lora_rank, the field named): the one further above its default is named.
LORA = [(2, 512, "max_lora_rank"), (4, 16, "max_loras")]


@pytest.mark.parametrize("loras, rank, field", LORA)
def test_lora_slots_past_the_available_memory_are_a_config_error_before_allocating(loras, rank, field, monkeypatch):
    """Memory short: the host reports less available than the slots need, and the allocator
    would fail (LoRALinear raises as torch's allocator does)."""
    def allocator_fails(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: not enough memory")

    model_dir = str(tiny_hf_model_dir("qwen3"))
    model = graphrt.select_backend("eager").load_model(model_dir)
    need = torch_lora.lora_slot_bytes(model, loras, rank) if hasattr(torch_lora, "lora_slot_bytes") else 1
    monkeypatch.setattr(memory_bounds, "available_memory_bytes", lambda: need - 1, raising=False)
    monkeypatch.setattr(torch_lora.LoRALinear, "__init__", allocator_fails)
    with pytest.raises(ConfigError) as err:
        graphrt.ModelRunner(model, backend="eager", progress=False, warmup=False, max_loras=loras,
                            max_lora_rank=rank, **SMALL)
    text = str(err.value)
    assert text.startswith(f"{field}: implies {need} bytes"), text
    assert f"max_loras={loras}" in text and f"max_lora_rank={rank}" in text and f"{need - 1} bytes" in text, text


def test_lora_slots_that_fit_are_allocated_as_counted():
    model = graphrt.select_backend("eager").load_model(str(tiny_hf_model_dir("qwen3")))
    need = torch_lora.lora_slot_bytes(model, 2, 8)
    runner = graphrt.ModelRunner(model, backend="eager", progress=False, warmup=False, max_loras=2, max_lora_rank=8,
                                 **SMALL)
    held = sum(layer.lora_a.nbytes + layer.lora_b.nbytes for layer in runner.executor.lora.layers.values())
    assert held == need > 0
