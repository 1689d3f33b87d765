"""pytest plugin of the conformance suite: its options and fixtures.

Loaded by the ``pytest11`` entry point of an installed graphrt, or explicitly with
``-p graphrt.testing.plugin``. Imports nothing heavy: the kit loads when a test asks for it.

Options: ``--graphrt-model`` (a Hugging Face directory or ``module:function`` returning a
fresh model), ``--graphrt-backend`` (default ``cpu``), ``--graphrt-mode`` (a graph mode, e.g.
``FULL``) and ``--graphrt-examples`` (per property). Without ``--graphrt-model`` the suite's
tests skip.
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("graphrt", "graphrt conformance suite (graphrt.testing)")
    group.addoption("--graphrt-model", default=None,
                    help="model for graphrt.testing.conformance: a Hugging Face directory or module:function")
    group.addoption("--graphrt-backend", default="cpu", help="graphrt backend name (default cpu)")
    group.addoption("--graphrt-mode", default=None, help="graph mode, e.g. FULL (default: the config's)")
    group.addoption("--graphrt-examples", type=int, default=None, help="examples per property")


@pytest.fixture(scope="session")
def graphrt_factory(request: Any) -> Any:
    """The runner factory of the command line's model, backend and mode."""
    spec = request.config.getoption("--graphrt-model")
    if spec is None:
        pytest.skip("graphrt conformance: no --graphrt-model given")
    from graphrt.testing.conformance import load_model
    from graphrt.testing.runners import RunnerFactory

    mode = request.config.getoption("--graphrt-mode")
    fields = {"mode": mode} if mode else {}
    return RunnerFactory(load_model(spec), request.config.getoption("--graphrt-backend"), **fields)


@pytest.fixture(scope="session")
def graphrt_examples(request: Any) -> int:
    """Examples per property (``--graphrt-examples``, default the suite's)."""
    from graphrt.testing.conformance import DEFAULT_EXAMPLES

    n = request.config.getoption("--graphrt-examples")
    return DEFAULT_EXAMPLES if n is None else int(n)
