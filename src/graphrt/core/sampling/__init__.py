"""Sampling on the host: a request's and a step's sampling fields checked by one rule each.

The rule of a numeric field (``rule``), the step's ``SamplingBatch`` and the per-field checks
(``batch``), its optional columns (``columns``: min-p, penalties), the penalty ledger
(``penalty_ledger``) and the logprobs a step returns (``logprobs``). Numpy only.
"""
