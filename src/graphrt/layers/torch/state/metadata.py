"""What a step tells the recurrent layers of a hybrid model (docs/hybrid.md), built on the device.

:func:`build_state_metadata` builds :class:`StateMetadata` from the step's static buffers with
device ops only (capturable), once per forward. Request ``R`` is the padding request owning the
padded tokens. Padded requests write the trash slot (index ``num_slots``) and start from zeros,
never a slot's contents (SGLang #30974's ``torch.empty`` rows); negative slots are mapped with
``where``, never used as indices (vllm-ascend #7506). A request reads ring entry
``(num_computed - 1) % checkpoints`` and writes its last ``min(query_len, checkpoints)``
positions, so a step after rejected drafts reads the last accepted token's state.

An own recurrent layer (docs/hybrid.md, "A recurrent layer of your own") reads its initial
states with :func:`read_states` and stores the states after its last C positions, newest first,
with :func:`write_states`; both are exported as ``graphrt.models.torch.read_states`` /
``write_states``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graphrt.core.errors import ConfigError


@dataclass
class StateMetadata:
    """A step's recurrent-state metadata, ``R`` padded requests plus the padding request."""

    starts: torch.Tensor          # int64 [R + 1]: each request's first token
    query_lens: torch.Tensor      # int64 [R + 1]: its tokens (padded requests 0; the padding request the rest)
    token_req: torch.Tensor       # int64 [T]: each token's request, in [0, R]
    token_index: torch.Tensor     # int64 [T]: each token's index within its request's tokens of the step
    read_slot: torch.Tensor       # int64 [R + 1]: the slot read (the trash slot where none)
    read_checkpoint: torch.Tensor  # int64 [R + 1]: the ring entry read
    has_initial: torch.Tensor     # bool [R + 1]: whether the request continues a state (else zeros)
    write_slot: torch.Tensor      # int64 [R + 1, C]: where the state after each of the last C positions goes
    write_checkpoint: torch.Tensor  # int64 [R + 1, C]: its ring entry (the trash slot where there is none)
    num_slots: int                # live slots; index ``num_slots`` is the trash slot
    checkpoints: int              # C
    uniform_query_len: int        # q > 0: every one of the R requests owns exactly q tokens, token r*q + j
                                  # its j-th (uniform decode: a recurrent step per token); 0 otherwise
    #: The recurrent kernels the layers run (a ``kernels.RecurrentKernels``, chosen once by the
    #: state backend); None: graphrt's reference kernels.
    kernels: Any = None


def build_state_metadata(query_start_loc: torch.Tensor, num_computed: torch.Tensor, state_slots: torch.Tensor,
                         num_tokens: int, *, num_slots: int, checkpoints: int,
                         uniform_query_len: int = 0, kernels: Any = None) -> StateMetadata:
    """The metadata of a step of ``num_tokens`` tokens and ``len(state_slots)`` requests from its
    device buffers (views of the static buffers: every op here is captured). ``uniform_query_len``
    (q) asks for the recurrent form: only where every request schedules q tokens and
    ``num_tokens == R * q`` (a uniform-decode key), else it is ignored. ``kernels``: the set the
    layers run (None: the reference)."""
    r = state_slots.shape[0]
    device = state_slots.device
    qsl = query_start_loc[:r + 1].long()
    starts = qsl                                             # the padding request starts at qsl[R]
    ends = torch.cat((qsl[1:], qsl.new_full((1,), num_tokens)))
    query_lens = ends - starts
    tokens = torch.arange(num_tokens, device=device)
    token_req = torch.searchsorted(qsl[1:].contiguous(), tokens, right=True)
    token_index = tokens - starts.index_select(0, token_req)
    raw = torch.cat((state_slots.long(), state_slots.new_full((1,), -1).long()))
    live = raw >= 0
    slot = torch.where(live, raw, num_slots)
    computed = torch.cat((num_computed[:r].long(), num_computed.new_zeros(1).long()))
    has_initial = live & (computed > 0)
    read_checkpoint = torch.where(has_initial, (computed - 1).remainder(checkpoints), 0)
    back = torch.arange(checkpoints, device=device)                  # i: the (i+1)-th last position
    index = query_lens.unsqueeze(1) - 1 - back                       # [R + 1, C]: in-request index
    writes = (index >= 0) & live.unsqueeze(1)
    write_slot = torch.where(writes, slot.unsqueeze(1), num_slots)
    write_checkpoint = torch.where(writes, (computed.unsqueeze(1) + index).remainder(checkpoints), 0)
    q = uniform_query_len if uniform_query_len > 0 and num_tokens == r * uniform_query_len else 0
    return StateMetadata(starts, query_lens, token_req, token_index, slot, read_checkpoint, has_initial,
                         write_slot, write_checkpoint, num_slots, checkpoints, q, kernels)


def read_states(cache: torch.Tensor, meta: StateMetadata, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each request's initial state from ``cache [slots + 1, C, *shape]``: ``[R + 1, *shape]``,
    the state after its last computed token, zeros where it has none -- a new or preempted
    request, a padded one, the padding request ``R`` (``where``: NaN in a slot never leaks)."""
    state = cache[meta.read_slot, meta.read_checkpoint]
    if dtype is not None:
        state = state.to(dtype)
    mask = meta.has_initial.view(-1, *([1] * (state.dim() - 1)))
    return torch.where(mask, state, torch.zeros((), dtype=state.dtype, device=state.device))


def write_states(cache: torch.Tensor, meta: StateMetadata, states: torch.Tensor) -> None:
    """Store ``states [R + 1, C, *shape]`` at each request's slot and ring entries:
    ``states[r, c]`` is request ``r``'s state after its position ``end - 1 - c`` -- **newest
    first**: entry 0 is the state after the step's last token, entry 1 after the one before,
    ... -- where ``end`` is the request's tokens so far (``num_computed_tokens`` + its tokens of
    the step). What has no such position (a request of fewer than C tokens, a padded one, the
    padding request) goes to the trash slot. A ``states`` of another shape is a ConfigError
    (the layer keeps another shape than its ``state_spec()`` says: docs/hybrid.md)."""
    want = (*meta.write_slot.shape, *cache.shape[2:])
    if tuple(states.shape) != want:
        raise ConfigError(f"write_states: states of shape {tuple(states.shape)} for a state cache of shape "
                          f"{tuple(cache.shape)} ([slots + 1, checkpoints, *shape]); pass [R + 1, checkpoints, "
                          f"*shape] = {want}, each request's state after each of its last checkpoints positions, "
                          "newest first (a per-request shape the spec does not declare: declare what the layer "
                          "keeps, docs/hybrid.md)")
    cache.index_put_((meta.write_slot, meta.write_checkpoint), states.to(cache.dtype))


__all__ = ["StateMetadata", "build_state_metadata", "read_states", "write_states"]
