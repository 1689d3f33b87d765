"""The torch executor's forward on its static buffers: one object the executor, the graph
builder, PIECEWISE capture and the baked-value checks share (in place of the executor's bound
methods handed to each).

:class:`TorchForward` holds what a forward reads and writes -- the model, the step buffers, the
attention backend and the recurrent state backend (beside it), the hidden and logits outputs --
and does one job: the step's host values (:meth:`~TorchForward.dummy_host`,
:meth:`~TorchForward.step_host_values`), the two backends' metadata in their phase
(:meth:`~TorchForward.metadata`, :meth:`~TorchForward.step_context`), and the model run on the
static buffers' first rows (:meth:`~TorchForward.run`, :meth:`~TorchForward.run_split`), whose
outputs land in ``hidden_out`` / ``logits_out``. Everything it runs reads tensors only, so a
capture records it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch

from graphrt.backends.torch.step_buffers import StepBuffers
from graphrt.config import GraphConfig
from graphrt.core.attention_decl import backend_name
from graphrt.core.dispatch import BatchDescriptor
from graphrt.core.inputs.fields import ModelInputs
from graphrt.layers.torch.attention.backend import CaptureHostValues, HostTensorsRefused, HostValues
from graphrt.layers.torch.forward_context import forward_context, state_context


class TorchForward:
    """A torch model's forward over ``buffers`` with its ``attention`` backend (set up; its
    ``keyed`` host values) and, for a hybrid model, its recurrent ``state`` backend."""

    def __init__(self, model: torch.nn.Module, config: GraphConfig, buffers: StepBuffers, attention: Any,
                 keyed: tuple[str, ...], state: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.config, self.buffers = model, config, buffers
        self.attention, self.keyed, self.state = attention, keyed, state
        #: The capture phase's build (a duck-typed backend without one: its build).
        self._build_for_capture = getattr(attention, "build_for_capture", attention.build)
        self.static = buffers.static
        self.vocab_size = int(model.config.vocab_size)
        max_t, max_r, q = config.max_num_batched_tokens, config.max_num_seqs, config.decode_query_len
        self.hidden_out = torch.zeros(max_t, int(model.config.hidden_size), dtype=dtype, device=device)
        self.logits_out = torch.zeros(max_r, self.vocab_size, dtype=torch.float32, device=device)
        # Speculative decoding: logits at each request's last q positions (drafts verified).
        self.position_logits_out = (torch.zeros(max_r, q, self.vocab_size, dtype=torch.float32, device=device)
                                    if q > 1 else None)
        self._position_offsets = torch.arange(-q, 0, device=device)
        #: Pure padding in the static buffers (what captures and warm-ups run on).
        self.load_dummy: Callable[[int, int], ModelInputs] = buffers.load_dummy

    # ---- host values ---------------------------------------------------------------------
    def dummy_host(self, num_tokens: int, num_reqs: int, key: BatchDescriptor | None = None) -> HostValues:
        """Host values of a padding-only step of that shape (a capture's, a warm-up's): ``key``'s
        context bucket as ``max_seq_len`` where it has one, else ``max_model_len``; within a
        capture of ``key`` only the attention's keyed values can be read (CaptureHostValues)."""
        uniform = key.uniform_decode if key is not None else False
        context = (key.max_seq_len if key is not None else None) or self.config.max_model_len
        values = HostValues(num_tokens, num_reqs, 0, 0, 0, context, uniform)
        if key is None:
            return values
        return CaptureHostValues(values, self.keyed, backend_name(self.attention), key)

    def step_host_values(self, host: HostValues, padded: ModelInputs, key: BatchDescriptor) -> HostValues:
        """Fill ``host`` with the padded step's values (a graph's key: its context bucket as
        ``max_seq_len``, else the step's longest request) and return it."""
        host.num_tokens, host.num_reqs = len(padded.input_ids), len(padded.seq_lens)
        host.real_num_tokens, host.real_num_reqs = padded.num_tokens, padded.num_reqs
        host.max_query_len = padded.max_query_len
        # the key's flag (every key holds it), like its context: a step run eagerly at a key takes
        # the graph's form (the recurrent layers' uniform decode)
        host.uniform_decode = bool(key.uniform_decode)
        host.max_seq_len = key.max_seq_len or padded.max_seq_len
        host.query_start_loc, host.seq_lens = padded.query_start_loc, padded.seq_lens
        return host

    # ---- metadata ------------------------------------------------------------------------
    def metadata(self, num_tokens: int, num_reqs: int, host: HostValues) -> Any:
        """The attention backend's metadata of the static buffers' first ``num_tokens`` /
        ``num_reqs`` rows and the step's ``host`` values: its capture phase inside a capture
        (guarded values, no host tensor reachable), else its build."""
        if isinstance(host, CaptureHostValues):
            refused = HostTensorsRefused(backend_name(self.attention), host.captured_key)
            return self._build_for_capture(self.buffers.capture_tensors(num_tokens, num_reqs, refused), host)
        views = self.buffers.views.get((num_tokens, num_reqs))
        return self.attention.build(views if views is not None else self.buffers.tensors(num_tokens, num_reqs), host)

    def step_context(self, num_tokens: int, num_reqs: int, host: HostValues) -> Any:
        """The forward context of a step: the attention backend's metadata and, for a hybrid
        model, the recurrent state backend's (``state_context``), each from its phase (a
        capture's or a run's)."""
        meta = self.metadata(num_tokens, num_reqs, host)
        if self.state is None:
            return forward_context(meta)
        views = self.buffers.tensors(num_tokens, num_reqs)
        state = (self.state.build_for_capture(views, host) if isinstance(host, CaptureHostValues)
                 else self.state.build(views, host))
        stack = contextlib.ExitStack()
        stack.enter_context(forward_context(meta))
        stack.enter_context(state_context(state))
        return stack

    # ---- the run -------------------------------------------------------------------------
    def run(self, num_tokens: int, num_reqs: int, host: HostValues) -> None:
        """Run the model on the static buffers' first rows; write hidden and logits outputs.

        Everything here reads tensors only, so it can be captured; the sizes (and the keyed
        host values, e.g. a context bucket) are the key."""
        s = self.static
        with self.step_context(num_tokens, num_reqs, host):
            hidden = self.model(s["input_ids"][:num_tokens], s["positions"][:num_tokens])
        self._outputs(hidden, num_tokens, num_reqs)

    def run_split(self, calls: Sequence[Callable[[], None]], output: torch.Tensor,
                  num_tokens: int, num_reqs: int, host: HostValues) -> None:
        """The forward as the split model's step calls over the piece buffers."""
        with self.step_context(num_tokens, num_reqs, host):
            for call in calls:
                call()
        self._outputs(output, num_tokens, num_reqs)

    def _outputs(self, hidden: torch.Tensor, num_tokens: int, num_reqs: int) -> None:
        self.hidden_out[:num_tokens].copy_(hidden)
        ends = self.static["query_start_loc"][1:num_reqs + 1]
        if self.position_logits_out is None:
            last = (ends - 1).clamp(min=0).long()
            self.logits_out[:num_reqs].copy_(self.model.compute_logits(hidden.index_select(0, last)))
            return
        rows = (ends.unsqueeze(1) + self._position_offsets).clamp(min=0).long().flatten()
        logits = self.model.compute_logits(hidden.index_select(0, rows)).view(num_reqs, -1, self.vocab_size)
        self.position_logits_out[:num_reqs].copy_(logits)
        self.logits_out[:num_reqs].copy_(logits[:, -1])


__all__ = ["TorchForward"]
