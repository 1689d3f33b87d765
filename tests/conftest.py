"""Shared fixtures."""

from __future__ import annotations

import pytest

from graphrt import host_kernels


@pytest.fixture(scope="module", params=("numba", "numpy"), autouse=False)
def host_kernel(request):
    """Run a module's tests once per host-kernel implementation (via ``GRAPHRT_HOST_KERNEL``);
    numba's run is skipped where numba does not import."""
    if request.param == "numba" and host_kernels.resolve_kernel("auto") != "numba":
        pytest.skip("numba does not import here")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(host_kernels.KERNEL_ENV, request.param)
        yield request.param
