"""The engine's log lines, as SGLang's scheduler prints them, and the numbers behind them.

Per step with prefill work a ``Prefill batch.`` line; every ``decode_log_interval`` steps
with decode work a ``Decode batch.`` line that also says whether the last step replayed a
graph (and on which backend), the share of steps on graphs and how many steps and tokens ran
eagerly since the last decode line, by cause (and, while background warm-up builds, how many
keys it has left). Both go to the ``graphrt.engine`` logger at INFO, and the same numbers stay in
:class:`EngineMetrics` (``llm.metrics``) for an engine's own dashboard.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from graphrt.core.errors import InputError
from graphrt.core.graph_modes import RuntimeMode
from graphrt.core.telemetry import prometheus_text as core_prometheus_text

if TYPE_CHECKING:
    from graphrt.runner import ModelRunner

logger = logging.getLogger("graphrt.engine")


@dataclass
class PrefillLine:
    """One prefill batch: requests with prefill work, their tokens, tokens the prefix cache
    supplied at admission, KV usage, running and waiting requests."""

    new_seq: int
    new_token: int
    cached_token: int
    token_usage: float
    running_req: int
    queue_req: int

    def __str__(self) -> str:
        return (f"Prefill batch. #new-seq: {self.new_seq}, #new-token: {self.new_token}, "
                f"#cached-token: {self.cached_token}, token usage: {self.token_usage:.2f}, "
                f"#running-req: {self.running_req}, #queue-req: {self.queue_req}")


@dataclass
class DecodeLine:
    """The state after a decode step, and rates since the previous decode line."""

    running_req: int
    token: int
    token_usage: float
    graph: bool
    backend: str
    gen_throughput: float
    queue_req: int
    eager_steps: int
    eager_tokens: int
    eager_causes: dict[str, tuple[int, int]] = field(default_factory=dict)
    graph_share: float = 1.0              # share of the steps since the last line on graphs
    warmup_pending: int = 0               # keys background warm-up has left to build

    def __str__(self) -> str:
        causes = ", ".join(f"{c} {s}/{t}" for c, (s, t) in self.eager_causes.items())
        return (f"Decode batch. #running-req: {self.running_req}, #token: {self.token}, "
                f"token usage: {self.token_usage:.2f}, graph: {self.graph} ({self.backend}), "
                f"gen throughput (token/s): {self.gen_throughput:.2f}, #queue-req: {self.queue_req}, "
                f"eager since last: {self.eager_steps} steps / {self.eager_tokens} tokens"
                + (f" ({causes})" if causes else "")
                + f", on graphs since last: {100 * self.graph_share:.1f}% of steps"
                + (f", warm-up: {self.warmup_pending} keys to build" if self.warmup_pending else ""))


def check_decode_log_interval(value: int) -> None:
    """Refuse a ``decode_log_interval`` that is not an integer >= 1 (InputError naming it)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError("decode_log_interval", f"must be an integer >= 1 (decode steps), got {value!r}")


class EngineMetrics:
    """Counts what each step did and logs SGLang's prefill and decode lines."""

    def __init__(self, *, backend: str, block_size: int, capacity_blocks: int, decode_log_interval: int) -> None:
        self.backend = backend
        self.block_size = block_size
        self.capacity_blocks = max(capacity_blocks, 1)
        check_decode_log_interval(decode_log_interval)
        self.decode_log_interval = decode_log_interval
        self.last_prefill: PrefillLine | None = None
        self.last_decode: DecodeLine | None = None
        self.num_prefill_lines = self.num_decode_lines = 0
        #: The scheduler's decode-step count at which the next decode line is due.
        self.next_decode_line = decode_log_interval
        self._decode_tokens_mark = 0        # the scheduler's decode tokens at the last decode line
        self._since = time.perf_counter()
        self._eager_mark: dict[str, tuple[int, int]] = {}
        self._steps_mark = 0
        self._cached_seen = 0

    def record(self, step: Any, scheduler: Any, runner: ModelRunner) -> None:
        """After a step ran: log the prefill line if it had prefill work, and the decode line
        once ``decode_log_interval`` decode steps ran since the last one (the scheduler counts
        them). The engine calls this only when one of the two is due."""
        used = scheduler.allocator.num_used
        usage = used / self.capacity_blocks
        if step.num_prefill_reqs:
            cached = scheduler.num_cached_tokens - self._cached_seen
            self._cached_seen = scheduler.num_cached_tokens
            self.last_prefill = PrefillLine(step.num_prefill_reqs, step.num_prefill_tokens, cached, usage,
                                            len(scheduler.running), len(scheduler.waiting))
            self.num_prefill_lines += 1
            logger.info("%s", self.last_prefill)
        if scheduler.num_decode_steps < self.next_decode_line:
            return
        now = time.perf_counter()
        eager = self._eager_delta(runner.stats)
        info = runner.last_step
        tokens = scheduler.num_decode_tokens - self._decode_tokens_mark
        eager_steps = sum(s for s, _ in eager.values())
        steps, self._steps_mark = runner.stats.steps - self._steps_mark, runner.stats.steps
        background = runner.background
        self.last_decode = DecodeLine(
            len(scheduler.running), used * self.block_size, usage,
            info is not None and info.mode is not RuntimeMode.NONE, self.backend,
            tokens / max(now - self._since, 1e-9), len(scheduler.waiting),
            eager_steps, sum(t for _, t in eager.values()), eager,
            1.0 - eager_steps / steps if steps else 1.0,
            len(background.pending) if background is not None and background.active else 0)
        self.num_decode_lines += 1
        logger.info("%s", self.last_decode)
        self.next_decode_line = scheduler.num_decode_steps + self.decode_log_interval
        self._decode_tokens_mark = scheduler.num_decode_tokens
        self._since = now

    def _eager_delta(self, stats: Any) -> dict[str, tuple[int, int]]:
        """Eager steps / tokens per cause since the previous decode line (causes with any)."""
        now = {cause.value: (count.steps, count.tokens) for cause, count in stats.eager_by_cause.items()}
        delta = {c: (s - self._eager_mark.get(c, (0, 0))[0], t - self._eager_mark.get(c, (0, 0))[1])
                 for c, (s, t) in now.items()}
        self._eager_mark = now
        return {c: v for c, v in delta.items() if v[0]}

    def as_dict(self) -> dict[str, Any]:
        """The last lines' numbers and how many of each were logged."""
        return {"prefill": asdict(self.last_prefill) if self.last_prefill else None,
                "decode": asdict(self.last_decode) if self.last_decode else None,
                "prefill_lines": self.num_prefill_lines, "decode_lines": self.num_decode_lines}

def prometheus_text(runner: ModelRunner) -> str:
    """A runner's graph coverage in Prometheus' text format (:mod:`graphrt.core.telemetry`)."""
    return core_prometheus_text(runner.stats, runner.sampler_stats, backend=runner.backend.name,
                                warmup=runner.background.report() if runner.background is not None else None,
                                traffic=runner.traffic.report() if runner.traffic is not None else None)


def engine_stats(llm: Any) -> dict[str, Any]:
    """``graphrt.LLM.stats``: its runner's cache statistics, the scheduler's and the prefix
    cache's counters, fault counts, graph memory, the log lines' numbers and the weights feature's
    (refits, sleeps, recaptured keys: ``weights``)."""
    runner, scheduler = llm.runner, llm.scheduler
    out = runner.stats.as_dict()
    out.update(preemptions=scheduler.num_preemptions, log_lines=llm.metrics.as_dict(),
               kv_blocks=runner.num_kv_blocks, step_faults=llm.loop.num_step_faults,
               kv_cache_resets=runner.kv_cache_resets, graph_memory=runner.graph_memory.as_dict(),
               sampler_eager_steps=runner.sampler_stats.eager_steps,
               sampler_failed_builds=runner.sampler_stats.failed_builds,
               recomputed=scheduler.num_recomputed, prefill_tokens=scheduler.num_prefill_tokens,
               decode_tokens=scheduler.num_decode_tokens, prefix_cache_hit_tokens=scheduler.num_cached_tokens,
               prefix_cache_blocks=llm.allocator.num_cached,
               prefix_cache_evictions=llm.prefix_cache.num_evicted if llm.prefix_cache else 0,
               overlap=llm.overlap, weights=runner.weights.stats.as_dict(),
               warmup=runner.background.report() if runner.background is not None else None,
               traffic=runner.traffic.report() if runner.traffic is not None else None)
    return out


__all__ = ["engine_stats", "prometheus_text", "check_decode_log_interval", "DecodeLine", "EngineMetrics", "PrefillLine"]
