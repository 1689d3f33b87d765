"""What an attention backend declares, read alike by the torch and the XLA backends.

A graph or executable fixes every host value read while it was made, so the runner must know
what the attention reads on the host (:class:`AttentionDeclarations`): ``graph_support`` (vLLM's
four FULL-graph levels), ``keyed_host_values`` (values a key may fix; ``max_seq_len`` among them
narrows the context per bucket: :func:`narrows_context`), ``refreshed_host_values`` (read before
every run, outside the graph) and ``kv_cache_dtypes``. The checks raise
:class:`~graphrt.core.errors.ConfigError` naming the backend when a runner is built. The
standard library only."""

from __future__ import annotations

import os
from typing import Any, ClassVar, Iterable, Sequence

from graphrt.core.defaults import ATTENTION_ENV
from graphrt.core.errors import ConfigError
from graphrt.core.graph_modes import AttentionGraphSupport
from graphrt.core.kv_spec import kv_cache_dtype_name

#: The step's host values a backend may read (fields of the torch seam's ``HostValues``).
HOST_VALUES = ("num_tokens", "num_reqs", "real_num_tokens", "real_num_reqs", "max_query_len",
               "max_seq_len", "uniform_decode", "query_start_loc", "seq_lens")
#: Those a graph's key holds, so a backend may declare them keyed.
KEYABLE_HOST_VALUES = ("num_tokens", "num_reqs", "uniform_decode", "max_seq_len")
#: The keyed value that gives keys context buckets (the block table narrowed to the bucket).
CONTEXT_VALUE = "max_seq_len"
#: KV-cache dtypes (canonical names) a backend that declares none can read and write: floats.
FLOAT_KV_DTYPES = ("float64", "float32", "float16", "bfloat16")
#: The fp8 KV-cache dtypes (stored value / scale): only a backend that declares them gets them.
FP8_KV_DTYPES = ("float8_e4m3fn", "float8_e5m2")


class AttentionDeclarations:
    """What an attention says about itself; every default is the safe one (subclass and set).

    Defaults: runs in any FULL graph, keys and refreshes nothing, float KV caches only."""

    #: A name for logs and errors.
    name: ClassVar[str] = "attention"
    #: What the kernels can run inside a FULL graph (the runner degrades the mode to it).
    graph_support: ClassVar[AttentionGraphSupport] = AttentionGraphSupport.ALWAYS
    #: Host values read before every run, outside the graph (the torch seam's ``before_replay``).
    refreshed_host_values: ClassVar[tuple[str, ...]] = ()
    #: KV-cache dtypes the kernels read and write (canonical names or vLLM's spellings).
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = FLOAT_KV_DTYPES

    def keyed_host_values(self, device: Any, dtype: Any) -> tuple[str, ...]:
        """Host values the metadata build reads and a graph may fix, on this device / dtype."""
        return ()


def backend_name(backend: Any) -> str:
    """``backend.name``, else its class name (for errors)."""
    return str(getattr(backend, "name", None) or type(backend).__name__)


def check_declarations(backend: Any, *, refresh: bool = True) -> None:
    """Refuse declarations that name nothing real (ConfigError naming the backend and the field):
    unknown refreshed values, a graph-support level that is not one, KV dtypes that are not.
    ``refresh``: whether this framework can refresh before a run (False: XLA, where any
    refreshed value is refused)."""
    name = backend_name(backend)
    refreshed = tuple(getattr(backend, "refreshed_host_values", ()) or ())
    unknown = [v for v in refreshed if v not in HOST_VALUES]
    if unknown:
        raise ConfigError(f"attention backend {name!r}: refreshed_host_values {unknown} are not host values "
                          f"(one of {HOST_VALUES})")
    if refreshed and not refresh:
        raise ConfigError(f"attention backend {name!r}: refreshed_host_values {list(refreshed)}, but an XLA "
                          "executable takes the step's arrays as arguments and runs no Python before a call; "
                          "read them from the step's arrays inside the forward, or key them")
    try:
        AttentionGraphSupport(getattr(backend, "graph_support", AttentionGraphSupport.ALWAYS))
    except ValueError as exc:
        raise ConfigError(f"attention backend {name!r}: graph_support must be an AttentionGraphSupport") from exc
    supported_kv_dtypes(backend)


def supported_kv_dtypes(backend: Any) -> tuple[str, ...]:
    """The canonical KV-cache dtypes ``backend`` declares (``kv_cache_dtypes``)."""
    declared = getattr(backend, "kv_cache_dtypes", FLOAT_KV_DTYPES)
    if isinstance(declared, str) or not isinstance(declared, Iterable):
        raise ConfigError(f"attention backend {backend_name(backend)!r}: kv_cache_dtypes must be a tuple of "
                          f"dtype names, got {declared!r}")
    return tuple(kv_cache_dtype_name(d, f"attention backend {backend_name(backend)!r}: kv_cache_dtypes")
                 for d in declared)


def checked_keyed(backend: Any, device: Any, dtype: Any) -> tuple[str, ...]:
    """Run ``backend``'s setup phase (once, when the runner is built): what it fixes when a graph
    is built (sorted), checked to be values a key holds."""
    setup = getattr(backend, "setup", None)        # the setup phase (once); a duck-typed backend: its declaration
    keyed = tuple(sorted(setup(device, dtype) if callable(setup) else backend.keyed_host_values(device, dtype)))
    bad = [v for v in keyed if v not in KEYABLE_HOST_VALUES]
    if bad:
        raise ConfigError(f"attention backend {backend_name(backend)!r} keys on {bad}, which no graph key holds: "
                          f"keyed_host_values may name {KEYABLE_HOST_VALUES}; refresh the others in "
                          "before_replay (refreshed_host_values)")
    return keyed


def requested_kernel(choices: Sequence[str], taker: str) -> str:
    """The one parser of ``GRAPHRT_ATTENTION`` (torch and XLA alike): its value, lower-cased,
    ``auto`` where unset or empty; ConfigError naming ``taker`` and ``choices`` for another."""
    choice = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if choice not in choices:
        raise ConfigError(f"{ATTENTION_ENV}={choice!r}: {taker} takes one of {tuple(choices)}")
    return choice


def narrows_context(keyed: Iterable[str]) -> bool:
    """Whether keys get context buckets: the attention keys ``max_seq_len`` (its cost follows the
    block table's width, which a graph then fixes at its bucket)."""
    return CONTEXT_VALUE in tuple(keyed)


def least_support(backend: Any, layers: Iterable[Any] = ()) -> AttentionGraphSupport:
    """What FULL graphs the attention supports: the backend's level and the least its layers
    declare (``graph_support`` on a layer still counts)."""
    levels = [AttentionGraphSupport(getattr(layer, "graph_support", AttentionGraphSupport.ALWAYS))
              for layer in layers]
    levels.append(AttentionGraphSupport(getattr(backend, "graph_support", AttentionGraphSupport.ALWAYS)))
    return min(levels)


def check_kv_dtypes(backend: Any, group_dtypes: Iterable[tuple[int, str]]) -> None:
    """Refuse a KV cache whose dtype the attention cannot read and write: ConfigError naming the
    group, its dtype, the backend and what it declares. ``group_dtypes``: (group index,
    canonical dtype) of a resolved KV cache spec."""
    supported = supported_kv_dtypes(backend)
    for i, dtype in group_dtypes:
        if dtype not in supported:
            fp8 = (" (fp8 stores value / scale: a kernel must quantize on write and dequantize on read)"
                   if dtype in FP8_KV_DTYPES else "")
            raise ConfigError(f"kv_cache_spec.groups[{i}].dtype: {dtype}, but attention backend "
                              f"{backend_name(backend)!r} reads and writes KV caches of {list(supported)} only"
                              f"{fp8}; set kv_cache_dtype to one of them, or declare {dtype!r} in the backend's "
                              "kv_cache_dtypes if its kernels handle it")


def device_type(device: Any) -> str:
    """A device's type (what a kernel declares it serves): ``"npu"`` for ``torch.device("npu:0")``
    and for the string ``"npu:0"`` (read without ``torch.device``, which needs torch_npu for it)."""
    return str(getattr(device, "type", device)).split(":")[0]


__all__ = ["AttentionDeclarations", "CONTEXT_VALUE", "FLOAT_KV_DTYPES", "FP8_KV_DTYPES", "HOST_VALUES",
           "KEYABLE_HOST_VALUES", "backend_name", "check_declarations", "check_kv_dtypes", "checked_keyed",
           "device_type", "least_support", "narrows_context", "requested_kernel", "supported_kv_dtypes"]
