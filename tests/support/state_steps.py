"""Drawn steps of the recurrent-state kernels' tests: request layouts and their state metadata
(the kernel tests of RG-LRU and lightning attention share them)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from graphrt.layers.torch.state.metadata import build_state_metadata


@st.composite
def state_layouts(draw: st.DrawFn, slots: int, max_new: int) -> tuple[list[tuple[int, int, int]], int, int]:
    """A step: per request (new tokens up to ``max_new``, computed tokens, slot of ``slots`` or -1
    for padded), the padded tokens after them, and a seed."""
    n = draw(st.integers(1, 4))
    order = draw(st.permutations(range(slots)))[:n]
    reqs = [(draw(st.integers(0, max_new)), draw(st.integers(0, 9)), s if draw(st.booleans()) or i == 0 else -1)
            for i, s in enumerate(order)]
    reqs = [(max(q, i == 0) if s >= 0 else 0, c if s >= 0 else 0, s) for i, (q, c, s) in enumerate(reqs)]
    return reqs, draw(st.integers(0, 3)), draw(st.integers(0, 2**16))


def state_meta(reqs: list[tuple[int, int, int]], pad: int, *, slots: int, checkpoints: int,
               uniform: int = 0) -> tuple[object, int]:
    """(the state metadata of ``reqs`` with ``pad`` padded tokens, the step's token count)."""
    lens = [q for q, _, _ in reqs]
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    total = int(qsl[-1]) + pad
    return build_state_metadata(qsl, torch.tensor([c for _, c, _ in reqs], dtype=torch.int32),
                                torch.tensor([s for _, _, s in reqs], dtype=torch.int32), total,
                                num_slots=slots, checkpoints=checkpoints, uniform_query_len=uniform), total
