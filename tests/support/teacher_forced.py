"""Teacher-forced parity of a graphrt request with transformers' own forward, by logprobs.

:func:`assert_teacher_forced` takes a finished ``RequestOutput`` that asked for ``logprobs=1`` and
``prompt_logprobs=1`` and checks every prompt and generated token's logprob (from its prefix,
computed by graphrt through chunked prefill, batchmates and graphs) against ``log_softmax`` of
transformers' float32 logits of the whole sequence in one forward (eager attention), and each
generated token against transformers' argmax (exact ties allowed).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from transformers_matrix import TIE_TOLERANCE
from transformers_zoo import reference_logits

#: Logprobs of float32 models: other summation orders than transformers' (packed rows, paged
#: attention, grouped experts), not other arithmetic.
ATOL = 2e-4


def assert_teacher_forced(reference: Any, out: Any, atol: float = ATOL) -> None:
    """Every logprob of ``out`` within ``atol`` of transformers' (module docstring)."""
    seq = list(out.prompt_token_ids) + list(out.token_ids)
    want = torch.log_softmax(reference_logits(reference, seq[:-1]), -1)
    got = [lp[tok].logprob for lp, tok in zip(out.prompt_logprobs[1:] + out.logprobs, seq[1:])]
    np.testing.assert_allclose(got, [float(want[i, tok]) for i, tok in enumerate(seq[1:])], atol=atol)
    for j, tok in enumerate(out.token_ids):
        row = want[len(out.prompt_token_ids) - 1 + j]
        assert row[tok] >= row.max() - TIE_TOLERANCE, (j, tok, int(row.argmax()))
