"""The torch graph logic, written once over a small device-graph API.

``TorchExecutor`` owns static device buffers (inputs, hidden states, logits, sampler
state), the paged KV cache, and one captured graph per key. CUDA, Ascend and the CPU
recording graph differ only in their :class:`DeviceGraphAPI`; with no API (``eager``)
every step runs eagerly on the same buffers.

Capture follows the rules that make device graphs correct: warm-up runs first, the
largest key first into one shared pool, garbage collection paused, dummy inputs that are
pure padding (slot -1: no KV write, seq_len 0: attend to nothing), inputs read only from
static buffers, and outputs written into static buffers the caller slices.
"""

from __future__ import annotations

import abc
import contextlib
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import numpy as np
import torch

from graphrt.backends.base import Executor, SamplingBatch
from graphrt.config import GraphConfig
from graphrt.dispatch import BatchDescriptor, RuntimeMode
from graphrt.errors import GraphCaptureError, GraphrtError
from graphrt.forward_context import forward_context
from graphrt.inputs import ModelInputs
from graphrt.models.torch_attention import TorchAttentionMetadata
from graphrt.padding import _DTYPES as PAD_DTYPES
from graphrt.sampler import greedy_sample, random_sample

logger = logging.getLogger(__name__)

#: Eager runs before each capture (allocator warm-up, lazy initialisation, torch.compile).
NUM_WARMUP_RUNS = 1
_TORCH_DTYPES = {np.int32: torch.int32, np.int64: torch.int64}


class DeviceGraphAPI(abc.ABC):
    """The few device calls the shared graph code needs (CUDA, NPU, CPU recording)."""

    name: str = ""
    device: torch.device = torch.device("cpu")
    #: Host staging buffers are page-locked (async host-to-device copies).
    pin_memory: bool = False

    @abc.abstractmethod
    def new_graph(self) -> Any:
        """An empty graph object with ``replay()``."""

    @abc.abstractmethod
    def capture(self, graph: Any, pool: Any) -> ContextManager[Any]:
        """Context manager in which the device records ``graph`` into ``pool``."""

    @abc.abstractmethod
    def new_pool(self) -> Any:
        """A memory-pool handle shared by every graph of one executor."""

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU)."""

    @abc.abstractmethod
    def memory_in_use(self) -> int:
        """Bytes held by the device allocator (or by captured graphs, on CPU)."""

    def memory_info(self) -> tuple[int, int] | None:
        """(free, total) device bytes, where known."""
        return None


@dataclass
class CapturedGraph:
    """One captured forward or sampler, with the input addresses it was captured on."""

    graph: Any
    input_ptrs: dict[str, int]


class TorchExecutor(Executor):
    """Static buffers, KV cache and graphs for a torch model on one device."""

    def __init__(self, model: torch.nn.Module, config: GraphConfig, device: torch.device,
                 graph_api: DeviceGraphAPI | None) -> None:
        self.model = model.eval()
        self.config = config
        self.device = torch.device(device)
        self.graph_api = graph_api
        self.has_graphs = graph_api is not None
        self.pre_replay_hooks: list[Callable[[ModelInputs], None]] = []
        self.vocab_size = int(model.config.vocab_size)
        self.hidden_size = int(model.config.hidden_size)
        self.block_size = config.block_size
        max_t, max_r = config.max_num_batched_tokens, config.max_num_seqs
        width = config.max_blocks_per_req
        shapes = {"input_ids": (max_t,), "positions": (max_t,), "slot_mapping": (max_t,),
                  "query_start_loc": (max_r + 1,), "seq_lens": (max_r,),
                  "num_computed_tokens": (max_r,), "block_table": (max_r, width)}
        pin = graph_api is not None and graph_api.pin_memory
        self._host = {name: torch.zeros(shape, dtype=_TORCH_DTYPES[PAD_DTYPES[name]], pin_memory=pin)
                      for name, shape in shapes.items()}
        self.host_buffers = {name: t.numpy() for name, t in self._host.items()}
        same = self.device.type == "cpu"
        self.static = self._host if same else {name: t.to(self.device) for name, t in self._host.items()}
        param_dtype = next(model.parameters()).dtype
        self.hidden_out = torch.zeros(max_t, self.hidden_size, dtype=param_dtype, device=self.device)
        self.logits_out = torch.zeros(max_r, self.vocab_size, dtype=torch.float32, device=self.device)
        self._samp_host = {"temperature": torch.zeros(max_r, dtype=torch.float32, pin_memory=pin),
                           "top_k": torch.zeros(max_r, dtype=torch.int64, pin_memory=pin),
                           "top_p": torch.ones(max_r, dtype=torch.float32, pin_memory=pin)}
        self._samp_np = {k: t.numpy() for k, t in self._samp_host.items()}
        self.samp_static = (self._samp_host if same else
                            {k: t.to(self.device) for k, t in self._samp_host.items()})
        self.noise = torch.ones(max_r, self.vocab_size, dtype=torch.float32, device=self.device)
        self.tokens_out = torch.zeros(max_r, dtype=torch.int64, device=self.device)
        self._generators: dict[int, torch.Generator] = {}
        self._pool = graph_api.new_pool() if graph_api is not None else None
        self.kv_cache: torch.Tensor | None = None

    # ---- KV cache -------------------------------------------------------------------
    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        layers, kv_heads, head_dim = self.model.kv_cache_spec()
        itemsize = next(self.model.parameters()).element_size()
        return 2 * layers * block_size * kv_heads * head_dim * itemsize

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """One tensor [layers, 2, blocks * block_size + 1, kv_heads, head_dim]; the last row
        of each layer is the trash row padded tokens write into."""
        layers, kv_heads, head_dim = self.model.kv_cache_spec()
        dtype = next(self.model.parameters()).dtype
        self.kv_cache = torch.zeros(layers, 2, num_blocks * block_size + 1, kv_heads, head_dim,
                                    dtype=dtype, device=self.device)
        for i, layer in enumerate(self.model.attention_layers()):
            layer.kv_cache = self.kv_cache[i]

    def memory_info(self) -> tuple[int, int] | None:
        return self.graph_api.memory_info() if self.graph_api is not None else None

    # ---- forward -------------------------------------------------------------------
    def _forward(self, num_tokens: int, num_reqs: int) -> None:
        """Run the model on the static buffers' first rows; write hidden and logits outputs.

        Everything here reads tensors only, so it can be captured; the sizes are the key.
        """
        s = self.static
        meta = TorchAttentionMetadata.build(s["slot_mapping"][:num_tokens],
                                            s["query_start_loc"][:num_reqs + 1],
                                            s["seq_lens"][:num_reqs], s["block_table"][:num_reqs],
                                            self.block_size)
        with forward_context(meta):
            hidden = self.model(s["input_ids"][:num_tokens], s["positions"][:num_tokens])
        self.hidden_out[:num_tokens].copy_(hidden)
        last = (s["query_start_loc"][1:num_reqs + 1] - 1).clamp(min=0).long()
        self.logits_out[:num_reqs].copy_(self.model.compute_logits(hidden.index_select(0, last)))

    def _sample_into(self, num_reqs: int, greedy: bool) -> None:
        logits = self.logits_out[:num_reqs]
        if greedy:
            self.tokens_out[:num_reqs].copy_(greedy_sample(logits))
        else:
            s = self.samp_static
            self.tokens_out[:num_reqs].copy_(random_sample(
                logits, s["temperature"][:num_reqs], s["top_k"][:num_reqs], s["top_p"][:num_reqs],
                self.noise[:num_reqs]))

    def _load_dummy(self, num_tokens: int, num_reqs: int) -> None:
        """Pure padding: no KV write (slot -1), every request empty (seq_len 0)."""
        h = self.host_buffers
        h["input_ids"][:num_tokens] = 0
        h["positions"][:num_tokens] = 0
        h["slot_mapping"][:num_tokens] = -1
        h["query_start_loc"][:num_reqs + 1] = 0
        h["seq_lens"][:num_reqs] = 0
        h["block_table"][:num_reqs] = 0
        self._to_device(num_tokens, num_reqs)

    def _to_device(self, num_tokens: int, num_reqs: int) -> None:
        if self.static is self._host:
            return
        for name, n in (("input_ids", num_tokens), ("positions", num_tokens),
                        ("slot_mapping", num_tokens), ("query_start_loc", num_reqs + 1),
                        ("seq_lens", num_reqs), ("block_table", num_reqs)):
            self.static[name][:n].copy_(self._host[name][:n], non_blocking=True)

    def _input_ptrs(self) -> dict[str, int]:
        ptrs = {name: t.data_ptr() for name, t in self.static.items()}
        ptrs.update({f"sampler.{k}": t.data_ptr() for k, t in self.samp_static.items()})
        ptrs["kv_cache"] = self.kv_cache.data_ptr() if self.kv_cache is not None else 0
        return ptrs

    # ---- build / run -----------------------------------------------------------------
    def build(self, mode: RuntimeMode, key: BatchDescriptor | tuple) -> tuple[Any, int]:
        """Capture the forward for a FULL key, or the sampler for ("sample", reqs, greedy)."""
        if self.graph_api is None:
            raise GraphrtError("the eager backend captures no graphs")
        if isinstance(key, tuple) and key and key[0] == "sample":
            _, num_reqs, greedy = key
            return self._capture(lambda: self._sample_into(num_reqs, greedy), lambda: None)
        if mode is not RuntimeMode.FULL:
            raise GraphrtError(f"{mode.value} graphs are not available on this backend")
        num_reqs = key.num_reqs
        return self._capture(lambda: self._forward(key.num_tokens, num_reqs),
                             lambda: self._load_dummy(key.num_tokens, num_reqs))

    def _capture(self, fn: Callable[[], None], load_dummy: Callable[[], None]) -> tuple[Any, int]:
        api = self.graph_api
        with torch.no_grad():
            load_dummy()
            for _ in range(NUM_WARMUP_RUNS):
                fn()
            api.synchronize()
            graph = api.new_graph()
            before = api.memory_in_use()
            with _gc_paused(), api.capture(graph, self._pool):
                fn()
            api.synchronize()
        return CapturedGraph(graph, self._input_ptrs()), max(api.memory_in_use() - before, 0)

    def run(self, mode: RuntimeMode, key: BatchDescriptor, entry: Any, padded: ModelInputs) -> Any:
        """Copy the padded step into static buffers, then replay ``entry`` or run eagerly."""
        t, r = padded.padded_num_tokens, padded.padded_num_reqs
        self._to_device(t, r)
        for hook in self.pre_replay_hooks:
            hook(padded)
        with torch.no_grad():
            if entry is None:
                self._forward(t, r)
            else:
                self._replay(entry)
        return self.logits_out[:r]

    def _replay(self, entry: CapturedGraph) -> None:
        if self.config.debug_check_addresses:
            now = self._input_ptrs()
            moved = [k for k, p in entry.input_ptrs.items() if now.get(k) != p]
            if moved:
                raise GraphrtError(f"static buffers {moved} moved since capture: a replay would read "
                                   "stale memory; never reassign executor buffers, copy into them")
        entry.graph.replay()

    def sample(self, logits: Any, num_reqs: int, sampling: SamplingBatch, *,
               padded_reqs: int | None = None, entry: Any = None) -> np.ndarray:
        """Fill sampler buffers and noise, replay the sampler graph (or run it eagerly)."""
        rp = padded_reqs or num_reqs
        greedy = sampling.all_greedy
        if not greedy:
            np_ = self._samp_np
            np_["temperature"][:num_reqs] = sampling.temperature
            np_["top_k"][:num_reqs] = sampling.top_k
            np_["top_p"][:num_reqs] = sampling.top_p
            np_["temperature"][num_reqs:rp] = 0.0
            np_["top_k"][num_reqs:rp] = self.vocab_size
            np_["top_p"][num_reqs:rp] = 1.0
            if self.samp_static is not self._samp_host:
                for k, t in self.samp_static.items():
                    t[:rp].copy_(self._samp_host[k][:rp], non_blocking=True)
            self._fill_noise(num_reqs, sampling)
        with torch.no_grad():
            if entry is None:
                self._sample_into(rp, greedy)
            else:
                self._replay(entry)
        return self.tokens_out[:num_reqs].cpu().numpy()

    def _fill_noise(self, num_reqs: int, sampling: SamplingBatch) -> None:
        """Exp(1) noise per row: the device RNG, or the request's own seeded generator."""
        self.noise[:num_reqs].exponential_()
        for i, seed in enumerate(sampling.seeds):
            if seed is None:
                continue
            rid = sampling.request_ids[i]
            gen = self._generators.get(rid)
            if gen is None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(int(seed))
                self._generators[rid] = gen
            self.noise[i].exponential_(generator=gen)

    def free_request(self, request_id: int) -> None:
        self._generators.pop(request_id, None)

    def hidden_states(self, num_tokens: int) -> np.ndarray:
        return self.hidden_out[:num_tokens].float().cpu().numpy()

    def logits(self, num_reqs: int) -> np.ndarray:
        return self.logits_out[:num_reqs].cpu().numpy()


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Collect once, then keep the collector out of the capture (it may free captured tensors)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def describe_capture_failure(exc: BaseException) -> str:
    """Why a capture failed and what to change, for the eager-fallback warning."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text.lower():
        return (f"out of memory while capturing ({text}); lower max_cudagraph_capture_size, "
                "capture fewer sizes, or reserve less memory for the KV cache")
    if isinstance(exc, GraphCaptureError):
        return f"{text}; make the model capturable or use graph mode PIECEWISE / NONE"
    return f"{type(exc).__name__}: {text}"


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and its wall seconds."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0
