"""The torch graph logic, written once over a small device-graph API.

``TorchExecutor`` owns the static device buffers, the paged KV cache and the captured graphs;
CUDA, Ascend and the CPU recording graph differ only in their :class:`DeviceGraphAPI` (none:
``eager``). Capturing is :class:`~graphrt.backends.torch.capture.graph_builder.GraphBuilder`'s.
One refresh path: the attention backend's ``before_replay`` runs before every run, then the
graph's tasks (:func:`graph_task`); at a FULL capture it runs on the padding step with only its
declared host values readable, and ``BakedValueChecks.check_refresh`` proves nothing it leaves
reaches the graph as a number."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Sequence

import numpy as np
import torch

from graphrt.backends.base import BufferWatch, Capabilities, Executor, SamplingBatch
from graphrt.backends.torch.capture.baked_values import BakedValueChecks
from graphrt.backends.torch.kv_cache import TorchKVCache
from graphrt.backends.torch.forward import TorchForward
from graphrt.backends.torch.state_cache import TorchStateCache, model_state_spec
from graphrt.backends.torch.lora import TorchLora
from graphrt.backends.torch.capture.piecewise_capture import PiecewiseCapture
from graphrt.backends.torch.capture.fx_split import PiecewiseEntry
from graphrt.backends.torch.capture.graph_builder import GraphBuilder, TorchEntry
from graphrt.backends.torch.capture.graph_memory import measure_graph_memory
from graphrt.config import GraphConfig
from graphrt.core.dispatch import BatchDescriptor, SamplerKey, sampler_key
from graphrt.core.errors import GraphrtError
from graphrt.core.graph_modes import RuntimeMode
from graphrt.layers.torch.state.backend import RecurrentStateBackend
from graphrt.core.inputs.extra_inputs import check_extra_specs
from graphrt.core.inputs.fields import ModelInputs
from graphrt.core.attention_decl import check_declarations, check_kv_dtypes
from graphrt.layers.torch.attention.backend import (HostValues, check_layers_read, check_metadata,
                                                    overrides_before_replay)
from graphrt.layers.torch.attention.selector import select_attention
from graphrt.backends.torch.device_graphs import (CapturedGraph, DeviceGraphAPI, check_addresses,
                                                 describe_capture_failure)
from graphrt.backends.torch.model_protocol import attention_support, keyed_host_values
from graphrt.backends.torch.sampling.sampled_outputs import FutureInputs, SampledOutputs, device_event
from graphrt.backends.torch.step_buffers import StepBuffers
from graphrt.backends.torch.sampling.sampler import SamplerState
from graphrt.backends.torch.live_buffers import LiveBuffers
from graphrt.backends.torch.sleep import TorchSleep
from graphrt.backends.torch.weights import TorchWeights, WeightSource
from graphrt.core.weight_reports import SleepReport, WakeReport, WeightsUpdate

logger = logging.getLogger(__name__)


class TorchExecutor(Executor[TorchEntry]):
    """Static buffers, KV cache and graphs for a torch model on one device (what a step hands
    out beyond its replay -- sampled outputs in host slots, logprobs, prompt logprobs, device
    logits -- is held as ``outputs``, a :class:`~graphrt.backends.torch.sampling.sampled_outputs.SampledOutputs`)."""

    def __init__(self, model: torch.nn.Module, config: GraphConfig, device: torch.device,
                 graph_api: DeviceGraphAPI | None, host_arrays: dict[str, np.ndarray] | None = None) -> None:
        """``host_arrays``: staging buffers to use instead of allocating them (one per field, of
        ``buffer_shapes``'s shape; tensor parallelism's step-channel buffers)."""
        self.model = model.eval()
        self.config = config
        self.device = torch.device(device)
        self.graph_api = graph_api
        param_dtype = next(model.parameters()).dtype
        self.kv = TorchKVCache(model, config, self.device, f"torch {self.device.type}")
        #: The model's one attention object (the seam, docs/attention.md), chosen here once: its
        #: kernel, its metadata, its refresh before every run, its declarations.
        self.attention = select_attention(model, self.device, param_dtype, config.block_size, self.kv.kv_dtype(),
                                          self.kv.kv_dtypes())
        check_declarations(self.attention)
        check_kv_dtypes(self.attention, self.kv.group_dtypes())
        support = attention_support(model, self.attention)
        keyed = keyed_host_values(self.attention, self.device, param_dtype)   # its setup, once
        #: The refresh path: the backend's own before_replay, run before every run when it has one.
        self._refresh = overrides_before_replay(self.attention)
        self._host_values = HostValues(0, 0, 0, 0, 0, 0, False)   # the running step's, reused
        self.vocab_size = int(model.config.vocab_size)
        self.hidden_size = int(model.config.hidden_size)
        self.block_size = config.block_size
        max_t, max_r = config.max_num_batched_tokens, config.max_num_seqs
        pin = graph_api is not None and graph_api.pin_memory and self.device.type != "cpu"
        #: Host staging and static device buffers of every field and extra input.
        declared = getattr(model, "extra_inputs", None)       # the model's per-step inputs (none: most models)
        self.buffers = StepBuffers(max_t, max_r, config.max_blocks_per_req, config.block_size, self.device, pin,
                                   host_arrays, check_extra_specs(declared, type(model).__name__) if declared else {})
        self.host_buffers, self.static = self.buffers.host_arrays, self.buffers.static
        # A hybrid model's recurrent states (docs/hybrid.md): a slot per running request and the
        # trash slot, allocated now (their size does not depend on the KV cache's).
        spec = model_state_spec(model, f"torch {self.device.type}")
        self.state = TorchStateCache(model, spec, config, self.device) if spec is not None else None
        self.state_caches: list[torch.Tensor] = self.state.allocate() if self.state is not None else []
        self.num_state_slots = self.state.num_slots if self.state is not None else None
        #: The recurrent state's backend, beside the attention one (same phases; set up here, once).
        self.state_backend = (RecurrentStateBackend(self.state.num_slots, self.state.checkpoints,
                                                    config.decode_query_len) if self.state is not None else None)
        if self.state_backend is not None:
            self.state_backend.setup(self.device, param_dtype)
        self.state_memory = self.state.memory if self.state is not None else None
        #: The forward on the static buffers (host values, both backends' metadata, the model run,
        #: its outputs): one object this executor, the builder, PIECEWISE capture and the checks share.
        self.fwd = TorchForward(model, config, self.buffers, self.attention, keyed,
                                self.state_backend, self.device, param_dtype)
        probe = min(2, max_t), 1                      # the builder's metadata must fit a step
        probe_meta = self.attention.build(self.buffers.tensors(*probe), self.fwd.dummy_host(*probe))
        check_metadata(self.attention, probe_meta, *probe)
        check_layers_read(self.attention, probe_meta, model.attention_layers() if hasattr(model, "attention_layers")
                          else [])
        #: The model's declared extra inputs and their staging buffers (the runner writes them).
        self.extra_inputs, self.extra_buffers = self.buffers.extra, self.buffers.extra_arrays
        self.dtype = param_dtype
        self.hidden_out, self.logits_out = self.fwd.hidden_out, self.fwd.logits_out
        self.position_logits_out = self.fwd.position_logits_out
        self.sampler = SamplerState(max_r, self.vocab_size, self.device, pin, config.max_logprobs, max_t,
                                    penalties=config.enable_penalties)
        self._copied = None if self.buffers.same else device_event(self.device)
        # Graph backends launch steps without waiting (the CPU's events are complete at once);
        # the sampled outputs' host slots are made by the first such step.
        #: What it can do, PIECEWISE aside (:attr:`capabilities` adds it when first read).
        self._declared = Capabilities(
            has_graphs=graph_api is not None, attention_support=support,
            eager_fallback=True, async_execution=graph_api is not None,
            device_runs_ahead=graph_api is not None and graph_api.asynchronous, keyed_host_values=keyed,
            graphs_share_memory=graph_api is not None and graph_api.graphs_share_memory)
        self.futures = FutureInputs(self.static["input_ids"], self.sampler.tokens, pin) if graph_api else None
        #: The step's outputs besides the tokens it waits for (steps that do not wait, logprobs).
        self.outputs = SampledOutputs(self.sampler, self.logits_out, self.hidden_out,
                                      lambda hidden: self.model.compute_logits(hidden),
                                      graph_api.new_event if graph_api is not None else None, pin)
        self.fetch_tokens, self.fetch_logprobs = self.outputs.fetch_tokens, self.outputs.fetch_logprobs
        self.sample_logprobs, self.prompt_logprobs = self.outputs.sample_logprobs, self.outputs.prompt_logprobs
        self.kv_caches: list[torch.Tensor] = []
        self.kv_cache: torch.Tensor | None = None
        # LoRA-capable linears swapped in (max_loras > 0) before the model is split or traced.
        self.lora = TorchLora(model, config, self.device, pin) if config.max_loras else None
        self._pin = pin
        #: The buffers every graph reads (recorded at capture, checked at refit, wake and LoRA
        #: load; before every replay with ``debug_check_addresses``). In-place refit and sleep /
        #: wake are made on first use (:attr:`refit`, :attr:`sleeper`).
        self.live = LiveBuffers(model, self._cache_tensors, self.device_buffers)
        self._builder: GraphBuilder | None = None       # made by the first capture (:attr:`builder`)
        if config.compile_model and (note := self.pieces.compile_note()) is not None:
            logger.warning("graphrt: compile_model is ignored: %s", note)

    @functools.cached_property
    def pieces(self) -> PiecewiseCapture:
        """PIECEWISE capture (``pieces.split_model``: the fx split; ``pieces.capture``: fx,
        breakable or None), made on first use: the graph mode's resolution or a capture."""
        return PiecewiseCapture(self.model, self.config, self.graph_api, self.static, forward=self.fwd,
                                input_ptrs=self.input_ptrs)

    @property
    def builder(self) -> GraphBuilder | None:
        """Captures every graph (None on the eager backend; ``builder.report``: the capture report
        per key, ``builder.pool``: the pool every graph shares), made by the first capture or
        graph-memory sample and handed only what a capture uses."""
        if self._builder is None and self.graph_api is not None:
            self._builder = self._make_builder()
        return self._builder

    def _make_builder(self) -> GraphBuilder:
        # Check the host values each FULL capture bakes in (off while graph memory is sampled:
        # warm-up captures, and checks, the same keys again); refuse the capture where they vary.
        # A model's own backend with a refresh gets the check at every FULL capture, in every
        # mode, and a key whose forward bakes a value that varies is refused (it runs eagerly).
        config, graph_api = self.config, self.graph_api
        own_refresh = self._refresh and getattr(self.model, "attention_backend", None) is not None
        checked = config.check_baked_values or config.strict or own_refresh
        checks = (BakedValueChecks(self.buffers, self.attention, self._declared.keyed_host_values, graph_api,
                                   forward=self.fwd, refresh=self._refresh, refuse=config.strict or own_refresh,
                                   max_model_len=config.max_model_len, vocab_size=self.vocab_size)
                  if checked or self._refresh else None)   # only where captures ask
        return GraphBuilder(
            graph_api, pieces=self.pieces, sampler=self.sampler, logits_out=self.logits_out, lora=self.lora,
            forward=self.fwd, input_ptrs=self.input_ptrs,
            check_baked=checks.check_baked if checks is not None and checked else None,
            check_refresh=checks.check_refresh if checks is not None and self._refresh else None,
            refresh_for_capture=checks.refresh_for_capture if checks is not None and self._refresh else None,
            live_buffers=self.live.snapshot,
        )

    @functools.cached_property
    def refit(self) -> TorchWeights:
        """In-place refit (``update_weights``, ``weight_names``), made on first use."""
        return TorchWeights(self.model)

    @functools.cached_property
    def sleeper(self) -> TorchSleep:
        """Sleep / wake, made on first use."""
        return TorchSleep(self.model, self._cache_tensors, self.device, self.graph_api, self._pin)

    # ---- KV cache (backends/torch/kv_cache.py) -----------------------------------------
    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return self.kv.bytes_per_block(block_size)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Per the model's KV cache spec: ``kv_caches`` one tensor per stored layout (none where
        the model owns its cache), ``kv_cache`` the only one where there is one -- every layer of
        one layout: ``[layers, 2, blocks * block_size + 1, kv_heads, head_dim]``; the last row of
        each layer is the trash row padded tokens write into."""
        if self.kv_caches:                  # graphs captured before read the old tensors
            self.live.due = True
        self.kv_caches = self.kv.allocate(num_blocks, block_size)
        self.kv_cache = self.kv_caches[0] if len(self.kv_caches) == 1 else None

    def memory_info(self) -> tuple[int, int] | None:
        return self.graph_api.memory_info() if self.graph_api is not None else None

    def measure_graph_memory(self, jobs: Sequence[tuple[RuntimeMode, Any]]) -> tuple[dict[Any, int], str | None]:
        """Capture ``jobs`` into a throwaway pool before the KV cache exists (backends/torch/capture/graph_memory.py)."""
        return measure_graph_memory(self.builder, bool(self.kv_caches),
                                    lambda blocks: self.allocate_kv_cache(blocks, self.block_size), self._release_kv, jobs)

    def _release_kv(self) -> None:
        self.kv.release()
        self.kv_caches, self.kv_cache = [], None

    @functools.cached_property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        """What it can do; ``supports_piecewise``, decided on the first read (it may need the fx
        split): PIECEWISE graphs need a graph API and a model that splits at its attention calls
        (fx) or declares them (breakable). The fx trace runs here, on the thread building the
        runner, never later on a background capture thread: tracing patches ``nn.Module.__call__``
        process-wide, so another engine's forward on another thread would run through the tracer."""
        piecewise = self.graph_api is not None and self.pieces.capture is not None
        return dataclasses.replace(self._declared, supports_piecewise=piecewise)


    @property
    def sampler_buffer_bytes(self) -> int:
        """Bytes of the sampler's shared buffers, read when reported: penalty state made by a
        later batch counts too."""
        return self.sampler.buffer_bytes

    @property
    def build_count(self) -> int:
        """Graphs captured so far (one row each of ``builder.report``, the capture report)."""
        return len(self._builder.report) if self._builder is not None else 0

    @property
    def kv_owned_by_model(self) -> bool:  # type: ignore[override]
        return bool(self.kv.spec is not None and self.kv.spec.owned_by_model)

    def kv_views(self) -> list[torch.Tensor]:
        return list(self.kv_caches)

    def device_buffers(self) -> dict[str, torch.Tensor]:
        """Static inputs, the hidden / logits outputs and the sampler's parameters, noise and tokens."""
        out = {f"static.{name}": t for name, t in self.static.items()}
        out.update(hidden_out=self.hidden_out, logits_out=self.logits_out)
        out.update({f"sampler.{name}": t for name, t in self.sampler.static.items()})
        out.update({f"sampler.{name}": getattr(self.sampler, name) for name in ("noise", "tokens")
                    if getattr(self.sampler, name, None) is not None})
        return out

    def input_ptrs(self) -> dict[str, int]:
        ptrs = self.buffers.pointers()
        ptrs.update({f"sampler.{k}": t.data_ptr() for k, t in self.sampler.static.items()})
        ptrs.update({f"kv_cache.{i}" if i else "kv_cache": t.data_ptr() for i, t in enumerate(self.kv_caches)})
        ptrs.update({f"state_cache.{i}": t.data_ptr() for i, t in enumerate(self.state_caches)})
        return ptrs

    # ---- weights, sleep and the live-buffer check (weights.py, sleep.py, live_buffers.py) -----
    def update_weights(self, source: WeightSource, *, check_only: bool = False) -> WeightsUpdate:
        """Copy a checkpoint's (or an iterable's) tensors into the parameters in place (TorchWeights)."""
        return self.refit.update(source, check_only=check_only)

    def weight_names(self) -> frozenset[str]:
        return self.refit.names()

    def sleep(self, level: int) -> SleepReport:
        return self.sleeper.sleep(level)

    def wake(self) -> WakeReport:
        return self.sleeper.wake()

    def stale_buffers(self, entries: Any) -> dict[Any, list[str]]:
        return self.live.stale(entries)

    def buffer_watch(self) -> BufferWatch | None:
        """The live buffers' watch (:meth:`LiveBuffers.watch`): due after a re-binding anywhere or
        a cache allocated again; in strict mode also when a parameter's, buffer's or cache view's
        address moved (a comparison per step). None without graphs (eager: nothing is captured)."""
        return self.live.watch(thorough=self.config.strict) if self.graph_api is not None else None

    def _cache_tensors(self) -> dict[str, torch.Tensor]:
        """The KV and state cache tensors by name (what a sleep drops)."""
        out = {f"kv_cache.{i}" if i else "kv_cache": t for i, t in enumerate(self.kv_caches)}
        out.update({f"state_cache.{i}": t for i, t in enumerate(self.state_caches)})
        return out

    # ---- build (backends/torch/capture/graph_builder.py) ------------------------------------------
    def build(self, mode: RuntimeMode, key: BatchDescriptor | SamplerKey) -> tuple[TorchEntry, int]:
        """Capture the forward for a FULL key, its pieces for a PIECEWISE key, or the
        sampler for a :class:`SamplerKey` (:class:`GraphBuilder`). Returns (entry, graph bytes)."""
        if self.builder is None:
            raise GraphrtError("the eager backend captures no graphs")
        return self.builder.build(mode, key)

    # ---- run -------------------------------------------------------------------------
    def run(self, mode: RuntimeMode, key: BatchDescriptor, entry: TorchEntry | None,
            padded: ModelInputs, future: Any = None) -> torch.Tensor:
        """Copy the padded step into static buffers, then replay ``entry`` or run eagerly.
        ``future`` (graph backends): ``(rows, sampled)``, the previous step's tokens written into
        the static inputs on the device first (:class:`FutureInputs`)."""
        t, r = len(padded.input_ids), len(padded.seq_lens)
        if self._copied is not None:        # a device apart from the host: copy the step's rows
            self.buffers.to_device(t, r)
        if future is not None:
            self.futures.write(future[0], padded.query_start_loc)
        if self.lora is not None:
            self.lora.before_step(key, t)
        if self._copied is not None:
            self._copied.record()
        # The step's host values: read by the refresh and by a forward that runs in Python (eager,
        # PIECEWISE: at a key, the key's context); a full graph's replay without a refresh reads none.
        replayed = entry is not None and not isinstance(entry, PiecewiseEntry)
        host = None if replayed and not self._refresh else self.fwd.step_host_values(self._host_values, padded, key)
        if self._refresh:                 # the one refresh path, before every run
            self.attention.before_replay(self.buffers.tensors(t, r), host)
        if entry is not None and self.graph_api is not None and entry.tasks:
            self.graph_api.pre_replay(entry.tasks)
        if entry is not None and self.config.debug_check_addresses:
            check_addresses(entry, self.input_ptrs())
            self.live.check_entry(entry, (mode, key))
        with torch.no_grad():
            if entry is None:
                self.fwd.run(t, r, host)
            elif replayed:
                entry.graph.replay()
            else:                                     # PIECEWISE, attention eager: the step's own values
                self.fwd.run_split(entry.calls, entry.output, t, r, host)
        if self._copied is not None:
            self._copied.synchronize()
        return self.logits_out[:r]

    def sample(self, logits: Any, num_reqs: int, sampling: SamplingBatch, *,
               padded_reqs: int | None = None, entry: CapturedGraph | None = None, wait: bool = True,
               key: SamplerKey | None = None) -> np.ndarray:
        """Fill the sampler's buffers, replay the sampler graph (or run it eagerly); the real
        requests' tokens, a host copy (never a view of the device buffer), or with ``wait=False``
        (graph backends) their copy queued into a host slot (a :class:`Sampled`)."""
        rows = padded_reqs or num_reqs
        if key is None:
            key = sampler_key(sampling, rows, self.vocab_size)
        sampler = self.sampler
        if not key.greedy:
            sampler.write(sampling, num_reqs, rows)
        with torch.no_grad():
            if key.penalties:
                sampler.fold_penalties(sampling, num_reqs, rows, self.static["input_ids"])
            if entry is None:
                sampler.compute(self.logits_out, rows, key.greedy, key.wide_top_k, key.penalties)
            else:
                if self.config.debug_check_addresses:
                    check_addresses(entry, self.input_ptrs())
                    self.live.check_entry(entry, key)
                entry.graph.replay()
        if not wait:
            return self.outputs.launch(num_reqs)
        tokens = sampler.tokens[:num_reqs].cpu().numpy()
        return tokens.copy() if sampler.tokens.device.type == "cpu" else tokens

    def prepare_penalties(self, sampling: SamplingBatch, token_ids: np.ndarray, req_rows: np.ndarray,
                          num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray, rows: int) -> None:
        """Plan a penalised batch's token counts (``SamplerState.plan_penalties``; :meth:`sample`
        folds them in after the forward wrote the step's ``input_ids``)."""
        self.sampler.plan_penalties(sampling, token_ids, req_rows, num_computed_tokens, num_scheduled_tokens, rows)

    def entry_memory(self, entry: Any) -> dict[str, Any]:
        """With ``collectives="eager"``: the functional collectives a PIECEWISE entry runs
        eagerly per replay (``eager_collectives``), the warm-up report's cost of the breaks."""
        if self.config.collectives != "eager" or not isinstance(entry, PiecewiseEntry):
            return {}
        return {"eager_collectives": entry.eager_collectives}

    def describe_build_failure(self, exc: BaseException) -> str:
        return describe_capture_failure(exc)

    def device_logits(self, num_rows: int) -> torch.Tensor:
        """The last step's logits rows, a view of the static buffer (the next step overwrites it)."""
        return self.logits_out[:num_rows]

    def free_request(self, request_id: int) -> None:
        self.sampler.free_request(request_id)

    def hidden_states(self, num_tokens: int) -> np.ndarray:
        return self.hidden_out[:num_tokens].float().cpu().numpy()

    def logits(self, num_reqs: int) -> np.ndarray:
        return self.logits_out[:num_reqs].cpu().numpy()

    def position_logits(self, num_reqs: int) -> np.ndarray:
        if self.position_logits_out is None:
            raise GraphrtError("position logits need num_speculative_tokens > 0")
        return self.position_logits_out[:num_reqs].cpu().numpy()
