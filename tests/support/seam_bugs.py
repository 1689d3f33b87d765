"""Attention backends with the bugs an author makes at the seam, planted in tests/support/user_attention.py's
dense backend (each gives wrong tokens where a graph bakes the value it reads; docs/testing.md,
"Planted bugs"):

* :class:`UndeclaredRefresh` overrides ``before_replay`` (a device copy of the step's lengths
  the metadata reads) and declares nothing;
* :class:`StashedWidth` declares ``seq_lens`` refreshed, stashes its maximum on itself in
  ``before_replay`` and hands ``build`` the Python int;
* :class:`DlpackWidth` reads the lengths with ``np.from_dlpack`` in ``build``;
* :class:`VarsWidth` reads ``max_seq_len`` through ``vars(host)`` without declaring it;
* :class:`ItemWidth` reads the longest length with ``int(tensor)`` in ``build``;
* :class:`OnHostWidth` reads the host staging buffers (``step.on_host``) in ``build``.

:class:`ApartBuffers` keeps the host staging buffers apart from the static ones on a CPU (as
on CUDA), for the CUDA adapter's code path over the recording graph (``cuda_apart``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from support.device_fakes import FakeCuda
from graphrt.backends.torch import executor as executor_mod
from graphrt.backends.torch.cuda import CudaGraphAPI, CudaGraphBackend
from graphrt.backends.torch.device_graphs import CompletedEvent
from graphrt.backends.torch.step_buffers import StepBuffers
from graphrt.layers.torch.attention.backend import HostValues, StepTensors
from support.user_attention import DenseBackend, DenseMeta, dense_model


class _Dense(DenseBackend):
    """The dense backend whose gather width comes from :meth:`width` (a Python int)."""

    keyed: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__(declare=True)

    def keyed_host_values(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        return self.keyed

    def width(self, step: StepTensors, host: HostValues) -> int:
        raise NotImplementedError

    def build(self, step: StepTensors, host: HostValues) -> DenseMeta:
        return self.gather(step, self.width(step, host), step.seq_lens)


class UndeclaredRefresh(_Dense):
    """Its metadata reads a device copy of the lengths that ``before_replay`` refreshes; it
    declares nothing (it reads no host value). Never called, the copy stays stale."""

    name = "undeclared-refresh"
    keyed = ("max_seq_len",)

    def _lens(self, like: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "lens"):
            self.lens = torch.zeros(4096, dtype=like.dtype, device=like.device)
        return self.lens[:like.shape[0]]

    def before_replay(self, step: StepTensors, host: HostValues) -> None:
        self._lens(step.seq_lens).copy_(step.seq_lens)

    def build(self, step: StepTensors, host: HostValues) -> DenseMeta:
        return self.gather(step, max(int(host.max_seq_len), 1), self._lens(step.seq_lens))


class StashedWidth(_Dense):
    """Declares ``seq_lens`` refreshed, then keeps its maximum as a Python int for ``build``."""

    name = "stashed-width"
    refreshed_host_values = ("seq_lens",)
    stash = 1

    def before_replay(self, step: StepTensors, host: HostValues) -> None:
        self.stash = max(int(np.max(host.seq_lens, initial=0)), 1)

    def width(self, step: StepTensors, host: HostValues) -> int:
        return self.stash


class DlpackWidth(_Dense):
    """Reads the step's lengths through DLPack in ``build``."""

    name = "dlpack-width"

    def width(self, step: StepTensors, host: HostValues) -> int:
        return max(int(np.from_dlpack(step.seq_lens).max(initial=0)), 1)


class VarsWidth(_Dense):
    """Reads ``max_seq_len`` through ``vars(host)``, undeclared."""

    name = "vars-width"

    def width(self, step: StepTensors, host: HostValues) -> int:
        return max(int(vars(host)["max_seq_len"]), 1)


class ItemWidth(_Dense):
    """Reads the step's longest length with ``int(tensor)`` in ``build`` (a device sync)."""

    name = "item-width"

    def width(self, step: StepTensors, host: HostValues) -> int:
        return max(int(step.seq_lens.max()), 1)


class OnHostWidth(_Dense):
    """Reads the step's lengths from the host staging buffers in ``build`` where there are some."""

    name = "on-host-width"

    def width(self, step: StepTensors, host: HostValues) -> int:
        if step.on_host is None:                    # the whole table: right for any step
            return step.block_table.shape[1] * step.block_size
        return max(int(step.on_host.seq_lens.numpy().max(initial=0)), 1)


PLANTED = {cls.name: cls for cls in (UndeclaredRefresh, StashedWidth, DlpackWidth, VarsWidth, ItemWidth,
                                     OnHostWidth)}


def planted_model(name: str) -> torch.nn.Module:
    """The tiny Qwen3 with the dense attention and the planted backend ``name``."""
    model = dense_model(declare=True)
    model.attention_backend = PLANTED[name]()
    return model


class SimCuda(CudaGraphBackend):
    """The CUDA adapter on the CPU: its own code over a stand-in ``torch.cuda`` (tests/support/device_fakes.py)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.fake = FakeCuda()

    def graph_api(self) -> CudaGraphAPI:
        return CudaGraphAPI(self.device, self.fake)


class ApartBuffers(StepBuffers):
    """Step buffers whose static ("device") tensors are copies apart from the host staging ones,
    as on CUDA, so ``StepTensors.on_host`` exists on a CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.same = False
        self.static = {name: t.clone() for name, t in self.host.items()}
        self.extra_static = {name: t.clone() for name, t in self.extra_host.items()}


def apart_executor(monkeypatch: Any) -> None:
    """Make torch executors built from now on keep their staging buffers apart (and copy them
    across before each run, as on a device)."""
    monkeypatch.setattr(executor_mod, "StepBuffers", ApartBuffers)
    monkeypatch.setattr(executor_mod, "device_event", lambda device: CompletedEvent())


__all__ = ["ApartBuffers", "DlpackWidth", "ItemWidth", "OnHostWidth", "PLANTED", "SimCuda", "StashedWidth", "UndeclaredRefresh",
           "VarsWidth", "apart_executor", "planted_model"]
