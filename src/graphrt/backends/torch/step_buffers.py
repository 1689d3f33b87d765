"""A torch executor's step buffers: host staging and the static device buffers graphs read.

Per step field and declared extra input: a host staging buffer the runner writes and a static
device buffer graphs read (the same tensor on a CPU). :meth:`StepBuffers.tensors` gives the
step's device views as :class:`~graphrt.layers.torch.attention.backend.StepTensors`, remembered
per shape (no allocation per step); :meth:`StepBuffers.load_dummy` writes pure padding."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import numpy as np
import torch

from graphrt.core.inputs.extra_inputs import ExtraInput
from graphrt.core.inputs.fields import FIELD_DTYPES, FIELDS, ModelInputs, buffer_shapes, field_rows
from graphrt.core.inputs.padding import Padder
from graphrt.layers.torch.attention.backend import StepTensors

_TORCH_DTYPES = {np.int32: torch.int32, np.int64: torch.int64}


class StepBuffers:
    """The staging and static buffers of steps of up to ``max_tokens`` tokens and ``max_reqs``
    requests, block-table rows ``width`` wide, on ``device``."""

    def __init__(self, max_tokens: int, max_reqs: int, width: int, block_size: int, device: torch.device,
                 pin: bool, host_arrays: Mapping[str, np.ndarray] | None = None,
                 extra: Mapping[str, ExtraInput] | None = None) -> None:
        """``host_arrays``: staging buffers to use instead of allocating them (one per field, of
        ``buffer_shapes``'s shape; tensor parallelism's step-channel buffers)."""
        shapes = buffer_shapes(max_tokens, max_reqs, width)
        self.block_size = block_size
        self.host = ({name: torch.from_numpy(host_arrays[name]) for name in shapes} if host_arrays is not None else
                     {name: torch.zeros(shape, dtype=_TORCH_DTYPES[FIELD_DTYPES[name]], pin_memory=pin)
                      for name, shape in shapes.items()})
        #: The staging buffers as numpy arrays: what the runner writes each padded step into.
        self.host_arrays = {name: t.numpy() for name, t in self.host.items()}
        self.same = device.type == "cpu"
        self.static = self.host if self.same else {name: t.to(device) for name, t in self.host.items()}
        self.levels = tuple((name, FIELDS[name].level) for name in shapes)
        self.extra = dict(extra or {})
        self.extra_host = {name: torch.zeros((spec.rows(max_tokens, max_reqs), *spec.shape),
                                             dtype=torch.from_numpy(np.zeros(0, np.dtype(spec.dtype))).dtype,
                                             pin_memory=pin)
                           for name, spec in self.extra.items()}
        #: The extra inputs' staging buffers as numpy arrays (``core.inputs.extra_inputs.ExtraInputs`` writes them).
        self.extra_arrays = {name: t.numpy() for name, t in self.extra_host.items()}
        self.extra_static = self.extra_host if self.same else {n: t.to(device) for n, t in self.extra_host.items()}
        self._padder = Padder(kernel="numpy")     # the default fills: pure padding
        #: :meth:`tensors` by ``(num_tokens, num_reqs)``, built on first use: a hot path reads it first.
        self.views: dict[tuple[int, int], StepTensors] = {}
        self._capture_views: dict[tuple[int, int], StepTensors] = {}

    def to_device(self, num_tokens: int, num_reqs: int) -> None:
        """Copy a step's rows of every field (``fields.field_rows``) and extra input from the
        host staging buffers into the static device buffers (nothing to do on a CPU device)."""
        if self.same:
            return
        for name, level in self.levels:
            n = field_rows(level, num_tokens, num_reqs)
            self.static[name][:n].copy_(self.host[name][:n], non_blocking=True)
        for name, spec in self.extra.items():
            n = spec.rows(num_tokens, num_reqs)
            self.extra_static[name][:n].copy_(self.extra_host[name][:n], non_blocking=True)

    def tensors(self, num_tokens: int, num_reqs: int) -> StepTensors:
        """The device views of a step of ``num_tokens`` / ``num_reqs`` (padded) rows; on a device
        apart from the host, ``on_host`` holds the staging buffers' views of the same rows."""
        views = self.views.get((num_tokens, num_reqs))
        if views is None:
            views = self.views[(num_tokens, num_reqs)] = self._step_views(self.static, self.extra_static,
                                                                           num_tokens, num_reqs)
            if not self.same:       # the staging views too, for before_replay (no device sync)
                views.on_host = self._step_views(self.host, self.extra_host, num_tokens, num_reqs)
        return views

    def capture_tensors(self, num_tokens: int, num_reqs: int, refused: Any) -> StepTensors:
        """:meth:`tensors` as a graph's metadata build sees them: ``on_host`` is ``refused`` (a
        :class:`~graphrt.layers.torch.attention.backend.HostTensorsRefused`: a device graph cannot
        see a host read, so none may happen while it is captured), on every device alike."""
        views = self._capture_views.get((num_tokens, num_reqs))
        if views is None:
            views = replace(self.tensors(num_tokens, num_reqs), on_host=refused)
            self._capture_views[(num_tokens, num_reqs)] = views
        return views

    def _step_views(self, s: Mapping[str, torch.Tensor], extra: Mapping[str, torch.Tensor], num_tokens: int,
                    num_reqs: int) -> StepTensors:
        return StepTensors(
            s["input_ids"][:num_tokens], s["positions"][:num_tokens], s["slot_mapping"][:num_tokens],
            s["query_start_loc"][:num_reqs + 1], s["seq_lens"][:num_reqs], s["num_computed_tokens"][:num_reqs],
            s["block_table"][:num_reqs], self.block_size,
            {name: t[:spec.rows(num_tokens, num_reqs)] for (name, t), spec in zip(extra.items(), self.extra.values())},
            state_slots=s["state_slots"][:num_reqs] if "state_slots" in s else None)

    def load_dummy(self, num_tokens: int, num_reqs: int) -> ModelInputs:
        """Pure padding (the padder's fills: no KV write, every request empty; extra inputs their
        fill) in the static buffers: what captures and warm-ups run on."""
        padded = self._padder.pad_empty(num_tokens, num_reqs, self.host_arrays)
        for name, spec in self.extra.items():
            self.extra_arrays[name][:spec.rows(num_tokens, num_reqs)] = spec.fill
        self.to_device(num_tokens, num_reqs)
        return padded

    def pointers(self) -> dict[str, int]:
        """Every static buffer's address (a graph read them there; debug checks compare)."""
        ptrs = {name: t.data_ptr() for name, t in self.static.items()}
        ptrs.update({f"extra.{name}": t.data_ptr() for name, t in self.extra_static.items()})
        return ptrs


__all__ = ["StepBuffers"]
