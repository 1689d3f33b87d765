"""The conformance suite: every property of :mod:`graphrt.testing.properties`, N examples each.

Run as ``graphrt conformance --model DIR --backend cpu`` (:func:`run_conformance`, a line per
property) or ``pytest --pyargs graphrt.testing.conformance --graphrt-model DIR
--graphrt-backend cpu`` (a test per property; options from :mod:`graphrt.testing.plugin`).
``--model``: a Hugging Face directory, or ``module:function`` / ``file.py:function`` returning a
fresh model (docs/models.md). Needs ``hypothesis``. See docs/testing.md.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from graphrt.core.errors import CacheMissError, ConfigError, GraphCaptureError, GraphrtError
from graphrt.core.numerics import Tolerance
from graphrt.testing.history import CAUSE
from graphrt.testing.loading import load_callable, load_model
from graphrt.testing.properties import PROPERTIES
from graphrt.testing.reference import REFERENCE_KIND, REFERENCE_PROPERTY, Reference, matches_reference
from graphrt.testing.runners import RunnerFactory, can_run_unpadded

#: Examples per property when none is given.
DEFAULT_EXAMPLES = 100
#: torch intra-op threads while the suite runs (see :func:`torch_threads`).
DEFAULT_THREADS = 1
#: What a runner raises when it, or a graph it needs, cannot be built (strict-mode capture
#: failure, a refused model or attention): a FAIL line naming it, not a crash.
BUILD_ERRORS: tuple[type[BaseException], ...] = (GraphCaptureError, CacheMissError, ConfigError)


@dataclass
class Result:
    """One property's outcome: PASS, FAIL, or N/A (nothing to check on this backend)."""

    name: str
    examples: int                 # examples run, shrinking included
    seconds: float
    error: str | None = None      # the shrunk failure's message
    counterexample: str | None = None
    note: str | None = None       # why the property has nothing to check on this backend (N/A)

    @property
    def passed(self) -> bool:
        """No failure (a property that does not apply has none)."""
        return self.error is None

    @property
    def applicable(self) -> bool:
        """Whether the property had something to check on this backend."""
        return self.note is None

    @property
    def status(self) -> str:
        """``PASS``, ``FAIL`` or ``N/A``."""
        return "FAIL" if not self.passed else ("PASS" if self.applicable else "N/A")

    def line(self) -> str:
        """``PASS kv_isolated  100 examples  3.1 s`` (and, on failure, the counterexample);
        ``N/A  addresses_stable ... (not applicable: ...)``."""
        text = f"{self.status:<4} {self.name:<28} {self.examples:>5} examples {self.seconds:>7.1f} s"
        if self.note:
            text += f"  ({self.note})"
        if not self.passed:
            text += f"\n  {self.error}"
            if self.counterexample is not None:
                text += "\n  counterexample (shrunk):\n    " + self.counterexample.replace("\n", "\n    ")
        return text


def summary(results: Sequence[Result]) -> str:
    """``5 of 5 properties hold, 2 not applicable`` (``; failed: ...`` when some failed)."""
    checked = [r for r in results if r.applicable or not r.passed]
    failed = [r.name for r in checked if not r.passed]
    text = f"{len(checked) - len(failed)} of {len(checked)} properties hold"
    if len(checked) < len(results):
        text += f", {len(results) - len(checked)} not applicable"
    return text + (f"; failed: {', '.join(failed)}" if failed else "")


def _not_applicable(name: str, factory: RunnerFactory, reference: Reference | None) -> str | None:
    from graphrt.testing import access

    if name == REFERENCE_PROPERTY and reference is None:
        return "not applicable: no reference given (reference= / --reference)"
    runner = factory()
    if name == "replay_matches_eager" and not can_run_unpadded(runner):
        return f"not applicable: backend {runner.backend.name} has no eager path"
    if name == "state_isolated" and not runner.executor.num_state_slots:
        return "not applicable: the model keeps no recurrent state"
    if name == "addresses_stable" and access.addresses(runner) is None:
        return f"not applicable: backend {runner.backend.name} has no static device buffers"
    return None


def _property(name: str, reference: Reference | None,
              tolerance: Tolerance | None) -> tuple[Callable[[RunnerFactory, Any], None], str]:
    """Property ``name``'s function and strategy kind (the reference's bound to its reference)."""
    if name == REFERENCE_PROPERTY:
        return functools.partial(matches_reference, reference=reference, tolerance=tolerance), REFERENCE_KIND
    return PROPERTIES[name]


def known_properties() -> list[str]:
    """Every property's name: :data:`~graphrt.testing.properties.PROPERTIES` and the reference's."""
    return [*PROPERTIES, REFERENCE_PROPERTY]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def strategy_for(kind: str, factory: RunnerFactory) -> Any:
    """The strategy of a property's ``kind`` ("step", "bad", "trace", "split": a step and its
    chunks, "fresh_trace": lifetimes without prefix hits) for ``factory``'s runners."""
    from graphrt.testing import strategies

    args = factory.strategy_args()
    if kind == REFERENCE_KIND:
        return strategies.traces(**args, prefix_hits=False)
    return {"step": strategies.steps, "bad": strategies.bad_steps, "trace": strategies.traces,
            "split": strategies.splits}[kind](**args)


def _failed_captures(runner: Any) -> str:
    """``, 3 captures failed (they run eagerly): <the first reason>`` where warm-up had some."""
    failed = [e["failed"] for e in runner.cache.report() if e["failed"]]
    if not failed:
        return ""
    return f"; {len(failed)} captures failed (they run eagerly): {failed[0]}"


def check_property(name: str, factory: RunnerFactory, examples: int = DEFAULT_EXAMPLES, *,
                   seed: int = 0, reference: Reference | None = None,
                   reference_tolerance: Tolerance | None = None) -> Result:
    """Run property ``name`` on ``examples`` drawn examples; a failure (``AssertionError``, or a
    graphrt error on a valid example) is shrunk and reported; N/A runs no example.
    ``reference`` / ``reference_tolerance``: for ``matches_reference``."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.errors import Flaky

    if name not in known_properties():
        raise ValueError(f"unknown property {name!r}; known: {known_properties()}")
    fn, kind = _property(name, reference, reference_tolerance)
    start = time.perf_counter()
    try:
        note = _not_applicable(name, factory, reference)     # builds (warms up) the factory's runner
    except BUILD_ERRORS as exc:
        return Result(name, 0, time.perf_counter() - start, f"warm-up failed: {_describe(exc)}")
    if note is not None:                 # nothing to check: no examples drawn
        return Result(name, 0, time.perf_counter() - start, note=note)
    state: dict[str, Any] = {"runs": 0, "failing": None}

    @hypothesis_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, verbosity=Verbosity.quiet,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False, print_blob=False,
              phases=(Phase.explicit, Phase.generate, Phase.shrink))
    @given(strategy_for(kind, factory))
    def check(example: Any) -> None:
        state["runs"] += 1
        try:
            fn(factory, example)
        except BaseException:
            state["failing"] = example
            raise

    error = counterexample = None
    try:
        check()
    except (AssertionError, GraphrtError, Flaky) as exc:
        error = failure_text(exc).strip().replace("\n", "\n  ")
        failing = state["failing"]
        counterexample = "\n".join(repr(s) for s in failing) if isinstance(failing, list) else repr(failing)
    return Result(name, state["runs"], time.perf_counter() - start, error, counterexample, note)


#: The FAIL line of a property hypothesis found flaky (failed, then passed on the same example).
FLAKY = "flaky: the same example failed, then passed when hypothesis ran it again; {cause}"


def failure_text(exc: BaseException) -> str:
    """A failure's line: an ``AssertionError``'s message, a graphrt error named, or for
    hypothesis' ``Flaky`` (an example that failed and then passed) :data:`FLAKY` and the first
    failure -- never the raw ``FlakyFailure``."""
    from hypothesis.errors import Flaky

    if isinstance(exc, Flaky):
        first = next((e for e in getattr(exc, "exceptions", ()) if isinstance(e, (AssertionError, GraphrtError))),
                     None)
        if first is not None and CAUSE in str(first):     # the first failure already names the cause
            return f"{FLAKY.format(cause='the first failure:')}\n{str(first).strip()}"
        text = FLAKY.format(cause=CAUSE)
        return text if first is None else f"{text}\nthe first failure: {failure_text(first).strip()}"
    return str(exc) if isinstance(exc, AssertionError) else _describe(exc)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` for the block (None or 0: left alone); the
    kit's steps are small, and on a busy CPU a second thread can make them many times slower."""
    if not threads:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def private_hypothesis_storage() -> Iterator[str | None]:
    """Hypothesis' storage directory (``.hypothesis/``: the cache of constants it collects from
    local source files, written even with ``database=None``) in a temporary directory for the
    block, removed after it, so ``graphrt conformance`` writes nothing into the current
    directory; left alone where ``HYPOTHESIS_STORAGE_DIRECTORY`` names one. Yields the
    directory (None: left alone). The kit keeps no example database (``database=None``)."""
    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        yield None
        return
    from hypothesis import configuration

    with tempfile.TemporaryDirectory(prefix="graphrt-hypothesis-") as where:
        configuration.set_hypothesis_home_dir(where)
        try:
            yield where
        finally:
            configuration.set_hypothesis_home_dir(None)        # hypothesis' default again


def kit_threads(factory: RunnerFactory, threads: int | None) -> contextlib.AbstractContextManager[None]:
    """:func:`torch_threads` for a factory of a torch backend; nothing to pin for JAX."""
    framework = getattr(factory.backend, "framework", None) or _framework(factory.backend)
    return torch_threads(threads if framework == "torch" else None)


def run_conformance(model: str | Callable[[], Any] | None = None, backend: Any = "cpu", *,
                    examples: int = DEFAULT_EXAMPLES, mode: str | None = None,
                    properties: Sequence[str] | None = None, seed: int = 0,
                    factory: RunnerFactory | None = None, report: Callable[[str], None] | None = print,
                    threads: int | None = DEFAULT_THREADS, reference: Reference | str | None = None,
                    reference_tolerance: Tolerance | None = None, **config_fields: Any) -> list[Result]:
    """Every property (or ``properties``) on ``model`` and ``backend``, ``examples`` each;
    ``report`` gets a line per property (and one for the warm-up). ``factory`` replaces model /
    backend / config. ``threads``: torch intra-op threads (None or 0: as they are).
    ``reference(step) -> logits or tokens`` (or ``file.py:function``) adds ``matches_reference``,
    within ``reference_tolerance`` (default ``graphrt.reduction_tolerance``)."""
    if isinstance(reference, str):
        reference = load_callable(reference, "reference")
    if factory is None:
        if model is None:
            raise ValueError("give a model (directory or builder) or a factory")
        if mode is not None:
            config_fields["mode"] = mode
        factory = RunnerFactory(load_model(model) if isinstance(model, str) else model, backend, **config_fields)
    names = list(properties) if properties is not None else [
        *PROPERTIES, *([REFERENCE_PROPERTY] if reference is not None else [])]
    unknown = [n for n in names if n not in known_properties()]
    if unknown:
        raise ValueError(f"unknown properties {unknown}; known: {known_properties()}")
    results = []
    with kit_threads(factory, threads):
        start = time.perf_counter()
        try:
            runner = factory()
            line = (f"warm-up: {runner.backend.name}, graph mode {runner.mode.value}, "
                    f"{len(runner.dispatcher.keys())} bucket keys, {time.perf_counter() - start:.1f} s"
                    f"{_failed_captures(runner)}")
        except BUILD_ERRORS as exc:      # every property then fails with it, one line each
            line = f"warm-up: failed after {time.perf_counter() - start:.1f} s: {_describe(exc)}"
        if report is not None:
            report(line)
        for name in names:
            result = check_property(name, factory, examples, seed=seed, reference=reference,
                                    reference_tolerance=reference_tolerance)
            results.append(result)
            if report is not None:
                report(result.line())
    return results


def _framework(backend: Any) -> str:
    """The framework of a backend given by name, without importing it (``auto``: torch)."""
    from graphrt.registry import ALIASES, BACKENDS

    name = ALIASES.get(str(backend), str(backend))
    return "jax" if ".xla." in BACKENDS.get(name, "") else "torch"


# ------------------------------------------------------------------------------ pytest entry
# Collected by ``pytest --pyargs graphrt.testing.conformance``; ``graphrt_check`` comes from
# graphrt.testing.plugin. Without a reference, test_matches_reference skips.


def test_padding_invisible(graphrt_check: Callable[[str], None]) -> None:
    graphrt_check("padding_invisible")


def test_kv_isolated(graphrt_check: Callable[[str], None]) -> None:
    graphrt_check("kv_isolated")


def test_replay_matches_eager(graphrt_check: Callable[[str], None]) -> None:
    graphrt_check("replay_matches_eager")


def test_no_build_after_warmup(graphrt_check: Callable[[str], None]) -> None:
    graphrt_check("no_build_after_warmup")


def test_bad_input_rejected(graphrt_check: Callable[[str], None]) -> None:
    graphrt_check("bad_input_rejected")


def test_addresses_stable(graphrt_check: Callable[[str], None]) -> None:
    graphrt_check("addresses_stable")


def test_lifetime_matches_reference(graphrt_check: Callable[[str], None]) -> None:
    graphrt_check("lifetime_matches_reference")


def test_state_isolated(graphrt_check: Callable[[str], None]) -> None:
    graphrt_check("state_isolated")


def test_chunking_invariant(graphrt_check: Callable[[str], None]) -> None:
    graphrt_check("chunking_invariant")


def test_replay_deterministic(graphrt_check: Callable[[str], None]) -> None:
    graphrt_check("replay_deterministic")


def test_matches_reference(graphrt_check: Callable[[str], None]) -> None:
    graphrt_check("matches_reference")


__all__ = ["BUILD_ERRORS", "DEFAULT_EXAMPLES", "DEFAULT_THREADS", "FLAKY", "Result", "check_property", "failure_text",
           "kit_threads", "known_properties", "load_model", "private_hypothesis_storage", "run_conformance",
           "strategy_for", "summary", "torch_threads"]
