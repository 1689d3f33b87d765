"""graphrt's padding rules on the model kwargs of transformers' continuous batching.

transformers' varlen step hands its model one token row of ``num_q_tokens`` tokens, reads the
paged cache through ``read_index`` (every request's past and new tokens, ``kv + q`` rows) and
writes it through ``write_index``. Padded to a graphrt key, the rows past the real ones are
filled here by graphrt's rules (``graphrt.core.defaults.PAD_FILL_VALUES``, docs/padding.md),
each kwarg under the rule of the graphrt field it plays the part of (:data:`KWARG_RULES`).
Two fills are translated, because transformers' cache indexes slots where graphrt's skips
negative ones: graphrt's "a padded token writes no real KV slot" (``slot_mapping`` -1) is the
allocator's write-trash slot, in the sector no request is ever given; "the null block, never
handed to a request" (``block_table`` 0) is its read-trash slot, zeroed and never written.

Nothing here imports transformers: the fills are written into the tensors of one step's kwargs
(transformers' ``PagedAttentionArgs``), slice by slice, with no per-token loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import torch

from graphrt.core import defaults
from graphrt.core.inputs.fields import BOUNDARY, REQUEST, TOKEN

#: A level of transformers' own: one row per key the attention reads (each request's past and
#: new tokens, then padding), ``read_index``'s length and the attention mask's columns.
KEY = "key"


class KwargRule(NamedTuple):
    """The graphrt field whose padding rule a kwarg follows, and the kwarg's level."""

    graphrt_field: str
    level: Any
    why: str


#: Every padded kwarg of a varlen step and the graphrt rule it follows (docs/engines.md).
KWARG_RULES: dict[str, KwargRule] = {
    "input_ids": KwargRule("input_ids", TOKEN, "any valid id: finite activations"),
    "position_ids": KwargRule("positions", TOKEN, "a valid rotary index"),
    "write_index": KwargRule("slot_mapping", TOKEN, "no real KV slot: the allocator's write-trash slot"),
    "cu_seq_lens_q": KwargRule("query_start_loc", BOUNDARY, "repeats the last value: padded requests are empty"),
    "cu_seq_lens_k": KwargRule("query_start_loc", BOUNDARY, "repeats the last value: padded requests read nothing"),
    "logits_indices": KwargRule("positions", REQUEST, "a valid row (0); the token it samples is never read"),
    "read_index": KwargRule("block_table", KEY, "the null block: the allocator's read-trash slot (zeros)"),
    "attention_mask": KwargRule("seq_lens", KEY, "attends to nothing: a padded token to no key, no token "
                                                  "to a padded key"),
}


@dataclass(frozen=True)
class RealSizes:
    """What is real in a step padded to a key: tokens, requests, requests that sample a token,
    keys read per allocator (``read_index``'s rows) and per layer type (mask columns)."""

    tokens: int
    reqs: int
    logits: int
    reads: Sequence[int]
    keys: Mapping[str, int]


class KwargPadder:
    """Fills the padded rows of a step's model kwargs by :data:`KWARG_RULES`.

    ``write_trash`` / ``read_trash``: per allocator (in the order of the kwargs' index lists),
    the slot a padded token writes and the slot a padded key reads.
    """

    def __init__(self, write_trash: Sequence[int], read_trash: Sequence[int]) -> None:
        fills = defaults.PAD_FILL_VALUES
        self.input_id = int(fills["input_ids"])
        self.position = int(fills["positions"])
        self.write_trash = [int(i) for i in write_trash]
        self.read_trash = [int(i) for i in read_trash]

    def fill(self, kwargs: Mapping[str, Any], real: RealSizes, defaults_args: torch.Tensor | None = None) -> None:
        """Write the fills into ``kwargs`` (whose tensors are sized to the key) past ``real``.
        ``defaults_args``: the logits processors' neutral per-request arguments (a column),
        for the padded requests' columns of ``logits_processor_args``."""
        t, r = real.tokens, real.reqs
        kwargs["input_ids"][0, t:] = self.input_id
        kwargs["position_ids"][0, t:] = self.position
        for index, trash in zip(kwargs["write_index"], self.write_trash):
            index[t:] = trash
        for index, trash, reads in zip(kwargs["read_index"], self.read_trash, real.reads):
            index[reads:] = trash
        _repeat_last(kwargs["cu_seq_lens_q"], r)
        for bounds in kwargs["cu_seq_lens_k"].values():
            _repeat_last(bounds, r)
        kwargs["logits_indices"][real.logits:] = self.position
        args = kwargs.get("logits_processor_args")
        if defaults_args is not None and args is not None and args.numel():
            args[:, r:] = defaults_args
        masks = kwargs.get("attention_mask")
        if masks is None:
            return
        if isinstance(masks, torch.Tensor):
            masks = {next(iter(real.keys)): masks}
        for layer_type, mask in masks.items():
            low = torch.finfo(mask.dtype).min
            mask[..., t:, :] = low
            mask[..., :t, real.keys[layer_type]:] = low


def _repeat_last(bounds: torch.Tensor, reqs: int) -> None:
    """Rows past ``reqs + 1`` of a boundary field take row ``reqs`` (graphrt's query_start_loc)."""
    bounds[reqs + 1:] = bounds[reqs]


def empty_sizes(num_allocators: int, layer_types: Sequence[str]) -> RealSizes:
    """The real sizes of a step of pure padding (a capture's input, graphrt's empty step)."""
    return RealSizes(0, 0, 0, [0] * num_allocators, dict.fromkeys(layer_types, 0))
