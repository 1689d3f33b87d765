"""Backend registry: names, aliases, availability reasons, lazy imports.

This machine has no GPU and no torch_npu: ``cuda`` and ``npu`` must be unavailable with a
reason, ``cpu`` and ``eager`` (torch) available.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import subprocess
import sys

import pytest

import graphrt
from graphrt import BackendUnavailableError, GraphrtError, available_backends, select_backend
from graphrt import registry

NAMES = {"cuda", "npu", "cpu", "xla", "eager"}
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_JAX = importlib.util.find_spec("jax") is not None


def _has_cuda() -> bool:
    if not HAS_TORCH:
        return False
    import torch
    return torch.cuda.is_available()


HAS_NPU = importlib.util.find_spec("torch_npu") is not None


def test_available_backends_lists_every_backend():
    got = available_backends()
    assert set(got) == NAMES
    for name, reason in got.items():
        assert reason is None or (isinstance(reason, str) and reason.strip()), (name, reason)


@pytest.mark.parametrize("name", sorted(NAMES))
def test_backend_module_imports_without_its_device(name):
    """Each backend module must import here (lazily needing its framework / device), so that
    its ``unavailable_reason`` can explain what is missing instead of an ImportError."""
    module, cls = registry.BACKENDS[name].split(":")
    backend = getattr(importlib.import_module(module), cls)
    reason = backend.unavailable_reason()
    assert reason is None or (isinstance(reason, str) and reason.strip())
    assert registry.unavailable_reason(name) == reason


@pytest.mark.skipif(_has_cuda(), reason="a CUDA GPU is present")
def test_cuda_unavailable_here():
    reason = available_backends()["cuda"]
    assert isinstance(reason, str) and reason
    with pytest.raises(BackendUnavailableError) as excinfo:
        select_backend("cuda")
    err = excinfo.value
    assert isinstance(err, GraphrtError) and isinstance(err, RuntimeError)
    assert "cuda" in str(err) and reason in str(err)


@pytest.mark.skipif(HAS_NPU, reason="torch_npu is installed")
@pytest.mark.parametrize("name", ["npu", "acl", "NPU"])
def test_npu_unavailable_here(name):
    reason = available_backends()["npu"]
    assert isinstance(reason, str) and reason
    with pytest.raises(BackendUnavailableError) as excinfo:
        select_backend(name)
    assert "npu" in str(excinfo.value) and reason in str(excinfo.value)


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("name", ["cpu", "eager"])
def test_torch_cpu_backends_available(name):
    assert available_backends()[name] is None
    backend = select_backend(name)
    assert backend.name == name
    assert type(backend).unavailable_reason() is None


@pytest.mark.skipif(not HAS_JAX, reason="jax is not installed")
def test_xla_available_with_jax():
    assert available_backends()["xla"] is None
    assert select_backend("jax").name == "xla"


@pytest.mark.skipif(_has_cuda() or HAS_NPU or not HAS_TORCH, reason="an accelerator is present")
@pytest.mark.skipif(not HAS_JAX, reason="jax is not installed")
def test_auto_picks_with_start_up_in_mind_on_a_cpu_and_says_why(caplog, monkeypatch):
    """issue 47: on a CPU, auto picked xla for a checkpoint, which compiled every bucket before
    README's first token (minutes for a two-layer toy). Now eager, which starts at once, for a
    checkpoint or a torch module, xla for a JAX model; the pick and its reason are logged and in
    available_backends()."""
    import torch

    monkeypatch.setattr(registry, "jax_accelerator", lambda: None)
    with caplog.at_level(logging.INFO, logger="graphrt.registry"):
        assert select_backend("auto").name == "eager"
    assert "backend auto -> eager: no accelerator, so start-up decides: eager serves the first token at once" \
        in caplog.text and "backend='xla'" in caplog.text
    assert select_backend("AUTO").name == "eager"
    assert select_backend("auto", model=torch.nn.Linear(2, 2)).name == "eager"
    avail = available_backends()
    assert avail.auto == "eager" and "start-up" in avail.auto_reason and "backend='cpu'" in avail.auto_reason
    assert avail["cpu"] is None and dict(avail) == {k: avail[k] for k in registry.BACKENDS}
    from graphrt.backends.xla.programs import XlaModel
    from graphrt.models.hf_config import DecoderConfig

    jax_model = XlaModel(config=None, params={})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="graphrt.registry"):
        assert select_backend("auto", model=jax_model).name == "xla"
    assert "backend auto -> xla: a JAX model" in caplog.text
    pair = (DecoderConfig.__new__(DecoderConfig), {})
    assert available_backends(pair).auto == "xla" and available_backends(jax_model).auto == "xla"


@pytest.mark.skipif(not HAS_TORCH or not HAS_JAX, reason="torch and jax")
def test_auto_keeps_the_device_picks(caplog, monkeypatch):
    """Where a device is visible the pick is as before: cuda, npu, and xla where JAX sees a TPU
    (before eager; a torch module still gets a torch backend)."""
    import torch

    reasons = dict(available_backends())
    monkeypatch.setattr(registry, "jax_accelerator", lambda: "tpu")
    with caplog.at_level(logging.INFO, logger="graphrt.registry"):
        assert select_backend("auto").name == "xla"
    assert "backend auto -> xla: JAX sees an accelerator (tpu)" in caplog.text
    assert available_backends().auto == "xla"
    assert select_backend("auto", model=torch.nn.Linear(2, 2)).name == "eager"
    for device in ("cuda", "npu"):
        seen = {**reasons, device: None}
        assert registry.auto_choice(None, seen.get) == (device, registry.AUTO_REASONS[device])
        assert registry.auto_choice(torch.nn.Linear(2, 2), seen.get)[0] == device
    monkeypatch.setattr(registry, "jax_accelerator", lambda: None)
    none = {name: "missing" for name in registry.BACKENDS}
    assert registry.auto_choice(None, none.get) == (None, "no backend is available: cuda: missing; npu: missing; "
                                                          "eager: missing; xla: missing; cpu: missing")
    no_torch = {**none, "xla": None}
    assert registry.auto_choice(None, no_torch.get)[0] == "xla"


def test_aliases_and_case():
    assert registry.canonical_name("acl") == "npu"
    assert registry.canonical_name("jax") == "xla"
    assert registry.canonical_name("CUDA") == "cuda"
    assert registry.canonical_name("Eager") == "eager"
    for name in NAMES:
        assert registry.canonical_name(name) == name


@pytest.mark.parametrize("name", ["tpu", "rocm", "", "cuda0"])
def test_unknown_name_lists_the_valid_ones(name):
    for call in (select_backend, registry.canonical_name, registry.unavailable_reason):
        with pytest.raises(ValueError) as excinfo:
            call(name)
        assert not isinstance(excinfo.value, BackendUnavailableError)
        message = str(excinfo.value)
        for valid in sorted(NAMES) + ["acl", "jax", "auto"]:
            assert valid in message, (valid, message)


def test_public_names():
    for name in ("select_backend", "available_backends", "BucketPolicy", "Padder", "GraphCache",
                 "prepare_inputs", "ModelInputs", "GraphrtError", "BackendUnavailableError",
                 "InputError", "CacheMissError"):
        assert hasattr(graphrt, name), name
    assert issubclass(graphrt.InputError, ValueError)
    assert issubclass(graphrt.InputError, graphrt.GraphrtError)
    assert issubclass(graphrt.BackendUnavailableError, graphrt.GraphrtError)
    assert issubclass(graphrt.CacheMissError, graphrt.GraphrtError)
    with pytest.raises(AttributeError):
        graphrt.NoSuchThing  # noqa: B018


def test_import_graphrt_imports_neither_torch_nor_jax():
    code = (
        "import json, sys\n"
        "import graphrt\n"
        "import graphrt.core.inputs.preparer, graphrt.core.inputs.padding, graphrt.core.buckets, graphrt.core.dispatch\n"
        "import graphrt.core.cache, graphrt.config, graphrt.registry, graphrt.layers.torch.forward_context\n"
        "heavy = ('torch', 'jax', 'jaxlib', 'torch_npu', 'flax')\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
