"""The attention seam on torch: the one attention object of a model, what it builds and declares.

Per step the executor hands an :class:`AttentionBackend` the step's device tensors
(:class:`StepTensors`) and host values (:class:`HostValues`); its metadata is what the layers read
from the forward context. A captured graph bakes in every host value read, so a backend declares
them; under capture reading an undeclared one raises GraphCaptureError. See docs/attention.md,
"The seam".
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from graphrt.core.attention_decl import (FLOAT_KV_DTYPES, FP8_KV_DTYPES, HOST_VALUES, KEYABLE_HOST_VALUES,
                                         AttentionDeclarations, backend_name)
from graphrt.core.errors import ConfigError, GraphCaptureError
from graphrt.layers.torch.attention.paged import (PagedAttention, TorchAttentionMetadata, choose_attention_kernel,
                                                  paged_attend)

#: What graphrt's kernels read of the step's metadata (the fields of
#: :class:`TorchAttentionMetadata`); graphrt's attention layers (``PagedAttention``: graphrt's
#: decoders, the Transformers backend's ``HFPagedAttention``) call its ``attend(layer, q, k, v)``
#: (docs/attention.md, "graphrt's layers and a backend of your own").
PAGED_METADATA_FIELDS = ("slot_mapping", "query_start_loc", "seq_lens", "block_table", "token_req_idx", "block_size")


@dataclass
class HostValues:
    """The step's host values. ``num_tokens`` / ``num_reqs``: padded sizes (the key's), ``real_*``
    the real ones; ``max_seq_len``: longest request (a graph's context bucket); ``max_query_len``:
    most tokens a request schedules. ``query_start_loc`` / ``seq_lens``: padded host arrays,
    never keyed, so only ``before_replay`` may read them."""

    num_tokens: int
    num_reqs: int
    real_num_tokens: int
    real_num_reqs: int
    max_query_len: int
    max_seq_len: int
    uniform_decode: bool
    query_start_loc: Any = None
    seq_lens: Any = None


def _refuse(what: str) -> Any:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise GraphCaptureError(f"{object.__getattribute__(self, '_what')} was used while a graph was captured "
                                f"({what}): the graph would bake in a value it must not hold (docs/attention.md)")
    return refuse


class Refused:
    """What a guard leaves where a value must not be read during a capture: any use of it (a
    number, a truth value, an index, an attribute, arithmetic) raises GraphCaptureError."""

    __slots__ = ("_what",)

    def __init__(self, what: str) -> None:
        object.__setattr__(self, "_what", what)

    def __repr__(self) -> str:
        return f"<refused: {object.__getattribute__(self, '_what')}>"

    __getattr__ = _refuse("an attribute of it")


for _name in ("__int__", "__index__", "__float__", "__bool__", "__len__", "__iter__", "__getitem__",
              "__array__", "__dlpack__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
              "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__",
              "__rfloordiv__", "__truediv__", "__rtruediv__", "__mod__", "__neg__", "__hash__", "__format__"):
    setattr(Refused, _name, _refuse(_name.strip("_")))
del _name


class CaptureHostValues(HostValues):
    """:class:`HostValues` of a graph being captured: only keyed values can be read (and refreshed
    ones in ``before_replay``). Reading another, by any route, raises GraphCaptureError naming the
    value, the backend and the line."""

    def __init__(self, values: HostValues, keyed: tuple[str, ...], backend: str, key: Any, *,
                 reader: str = "build", refreshed: tuple[str, ...] = ()) -> None:
        allowed = frozenset(keyed) | frozenset(refreshed)
        state = object.__getattribute__(self, "__dict__")
        for name in HOST_VALUES:
            state[name] = getattr(values, name) if name in allowed else Refused(f"host value {name!r}")
        state["_guard"] = (allowed, backend, key, reader)

    @property
    def captured_key(self) -> Any:
        """The key of the graph being captured (what the guard's errors name)."""
        return object.__getattribute__(self, "_guard")[2]

    def __getattribute__(self, name: str) -> Any:
        if name in HOST_VALUES or name == "__dict__":
            allowed, backend, key, reader = object.__getattribute__(self, "_guard")
            if name not in allowed:
                caller = sys._getframe(1)
                where = f"{caller.f_code.co_name} at {caller.f_code.co_filename}:{caller.f_lineno}"
                if name == "__dict__":
                    raise GraphCaptureError(
                        f"attention backend {backend!r} read the host values' __dict__ (vars(host)) while the "
                        f"graph of {key} was captured ({where}): it holds values the graph must not bake in; read "
                        f"the values by name, declaring each (docs/attention.md)")
                declare = ("Declare it in keyed_host_values (one of "
                           f"{KEYABLE_HOST_VALUES}: the key holds it) or in refreshed_host_values and read it in "
                           "before_replay, which runs outside the graph" if reader == "build" else
                           "Declare it in refreshed_host_values (or keyed_host_values)")
                raise GraphCaptureError(
                    f"attention backend {backend!r} read the host value {name!r} in {reader} while the graph of "
                    f"{key} was captured ({where}), without declaring it: the graph would bake in this step's "
                    f"value. {declare} (docs/attention.md)")
        return object.__getattribute__(self, name)


class HostTensorsRefused:
    """``StepTensors.on_host`` while a graph's metadata is built: a capture cannot see host reads,
    so any use raises GraphCaptureError; ``before_replay`` reads them, outside the graph."""

    __slots__ = ("_backend", "_key")

    def __init__(self, backend: str, key: Any) -> None:
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "_key", key)

    def _fail(self, *args: Any) -> Any:
        caller = sys._getframe(2)
        raise GraphCaptureError(
            f"attention backend {object.__getattribute__(self, '_backend')!r} read step.on_host (the host staging "
            f"buffers) while the graph of {object.__getattribute__(self, '_key')} was captured "
            f"({caller.f_code.co_name} at {caller.f_code.co_filename}:{caller.f_lineno}): a device graph cannot "
            f"see a host read, so the graph would bake in this step's values. Read the device tensors in build, "
            f"and the host ones in before_replay (refreshed_host_values; docs/attention.md)")

    def __getattr__(self, name: str) -> Any:
        return self._fail()

    def __bool__(self) -> bool:
        return self._fail()

    def __repr__(self) -> str:
        return "<step.on_host: refused while a graph is captured>"


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
    #: int32 [R]: each request's recurrent-state slot (negative: none); what the recurrent state
    #: backend reads (None where the buffers have no such field).
    state_slots: torch.Tensor | None = None


class AttentionBackend(AttentionDeclarations):
    """What a model's attention needs from a step, built into device tensors, what it declares,
    and its kernel. The executor runs its phases, each in one place:

    * :meth:`setup`, once, when the runner is built: prepare for the device and dtype, return
      the keyed host values;
    * :meth:`build` for an eager run or a replay, :meth:`build_for_capture` inside a capture
      (keyed values only: the phase says it is a capture);
    * :meth:`before_replay`, before every run, outside any graph: the one reader of the
      refreshed host values;
    * :meth:`attend`, the kernel graphrt's attention layers run (through the metadata's
      ``attend``, which graphrt's backends bind to it).

    Set it (subclassed or duck-typed) as ``model.attention_backend``, or register a kernel with
    the selector (selector.py). Defaults: any FULL graph, no host value read, nothing built,
    float KV caches only."""

    def setup(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        """Once, when the runner is built: prepare for ``device`` / ``dtype`` and return the host
        values :meth:`build` reads that a graph may fix. Default: :meth:`keyed_host_values`."""
        return tuple(self.keyed_host_values(device, dtype))

    def keyed_host_values(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        """Host values :meth:`build` reads and a graph may fix, on this device / dtype (a
        declaration: :meth:`setup` returns it)."""
        return ()

    def build(self, step: StepTensors, host: HostValues) -> Any:
        """The step's metadata for an eager run or a replay, from device ops on ``step`` and the
        declared ``host`` values; the attention layers read it from the forward context."""
        return step

    def build_for_capture(self, step: StepTensors, host: HostValues) -> Any:
        """The metadata a graph captures: device ops only (they are recorded); ``host`` holds
        the keyed values only and ``step.on_host`` is refused. Default: :meth:`build`."""
        return self.build(step, host)

    def before_replay(self, step: StepTensors, host: HostValues) -> None:
        """Before every run, outside any graph, when overridden: refresh the device buffers a
        graph reads from ``refreshed_host_values`` / ``step.on_host``. Default: not called."""

    def attend(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``layer``'s attention over the step (the forward context's metadata): ``q [T, Hq*D]``,
        ``k`` / ``v`` ``[T, Hkv*D]`` -> ``[T, Hq*D]``. Default: graphrt's reference kernel."""
        return paged_attend("reference", layer, q, k, v)


def overrides_before_replay(backend: Any) -> bool:
    """Whether ``backend`` overrides (or duck-types) :meth:`AttentionBackend.before_replay`."""
    method = getattr(type(backend), "before_replay", None)
    return method is not None and method is not AttentionBackend.before_replay


class PagedAttentionBackend(AttentionBackend):
    """graphrt's own: :class:`TorchAttentionMetadata` for :class:`PagedAttention`, its kernel
    (``"triton"``, ``"reference"``) fixed by the selector, or (None: constructed by a model or
    composed in another backend) chosen once at :meth:`setup` the selector's way; never set up,
    it runs the reference kernel over the whole table. The reference kernel attends over every
    table column, so a set-up one narrows the table to ``max_seq_len`` (keyed); Triton reads
    lengths on the device and keys nothing. ``kv_fp8``: whether the KV caches are scaled fp8,
    decided once by the selector from every cache's dtype (their dtypes are fixed when the runner
    is built): False, every cache is float and the kernel never asks; None (not known, or
    caches of both kinds), the kernel asks each cache's dtype per call."""

    name = "graphrt-paged"
    kv_cache_dtypes = FLOAT_KV_DTYPES + FP8_KV_DTYPES

    def __init__(self, head_dim: int | None = None, kernel: str | None = None, kv_fp8: bool | None = None) -> None:
        self.head_dim = head_dim
        self.kernel = kernel
        self.kv_fp8 = kv_fp8
        self._narrow = False           # set up: the table narrowed to the keyed context

    def setup(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        if self.kernel is None:
            self.kernel = choose_attention_kernel(device, self.head_dim or 64, dtype, dtype).kernel
        keyed = tuple(self.keyed_host_values(device, dtype))
        self._narrow = "max_seq_len" in keyed
        return keyed

    def keyed_host_values(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        return () if self.kernel == "triton" else ("max_seq_len",)

    def build(self, step: StepTensors, host: HostValues) -> TorchAttentionMetadata:
        table = step.block_table
        if self._narrow:
            table = table[:, :max(-(-host.max_seq_len // step.block_size), 1)]   # blocks_for, inline: every step
        return TorchAttentionMetadata.build(step.slot_mapping, step.query_start_loc, step.seq_lens, table,
                                            step.block_size, attend=self.attend)

    def attend(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``layer``'s attention by the kernel :meth:`setup` fixed (the reference one if never set up)."""
        return paged_attend(self.kernel or "reference", layer, q, k, v, self.kv_fp8)


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
            raise ConfigError(f"attention backend {backend_name(backend)!r} built "
                              f"metadata field {name!r} of shape {tuple(value.shape)} for a step of {num_tokens} "
                              f"tokens and {num_reqs} requests: its rows must be the step's tokens, requests or "
                              f"requests + 1 (list it in the backend's free_shape_fields if it is sized otherwise)")


def check_layers_read(backend: Any, metadata: Any, layers: Any) -> None:
    """Refuse a backend whose metadata the model's graphrt attention layers cannot run: each
    ``PagedAttention`` calls the metadata's ``attend(layer, q, k, v)`` (graphrt's
    :class:`TorchAttentionMetadata` binds it to its backend's kernel), and a layer with graphrt's
    reference-kernel additions (``extended``: soft-capping, sinks, a V head size of its own) needs
    a backend whose kernel runs them (``attends_extended``). ConfigError naming the backend, the
    metadata type, the layer and what it needs, when the runner is built (before: ~20 failed
    captures, then a raw AttributeError)."""
    attend = callable(getattr(metadata, "attend", None))
    for index, layer in enumerate(layers or ()):
        if not isinstance(layer, PagedAttention):
            continue
        extended = getattr(layer, "extended", False)
        if attend and (not extended or getattr(backend, "attends_extended", False)):
            continue
        if extended and attend:
            what = ("runs graphrt's reference kernel with its additions (soft-capping, sinks or its own V head size), "
                    "which this backend's attend() does not run")
            fix = ("keep the model's own backend (ReferencePagedBackend, whose kernel runs them), or subclass it and "
                   "return its metadata with your fields added")
        else:
            missing = [name for name in PAGED_METADATA_FIELDS if not hasattr(metadata, name)]
            what = (f"reads {', '.join(missing)} of it to run graphrt's kernels" if missing else
                    "calls its attend(layer, q, k, v), which it has not")
            fix = ("return graphrt's TorchAttentionMetadata (e.g. PagedAttentionBackend's build, set up, your fields "
                   "added), or give the metadata an attend(layer, q, k, v) -> [T, heads * head_dim] that runs your "
                   "kernel, which graphrt's layers then call; or make the model's attention layers your own modules")
        raise ConfigError(
            f"attention backend {backend_name(backend)!r} builds {type(metadata).__name__} metadata, but attention "
            f"layer {index} ({type(layer).__name__}, graphrt's paged attention) {what}: {fix} (docs/attention.md, "
            f"\"graphrt's layers and a backend of your own\")")


__all__ = ["AttentionBackend", "CaptureHostValues", "HOST_VALUES", "HostTensorsRefused", "HostValues",
           "KEYABLE_HOST_VALUES", "PAGED_METADATA_FIELDS", "PagedAttentionBackend", "Refused", "StepTensors",
           "check_layers_read", "check_metadata",
           "overrides_before_replay"]
