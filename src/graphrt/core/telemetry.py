"""Graph coverage as Prometheus text (docs/api.md, "Coverage telemetry").

:func:`prometheus_text` renders a runner's forward and sampler cache counters (and background
warm-up's and re-fits' reports): steps and tokens on graphs, every eager cause (zero until it
happens, so series exist from the start), builds. ``graphrt.LLM.metrics_text()`` serves it."""

from __future__ import annotations

from typing import Any, Mapping

from graphrt.core.cache import CacheStats
from graphrt.core.eager import EagerCause, describe_causes


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for k, v in labels.items())
    return "{" + inner + "}"


class _Text:
    """Collects metric families in exposition order."""

    def __init__(self, base: Mapping[str, str]) -> None:
        self.base = dict(base)
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str, samples: list[tuple[Mapping[str, str], float]]) -> None:
        self.lines += [f"# HELP graphrt_{name} {help_text}", f"# TYPE graphrt_{name} {kind}"]
        for labels, value in samples:
            number = repr(float(value)) if isinstance(value, float) else str(int(value))
            self.lines.append(f"graphrt_{name}{_labels({**self.base, **labels})} {number}")


def prometheus_text(forward: CacheStats, sampler: CacheStats | None = None, *, backend: str = "",
                    warmup: Mapping[str, Any] | None = None, traffic: Mapping[str, Any] | None = None) -> str:
    """The exposition text of these counters (``backend`` as a label on every sample)."""
    out = _Text({"backend": backend} if backend else {})
    meanings = describe_causes()
    out.family("steps_total", "counter", "Forward steps run (graph or eager).", [({}, forward.steps)])
    out.family("graph_steps_total", "counter", "Forward steps replayed from a graph / executable.",
               [({}, forward.steps - forward.eager_steps)])
    out.family("eager_steps_total", "counter",
               "Forward steps run without a graph, by cause: " + "; ".join(f"{c}: {m}" for c, m in meanings.items()),
               [({"cause": c.value}, forward.eager_by_cause[c].steps) for c in EagerCause])
    out.family("eager_tokens_total", "counter", "Real tokens of the eager forward steps, by cause.",
               [({"cause": c.value}, forward.eager_by_cause[c].tokens) for c in EagerCause])
    out.family("real_tokens_total", "counter", "Real tokens run.", [({}, forward.real_tokens)])
    out.family("padded_tokens_total", "counter", "Tokens run, padding included.", [({}, forward.padded_tokens)])
    out.family("graph_step_ratio", "gauge", "Share of forward steps on graphs.", [({}, forward.graph_step_share)])
    out.family("graph_token_ratio", "gauge", "Share of real tokens on graphs.", [({}, forward.graph_token_share)])
    out.family("padding_waste_ratio", "gauge", "Share of run tokens that were padding.", [({}, forward.padding_waste)])
    out.family("graph_entries", "gauge", "Built forward keys (failed ones included).", [({}, forward.entries)])
    out.family("failed_builds_total", "counter", "Keys whose capture / compile failed (they run eagerly).",
               [({"graph": "forward"}, forward.failed_builds)]
               + ([({"graph": "sampler"}, sampler.failed_builds)] if sampler is not None else []))
    out.family("unplanned_builds_total", "counter", "Builds after warm-up completed.",
               [({"graph": "forward"}, forward.unplanned_builds)]
               + ([({"graph": "sampler"}, sampler.unplanned_builds)] if sampler is not None else []))
    out.family("retired_keys_total", "counter", "Entries a traffic re-fit dropped.", [({}, forward.retired)])
    if sampler is not None:
        out.family("sampler_eager_steps_total", "counter", "Sampler runs without a graph, by cause.",
                   [({"cause": c.value}, sampler.eager_by_cause[c].steps) for c in EagerCause])
    if warmup is not None:
        out.family("warmup_complete", "gauge", "1 once every planned key is built (background warm-up).",
                   [({}, 1 if warmup.get("complete") else 0)])
        out.family("warmup_pending_keys", "gauge", "Keys background warm-up has still to build.",
                   [({}, warmup.get("pending", 0))])
        out.family("warmup_build_seconds_total", "counter", "Seconds background warm-up spent building.",
                   [({}, float(warmup.get("build_seconds", 0.0)))])
    if traffic is not None:
        out.family("refits_total", "counter", "Traffic re-fits that changed the bucket set.",
                   [({}, traffic.get("refits", 0))])
    return "\n".join(out.lines) + "\n"


__all__ = ["prometheus_text"]
