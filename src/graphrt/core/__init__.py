"""graphrt's core: what every backend shares, on numpy alone (no torch, no jax).

Grouped by job: input preparation (``inputs``: the field table, the preparer and its padder,
the host loops), sampling (``sampling``: the fields' rules, the step's batch, penalties,
logprobs), and, at this level, the rest: the bucket policies (``buckets``), the dispatcher that
owns the graph keys (``dispatch``), the graph cache with its statistics (``cache``), the numbers
(``defaults``), the errors and the cross-shape tolerance (``numerics``).
"""

__version__ = "0.1.0"
