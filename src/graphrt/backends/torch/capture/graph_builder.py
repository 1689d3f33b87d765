"""How a :class:`~graphrt.backends.torch.executor.TorchExecutor` captures its graphs.

:class:`GraphBuilder` owns the graph pool, the capture report and the build of every key: a
FULL key's whole forward (compiled pieces with ``compile_model``), a PIECEWISE key's pieces, a
:class:`SamplerKey`'s sampler. It is handed only what a capture uses, never the executor, and
nothing here runs on a warm step. The rules: warm-up first, largest key first into one pool, GC
paused, dummy inputs that are pure padding, inputs only from static buffers, outputs into static
buffers the caller slices."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from graphrt.backends.torch.device_graphs import CapturedGraph, DeviceGraphAPI, GraphPool, describe_capture_failure
from graphrt.backends.torch.capture.fx_split import PiecewiseEntry
from graphrt.backends.torch.lora import TorchLora
from graphrt.backends.torch.capture.piecewise_capture import PiecewiseCapture
from graphrt.backends.torch.forward import TorchForward
from graphrt.backends.torch.sampling.sampler import SamplerState
from graphrt.core import defaults
from graphrt.core.dispatch import BatchDescriptor, SamplerKey
from graphrt.core.errors import GraphrtError
from graphrt.core.inputs.fields import ModelInputs
from graphrt.core.graph_modes import RuntimeMode

logger = logging.getLogger(__name__)

#: What a TorchExecutor captures per key: one graph (FULL, sampler) or a bucket's pieces.
TorchEntry = CapturedGraph | PiecewiseEntry


class GraphBuilder:
    """Captures one executor's graphs into one pool and reports each build (``report``: per
    built key its mode, seconds, graph bytes, whether it was compiled, baked values)."""

    def __init__(self, graph_api: DeviceGraphAPI, *, pieces: PiecewiseCapture, sampler: SamplerState,
                 logits_out: torch.Tensor, lora: TorchLora | None,
                 forward: TorchForward,
                 input_ptrs: Callable[[], dict[str, int]],
                 check_baked: Callable[[BatchDescriptor], Any] | None,
                 check_refresh: Callable[[BatchDescriptor], None] | None,
                 refresh_for_capture: Callable[[ModelInputs, BatchDescriptor], None] | None,
                 live_buffers: Callable[[bool], Any] | None = None) -> None:
        """``check_baked``: None where FULL captures are not checked for baked host values;
        ``check_refresh`` / ``refresh_for_capture``: None where the attention has no refresh;
        ``live_buffers(sampler)``: the buffers a graph captured now reads, kept as its ``buffers``."""
        self.graph_api = graph_api
        self.pool = GraphPool(graph_api)
        self.pieces, self.sampler, self.logits_out, self.lora = pieces, sampler, logits_out, lora
        self.forward, self._input_ptrs = forward, input_ptrs
        self._check_baked, self._check_refresh = check_baked, check_refresh
        self._refresh_for_capture = refresh_for_capture
        self._live_buffers = live_buffers
        self.report: list[dict[str, Any]] = []

    def build(self, mode: RuntimeMode, key: BatchDescriptor | SamplerKey,
              check_baked: bool = True) -> tuple[TorchEntry, int]:
        """Capture the forward for a FULL key, its pieces for a PIECEWISE key, or the
        sampler for a :class:`SamplerKey`. Returns (entry, graph bytes). ``check_baked=False``
        skips the baked-values check (graph memory samples: warm-up checks the same keys)."""
        t0 = time.perf_counter()
        if self.lora is not None:
            self.lora.use_key(key)
        baked = None
        if isinstance(key, SamplerKey):
            num_reqs, greedy, wide, penalties = key.num_reqs, key.greedy, key.wide_top_k, key.penalties
            sampler = self.sampler
            compute = (sampler.compute_logprobs if key.logprobs else
                       lambda logits, rows: sampler.compute(logits, rows, greedy, wide, penalties))
            entry, nbytes = self._capture(lambda: compute(self.logits_out, num_reqs), lambda: None)
        elif mode is RuntimeMode.FULL:
            entry, nbytes = self._with_compile_fallback(key, self._build_full)
            baked = self._check_baked(key) if check_baked and self._check_baked is not None else None
        elif mode is RuntimeMode.PIECEWISE:
            if self.pieces.capture is None:
                raise GraphrtError(f"PIECEWISE graphs are unavailable: {self.pieces.split_reason}")
            entry, nbytes = self._with_compile_fallback(key, lambda k, c: self.pieces.build(k, c, self.pool))
        else:
            raise GraphrtError(f"{mode.value} graphs are not available on this backend")
        if self._live_buffers is not None:       # what it reads, for the live-buffer check
            entry.buffers = self._live_buffers(isinstance(key, SamplerKey))
        seconds = time.perf_counter() - t0
        self.report.append({"key": str(key), "mode": mode.value, "seconds": round(seconds, 6),
                            "bytes": int(nbytes), "compiled": bool(entry.compiled)})
        if baked is not None:
            self.report[-1].update(baked=baked.num_values, varying=baked.varying)
        logger.debug("graphrt: captured %s %s in %.3f s, %d bytes%s", mode.value, key, seconds,
                     nbytes, " (compiled)" if entry.compiled else "")
        return entry, nbytes

    def forget(self, report_len: int) -> None:
        """Drop every graph, report row, piece buffer and compiled piece built since the report
        had ``report_len`` rows (graph memory samples: warm-up builds them again)."""
        del self.report[report_len:]
        self.new_pool()
        self.pieces.reset()

    def new_pool(self) -> None:
        """Capture from now on into a fresh pool (the old one goes with its graphs)."""
        self.pool = GraphPool(self.graph_api)

    def _with_compile_fallback(self, key: BatchDescriptor,
                               build: Callable[[BatchDescriptor, bool], tuple[Any, int]]) -> tuple[Any, int]:
        """Build from compiled pieces where configured; if compiling fails, build uncompiled."""
        if not self.pieces.compiles(key.num_tokens):
            return build(key, False)
        try:
            return build(key, True)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - a compile failure must not cost the graph
            logger.warning("graphrt: torch.compile of %s, or capturing its compiled pieces, failed (%s); "
                           "capturing it uncompiled", key, describe_capture_failure(exc))
            self.pieces.compiled.pop(key.num_tokens, None)
            return build(key, False)

    def _build_full(self, key: BatchDescriptor, compiled: bool) -> tuple[CapturedGraph, int]:
        num_tokens, num_reqs = key.num_tokens, key.num_reqs
        if self._check_refresh is not None:   # nothing the refresh leaves behind may reach the graph as a number
            self._check_refresh(key)
        host = self.forward.dummy_host(num_tokens, num_reqs, key)     # guarded: only keyed values read
        if not compiled:
            return self._capture(lambda: self.forward.run(num_tokens, num_reqs, host),
                                 lambda: self._load_for_capture(key))
        calls, output, held = self.pieces.prepare(num_tokens, compiled=True)
        entry, nbytes = self._capture(lambda: self.forward.run_split(calls, output, num_tokens, num_reqs, host),
                                      lambda: self._load_for_capture(key))
        entry.compiled = True
        return entry, nbytes + held

    def _load_for_capture(self, key: BatchDescriptor) -> None:
        """Pure padding for a FULL capture, then the refresh path on it, as before every run:
        the backend's ``before_replay`` with only its declared host values readable
        (:meth:`~graphrt.backends.torch.capture.baked_values.BakedValueChecks.refresh_for_capture`)."""
        padded = self.forward.load_dummy(key.num_tokens, key.num_reqs)
        if self._refresh_for_capture is not None:
            self._refresh_for_capture(padded, key)

    def _capture(self, fn: Callable[[], None], load_dummy: Callable[[], None],
                 warmups: int = defaults.CAPTURE_WARMUP_RUNS) -> tuple[CapturedGraph, int]:
        load_dummy()
        graph, nbytes, tasks = self.pool.capture(fn, warmups)
        return CapturedGraph(graph, self._input_ptrs(), tasks), nbytes
