"""A module's tests built on a heap the garbage collector has already seen.

Every warm-up calls ``gc.collect()`` before it freezes what is alive
(``graphrt.core.collector.objects_frozen``, vLLM #21146). In a pytest worker that collected the
whole suite (about two million objects) each of those collections takes about a second, paid by
every runner a test builds. A module that builds dozens of runners imports :func:`frozen_heap`:
it holds ``objects_frozen`` for the module, so the heap is collected and frozen once and each
warm-up's collection then walks only what was made since. graphrt's own code is unchanged (it
still collects, freezes and pauses the collector around captures; the hold only keeps the last
thread out from unfreezing). The price: cyclic garbage frozen at a warm-up while alive (the
earlier tests' runners) waits for the module's end -- fine for tiny models, not for a module
that checks when objects are freed.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from graphrt.core.collector import objects_frozen


@pytest.fixture(autouse=True, scope="module")
def frozen_heap() -> Iterator[None]:
    """Hold ``objects_frozen`` for the module (autouse where a test module imports it)."""
    with objects_frozen():
        yield
