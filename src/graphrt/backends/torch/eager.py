"""``eager``: the same interface with no graphs (a baseline, and the reference in tests).

Pieces: the shared dispatcher (every key runs eagerly), :class:`graphrt.Padder` and
:class:`graphrt.GraphCache`; no device-graph API.
"""

from __future__ import annotations

from graphrt.backends.torch.backend import TorchBackend


class EagerBackend(TorchBackend):
    """Runs every step eagerly on the same static buffers the graph backends use."""

    name = "eager"
