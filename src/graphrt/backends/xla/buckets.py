"""XLA's bucket grid: which shapes get an executable, built from GraphConfig's validated flags.

XLA has no eager escape, so every step needs a compiled shape (sglang-jax's design; docs/xla.md,
"Buckets"): decode steps at the next batch-size padding ``b``, key ``(b * q, b, True)``; every
other step at the next token padding ``t`` and one batch size, ``(t, max_reqs, False)``: the sum
of the two lists, not their product, times the context buckets. ``max_reqs`` is
:func:`graphrt.config.covering_padding`'s, nowhere recomputed. Imports no jax."""

from __future__ import annotations

from dataclasses import dataclass

from graphrt.config import GraphConfig, covering_padding
from graphrt.core.buckets import BucketPolicy
from graphrt.core.dispatch import Dispatcher
from graphrt.core.errors import ConfigError
from graphrt.core.graph_modes import GraphMode

#: XLA has no eager path: its context buckets grow by this factor up to max_model_len, so a
#: step attends over at most this many times its longest request (and a few executables per key).
XLA_CONTEXT_BUCKET_GROWTH = 4
#: XLA backend: the smallest default token padding (the default paddings are powers of two
#: from here up to ``max_num_batched_tokens``; sglang-jax starts its token paddings at 16 too).
XLA_MIN_TOKEN_PADDING = 16


@dataclass(frozen=True)
class XlaBuckets:
    """The token x batch-size grid of one config (:meth:`from_config`)."""

    #: Token paddings of prefill / mixed steps; the largest covers ``max_num_batched_tokens``.
    tokens: BucketPolicy
    #: Batch-size paddings; the largest (``max_reqs``) covers ``max_num_seqs``.
    batch_sizes: BucketPolicy
    #: Batch sizes of decode keys: ``batch_sizes``, capped at the largest decode batch the token
    #: budget holds when ``max_reqs`` decode requests would not fit in it.
    decode: BucketPolicy
    #: XLA's largest batch size: every mixed step's padded batch (see the module docstring).
    max_reqs: int
    max_num_seqs: int
    decode_query_len: int
    #: Context buckets: every key exists once per bucket, whose block table is that many tokens
    #: wide (the JAX reference attends over every column), up to max_model_len by factors of
    #: ``XLA_CONTEXT_BUCKET_GROWTH``: a step's cost follows its longest request.
    contexts: BucketPolicy

    @classmethod
    def from_config(cls, config: GraphConfig) -> "XlaBuckets":
        """The grid of ``config``'s ``precompile_token_paddings`` / ``precompile_bs_paddings``,
        or, unset, powers of two up to ``max_num_batched_tokens`` (from
        ``XLA_MIN_TOKEN_PADDING``) and up to ``max_num_seqs``."""
        limit = config.max_num_batched_tokens
        top_tokens = covering_padding(config.precompile_token_paddings, limit)
        max_reqs = covering_padding(config.precompile_bs_paddings, config.max_num_seqs)
        for name, top in (("precompile_token_paddings", top_tokens), ("precompile_bs_paddings", max_reqs)):
            if top is None:       # only a config built without validation (model_construct)
                raise ConfigError(f"{name}: no padding covers the limit; build the config with GraphConfig.create")
        tokens = (BucketPolicy(config.precompile_token_paddings) if config.precompile_token_paddings is not None
                  else BucketPolicy.powers_of_two(top_tokens, min_size=min(XLA_MIN_TOKEN_PADDING, top_tokens)))
        sizes = (BucketPolicy(config.precompile_bs_paddings) if config.precompile_bs_paddings is not None
                 else BucketPolicy.powers_of_two(max_reqs))
        fits = max_reqs * config.decode_query_len <= limit
        return cls(tokens, sizes, sizes if fits else sizes.capped(config.max_decode_batch), max_reqs,
                   config.max_num_seqs, config.decode_query_len,
                   config.context_policy(growth=XLA_CONTEXT_BUCKET_GROWTH))

    @property
    def max_tokens(self) -> int:
        """Rows of the token-level staging buffers: the largest key's tokens, mixed or decode."""
        return max(self.tokens.max_size, self.max_reqs)

    def dispatcher(self, context: bool = True) -> Dispatcher:
        """The dispatcher over this grid: decode steps by batch size, mixed steps at
        ``max_reqs``; no eager path, so a step above the grid is an ``InputError``. ``context``:
        every key once per context bucket (the attention keys ``max_seq_len``), else none."""
        return Dispatcher(GraphMode.FULL, token_buckets=self.tokens, decode_buckets=self.decode,
                          mixed_num_reqs=self.max_reqs, max_num_seqs=self.max_num_seqs, eager_fallback=False,
                          separate_decode=True, decode_query_len=self.decode_query_len,
                          context_buckets=self.contexts if context else None,
                          max_context=self.contexts.max_size if context else None)


__all__ = ["XlaBuckets"]
