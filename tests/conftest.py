"""Shared fixtures: the host kernel to run a module on, and the tiny model and engine tables
the runner tests drive. The helpers the tests share live in the ``support`` package beside this
file (tests/ is on ``sys.path``: ``pythonpath`` in pyproject.toml)."""

from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under ``pytest -n N`` each worker gets one intra-op thread (before torch is imported here,
    # so spawned ranks and child processes inherit it too): N workers on N cores, not N * N threads.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from support import triton_interpreter  # noqa: F401  (first: Triton's interpreter before anything imports triton)

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from graphrt.core.inputs import host_kernels  # noqa: E402
from support import xla_test_cache  # noqa: E402
from support.frozen_heap import hold_for_module  # noqa: E402
from support.fast_subset import CI_EXAMPLES, FAST_EXAMPLES, measured_slow_ids  # noqa: E402

# ``make test`` runs the ``ci`` profile (the default), ``make test-fast`` the ``fast`` one
# (``--hypothesis-profile=fast``); support.fast_subset scales the tests' own counts to the profile.
settings.register_profile("ci", max_examples=CI_EXAMPLES)
settings.register_profile("fast", max_examples=FAST_EXAMPLES)
settings.load_profile("ci")


def pytest_configure(config: pytest.Config) -> None:
    """The run's shared JAX compilation cache (support/xla_test_cache.py)."""
    xla_test_cache.configure(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    xla_test_cache.unconfigure(config)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture: JAX's cache at the run's directory, whatever the last test did."""
    xla_test_cache.apply(item)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests listed in tests/slow_tests.txt ``slow`` (measured, beside the decorators)."""
    slow = measured_slow_ids()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="module")
def frozen_heap(request: pytest.FixtureRequest):
    """The module's tests on a heap collected and frozen once (support/frozen_heap.py): a warm-up's
    own collection then walks only what the module made, not the whole worker's heap."""
    with hold_for_module(request.node):
        yield


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
    """A tiny random Qwen3 checkpoint (tests/support/hf_models.py)."""
    from support.hf_models import tiny_hf_model_dir

    return str(tiny_hf_model_dir("qwen3"))


@pytest.fixture(scope="module")
def tables():
    """The engine tables of runner_steps.CONFIG: every row owns its own non-null blocks."""
    from support.runner_steps import CONFIG, VOCAB, Tables

    return Tables(CONFIG, VOCAB, seed=0)
