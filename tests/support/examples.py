"""Hypothesis example counts that follow the run's profile (tests/conftest.py registers them).

A test that asks for ``max_examples=examples(200)`` draws 200 examples under the ``ci``
profile (``make test``, the default) and a fifth of them under ``fast`` (``make test-fast``):
the counts in the tests are written for the whole suite, and the fast loop scales them all
the same way instead of each test knowing the profiles.
"""

from __future__ import annotations

from hypothesis import settings

#: The profiles' default example counts: ``ci`` is hypothesis' own default.
CI_EXAMPLES, FAST_EXAMPLES = 100, 20
#: The fewest examples a scaled count keeps (a property still sees a few drawn steps).
MIN_EXAMPLES = 3


def examples(n: int) -> int:
    """``n`` scaled by the loaded profile's ``max_examples`` against the ``ci`` profile's."""
    scaled = round(n * settings().max_examples / CI_EXAMPLES)
    return max(min(n, MIN_EXAMPLES), scaled)
