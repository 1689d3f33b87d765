"""The attention seam on torch: what an attention backend builds from a step, and declares.

An engine plugs its attention in once as an :class:`AttentionBackend` (``model.attention_backend``)
and gets every torch graph backend. Per step the executor hands the backend the step's device
tensors (:class:`StepTensors`: views of the static buffers a graph reads) and its host values
(:class:`HostValues`); the backend returns its metadata, which the model's attention layers
read from :func:`graphrt.core.forward_context.get_forward_context`.

A captured graph replays ops, not Python: a host value a backend reads while building
metadata is baked into the graph. So a backend declares every host value it reads:

* ``keyed_host_values(device, dtype)``: values a graph may fix, because its key holds them --
  ``num_tokens`` / ``num_reqs`` (the padded shape), ``uniform_decode``, and ``max_seq_len``
  (the key's context bucket: the dispatcher then keys FULL graphs by context, docs/attention.md);
* ``refreshed_host_values``: values :meth:`AttentionBackend.before_replay` reads before every
  run, outside the graph, to write device buffers the graph reads (vLLM's and SGLang's
  replay-time metadata; on Ascend a task update).

While a graph is captured the backend gets :class:`CaptureHostValues`: reading an undeclared
value -- or a refreshed one inside the graph -- raises
:class:`~graphrt.core.errors.GraphCaptureError` naming the value and the backend, in every
mode, instead of baking it. graphrt's own attention is :class:`PagedAttentionBackend`.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from graphrt.core.dispatch import AttentionGraphSupport
from graphrt.core.errors import ConfigError, GraphCaptureError
from graphrt.models.torch.attention import TorchAttentionMetadata, choose_attention_kernel

#: The step's host values a backend may read (fields of :class:`HostValues`).
HOST_VALUES = ("num_tokens", "num_reqs", "real_num_tokens", "real_num_reqs", "max_query_len",
               "max_seq_len", "uniform_decode", "query_start_loc", "seq_lens")
#: Those a graph's key holds, so a backend may declare them keyed.
KEYABLE_HOST_VALUES = ("num_tokens", "num_reqs", "uniform_decode", "max_seq_len")


@dataclass
class HostValues:
    """The step's host values. ``num_tokens`` / ``num_reqs`` are the padded sizes (the key's),
    ``real_*`` the real ones; ``max_seq_len`` is the longest request's length -- for a graph, its
    key's context bucket (every request is at most that long); ``max_query_len`` the most
    tokens a request schedules. ``query_start_loc`` [R + 1] / ``seq_lens`` [R]: the padded
    step's host arrays (numpy; None in a capture's values), for kernels that take per-request
    lengths as host lists -- never keyed, so only ``before_replay`` may read them."""

    num_tokens: int
    num_reqs: int
    real_num_tokens: int
    real_num_reqs: int
    max_query_len: int
    max_seq_len: int
    uniform_decode: bool
    query_start_loc: Any = None
    seq_lens: Any = None


class CaptureHostValues(HostValues):
    """:class:`HostValues` of a graph being captured: only the backend's keyed values can be read."""

    def __init__(self, values: HostValues, keyed: tuple[str, ...], backend: str, key: Any) -> None:
        super().__init__(**dataclasses.asdict(values))
        object.__setattr__(self, "_guard", (frozenset(keyed), backend, key))

    def __getattribute__(self, name: str) -> Any:
        if name in HOST_VALUES:
            keyed, backend, key = object.__getattribute__(self, "_guard")
            if name not in keyed:
                caller = sys._getframe(1)
                raise GraphCaptureError(
                    f"attention backend {backend!r} read the host value {name!r} while the graph of {key} "
                    f"was captured ({caller.f_code.co_name} at {caller.f_code.co_filename}:{caller.f_lineno}), "
                    f"without declaring it keyed: the graph would bake in this step's value. Declare it in "
                    f"keyed_host_values (one of {KEYABLE_HOST_VALUES}: the key holds it) or in "
                    f"refreshed_host_values and read it in before_replay, which runs outside the graph "
                    f"(docs/attention.md)")
        return object.__getattribute__(self, name)


@dataclass
class StepTensors:
    """A step's device tensors, views of the static buffers a graph reads: ``T`` (padded) token
    rows, ``R`` (padded) request rows, ``R + 1`` boundaries; ``extra``: the model's declared
    per-step inputs (``extra_inputs``), padded like the rest."""

    input_ids: torch.Tensor          # int32 [T]
    positions: torch.Tensor          # int32 [T]
    slot_mapping: torch.Tensor       # int64 [T]; negative: a padded token
    query_start_loc: torch.Tensor    # int32 [R + 1]
    seq_lens: torch.Tensor           # int32 [R]; 0: a padded request
    num_computed_tokens: torch.Tensor  # int32 [R]
    block_table: torch.Tensor        # int32 [R, B]
    block_size: int
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    #: The same step in the host staging buffers the device ones are copied from (None where
    #: the tensors above are host ones): what ``before_replay`` reads without a device sync.
    on_host: "StepTensors | None" = None


class AttentionBackend:
    """What a model's attention needs from a step, built into device tensors, and what it declares.

    Subclass it (or duck-type it) and set it as ``model.attention_backend``. Defaults: runs in
    any FULL graph, reads no host value, builds nothing."""

    #: A name for logs and errors.
    name: ClassVar[str] = "attention"
    #: What the kernels can run inside a FULL graph (the runner degrades the mode to it).
    graph_support: ClassVar[AttentionGraphSupport] = AttentionGraphSupport.ALWAYS
    #: Host values :meth:`before_replay` reads (outside the graph) before every run.
    refreshed_host_values: ClassVar[tuple[str, ...]] = ()

    def keyed_host_values(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        """Host values :meth:`build` reads and a graph may fix, on this device / dtype."""
        return ()

    def build(self, step: StepTensors, host: HostValues) -> Any:
        """The step's metadata, from device ops on ``step`` (it runs inside graph capture) and
        the declared ``host`` values; the attention layers read it from the forward context."""
        return step

    def before_replay(self, step: StepTensors, host: HostValues) -> None:
        """Before every run (replayed or eager), outside any graph: refresh the device buffers
        a graph reads from the declared ``refreshed_host_values``. Default: nothing."""


class PagedAttentionBackend(AttentionBackend):
    """graphrt's own: :class:`~graphrt.models.torch.attention.TorchAttentionMetadata` for
    :class:`~graphrt.models.torch.attention.PagedAttention`. The reference kernel attends over
    every column of the block table, so the table is narrowed to ``max_seq_len`` (keyed: the
    key's context bucket in a graph, the step's own length eagerly); Triton reads every length
    on the device and keys nothing."""

    name = "graphrt-paged"

    def __init__(self, head_dim: int | None = None) -> None:
        self.head_dim = head_dim
        self._narrow = False

    def keyed_host_values(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        choice = choose_attention_kernel(device, self.head_dim or 64, dtype, dtype)
        self._narrow = choice.kernel != "triton"
        return ("max_seq_len",) if self._narrow else ()

    def build(self, step: StepTensors, host: HostValues) -> TorchAttentionMetadata:
        table = step.block_table
        if self._narrow:
            table = table[:, :max(-(-host.max_seq_len // step.block_size), 1)]
        return TorchAttentionMetadata.build(step.slot_mapping, step.query_start_loc, step.seq_lens, table,
                                            step.block_size)


def check_metadata(backend: Any, metadata: Any, num_tokens: int, num_reqs: int) -> None:
    """Refuse metadata whose tensors do not fit the step: every tensor field of a dataclass (or
    NamedTuple) must have ``num_tokens``, ``num_reqs`` or ``num_reqs + 1`` rows, unless the
    backend lists it in ``free_shape_fields`` (ConfigError naming the backend and the field)."""
    if dataclasses.is_dataclass(metadata):
        items = [(f.name, getattr(metadata, f.name)) for f in dataclasses.fields(metadata)]
    elif isinstance(metadata, tuple) and hasattr(metadata, "_fields"):
        items = list(zip(metadata._fields, metadata))
    else:
        return
    free = set(getattr(backend, "free_shape_fields", ()))
    allowed = {num_tokens, num_reqs, num_reqs + 1}
    for name, value in items:
        if isinstance(value, torch.Tensor) and name not in free and value.dim() > 0 and value.shape[0] not in allowed:
            raise ConfigError(f"attention backend {getattr(backend, 'name', type(backend).__name__)!r} built "
                              f"metadata field {name!r} of shape {tuple(value.shape)} for a step of {num_tokens} "
                              f"tokens and {num_reqs} requests: its rows must be the step's tokens, requests or "
                              f"requests + 1 (list it in the backend's free_shape_fields if it is sized otherwise)")


__all__ = ["AttentionBackend", "CaptureHostValues", "HOST_VALUES", "HostValues", "KEYABLE_HOST_VALUES",
           "PagedAttentionBackend", "StepTensors", "check_metadata"]
