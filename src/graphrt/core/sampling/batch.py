"""Sampling parameters: one rule per field, in one place.

``SamplingParams`` (one request) and :class:`SamplingBatch` (a step's arrays) check their
fields with the rules below, so both accept the same values; a bad one raises
:class:`~graphrt.core.errors.InputError` naming the field (and row) before any device work
(docs/api.md, "Sampling parameters"). A batch checks its numeric columns by min and max: a few
microseconds whatever its size; rows are looked at only to name a bad one."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from graphrt.core.errors import InputError
from graphrt.core.sampling.columns import (FREQUENCY_PENALTY, MIN_P, PENALTY_RULES, PRESENCE_PENALTY, PROMPT_LENS,
                                           REPETITION_PENALTY, filter_columns)
from graphrt.core.sampling.rule import Rule, check_rows as _rows, is_integer as _is_integer

#: A padded sampler row (request rows past a step's real ones): greedy, no top-k / top-p
#: filter (its top_k is the vocabulary size). Its token is discarded.
SAMPLER_PAD_TEMPERATURE = 0.0
SAMPLER_PAD_TOP_P = 1.0
#: Sampling seeds are integers in [0, SAMPLING_SEED_LIMIT): 64 bits, the XLA sampler's whole
#: threefry2x32 key (two 32-bit halves), a CUDA Philox seed, and the key of the numpy Philox
#: generator the torch sampler draws a CPU request's noise from. No seed is truncated or wrapped.
SAMPLING_SEED_LIMIT = 2**64
#: Largest top_k: the XLA sampler holds top_k as int32. Any value at or above the vocabulary
#: keeps every token; a SamplingBatch stores -1 (disabled) as this value.
SAMPLING_MAX_TOP_K = 2**31 - 1
#: A SamplingBatch takes the min / max of its columns as Python lists (``tolist``, ``min``,
#: ``max``) up to this many rows, with two numpy reductions above: each numpy call costs about
#: 1 us whatever the size, the lists ~40 ns a value (measured on a 2-core x86 VM).
SAMPLING_CHECK_LIST_ROWS = 16

#: ``top_k`` that disables the top-k filter.
TOP_K_DISABLED = -1
#: The largest temperature (vLLM takes [0, 2], SGLang any finite value >= 0). At 1e6 logits
#: tens apart are already equally likely to float32's precision; near float32's top the XLA
#: sampler, which divides by multiplying by ``1 / T``, saw that reciprocal flush to 0 (past
#: ~8.5e37) and drew every token alike whatever min_p / top_p kept.
SAMPLING_MAX_TEMPERATURE = 1e6

_SEED = f"None or an integer in [0, 2**{SAMPLING_SEED_LIMIT.bit_length() - 1})"


_MAX_T = SAMPLING_MAX_TEMPERATURE   # exact in float32
TEMPERATURE = Rule("temperature", "real number", "fiu", np.float32, f"in [0, {_MAX_T:g}] (0: greedy)",
                   rows_ok=lambda t: (t >= 0.0) & (t <= _MAX_T),        # NaN fails both
                   bounds_ok=lambda lo, hi: lo >= 0.0 and hi <= _MAX_T)
TOP_P = Rule("top_p", "real number", "fiu", np.float32, "in (0, 1] (1: no top-p filter)",
             rows_ok=lambda p: (p > 0.0) & (p <= 1.0),
             bounds_ok=lambda lo, hi: lo > 0.0 and hi <= 1.0)
TOP_K = Rule("top_k", "integer", "iu", np.int64, f"-1 (disabled) or in [1, {SAMPLING_MAX_TOP_K}]",
             rows_ok=lambda k: ((k >= 1) & (k <= SAMPLING_MAX_TOP_K)) | (k == TOP_K_DISABLED),
             bounds_ok=lambda lo, hi: lo >= 1 and hi <= SAMPLING_MAX_TOP_K)

def seed(value: Any, name: str = "seed") -> int | None:
    """``value`` as a Python int in [0, SAMPLING_SEED_LIMIT), or None."""
    if value is None:
        return None
    if _is_integer(value) and 0 <= value < SAMPLING_SEED_LIMIT:
        return int(value)
    raise InputError(name, f"must be {_SEED}, got {value!r}")


def max_tokens(value: Any, name: str = "max_tokens") -> int:
    """``value`` as a Python int >= 1."""
    if not _is_integer(value):
        raise InputError(name, f"must be an integer, got {value!r}")
    if value < 1:
        raise InputError(name, f"must be >= 1, got {value!r}")
    return int(value)


def logprobs(value: Any, name: str = "logprobs") -> int | None:
    """``value`` as None or a Python int >= 0 (top logprobs wanted besides the sampled token's)."""
    if value is None:
        return None
    if not _is_integer(value):
        raise InputError(name, f"must be None or an integer >= 0, got {value!r}")
    if value < 0:
        raise InputError(name, f"must be None or an integer >= 0, got {value!r}")
    return int(value)


def check_logprobs_limit(value: int | None, limit: int, name: str = "logprobs") -> None:
    """Refuse a logprobs count above ``limit`` (``GraphConfig.max_logprobs``; 0: logprobs off)."""
    if value is None:
        return
    if limit == 0:
        raise InputError(name, f"asks for logprobs ({value}), but max_logprobs is 0: logprobs are off")
    if value > limit:
        raise InputError(name, f"must be at most max_logprobs={limit}, got {value}")


def flag(value: Any, name: str) -> bool:
    """``value`` as a bool (a Python or numpy bool; not a number or a string)."""
    if not isinstance(value, (bool, np.bool_)):
        raise InputError(name, f"must be a bool, got {value!r}")
    return bool(value)


def _seeds(seeds: list, request_ids: Sequence[Any]) -> None:
    """Check a batch's ``seeds`` (a list, some not None), normalising them in place to Python
    ints, and that each seeded row's request id is an integer, different from every other
    seeded row's (each seeded request has its own generator: a repeated id would share one)."""
    given = [s for s in seeds if s is not None]
    ids = [r for r, s in zip(request_ids, seeds) if s is not None]
    if len(ids) > 1 and len(set(ids)) != len(ids):
        seen: set = set()
        dup = next(r for r in ids if r in seen or seen.add(r))
        raise InputError("request_ids", f"request id {dup!r} is on two seeded rows; each seeded request "
                                        "has its own generator, so its id must be unique in the batch")
    if (set(map(type, given)) == {int} and min(given) >= 0 and max(given) < SAMPLING_SEED_LIMIT
            and set(map(type, request_ids)) == {int}):
        return   # plain Python ints, as sampling_batch passes them
    for i, s in enumerate(seeds):
        if s is not None:
            seeds[i] = seed(s, f"seeds[{i}]")
            if not _is_integer(request_ids[i]):
                raise InputError(f"request_ids[{i}]", "a seeded row's request id must be an integer, "
                                 f"got {request_ids[i]!r}")


_min_at, _max_at = np.minimum.reduceat, np.maximum.reduceat
_NAN = float("nan")


def _bounds(t: np.ndarray, p: np.ndarray, k: np.ndarray) -> tuple[list, list]:
    """Each column's (min, max), as lists; NaN where a float column holds NaN (or, below
    ``SAMPLING_CHECK_LIST_ROWS`` rows, any non-finite value: every rule refuses those, and a
    failed bound only sends a column to its exact check)."""
    n = len(t)
    if n <= SAMPLING_CHECK_LIST_ROWS:   # a numpy call costs ~1 us: lists are cheaper
        tl, pl, kl = t.tolist(), p.tolist(), k.tolist()
        lo, hi = [min(tl), min(pl), min(kl)], [max(tl), max(pl), max(kl)]
        for i, col in enumerate((tl, pl)):
            total = sum(col)
            if not total - total == 0.0:   # NaN or +-inf among them (min / max miss NaN)
                lo[i] = hi[i] = _NAN
        return lo, hi
    # Two reductions over the three columns (NaN propagates; float64 holds float32 exactly
    # and orders int64 / uint64 correctly around the bounds).
    cols = np.concatenate((t, p, k), dtype=np.float64)
    return _min_at(cols, (0, n, 2 * n)).tolist(), _max_at(cols, (0, n, 2 * n)).tolist()


@dataclass(frozen=True, eq=False, init=False)
class SamplingBatch:
    """Per-request sampling parameters of one step, as arrays (one row per real request).

    Checked at construction by the rules of :mod:`graphrt.core.sampling.batch` (the ones
    ``SamplingParams`` uses); a bad field raises ``InputError`` naming it and its row. Fields
    are normalised (float32 / int64 arrays; seeds as Python ints), and a ``top_k`` of -1 is
    stored as ``SAMPLING_MAX_TOP_K``: at least the vocabulary, no filter. The batch is frozen,
    but an array already of its dtype is kept, not copied: change none after construction.
    """

    temperature: np.ndarray        # float32; 0 = greedy
    top_k: np.ndarray              # int64; the vocabulary size or more where disabled
    top_p: np.ndarray              # float32; 1.0 where disabled
    seeds: Sequence[int | None]    # per request; None = the device RNG
    request_ids: Sequence[int]     # identity of each request (for seeded generators)
    #: int64 per request: top logprobs wanted besides the sampled token's, -1 where a row wants
    #: none; None when no row does (then no logprobs are computed).
    logprobs: np.ndarray | None = None
    all_greedy: bool = field(init=False)
    num_reqs: int = field(init=False)
    #: The largest count of ``logprobs``; None when no row wants logprobs.
    max_num_logprobs: int | None = field(init=False)
    #: float32 per request; None when no row has a min-p filter.
    min_p: np.ndarray | None = None
    #: float32 columns (repetition, presence, frequency) per request; None when no row has a
    #: penalty (then the sampler keeps no token counts).
    penalties: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    #: int64 prompt length per request (where its generated tokens begin); given with penalties.
    prompt_lens: np.ndarray | None = None
    #: ``(row, seed, request id)`` of each seeded row, in row order (empty: no row has a seed):
    #: what a sampler's per-step loop over seeded generators walks, found once per batch.
    seeded: tuple[tuple[int, int, Any], ...] = field(init=False)

    def __init__(self, temperature: Any, top_k: Any, top_p: Any, seeds: Sequence[Any],
                 request_ids: Sequence[Any], logprobs: Sequence[Any] | None = None, *,
                 min_p: Any = None, repetition_penalty: Any = None, presence_penalty: Any = None,
                 frequency_penalty: Any = None, prompt_lens: Any = None) -> None:
        t = TEMPERATURE.array(temperature, ndim=1)
        n = len(t)
        p = TOP_P.array(top_p, ndim=1)
        _rows(p, "top_p", n)
        k = TOP_K.array(top_k, ndim=1)
        _rows(k, "top_k", n)
        _rows(seeds, "seeds", n)
        _rows(request_ids, "request_ids", n)
        greedy = True
        if n:
            lo, hi = _bounds(t, p, k)
            for i, (rule, arr) in enumerate(((TEMPERATURE, t), (TOP_P, p), (TOP_K, k))):
                if not rule.bounds_ok(lo[i], hi[i]):
                    rule.check(arr, ndim=1)   # raises naming the first bad row (or all pass: -1)
            greedy = hi[0] == 0.0
            if k.dtype != np.int64:
                k = k.astype(np.int64)   # in range: checked above
            if lo[2] < 1:   # -1 (disabled): every token
                k = np.where(k == TOP_K_DISABLED, SAMPLING_MAX_TOP_K, k)
        seeds = list(seeds)
        try:
            unseeded = seeds.count(None)
        except ValueError:   # an element whose == is an array: not a seed
            unseeded = -1
        seeded: tuple[tuple[int, int, Any], ...] = ()
        if unseeded != n:
            _seeds(seeds, request_ids)
            seeded = tuple((i, s, request_ids[i]) for i, s in enumerate(seeds) if s is not None)
        counts, most = _logprob_rows(logprobs, n)
        setattr_ = object.__setattr__   # frozen: each field is set once, here
        if min_p is not None or repetition_penalty is not None or presence_penalty is not None \
                or frequency_penalty is not None or prompt_lens is not None:
            extra = filter_columns(n, min_p, (repetition_penalty, presence_penalty, frequency_penalty), prompt_lens)
            setattr_(self, "min_p", extra[0])
            setattr_(self, "penalties", extra[1])
            setattr_(self, "prompt_lens", extra[2])
        setattr_(self, "logprobs", counts)
        setattr_(self, "max_num_logprobs", most)
        setattr_(self, "temperature", t)
        setattr_(self, "top_k", k)
        setattr_(self, "top_p", p)
        setattr_(self, "seeds", seeds)
        setattr_(self, "seeded", seeded)
        setattr_(self, "request_ids", request_ids)
        setattr_(self, "all_greedy", greedy)   # computed once: runner and executor both ask
        setattr_(self, "num_reqs", n)

    @functools.cached_property
    def top_k_ceiling(self) -> int:
        """The largest top_k of a row that samples at random, 0 when none does (the sampler
        needs its wide variant where this lies between its candidates and the vocabulary)."""
        if self.all_greedy:
            return 0
        return int(self.top_k[self.temperature > 0.0].max())

    @property
    def penalized(self) -> bool:
        """Whether some row has a repetition, presence or frequency penalty."""
        return self.penalties is not None


def _logprob_rows(values: Sequence[Any] | None, n: int) -> tuple[np.ndarray | None, int | None]:
    """A batch's ``logprobs`` column (None or one None / integer >= 0 per row) as int64 rows,
    -1 where a row wants none, and its largest count; ``(None, None)`` when no row wants any."""
    if values is None:
        return None, None
    _rows(values, "logprobs", n)
    counts = [logprobs(v, f"logprobs[{i}]") for i, v in enumerate(values)]
    wanted = [c for c in counts if c is not None]
    if not wanted:
        return None, None
    return np.array([-1 if c is None else c for c in counts], np.int64), max(wanted)


def write_sampling_rows(sampling: SamplingBatch, num_reqs: int, rows: int, vocab_size: int,
                        out: Mapping[str, np.ndarray]) -> None:
    """Write a step's ``num_reqs`` rows of temperature / top-k / top-p into ``out`` (a
    backend's sampler staging buffers), and rows ``num_reqs..rows`` as padding: greedy, no
    filter (``SAMPLER_PAD_TEMPERATURE``, top_k ``vocab_size``,
    ``SAMPLER_PAD_TOP_P``, min_p 0 where ``out`` has a min_p row). Every backend pads its
    sampler rows through here."""
    temperature, top_k, top_p = out["temperature"], out["top_k"], out["top_p"]
    temperature[:num_reqs] = sampling.temperature
    top_k[:num_reqs] = sampling.top_k
    top_p[:num_reqs] = sampling.top_p
    temperature[num_reqs:rows] = SAMPLER_PAD_TEMPERATURE
    top_k[num_reqs:rows] = vocab_size
    top_p[num_reqs:rows] = SAMPLER_PAD_TOP_P
    min_p = out.get("min_p")
    if min_p is not None:           # 0: no min-p filter, on padded rows too
        min_p[:num_reqs] = 0.0 if sampling.min_p is None else sampling.min_p
        min_p[num_reqs:rows] = 0.0


def sampling_batch(params: Sequence[Any], request_ids: Sequence[int], vocab_size: int,
                   prompt_lens: Sequence[int] | None = None) -> SamplingBatch:
    """Arrays of one step's :class:`~graphrt.SamplingParams` (which checked their own fields),
    in request order; a disabled top_k, or one above ``vocab_size``, becomes ``vocab_size``.
    min_p and penalty columns are made only when some row uses them (``prompt_lens``, each
    request's prompt length, is then required). The batch checks every row again
    (``InputError`` naming the field and the row)."""
    try:
        columns = (np.array([p.temperature for p in params], np.float32),
                   np.array([vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params], np.int64),
                   np.array([p.top_p for p in params], np.float32))
    except (TypeError, ValueError, OverflowError):   # not SamplingParams: the batch names the bad row
        columns = ([p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params])
    wanted = [getattr(p, "logprobs", None) for p in params]
    extra: dict[str, Any] = {}
    try:
        extras = True in [p.has_extras for p in params]       # one pass; the columns only if needed
    except AttributeError:                                    # not SamplingParams: look at every column
        extras = True
    if extras:
        min_p = [getattr(p, "min_p", 0.0) for p in params]
        if any(min_p):
            extra["min_p"] = min_p
        for (rule, off) in PENALTY_RULES:
            column = [getattr(p, rule.field, off) for p in params]
            if any(v != off for v in column):
                extra[rule.field] = column
        if prompt_lens is not None and len(extra) > ("min_p" in extra):
            extra["prompt_lens"] = prompt_lens
    return SamplingBatch(*columns, [p.seed for p in params], list(request_ids),
                         wanted if any(w is not None for w in wanted) else None, **extra)


__all__ = ["SamplingBatch", "sampling_batch", "write_sampling_rows", "Rule", "TEMPERATURE", "TOP_P", "TOP_K",
           "TOP_K_DISABLED", "MIN_P", "REPETITION_PENALTY", "PRESENCE_PENALTY", "FREQUENCY_PENALTY",
           "PROMPT_LENS", "PENALTY_RULES", "seed", "max_tokens", "flag", "logprobs", "check_logprobs_limit"]
