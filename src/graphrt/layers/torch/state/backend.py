"""The recurrent state's backend: the attention backend's peer, with the same phases.

A hybrid model's executor composes it beside the attention backend (docs/hybrid.md):
:meth:`~RecurrentStateBackend.setup` once (the kernels chosen: :mod:`.kernels`; the keyed value
it reads, ``uniform_decode``), :meth:`~RecurrentStateBackend.build` for an eager run or a replay,
:meth:`~RecurrentStateBackend.build_for_capture` inside a capture (the captured key's flag),
:meth:`~RecurrentStateBackend.before_replay` (nothing to refresh: every value is on the device).
The metadata (:class:`~graphrt.layers.torch.state.metadata.StateMetadata`) holds the kernels the
recurrent layers run.
"""

from __future__ import annotations

from typing import Any

import torch

from graphrt.layers.torch.attention.backend import HostValues, StepTensors
from graphrt.layers.torch.state.kernels import RecurrentKernels, select_recurrent_kernels
from graphrt.layers.torch.state.metadata import StateMetadata, build_state_metadata


class RecurrentStateBackend:
    """Builds each step's :class:`StateMetadata` from the step's device views (device ops only:
    captured) for ``num_slots`` slots of ``checkpoints`` ring entries; ``decode_query_len``: the
    tokens a request schedules in a uniform-decode step (its recurrent form)."""

    name = "graphrt-recurrent"

    def __init__(self, num_slots: int, checkpoints: int, decode_query_len: int) -> None:
        self.num_slots, self.checkpoints, self.decode_query_len = num_slots, checkpoints, decode_query_len
        self.kernels: RecurrentKernels | None = None

    def setup(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        """Once, when the runner is built: the kernels for ``device``; keys ``uniform_decode``."""
        self.kernels = select_recurrent_kernels(device)
        return ("uniform_decode",)

    def build(self, step: StepTensors, host: HostValues) -> StateMetadata:
        """An eager run's or a replay's metadata (``host.uniform_decode``: the key's)."""
        return self._build(step, bool(host.uniform_decode))

    def build_for_capture(self, step: StepTensors, host: Any) -> StateMetadata:
        """A capture's: the captured key's uniform-decode flag (``host.captured_key``)."""
        return self._build(step, bool(getattr(host.captured_key, "uniform_decode", False)))

    def before_replay(self, step: StepTensors, host: HostValues) -> None:
        """Nothing: the state metadata reads device buffers only."""

    def _build(self, step: StepTensors, uniform: bool) -> StateMetadata:
        return build_state_metadata(step.query_start_loc, step.num_computed_tokens, step.state_slots,
                                    step.slot_mapping.shape[0], num_slots=self.num_slots, checkpoints=self.checkpoints,
                                    uniform_query_len=self.decode_query_len if uniform else 0, kernels=self.kernels)


__all__ = ["RecurrentStateBackend"]
