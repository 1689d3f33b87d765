"""Length-dependent RoPE (``dynamic``, ``longrope``) of a transformers model, per token.

transformers' rotary modules of these types pick their frequencies from the largest position of
the whole call (``dynamic_rope_update``: ``torch.max(position_ids) + 1``). graphrt runs a step of
many requests as one packed row, so a short request sharing a step with a long one was rotated
with the long one's frequencies: other tokens than alone, or in transformers (issue 46, item 3).

:func:`route_length_rope` replaces each such module with a :class:`TokenLengthRotary`, whose
frequencies follow each token's own sequence length, ``position + 1``:

* ``longrope``: the long factors where ``position + 1 > original_max_position_embeddings``, the
  short ones elsewhere;
* ``dynamic`` (NTK): the checkpoint's frequencies up to ``max_position_embeddings``, beyond it
  those transformers computes for a sequence of ``position + 1`` tokens.

That is what transformers computes when it runs a sequence one token at a time (as ``generate``
decodes): a token's rotation depends on its position only, never on its neighbours in the step,
on how a prompt was chunked, on a preemption's recomputation or on which request put a block in
the prefix cache. It is a function of the positions alone -- a device input -- so a captured
graph replays it for any step. (transformers' ``generate`` prefills a whole prompt in one call and
rotates a prompt longer than the threshold with the frequencies of its full length; graphrt
cannot, without the prompt's length in the step: a prompt that crosses the threshold gets, for
its tokens before it, the frequencies transformers gives them one token at a time.)

Each replacement is checked against the module it replaces, one token at a time across the
threshold, when the model is loaded: a module computing anything else (another ``dynamic``
variant, per-layer-type RoPE parameters) is refused with a :class:`ConfigError` naming it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from graphrt.core.errors import ConfigError

#: ``rope_type`` values whose frequencies depend on the sequence length in transformers.
LENGTH_DEPENDENT = ("dynamic", "longrope")
#: Tolerance of the load-time check against transformers' module (float32 cos / sin).
CHECK_RTOL, CHECK_ATOL = 1e-5, 1e-6


class TokenLengthRotary(nn.Module):
    """A rotary module whose frequencies follow each token's own length (module docstring).

    ``forward(x, position_ids)`` returns ``(cos, sin)`` as transformers' rotary modules do:
    ``[B, T, 2 * F]`` in ``x``'s dtype, the two halves equal, scaled by ``attention_scaling``."""

    def __init__(self, kind: str, inv_freq: torch.Tensor, threshold: int, attention_scaling: float,
                 long_inv_freq: torch.Tensor | None = None, theta: float = 0.0, factor: float = 1.0) -> None:
        super().__init__()
        if kind not in LENGTH_DEPENDENT:
            raise ConfigError(f"TokenLengthRotary: kind {kind!r} is not one of {LENGTH_DEPENDENT}")
        self.kind = kind
        #: Beyond it the frequencies change: original_max_position_embeddings (longrope),
        #: max_position_embeddings (dynamic).
        self.threshold = int(threshold)
        self.attention_scaling = float(attention_scaling)
        self.theta, self.factor = float(theta), float(factor)
        dim = 2 * inv_freq.numel()
        self.exponent = dim / (dim - 2) if dim > 2 else 1.0
        self.register_buffer("inv_freq", inv_freq.detach().float().clone(), persistent=False)
        self.register_buffer("long_inv_freq", (long_inv_freq if long_inv_freq is not None else inv_freq)
                             .detach().float().clone(), persistent=False)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=inv_freq.device).float() / dim
        self.register_buffer("exponents", exponents, persistent=False)

    def frequencies(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Float32 inverse frequencies ``[B, T, F]``, each token's for its length ``position + 1``."""
        length = position_ids.float() + 1.0
        beyond = (length > self.threshold)[..., None]
        if self.kind == "longrope":
            return torch.where(beyond, self.long_inv_freq, self.inv_freq)
        # dynamic NTK: the base transformers computes for a sequence of ``length`` tokens
        grown = length.clamp(min=float(self.threshold))
        base = self.theta * ((self.factor * grown / self.threshold) - (self.factor - 1)) ** self.exponent
        return torch.where(beyond, 1.0 / (base[..., None] ** self.exponents), self.inv_freq)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.frequencies(position_ids)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, threshold={self.threshold}, frequencies={self.inv_freq.numel()}"


def _kinds(rope_type: Any) -> list[str]:
    return [k for k in (rope_type.values() if isinstance(rope_type, dict) else [rope_type]) if isinstance(k, str)]


def _length_dependent(kind: str) -> bool:
    return kind == "longrope" or "dynamic" in kind


def token_length_rotary(module: nn.Module, path: str) -> TokenLengthRotary:
    """The per-token replacement of transformers' rotary ``module`` (at ``path``, for errors)."""
    rope_type = getattr(module, "rope_type", None)
    config = getattr(module, "config", None)
    original = getattr(module, "original_inv_freq", None)
    if not isinstance(rope_type, str) or config is None or not isinstance(original, torch.Tensor):
        raise ConfigError(f"{path} ({type(module).__name__}): rope_type {rope_type!r} picks its frequencies from the "
                          "largest position of the whole step, and graphrt cannot make them per token for this module "
                          "(per-layer-type RoPE parameters or a module without original_inv_freq): a packed step "
                          "would give each request tokens that depend on its neighbours")
    params = config.rope_parameters
    scaling = float(getattr(module, "attention_scaling", 1.0))
    if rope_type == "longrope":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        threshold = int(params["original_max_position_embeddings"])
        long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](config, original.device, seq_len=threshold + 1)
        return TokenLengthRotary("longrope", original, threshold, scaling, long_inv_freq=long_inv)
    return TokenLengthRotary("dynamic", original, int(config.max_position_embeddings), scaling,
                             theta=float(params["rope_theta"]), factor=float(params["factor"]))


def _check(original: nn.Module, replacement: TokenLengthRotary, path: str) -> None:
    """``replacement`` gives what ``original`` gives one token at a time, across the threshold
    (in increasing positions, as transformers' dynamic module caches what it grew to)."""
    t = replacement.threshold
    device = replacement.inv_freq.device
    x = torch.zeros(1, 1, 1, device=device)
    with torch.no_grad():
        for position in sorted({max(t - 2, 0), t - 1, t, t + 1, 2 * t + 3, 4 * t}):
            ids = torch.tensor([[position]], device=device)
            want, got = original(x, ids), replacement(x, ids)
            for w, g in zip(want, got):
                if w.shape != g.shape or not torch.allclose(w.float(), g.float(), rtol=CHECK_RTOL, atol=CHECK_ATOL):
                    raise ConfigError(
                        f"{path} ({type(original).__name__}, rope_type {original.rope_type!r}) picks its frequencies "
                        "from the largest position of the whole step, and graphrt's per-token replacement does not "
                        f"reproduce it (position {position}): refused, since a packed step would give each request "
                        "tokens that depend on its neighbours")


def route_length_rope(hf_model: nn.Module) -> list[str]:
    """Replace every length-dependent rotary module of ``hf_model`` by its
    :class:`TokenLengthRotary` (checked against it, module docstring); the paths replaced.
    A module graphrt cannot replace is refused with a ConfigError naming it."""
    found: dict[int, tuple[nn.Module, list[str]]] = {}
    for name, module in hf_model.named_modules(remove_duplicate=False):
        if any(_length_dependent(k) for k in _kinds(getattr(module, "rope_type", None))):
            found.setdefault(id(module), (module, []))[1].append(name)
    for module, paths in found.values():
        replacement = token_length_rotary(module, paths[0])
        _check(module, replacement, paths[0])
        for path in paths:
            hf_model.set_submodule(path, replacement)
    return [path for _, paths in found.values() for path in paths]


__all__ = ["LENGTH_DEPENDENT", "TokenLengthRotary", "route_length_rope", "token_length_rotary"]
