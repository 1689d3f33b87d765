"""Comparing two engine loops' outputs: tokens exactly, logprobs within ``graphrt.tolerance``."""

from __future__ import annotations

import numpy as np

import graphrt


def assert_same(got: list[tuple], ref: list[tuple]) -> None:
    """``got`` and ``ref``: one ``(token_ids, finish_reason, logprobs, prompt_logprobs)`` per request.
    The same tokens and finish reasons; the same logprob entries, their values within
    ``graphrt.tolerance`` (a request that stopped at EOS still ran in the next overlapped step,
    so that step's batch, and the rounding of its matmuls, may differ from the plain loop's)."""
    assert [o[:2] for o in got] == [o[:2] for o in ref]
    tol = graphrt.tolerance()
    for a, b in zip(got, ref):
        for lists in zip(a[2:], b[2:]):
            assert (lists[0] is None) == (lists[1] is None)
            for x, y in zip(*lists) if lists[0] is not None else ():
                assert (x is None) == (y is None) and (x is None or x.keys() == y.keys())
                for token in x or ():
                    assert x[token].rank == y[token].rank
                    np.testing.assert_allclose(x[token].logprob, y[token].logprob, **tol._asdict())
