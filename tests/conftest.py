"""Shared fixtures: the host kernel to run a module on, and the tiny model and engine tables
the runner tests drive."""

from __future__ import annotations

import pytest

from graphrt.core import host_kernels


@pytest.fixture(scope="module", params=("numba", "numpy"), autouse=False)
def host_kernel(request):
    """Run a module's tests once per host-kernel implementation (via ``GRAPHRT_HOST_KERNEL``);
    numba's run is skipped where numba does not import."""
    if request.param == "numba" and host_kernels.resolve_kernel("auto") != "numba":
        pytest.skip("numba does not import here")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(host_kernels.KERNEL_ENV, request.param)
        yield request.param


@pytest.fixture(scope="module")
def model_dir() -> str:
    """A tiny random Qwen3 checkpoint (tests/hf_models.py)."""
    from hf_models import tiny_hf_model_dir

    return str(tiny_hf_model_dir("qwen3"))


@pytest.fixture(scope="module")
def tables():
    """The engine tables of runner_steps.CONFIG: every row owns its own non-null blocks."""
    from runner_steps import CONFIG, VOCAB, Tables

    return Tables(CONFIG, VOCAB, seed=0)
