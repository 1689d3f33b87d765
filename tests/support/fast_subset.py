"""What ``make test-fast`` runs of a test: hypothesis example counts that follow the run's
profile (tests/conftest.py registers them), and parametrized matrices whose off-diagonal
combinations are marked ``slow``.

A test that asks for ``max_examples=examples(200)`` draws 200 examples under the ``ci``
profile (``make test``, the default) and a fifth of them under ``fast`` (``make test-fast``):
the counts in the tests are written for the whole suite, and the fast loop scales them all
the same way instead of each test knowing the profiles.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable, Iterable

import pytest
from hypothesis import settings

#: The profiles' default example counts: ``ci`` is hypothesis' own default.
CI_EXAMPLES, FAST_EXAMPLES = 100, 20
#: The fewest examples a scaled count keeps (a property still sees a few drawn steps).
MIN_EXAMPLES = 3
_ParameterSet = type(pytest.param(None))


def examples(n: int) -> int:
    """``n`` scaled by the loaded profile's ``max_examples`` against the ``ci`` profile's."""
    scaled = round(n * settings().max_examples / CI_EXAMPLES)
    return max(min(n, MIN_EXAMPLES), scaled)


def matrix(names: str, rows: list, fast: Callable[..., bool]) -> list:
    """``pytest.param`` rows for ``parametrize(names, ...)`` over the product of ``rows`` (one
    list per name; an entry may be a ``pytest.param`` with marks of its own), each id the
    values joined by ``-``; a combination ``fast(*values)`` rejects is marked ``slow``: the whole
    matrix runs in ``make test``, its main diagonal in ``make test-fast``."""
    out = []
    for combo in itertools.product(*rows):
        values, marks = [], []
        for entry in combo:
            if isinstance(entry, _ParameterSet):
                values.extend(entry.values)
                marks.extend(entry.marks)
            else:
                values.append(entry)
        if not fast(*values):
            marks.append(pytest.mark.slow)
        out.append(pytest.param(*values, marks=marks, id="-".join(map(str, values))))
    return out


def slow_except(values: Iterable, *fast: object) -> list:
    """``values`` for a ``parametrize``, all but ``fast`` marked ``slow`` (ids unchanged); a tuple
    value is a row of a several-name ``parametrize``."""
    def slow(v: object) -> object:
        return pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
    return [v if v in fast else slow(v) for v in values]


#: Test ids measured slow (one a line; ``#`` starts a comment): tests/conftest.py marks them.
SLOW_LIST = Path(__file__).resolve().parents[1] / "slow_tests.txt"


def measured_slow_ids() -> set[str]:
    """The node ids in :data:`SLOW_LIST`."""
    if not SLOW_LIST.exists():
        return set()
    lines = (line.split("#", 1)[0].strip() for line in SLOW_LIST.read_text().splitlines())
    return {line for line in lines if line}
