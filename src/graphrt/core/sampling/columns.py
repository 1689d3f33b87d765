"""A sampling batch's optional columns: min-p, the penalties and the prompt lengths they need.

Rules as :mod:`graphrt.core.sampling.batch`'s (one :class:`~graphrt.core.sampling.rule.Rule` per
field, an ``InputError`` naming the field and the row); a column every row leaves neutral is
kept as None, so a batch without them costs nothing more.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from graphrt.core.errors import InputError
from graphrt.core.sampling.rule import Rule, check_rows

#: Presence and frequency penalties lie in [-PENALTY_LIMIT, PENALTY_LIMIT] (vLLM's and SGLang's bound).
SAMPLING_PENALTY_LIMIT = 2.0
#: ``repetition_penalty`` bounds. vLLM takes any finite value > 0, SGLang (0, 2]; graphrt takes
#: [1/100, 100]: a factor of 100 already takes a seen logit of 20 to 0.2 (or -20 to -2000), and
#: past it a penalty changes little but how close the penalised logits come to float32's
#: overflow (the sampler's arithmetic stays finite for any factor, clamping at float32's max).
SAMPLING_MIN_REPETITION_PENALTY = 0.01
SAMPLING_MAX_REPETITION_PENALTY = 100.0

MIN_P = Rule("min_p", "real number", "fiu", np.float32, "in [0, 1] (0: no min-p filter)",
             rows_ok=lambda p: (p >= 0.0) & (p <= 1.0),
             bounds_ok=lambda lo, hi: lo >= 0.0 and hi <= 1.0)
# The bounds as float32 holds them (the rules compare float32 values).
_REP_LO = float(np.float32(SAMPLING_MIN_REPETITION_PENALTY))
_REP_HI = float(np.float32(SAMPLING_MAX_REPETITION_PENALTY))
REPETITION_PENALTY = Rule("repetition_penalty", "real number", "fiu", np.float32,
                          f"in [{SAMPLING_MIN_REPETITION_PENALTY:g}, {SAMPLING_MAX_REPETITION_PENALTY:g}] "
                          "(1: no repetition penalty)",
                          rows_ok=lambda r: (r >= _REP_LO) & (r <= _REP_HI),
                          bounds_ok=lambda lo, hi: lo >= _REP_LO and hi <= _REP_HI)
_PENALTY = SAMPLING_PENALTY_LIMIT
PRESENCE_PENALTY, FREQUENCY_PENALTY = (
    Rule(name, "real number", "fiu", np.float32, f"in [-{_PENALTY:g}, {_PENALTY:g}] (0: none)",
         rows_ok=lambda v: (v >= -_PENALTY) & (v <= _PENALTY),
         bounds_ok=lambda lo, hi: lo >= -_PENALTY and hi <= _PENALTY)
    for name in ("presence_penalty", "frequency_penalty"))
PROMPT_LENS = Rule("prompt_lens", "integer", "iu", np.int64, ">= 0", rows_ok=lambda n: n >= 0,
                   bounds_ok=lambda lo, hi: lo >= 0)
#: (rule, the value that turns it off) of each penalty column, in ``SamplingBatch.penalties`` order.
PENALTY_RULES = ((REPETITION_PENALTY, 1.0), (PRESENCE_PENALTY, 0.0), (FREQUENCY_PENALTY, 0.0))


def _column(rule: Rule, values: Any, n: int) -> np.ndarray:
    """One optional column, one checked value per request."""
    arr = rule.check(values, ndim=1)
    check_rows(arr, rule.field, n)
    return arr


def filter_columns(n: int, min_p: Any, penalties: tuple, prompt_lens: Any) -> tuple:
    """A batch's optional columns, checked: min_p (None when every row is 0), the penalty
    columns (None when every row is neutral; a column not given is neutral) and prompt_lens
    (required with penalties)."""
    mp = None if min_p is None else _column(MIN_P, min_p, n)
    if mp is not None and not mp.any():
        mp = None
    cols = None
    if any(v is not None for v in penalties):
        cols = tuple(np.full(n, off, np.float32) if v is None else _column(rule, v, n)
                     for (rule, off), v in zip(PENALTY_RULES, penalties))
        if all((c == off).all() for c, (_, off) in zip(cols, PENALTY_RULES)):
            cols = None
    lens = None if prompt_lens is None else _column(PROMPT_LENS, prompt_lens, n)
    if cols is not None and lens is None:
        raise InputError("prompt_lens", "one prompt length per request is needed when a row has a "
                                        "penalty: the repetition penalty counts prompt and generated "
                                        "tokens, presence / frequency penalties generated ones only")
    return mp, cols, lens


__all__ = ["SAMPLING_PENALTY_LIMIT", "SAMPLING_MIN_REPETITION_PENALTY", "SAMPLING_MAX_REPETITION_PENALTY", "MIN_P",
           "REPETITION_PENALTY", "PRESENCE_PENALTY", "FREQUENCY_PENALTY", "PROMPT_LENS", "PENALTY_RULES",
           "filter_columns"]
