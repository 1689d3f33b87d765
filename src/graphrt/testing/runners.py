"""Runner factories and the ways the properties run one step.

A *runner factory* is any callable ``factory(**overrides) -> ModelRunner`` (overrides are
:class:`~graphrt.GraphConfig` fields) returning a warmed-up runner, the same one for the same
overrides, so properties reuse runners and plant the KV they need before each example.

A step runs in up to three ways on the factory's runner: :func:`run_runner` (``runner.execute``),
:func:`run_at` (padded to a chosen key, run eagerly at that shape, or by its executable on XLA)
and :func:`replay_at` (padded to a chosen key, run by the graph warm-up built for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from graphrt.config import GraphConfig
from graphrt.core.cache import FailedBuild
from graphrt.core.dispatch import BatchDescriptor
from graphrt.core.errors import ConfigError, GraphCaptureError
from graphrt.core.graph_modes import GraphMode, RuntimeMode
from graphrt.testing import access
from graphrt.testing.step import Step

#: Limits of the conformance suite's runners: small enough to warm up in seconds, with chunked
#: prefills; graph backends capture up to the token budget, so every drawn step is covered.
KIT_LIMITS: dict[str, Any] = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4)


class RunnerFactory:
    """Warmed-up runners of one model on one backend, one per distinct set of overrides.

    ``model``: a Hugging Face directory or a zero-argument callable returning a fresh model object
    (runners must not share one: each assigns its layers a KV cache). ``config_fields`` default to
    :data:`KIT_LIMITS`; ``num_kv_blocks`` to a block-table row per request slot plus the null block.
    """

    def __init__(self, model: str | Callable[[], Any], backend: Any = "cpu", *,
                 num_kv_blocks: int | None = None, dtype: Any = None, **config_fields: Any) -> None:
        self.model = model
        self.backend = backend
        self.dtype = dtype
        fields = {**KIT_LIMITS, **config_fields}
        if fields.get("cudagraph_capture_sizes") is None and fields.get("max_cudagraph_capture_size") is None:
            fields["max_cudagraph_capture_size"] = fields["max_num_batched_tokens"]
        self.config = GraphConfig.create(**fields)
        self.num_kv_blocks = (num_kv_blocks if num_kv_blocks is not None
                              else self.config.max_num_seqs * self.config.max_blocks_per_req + 1)
        self._runners: dict[tuple, Any] = {}
        self._failed: dict[tuple, Exception] = {}      # warm-ups that failed (strict mode), runners refused

    def __call__(self, **overrides: Any) -> Any:
        """The runner for ``overrides`` (built and warmed up on first use); a failed warm-up or a
        refused runner raises again, not retried."""
        key = tuple(sorted((k, repr(v)) for k, v in overrides.items()))
        if key in self._failed:               # a failed warm-up fails the same way again
            raise self._failed[key]
        runner = self._runners.get(key)
        if runner is None:
            from graphrt.registry import select_backend
            from graphrt.runner import ModelRunner

            model = self.model if isinstance(self.model, str) else self.model()
            backend = select_backend(self.backend, model=model) if isinstance(self.backend, str) else self.backend
            config = GraphConfig.create(**{**self.config.model_dump(), **overrides})
            try:
                runner = ModelRunner(model, config, backend=backend, num_kv_blocks=self.num_kv_blocks,
                                     dtype=self.dtype, progress=False)
            except (GraphCaptureError, ConfigError) as exc:      # refused: the same again next time
                self._failed[key] = exc
                raise
            self._runners[key] = runner
        return runner

    def strategy_args(self) -> dict[str, Any]:
        """Keyword arguments of the strategies for this factory's runners."""
        runner = self()
        args = dict(config=self.config, num_kv_blocks=self.num_kv_blocks, vocab_size=runner.vocab_size)
        if runner.extra is not None:                 # the model's declared extra inputs
            args["extra_inputs"] = runner.extra.specs
        if runner.executor.num_state_slots:          # a model with recurrent state: slot tables
            args["num_state_slots"] = runner.executor.num_state_slots
        return args


def greedy(num_reqs: int, vocab_size: int) -> Any:
    """A greedy :class:`~graphrt.backends.base.SamplingBatch` of ``num_reqs`` rows."""
    from graphrt.engine.sampling_params import SamplingParams
    from graphrt.runner import sampling_batch

    return sampling_batch([SamplingParams(temperature=0.0)] * num_reqs, list(range(num_reqs)), vocab_size)


@dataclass
class Outputs:
    """One run of a step: real rows, and every row the padded shape computed."""

    how: str                      # "runner (FULL (mixed, tokens=8, reqs=4))", "eager at ...", ...
    key: BatchDescriptor          # the padded shape it ran at
    logits: np.ndarray            # [R, vocab] float32
    hidden: np.ndarray            # [T, hidden] float32
    padded_logits: np.ndarray     # [R_pad, vocab]: padded request rows included
    padded_hidden: np.ndarray     # [T_pad, hidden]
    kv: np.ndarray                # the KV cache afterwards, float32
    tokens: np.ndarray | None = None   # sampled (greedy) tokens, runner runs only
    state: np.ndarray | None = None    # the recurrent-state cache afterwards (hybrid models), float32


def _collect(runner: Any, how: str, key: BatchDescriptor, t: int, r: int, tokens: Any = None) -> Outputs:
    ex = runner.executor
    t_pad, r_pad = key.num_tokens, key.num_reqs if key.num_reqs is not None else r
    padded_hidden = np.asarray(ex.hidden_states(t_pad), dtype=np.float32)
    padded_logits = np.asarray(ex.logits(r_pad), dtype=np.float32)
    return Outputs(how, key, padded_logits[:r].copy(), padded_hidden[:t].copy(), padded_logits.copy(),
                   padded_hidden.copy(), access.kv_values(runner),
                   None if tokens is None else np.asarray(tokens).copy(), access.state_values(runner))


def run_runner(runner: Any, step: Step) -> Outputs:
    """``runner.execute`` of ``step`` with greedy sampling."""
    tokens = runner.execute(**step.kwargs(), sampling=greedy(step.num_reqs, runner.vocab_size))
    info = runner.last_step
    return _collect(runner, f"runner ({info.mode.value} {info.key})", info.key, step.num_tokens,
                    step.num_reqs, tokens)


def _write(runner: Any, step: Step, key: BatchDescriptor) -> Any:
    """Write ``step``'s inputs (extra inputs too), padded to ``key``, in the host buffers."""
    args = step.kwargs()
    extras = args.pop("extra_inputs", None)
    runner.preparer.check(**args)
    r = key.num_reqs if key.num_reqs is not None else step.num_reqs
    padded = runner.preparer.write(num_tokens=key.num_tokens, num_reqs=r,
                                   out=runner.executor.host_buffers)
    if runner.extra is not None:
        checked = runner.extra.check(extras, step.num_tokens, step.num_reqs)
        runner.extra.write(checked, step.num_tokens, step.num_reqs, key.num_tokens, r)
    return padded


def run_at(runner: Any, step: Step, key: BatchDescriptor | None) -> Outputs:
    """``step`` padded to ``key`` (None: unpadded) and run eagerly at that shape, or by the
    key's executable on a backend without an eager path."""
    t, r = step.num_tokens, step.num_reqs
    if key is None:
        key = BatchDescriptor(t, r, step.uniform_decode)
    padded = _write(runner, step, key)
    ex = runner.executor
    if ex.capabilities.eager_fallback:
        ex.run(RuntimeMode.NONE, key, None, padded)
        how = f"eager at {key}"
    else:
        built = built_entry(runner, key)     # the runner's executable for the key, else one built now
        entry = built[1] if built is not None else ex.build(RuntimeMode.FULL, key)[0]
        ex.run(RuntimeMode.FULL, key, entry, padded)
        how = f"executable of {key}"
    return _collect(runner, how, key, t, r)


def built_entry(runner: Any, key: BatchDescriptor) -> tuple[RuntimeMode, Any] | None:
    """The mode and graph / executable warm-up built for ``key`` (None: none, or it failed)."""
    for mode in (RuntimeMode.FULL, RuntimeMode.PIECEWISE):
        if (mode, key) in runner.cache:
            entry = runner.cache.lookup((mode, key))
            if not isinstance(entry, FailedBuild):
                return mode, entry
    return None


def replay_at(runner: Any, step: Step, key: BatchDescriptor) -> Outputs:
    """``step`` padded to ``key`` and run by the graph or executable built for ``key``
    (:func:`built_entry` must find one), whichever key the runner would pick."""
    built = built_entry(runner, key)
    if built is None:
        raise ValueError(f"no graph or executable was built for {key}")
    mode, entry = built
    padded = _write(runner, step, key)
    runner.executor.run(mode, key, entry, padded)
    return _collect(runner, f"replay of {mode.value} {key}", key, step.num_tokens, step.num_reqs)


def can_run_unpadded(runner: Any) -> bool:
    """Whether :func:`run_at` can run a step at its own shape (an eager path)."""
    return bool(runner.executor.capabilities.eager_fallback)


def bucket_keys(runner: Any) -> list[BatchDescriptor]:
    """The runner's bucket keys; on a backend without graphs (``eager``), the keys a graph
    backend would capture for its config, so padding is still exercised."""
    keys = [key for _, key in runner.dispatcher.keys()]
    if not keys:
        keys = [key for _, key in runner.config.graph_dispatcher(GraphMode.FULL_AND_PIECEWISE).keys()]
    return keys


def covering_keys(runner: Any, step: Step) -> list[BatchDescriptor]:
    """Every bucket key that can hold ``step``, smallest first; a decode key only for a decode
    step (each request schedules ``decode_query_len`` tokens)."""
    t, r = step.num_tokens, step.num_reqs
    q = runner.config.decode_query_len
    uniform = bool((np.asarray(step.num_scheduled_tokens) == q).all())
    keys = {k for k in bucket_keys(runner)
            if k.num_tokens >= t and (k.num_reqs is None or k.num_reqs >= r) and (uniform or not k.uniform_decode)}
    return sorted(keys, key=lambda k: (k.num_tokens, k.num_reqs or 0, k.uniform_decode))


class Planted(NamedTuple):
    """What a property planted before a step: KV values and, for a hybrid model, states."""

    kv: np.ndarray
    state: np.ndarray | None


def plant(runner: Any, step: Step, *, nan_unused: bool) -> Planted:
    """:func:`plant_kv` and :func:`plant_state`."""
    return Planted(plant_kv(runner, step, nan_unused=nan_unused), plant_state(runner, step, nan_unused=nan_unused))


def restore(runner: Any, planted: Planted) -> None:
    """Put the planted KV values and states back (before another run of the same step)."""
    access.set_kv(runner, planted.kv)
    if planted.state is not None:
        access.set_state(runner, planted.state)


def plant_state(runner: Any, step: Step, *, nan_unused: bool) -> np.ndarray | None:
    """Seeded values in every recurrent-state slot and checkpoint (None without state); with
    ``nan_unused`` NaN in every entry the step does not read, which must reach no real output."""
    current = access.state_values(runner)
    if current is None:
        return None
    values = (0.5 * np.random.default_rng(step.seed + 7).standard_normal(current.shape)).astype(np.float32)
    if nan_unused:
        keep = np.zeros(current.shape[:2], dtype=bool)
        for slot, checkpoint in step.state_reads(current.shape[1]):
            keep[slot, checkpoint] = True
        values[~keep] = np.nan
    access.set_state(runner, values)
    return values


def plant_kv(runner: Any, step: Step, *, nan_unused: bool) -> np.ndarray:
    """Seeded values in every KV slot; with ``nan_unused`` NaN in every slot the real tokens never
    read and in those they write (a kernel must store K/V before reading it). Returns the
    planted values (float32)."""
    shape = access.kv_values(runner).shape
    values = np.random.default_rng(step.seed).standard_normal(shape).astype(np.float32)
    if nan_unused:
        used = np.zeros(shape[2], dtype=bool)
        used[step.read_slots()] = True
        used[step.write_slots()] = False
        values[:, :, ~used] = np.nan
    access.set_kv(runner, values)
    return values


__all__ = ["KIT_LIMITS", "Outputs", "Planted", "RunnerFactory", "bucket_keys", "built_entry", "can_run_unpadded",
           "covering_keys", "greedy", "plant", "plant_kv", "plant_state", "replay_at", "restore", "run_at",
           "run_runner"]
