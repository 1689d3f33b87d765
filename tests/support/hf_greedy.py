"""transformers' own argmax as the reference of a greedy graphrt request, token by token.

:func:`argmax_problem` runs a sequence through the transformers model one token at a time (its
own KV cache, ``use_cache=True``), as ``generate`` decodes, so each token's RoPE frequencies
follow its own sequence length (position + 1) -- what graphrt computes for ``dynamic`` and
``longrope`` RoPE (docs/transformers-models.md) -- and checks each generated token against the
argmax of its step, exact ties allowed (``transformers_matrix.TIE_TOLERANCE``). For RoPE whose
frequencies do not depend on the length, this is transformers' ``generate`` itself.

:func:`reset_rotary` forgets what a dynamic RoPE module cached from an earlier, longer sequence
(transformers keeps its grown frequencies until a sequence shorter than
``max_position_embeddings`` comes), so each reference sequence starts from the checkpoint's own.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch

from transformers_matrix import TIE_TOLERANCE


def reset_rotary(model: torch.nn.Module) -> None:
    """Every rotary module of ``model`` back to its initial frequencies (module docstring)."""
    for module in model.modules():
        original = getattr(module, "original_inv_freq", None)
        if isinstance(original, torch.Tensor) and hasattr(module, "original_max_seq_len"):
            module.inv_freq = original.clone()
            module.max_seq_len_cached = module.original_max_seq_len


def stepwise_logits(model: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """Float32 logits ``[len(token_ids), vocab]``, each row from a step of one token over the
    cache of the ones before (module docstring)."""
    reset_rotary(model)
    # transformers >= 5.2x names the cache argument ``cache`` (``past_key_values`` is deprecated)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    rows, cache = [], None
    with torch.no_grad():
        for position, token in enumerate(token_ids):
            out = model(input_ids=torch.tensor([[int(token)]]), position_ids=torch.tensor([[position]]),
                        use_cache=True, **{name: cache})
            cache = getattr(out, name)
            rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


def argmax_problem(model: torch.nn.Module, prompt: Sequence[int], generated: Sequence[int],
                   tolerance: float = TIE_TOLERANCE) -> str | None:
    """None when every generated token is transformers' argmax of its step (within
    ``tolerance`` of the best logit: exact ties), else which one is not."""
    logits = stepwise_logits(model, list(prompt) + list(generated)[:-1])
    for j, token in enumerate(generated):
        row = logits[len(prompt) - 1 + j]
        if not bool(row[token] >= row.max() - tolerance):
            return (f"token {j} of a prompt of {len(prompt)}: graphrt chose {token} (logit {float(row[token]):.5f}), "
                    f"transformers' argmax is {int(row.argmax())} (logit {float(row.max()):.5f})")
    return None
