"""The torch executor's forward is one object (``TorchForward``, backends/torch/forward.py) that the
executor, the graph builder, PIECEWISE capture and the baked-value checks share, in place of the
executor's bound methods handed to each (issue 44)."""

from __future__ import annotations

import inspect

from graphrt.backends.torch.capture.baked_values import BakedValueChecks
from graphrt.backends.torch.capture.graph_builder import GraphBuilder
from graphrt.backends.torch.capture.piecewise_capture import PiecewiseCapture
from graphrt.backends.torch.executor import TorchExecutor
from graphrt.backends.torch.forward import TorchForward

#: What the collaborators were handed one by one before: the executor's bound methods.
BOUND_METHODS = {"forward_split", "dummy_host", "load_dummy", "step_context", "metadata", "step_host_values"}


def test_the_builder_capture_and_checks_take_the_one_forward_object() -> None:
    for cls in (GraphBuilder, PiecewiseCapture, BakedValueChecks):
        params = set(inspect.signature(cls.__init__).parameters)
        assert "forward" in params and not params & BOUND_METHODS, (cls.__name__, sorted(params & BOUND_METHODS))
    executor_methods = {"forward", "_forward_split", "_outputs", "metadata", "dummy_host", "step_context",
                        "step_host_values"}
    assert not executor_methods & set(vars(TorchExecutor))             # they are the forward object's now
    assert {"run", "run_split", "metadata", "dummy_host", "step_context", "step_host_values"} <= set(vars(TorchForward))
