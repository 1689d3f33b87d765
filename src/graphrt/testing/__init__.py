"""graphrt.testing: the property-based padding and graph conformance kit (docs/testing.md).

Run it on your own model, attention backend and device:

* :mod:`graphrt.testing.strategies` -- hypothesis strategies: :func:`~.strategies.steps`,
  :func:`~.strategies.bad_steps`, :func:`~.strategies.traces`;
* :mod:`graphrt.testing.properties` -- each property a function ``(factory, step)`` that
  raises ``AssertionError`` saying what broke;
* :mod:`graphrt.testing.conformance` -- every property, N examples each:
  :func:`~.conformance.run_conformance`, ``graphrt conformance`` and a pytest entry;
* :mod:`graphrt.testing.runners` -- :class:`~.runners.RunnerFactory` and how a step is run;
* :mod:`graphrt.testing.access` -- KV cache and buffers of torch and XLA executors as numpy.

``import graphrt`` does not import this package, and this package imports hypothesis,
pytest, torch and jax only in the modules and functions that need them.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "RunnerFactory": "graphrt.testing.runners",
    "Step": "graphrt.testing.step",
    "BadStep": "graphrt.testing.step",
    "run_conformance": "graphrt.testing.conformance",
    "check_property": "graphrt.testing.conformance",
    "PROPERTIES": "graphrt.testing.properties",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'graphrt.testing' has no attribute {name!r}")


__all__ = sorted(_LAZY)
