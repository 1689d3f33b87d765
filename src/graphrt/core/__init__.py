"""graphrt's core: what every backend shares, on numpy alone (no torch, no jax).

The step's field table and input preparation (``inputs``), the padding rules
(``padding``), the host loops (``host_loops``: compiled by ``host_kernels``, or interpreted), the
bucket policies (``buckets``), the dispatcher that owns the graph keys (``dispatch``), the
graph cache with its statistics (``cache``), the forward context, the numbers
(``defaults``), the errors and the cross-shape tolerance (``numerics``).
"""

__version__ = "0.1.0"
