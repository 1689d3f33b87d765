"""Every test module runs on a heap the garbage collector has already seen (tests/conftest.py).

Every warm-up calls ``gc.collect()`` before it freezes what is alive
(``graphrt.core.collector.objects_frozen``, vLLM #21146). In a pytest worker that collected the
whole suite (about two million objects) each of those collections takes about a second, paid by
every runner a test builds. :func:`hold_for_module` holds ``objects_frozen`` for a module, so the
heap is collected and frozen once and each warm-up's collection then walks only what was made
since. graphrt's own code is unchanged (it still collects, freezes and pauses the collector
around captures; the hold only keeps the last thread out from unfreezing). The price: cyclic
garbage frozen at a warm-up while alive (the earlier tests' runners) waits for the module's end --
fine for tiny models. A module that checks the collector itself, or when objects are freed, opts
out with ``pytestmark = pytest.mark.live_heap``; ``GRAPHRT_TEST_FROZEN_HEAP=off`` runs every module
without it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import pytest

from graphrt.core.collector import objects_frozen


@contextlib.contextmanager
def hold_for_module(module: pytest.Module) -> Iterator[None]:
    """Hold ``objects_frozen`` while ``module``'s tests run, unless it is marked ``live_heap``."""
    if module.get_closest_marker("live_heap") is not None or os.environ.get("GRAPHRT_TEST_FROZEN_HEAP") == "off":
        yield
        return
    with objects_frozen():
        yield
