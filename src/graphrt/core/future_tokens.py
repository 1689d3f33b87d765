"""Future tokens: step n + 1 reads step n's sampled tokens before the host has them.

An overlapped engine (SGLang's ``event_loop_overlap``) writes any valid id for a token not yet
sampled and names, per request, the row of step n whose token replaces its last scheduled one
(``future_rows``; -1: none). Asynchronous backends replace it on the device (inside the next
XLA executable, or after the torch graphs' input copies); eager writes the host tokens into
``input_ids``. Either way the step computes what it would with the real id."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from graphrt.core.errors import InputError


class PendingTokens:
    """One step's sampled tokens (int64 ``[R]``; a ``StepOutput`` when it asked for logprobs:
    what ``ModelRunner.execute`` returns), possibly still being computed.

    :meth:`result` waits for them (once; an asynchronous execution error surfaces there and
    again on each further call) and returns the same array afterwards."""

    __slots__ = ("_fetch", "_tokens")

    def __init__(self, fetch: Callable[[], np.ndarray] | None = None, tokens: np.ndarray | None = None) -> None:
        if (fetch is None) == (tokens is None):
            raise InputError("tokens", "PendingTokens takes exactly one of fetch and tokens")
        self._fetch, self._tokens = fetch, tokens

    def done(self) -> bool:
        """Whether the tokens are on the host already (``result`` will not wait)."""
        return self._tokens is not None

    def result(self) -> np.ndarray:
        """The tokens, waiting for the device if it has not finished the step."""
        if self._tokens is None:
            self._tokens = self._fetch()
            self._fetch = None
        return self._tokens


class FutureTokens:
    """The rules of ``future_rows``: checked against the last sampled step, and resolved.

    The runner keeps the last sampled step (``last``: the sampler's output -- its device array
    on an ``on_device`` backend, which resolves future tokens inside its executable, else the
    host tokens -- and its request count; None when the last step sampled nothing or failed)
    and passes it in; nothing here runs for a step without ``future_rows``.
    """

    def __init__(self, on_device: bool) -> None:
        self.on_device = on_device

    def check(self, future_rows: Any, num_reqs: int, last: tuple[Any, int] | None) -> np.ndarray:
        """``future_rows`` as int32 ``[num_reqs]``, each -1 or a row of the last sampled step;
        :class:`InputError` naming the field otherwise (nothing is written before this)."""
        rows = np.asarray(future_rows)
        if rows.shape != (num_reqs,) or rows.dtype.kind not in "iu":
            raise InputError("future_rows", f"needs one integer per request ({num_reqs}), got "
                                            f"{rows.dtype} {rows.shape}")
        sampled = last[1] if last is not None else 0
        if num_reqs and (rows.min() < -1 or rows.max() >= sampled):
            bad = int(np.flatnonzero((rows < -1) | (rows >= sampled))[0])
            src = (f"the last sampled step had {sampled} requests" if last is not None
                   else "no sampled step precedes this one")
            raise InputError("future_rows", f"row {bad} refers to {int(rows[bad])}; each entry is -1 or a "
                                            f"request row of the previous sampled step ({src})")
        return rows.astype(np.int32, copy=False)

    def apply(self, rows: np.ndarray, last: tuple[Any, int], input_ids: np.ndarray,
              query_start_loc: np.ndarray) -> tuple[np.ndarray, Any] | None:
        """Resolve the checked ``rows`` for a step whose padded inputs were just written: on the
        device, ``(rows, source)`` for the executor; on the host, the tokens are written at each
        such request's last scheduled position of ``input_ids`` and None is returned."""
        if self.on_device:
            return rows, last[0]
        take = rows >= 0
        if take.any():
            ends = query_start_loc[1:len(rows) + 1] - 1
            input_ids[ends[take]] = last[0][rows[take]]
        return None


__all__ = ["FutureTokens", "PendingTokens"]
