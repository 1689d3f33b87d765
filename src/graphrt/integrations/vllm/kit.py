"""graphrt.testing's padding-invisible and KV-isolation properties on a vLLM model, through the
plugin: vLLM's own runner, attention metadata and padding, the graphs graphrt captured for it.

:func:`check_engine` draws workloads with hypothesis (how many requests, their prompt lengths and
output lengths), runs each through ``llm.generate`` and has every traffic step's forward checked
in the worker (:class:`StepProperties`, installed on graphrt's runner by ``collective_rpc``):

* **KV isolation.** Before the forward, every KV block that no real request's block-table row
  names is filled with NaN. The forward may change KV only at the step's real slots and in vLLM's
  null block (block 0, where padded tokens go), and its real rows must be finite: padding and
  masking never read an unused block, nor write outside the step.
* **Padding invisible.** The forward runs again from the same KV with different padded rows
  (random token ids and positions past the real tokens): the real tokens' hidden rows and the KV
  at their slots must be bit for bit the same (the same graph, the same shapes).

A slot is a KV row where the attention backend stores a token's K/V contiguously (graphrt's
``GRAPHRT`` backend: token-major rows); otherwise (vLLM's CPU attention packs a block its own way)
the unit of the checks is the block. A finding says which step (its ``BatchDescriptor``), which
property and which slots; :func:`check_engine` raises AssertionError with hypothesis' smallest
workload.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from graphrt.integrations.vllm.session import SESSION

#: Workloads drawn by :func:`check_engine`: requests, prompt and output lengths.
MAX_REQUESTS = 8
MAX_PROMPT = 40
MAX_OUTPUT = 6


@dataclass
class StepProperties:
    """The checks on one worker's model runner (module docstring); findings accumulate in ``findings``."""

    runner: Any
    findings: list[str] = field(default_factory=list)
    steps: int = 0
    seed: int = 0

    def install(self) -> None:
        """Check every forward of ``runner`` from now on (its ``_model_forward``, vLLM's hook for that)."""
        forward = type(self.runner)._model_forward.__get__(self.runner)
        self.runner._model_forward = lambda *args, **kwargs: self.checked(forward, *args, **kwargs)

    def checked(self, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from vllm.forward_context import get_forward_context

        if not SESSION.sealed or not self.runner.kv_caches:
            return forward(*args, **kwargs)
        context = get_forward_context()
        metadata = next(iter(context.attn_metadata.values()))
        slots = next(iter(context.slot_mapping.values()))
        real_tokens, real_reqs = SESSION.step.tokens, SESSION.step.reqs
        input_ids, positions = kwargs["input_ids"], kwargs["positions"]
        padded = input_ids.shape[0]
        key = context.batch_descriptor or f"eager, {padded} tokens"
        caches = list(self.runner.kv_caches)
        units = [_units(cache, metadata) for cache in caches]
        block_size = caches[0].shape[2]
        token_major = units[0].shape[0] != caches[0].shape[0]
        real = slots[:real_tokens].to(torch.int64)
        real_units = real if token_major else torch.unique(real // block_size)
        null_units = torch.arange(block_size if token_major else 1)
        used_blocks = torch.unique(metadata.block_table[:real_reqs].to(torch.int64))
        unused = torch.ones(caches[0].shape[0], dtype=torch.bool)
        unused[used_blocks] = False
        unused[0] = False
        kept = [cache[unused].clone() for cache in caches]      # cached prefixes, other requests' blocks
        for cache in caches:
            cache[unused] = float("nan")
        before = [u.clone() for u in units]
        saved = (input_ids[real_tokens:].clone(), positions[real_tokens:].clone())
        out = forward(*args, **kwargs)
        hidden = out[:real_tokens].clone()
        after = [u.clone() for u in units]
        self.steps += 1
        self._isolation(key, before, after, real_units, null_units, hidden)
        if padded > real_tokens:
            for unit, old in zip(units, before):
                unit.copy_(old)
            gen = torch.Generator().manual_seed(self.seed + self.steps)
            input_ids[real_tokens:] = torch.randint(0, self.runner.model_config.get_vocab_size(),
                                                    (padded - real_tokens,), generator=gen, dtype=input_ids.dtype)
            positions[real_tokens:] = torch.randint(0, self.runner.max_model_len, (padded - real_tokens,),
                                                    generator=gen, dtype=positions.dtype)
            again = forward(*args, **kwargs)
            input_ids[real_tokens:], positions[real_tokens:] = saved
            self._padding(key, hidden, again[:real_tokens], after, units, real_units)
        for cache, old in zip(caches, kept):       # the NaN planted in unused blocks must not outlive the step
            cache[unused] = old
        return out

    def take(self) -> dict[str, Any]:
        """The findings and the count of steps checked since the last call (then cleared)."""
        taken = {"findings": self.findings, "steps": self.steps}
        self.findings, self.steps = [], 0
        return taken

    def _isolation(self, key: Any, before: list[torch.Tensor], after: list[torch.Tensor], real_units: torch.Tensor,
                   null_units: torch.Tensor, hidden: torch.Tensor) -> None:
        allowed = torch.zeros(before[0].shape[0], dtype=torch.bool)
        allowed[real_units] = True
        allowed[null_units] = True
        for layer, (old, new) in enumerate(zip(before, after)):
            changed = ~((old == new) | (old.isnan() & new.isnan())).flatten(1).all(dim=1)
            foreign = torch.nonzero(changed & ~allowed).flatten()
            if foreign.numel():
                self.findings.append(f"KV isolation: step {key} wrote KV {self._unit_name(before)} "
                                     f"{foreign[:8].tolist()} of layer {layer} outside its real ones "
                                     f"{real_units[:8].tolist()} and vLLM's null block")
                return
        if not torch.isfinite(hidden).all():
            self.findings.append(f"KV isolation: step {key}: NaN in KV blocks no request of the step names reached "
                                 f"the real tokens' hidden rows")

    def _padding(self, key: Any, hidden: torch.Tensor, again: torch.Tensor, after: list[torch.Tensor],
                 units: list[torch.Tensor], real_units: torch.Tensor) -> None:
        if not torch.equal(hidden, again):
            self.findings.append(f"padding visible: step {key}: the real tokens' hidden rows changed with the "
                                 f"padded rows' token ids and positions")
            return
        for layer, (first, unit) in enumerate(zip(after, units)):
            if not torch.equal(first[real_units], unit[real_units]):
                self.findings.append(f"padding visible: step {key}: the KV at the real slots of layer {layer} "
                                     f"changed with the padded rows' token ids and positions")
                return

    @staticmethod
    def _unit_name(units: list[torch.Tensor]) -> str:
        return "rows" if units[0].dim() == 3 else "blocks"


def _units(cache: torch.Tensor, metadata: Any) -> torch.Tensor:
    """The layer cache by slot (token-major rows, graphrt's attention) or by block (other backends)."""
    from graphrt.integrations.vllm.attention import GraphrtAttentionMetadata, kv_rows

    if isinstance(metadata, GraphrtAttentionMetadata):
        return kv_rows(cache, cache.shape[3] // 2)
    return cache


def check_engine(llm: Any, *, max_examples: int = 6, seed: int = 0) -> int:
    """Run the properties on ``llm`` (a vLLM ``LLM`` with the plugin active) over ``max_examples``
    hypothesis-drawn workloads, greedy; AssertionError with the findings of the smallest failing one.
    Returns how many steps were checked."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from vllm import SamplingParams

    llm.collective_rpc("graphrt_kit", args=(seed,))
    vocab = llm.llm_engine.model_config.get_vocab_size()
    checked = [0]
    request = st.tuples(st.lists(st.integers(3, vocab - 1), min_size=1, max_size=MAX_PROMPT),
                        st.integers(1, MAX_OUTPUT))

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(request, min_size=1, max_size=MAX_REQUESTS))
    def workload(requests: list[tuple[list[int], int]]) -> None:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
        llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False)
        reports = llm.collective_rpc("graphrt_kit_findings")
        checked[0] += sum(report["steps"] for report in reports)
        findings = [finding for report in reports for finding in report["findings"]]
        assert not findings, "\n".join(findings[:6])

    workload()
    return checked[0]


__all__ = ["StepProperties", "check_engine"]
