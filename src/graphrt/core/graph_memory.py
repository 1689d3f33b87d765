"""Graph memory in the KV budget: which keys to capture before the KV cache exists, how their
bytes extrapolate to every key, and what is left for the KV cache.

The rule (docs/backends.md, "Graph memory in the KV budget"): keys form **families** (forward
keys by mode and uniform decode, sized by tokens; sampler keys by kind, sized by rows); per
family the largest, smallest and middle key are **sampled**, captured in warm-up order in one
pool, so what one graph leaves for the next is measured as at warm-up (vLLM #51590 summed
per-mode deltas of graphs sharing a pool); every other key is **extrapolated** along its
family's line (in a shared caching-allocator pool, the smaller neighbour's bytes instead: vLLM
#45178 multiplied one allocator segment by every graph); ``GRAPH_MEMORY_MARGIN`` is kept on top."""

from __future__ import annotations

import logging
import math
import numbers
from fractions import Fraction
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

from graphrt.core import defaults
from graphrt.core.cache import describe_key
from graphrt.core.dispatch import BatchDescriptor, SamplerKey
from graphrt.core.errors import ConfigError, InputError
from graphrt.core.graph_modes import RuntimeMode
from graphrt.core.state_spec import check_state_fits

#: Graph memory in the KV budget (core/graph_memory.py): keys captured per family (the
#: largest, the smallest, evenly spaced between) before the KV cache is sized; the rest are
#: extrapolated along a line through them.
GRAPH_MEMORY_SAMPLES_PER_FAMILY = 3
#: ... and this fraction of the estimate is kept out of the KV cache on top of it, for what
#: the line misses (allocator fragmentation, a key that allocates more than its neighbours).
#: vLLM's misses ran both ways -- 3x over (#45178: a linear sum over a shared pool), 3.6x
#: under (#51590: per-mode deltas of one shared pool, two samples per mode); measuring the
#: samples in one warm-up-order span removes both causes, so the margin covers the residue
#: only; the runner logs estimate against actual after warm-up to check it.
GRAPH_MEMORY_MARGIN = 0.10

logger = logging.getLogger(__name__)

#: One build job: (runtime mode, key), as the runner's warm-up lists them (largest first).
Job = tuple[RuntimeMode, Any]


def family(job: Job) -> tuple[Hashable, int]:
    """(family, size) of a job: forward keys by (mode, uniform decode) -- and their LoRA
    adapter count when nonzero: a LoRA graph holds more than its size's graph without --
    sized by tokens, sampler keys by kind (greedy / random / logprobs / penalised) sized by request rows."""
    mode, key = job
    if isinstance(key, SamplerKey):
        return ("sampler", key.kind), key.num_reqs
    if isinstance(key, BatchDescriptor):
        if key.num_loras or key.max_seq_len is not None:    # more adapters, a longer context: more bytes
            return (mode, key.uniform_decode, key.num_loras, key.max_seq_len), key.num_tokens
        return (mode, key.uniform_decode), key.num_tokens
    raise TypeError(f"graph memory: unknown key type {type(key).__name__}")


def choose_samples(jobs: Sequence[Job], per_family: int = GRAPH_MEMORY_SAMPLES_PER_FAMILY
                   ) -> list[Job]:
    """The jobs to capture before the KV cache: per family the largest, the smallest and the
    middle ones (up to ``per_family``), returned in the order of ``jobs`` (warm-up order)."""
    groups: dict[Hashable, list[tuple[int, int]]] = {}
    for i, job in enumerate(jobs):
        fam, size = family(job)
        groups.setdefault(fam, []).append((size, i))
    chosen: set[int] = set()
    for members in groups.values():
        members.sort()
        n = len(members)
        if n <= per_family:
            chosen.update(i for _, i in members)
            continue
        picks = {0, n - 1} if per_family >= 2 else {n - 1}
        extra = per_family - len(picks)
        for k in range(1, extra + 1):    # evenly spaced between the ends; one: the middle
            picks.add(round(k * (n - 1) / (extra + 1)))
        chosen.update(members[p][1] for p in picks)
    return [job for i, job in enumerate(jobs) if i in chosen]


def _interpolate(points: list[tuple[int, int]], size: int) -> Fraction:
    """Piecewise-linear in ``size`` through ``points`` (sorted by distinct size), extended
    along the end segments, never below 0; exact (a rational number of bytes)."""
    if len(points) == 1:
        return Fraction(points[0][1])
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if size <= x1:
            break
    return max(Fraction(0), y0 + Fraction(y1 - y0, x1 - x0) * (size - x0))


def _lower_envelope(points: list[tuple[int, int]], size: int) -> int:
    """The smaller bytes of the two samples around ``size`` (the nearest one beyond the ends)."""
    below = [y for x, y in points if x <= size]
    above = [y for x, y in points if x >= size]
    near = [ys[i] for ys, i in ((below, -1), (above, 0)) if ys]
    return min(near)


def extrapolate(jobs: Sequence[Job], measured: dict[Any, int], shared_pool: bool = False) -> int:
    """Estimated bytes of building every job: each sampled key's measured bytes, plus per unsampled
    key its family's line, or in a ``shared_pool`` the smaller of its two neighbouring samples'
    bytes (graphs add whole allocator segments there: a line through two multiplies one segment
    by every key between, 105 MiB estimated against 4.5 MiB built on an H200). ``measured``
    maps keys to bytes in capture order; the first is no point of a line unless it is alone."""
    first = next(iter(measured), None)
    lines: dict[Hashable, dict[int, int]] = {}
    for job in jobs:
        if job[1] in measured:
            fam, size = family(job)
            lines.setdefault(fam, {})[size] = measured[job[1]]
    for job in jobs:   # the first capture is a point only where nothing else is
        if job[1] == first:
            fam, size = family(job)
            if len(lines[fam]) > 1:
                del lines[fam][size]
    total = Fraction(0)
    for job in jobs:
        if job[1] in measured:
            total += measured[job[1]]
        else:
            points = sorted(lines.get(family(job)[0], {}).items())
            if not points:
                continue
            size = family(job)[1]
            total += _lower_envelope(points, size) if shared_pool else _interpolate(points, size)
    return math.ceil(total)


@dataclass
class GraphMemory:
    """Graph memory against the KV budget: the estimate made before the KV cache was
    allocated, and the bytes every build actually took, known after warm-up."""

    estimate: int = 0                  # bytes, extrapolated over every key
    margin: int = 0                    # bytes kept out of the KV cache on top of the estimate
    num_keys: int = 0                  # keys warm-up builds
    sampled: dict[str, int] = field(default_factory=dict)   # key (as the warm-up report names it) -> bytes
    budget: int | None = None          # the KV budget before graphs (None: blocks given)
    kv_bytes: int | None = None        # what the KV cache got
    actual: int | None = None          # bytes of every entry built at warm-up (None: not yet)
    reason: str | None = None          # why nothing was deducted, where nothing was
    state: Any = None                  # a hybrid model's recurrent states (core.state_spec.StateMemory), in the budget
    sampler: int | None = None         # of ``actual``, the sampler entries' bytes
    sampler_buffers: int = 0           # bytes of the buffers every sampler entry shares (noise, workspace)
    #: Bytes needed only while one entry runs (XLA's temp memory: the largest forward's plus the
    #: largest sampler's), counted once, not per key: measured before the KV cache, and after warm-up.
    scratch: int = 0
    actual_scratch: int | None = None

    def built(self, forward: int, sampler: int, sampler_buffers: int, scratch: int = 0) -> None:
        """Record what warm-up built: forward and sampler entries' bytes, the sampler's shared
        buffers (allocated with the executor, outside every entry) and the scratch of one run."""
        self.actual, self.sampler, self.sampler_buffers = forward + sampler, sampler, sampler_buffers
        self.actual_scratch = scratch

    def add_scratch(self, scratch: int) -> None:
        """Count ``scratch`` bytes once in the deduction (the margin grows with it)."""
        self.scratch = int(scratch)
        self.margin = int(math.ceil((self.estimate + self.scratch) * GRAPH_MEMORY_MARGIN))

    @property
    def deducted(self) -> int:
        """Bytes taken out of the KV budget for graphs: the estimate, the scratch and the margin."""
        return self.estimate + self.scratch + self.margin

    @property
    def admitted(self) -> int | None:
        """Bytes of graphs the KV budget admitted (estimate plus margin), None without a budget:
        background warm-up builds no further once its graphs hold this many."""
        return None if self.reason is not None or self.budget is None else self.deducted

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers, for logs, JSON and an engine's stats."""
        out = {"estimate": self.estimate, "margin": self.margin, "actual": self.actual,
               "num_keys": self.num_keys, "sampled": dict(self.sampled), "budget": self.budget,
               "kv_bytes": self.kv_bytes, "reason": self.reason, "sampler": self.sampler,
               "sampler_buffers": self.sampler_buffers, "scratch": self.scratch, "actual_scratch": self.actual_scratch}
        if self.state is not None:
            out.update(self.state.as_dict())
        return out

    def split(self) -> str:
        """Forward against sampler bytes, e.g. ``forward 75.40 MiB, sampler 4.60 MiB (+ 39.00 MiB
        shared buffers)``; empty before warm-up."""
        if self.actual is None or self.sampler is None:
            return ""
        mib = 2**20
        return (f"forward {(self.actual - self.sampler) / mib:.2f} MiB, sampler {self.sampler / mib:.2f} MiB"
                f" (+ {self.sampler_buffers / mib:.2f} MiB shared buffers)")

    def summary(self) -> str:
        """One line: estimate (+ margin) against actual (forward and sampler apart), or why
        nothing was estimated."""
        actual = "not built yet" if self.actual is None else f"{self.actual / 2**20:.2f} MiB actual"
        if self.split():
            actual += f" ({self.split()})"
        state = "" if self.state is None else f"; {self.state.summary()}"
        if self.reason is not None:
            return f"graph memory: not deducted from the KV budget ({self.reason}); {actual}{state}"
        ratio = "" if not self.actual else f", estimate / actual {self.estimate / self.actual:.2f}"
        scratch = f" + {self.scratch / 2**20:.2f} MiB scratch while one runs" if self.scratch else ""
        if self.actual_scratch:
            actual += f" + {self.actual_scratch / 2**20:.2f} MiB scratch"
        return (f"graph memory: {self.estimate / 2**20:.2f} MiB estimated from {len(self.sampled)} of "
                f"{self.num_keys} keys{scratch} (+ {self.margin / 2**20:.2f} MiB margin), {actual}{ratio}{state}")


def kv_blocks_after_graphs(budget: int, per_block: int, full: int, graphs: GraphMemory) -> int:
    """KV blocks that ``budget`` bytes hold once ``graphs.deducted`` is taken out (at most
    ``full``); raises :class:`ConfigError` naming the numbers when fewer than 2 remain (the
    null block and one block of one request)."""
    left = budget - graphs.deducted
    blocks = min(max(left, 0) // per_block, full) if per_block else full
    if blocks < 2:
        raise ConfigError(
            f"kv_cache_memory: {budget} bytes leave {left} for the KV cache after {graphs.estimate} bytes "
            f"of graphs (estimated from {len(graphs.sampled)} of {graphs.num_keys} keys)"
            + (f", {graphs.scratch} bytes of scratch" if graphs.scratch else "") + " and a "
            f"{graphs.margin}-byte margin; one request needs 2 KV blocks of {per_block} bytes "
            f"({2 * per_block}): raise the budget or capture fewer sizes")
    graphs.budget, graphs.kv_bytes = budget, int(blocks) * per_block
    return int(blocks)


def estimate_graph_memory(jobs: Sequence[Job], measure: Callable[[Sequence[Job]], tuple[dict[Any, int], str | None]],
                          shared_pool: bool = False) -> GraphMemory:
    """Choose the samples of ``jobs``, ``measure`` them (bytes per key in capture order, or
    ({}, why not)), extrapolate (``shared_pool``: see :func:`extrapolate`), and add the margin."""
    if not jobs:
        return GraphMemory(reason="no keys to build (graph mode NONE or an eager backend)")
    samples = choose_samples(jobs)
    measured, reason = measure(samples)
    if reason is not None:
        return GraphMemory(num_keys=len(jobs), reason=reason)
    total = extrapolate(jobs, measured, shared_pool)
    names = {key: describe_key(key if isinstance(key, SamplerKey) else (mode, key)) for mode, key in samples}
    return GraphMemory(estimate=total, margin=int(math.ceil(total * GRAPH_MEMORY_MARGIN)),
                       num_keys=len(jobs), sampled={names[k]: int(v) for k, v in measured.items()})

def check_kv_args(num_kv_blocks: Any, kv_cache_memory: Any) -> None:
    """Refuse, before anything is loaded, a ``num_kv_blocks`` that is not None or an integer (a
    bool, a float or a string is not) and a ``kv_cache_memory`` that is not None or a finite
    number of bytes >= 0 (a bool or a string is not): InputError naming it."""
    blocks = num_kv_blocks
    if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, numbers.Integral)):
        raise InputError("num_kv_blocks", f"must be None or an integer >= 2 (KV blocks), got {type(blocks).__name__} "
                                          f"{blocks!r}")
    budget = kv_cache_memory
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, numbers.Real)
                               or not math.isfinite(budget) or budget < 0):
        raise InputError("kv_cache_memory", f"must be None or a finite number of bytes >= 0, got "
                                            f"{type(budget).__name__} {budget!r}")


def size_kv_cache(executor: Any, config: Any, jobs: Sequence[Job], explicit: int | None,
                  budget: int | None) -> tuple[int, GraphMemory]:
    """(KV blocks, graph memory) of a runner: ``explicit`` blocks, or what the budget (given, or
    the device's free memory) holds once the graphs' estimated memory and its margin are out
    of it. Without a budget (a host device) the default host KV size is used and nothing is
    deducted."""
    per_block = executor.kv_cache_bytes_per_block(config.block_size)
    state = getattr(executor, "state_memory", None)
    memory = GraphMemory(num_keys=len(jobs), reason="num_kv_blocks given", state=state)
    if explicit is not None:
        if explicit < 2:
            raise InputError("num_kv_blocks", f"needs >= 2 (block 0 is the null block), got {explicit}")
        return int(explicit), memory
    full = config.max_num_seqs * config.max_blocks_per_req + 1
    info = executor.memory_info() if budget is None else None
    if budget is None and info is None:
        budget = defaults.DEFAULT_HOST_KV_CACHE_BYTES
        memory.reason = "the default host KV size is no memory budget"
    else:   # a memory budget the graphs share with the KV cache
        if budget is None:           # the device's free memory: the states, allocated already, are out of it
            free, total = info
            budget = int(free - total * (1.0 - defaults.DEFAULT_GPU_MEMORY_UTILIZATION))
        elif state is not None:      # a budget in bytes holds the states too
            budget = check_state_fits(state, budget, per_block)
        memory = estimate_graph_memory(jobs, executor.measure_graph_memory,
                                       executor.capabilities.graphs_share_memory)
        memory.state = state
        if memory.reason is None and executor.scratch_bytes:
            memory.add_scratch(executor.scratch_bytes)
        logger.info("graphrt: %s", memory.summary())
        if memory.deducted:
            return kv_blocks_after_graphs(budget, per_block, full, memory), memory
    if not per_block:                # no attention layer: blocks hold nothing
        memory.budget, memory.kv_bytes = budget, 0
        return full, memory
    blocks = min(budget // per_block, full)
    if blocks < 2:
        raise InputError("kv_cache_memory", f"{budget} bytes hold {budget // per_block} KV blocks of "
                                            f"{per_block} bytes; at least 2 are needed")
    memory.budget, memory.kv_bytes = budget, int(blocks) * per_block
    return int(blocks), memory
