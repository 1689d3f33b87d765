"""pytest plugin of the conformance suite: its options, ini keys and fixtures.

Loaded by the ``pytest11`` entry point of an installed graphrt, or explicitly with
``-p graphrt.testing.plugin``. Imports nothing heavy: the kit loads when a test asks for it.
Every setting (:data:`OPTIONS`) is an option ``--graphrt-NAME`` and an ini key ``graphrt_NAME``;
the option wins, and a relative path in an ini key is relative to the ini file. The settings are
tabled in docs/testing.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import pytest


@dataclass(frozen=True)
class Option:
    """One setting: the option ``--graphrt-<name>`` and the ini key ``graphrt_<name>``."""

    name: str
    kind: str            # "str", "int", "bool", "list" (backends), "spec" (a directory or module:function)
    help: str


#: The plugin's settings; ``None`` / unset means the kit's default.
OPTIONS: tuple[Option, ...] = (
    Option("model", "spec", "model for graphrt.testing.conformance: a Hugging Face directory, "
                            "package.module:function or file.py:function returning a fresh model"),
    Option("backend", "list", "graphrt backend name(s): repeat the option, or separate names by commas "
                              "(ini: spaces); the suite runs on each (default cpu)"),
    Option("mode", "str", "graph mode, e.g. FULL (default: the config's)"),
    Option("examples", "int", "examples per property (default graphrt.testing.conformance.DEFAULT_EXAMPLES)"),
    Option("threads", "int", "torch intra-op threads while a conformance test runs (default 1: the kit's steps "
                             "are small; 0 leaves torch's setting alone)"),
    Option("strict", "bool", "strict mode: a capture that fails, or a step with no graph, fails the properties"),
    Option("seed", "int", "hypothesis seed (default 0)"),
    Option("reference", "spec", "your own step function, file.py:function or package.module:function: "
                                "reference(step) -> logits [reqs, vocab] or tokens [reqs], compared with the "
                                "runner by test_matches_reference (which skips without it)"),
)
_KINDS = {"str": "string", "int": "string", "spec": "string", "bool": "bool", "list": "args"}
_UNSET = {"str": "", "int": "", "spec": "", "bool": False, "list": []}


@dataclass(frozen=True)
class Settings:
    """The suite's settings after options and ini keys (None: the kit's default)."""

    model: str | None
    backends: tuple[str, ...]
    mode: str | None
    examples: int | None
    threads: int | None
    strict: bool
    seed: int
    reference: str | None


def pytest_addoption(parser: Any) -> None:
    """One option ``--graphrt-NAME`` and one ini key ``graphrt_NAME`` per entry of :data:`OPTIONS`."""
    group = parser.getgroup("graphrt", "graphrt conformance suite (graphrt.testing)")
    for opt in OPTIONS:
        flag, dest = f"--graphrt-{opt.name}", f"graphrt_{opt.name}"
        if opt.kind == "bool":
            group.addoption(flag, dest=dest, action="store_const", const=True, default=None, help=opt.help)
        elif opt.kind == "list":
            group.addoption(flag, dest=dest, action="append", default=None, help=opt.help)
        else:
            group.addoption(flag, dest=dest, default=None, type=int if opt.kind == "int" else str, help=opt.help)
        parser.addini(dest, f"{opt.help} (the option {flag} overrides it)", type=_KINDS[opt.kind],
                      default=_UNSET[opt.kind])


def _from_ini(config: Any, opt: Option) -> Any:
    """The ini key's value in the option's type, or None where it is unset."""
    raw = config.getini(f"graphrt_{opt.name}")
    if opt.kind == "bool":
        return bool(raw) or None
    if raw in ("", []):
        return None
    if opt.kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise pytest.UsageError(f"ini key graphrt_{opt.name}: expected an integer, got {raw!r}") from None
    if opt.kind == "spec" and config.inipath is not None:
        return _relative_to(str(raw), os.path.dirname(str(config.inipath)))
    return raw


def _relative_to(spec: str, base: str) -> str:
    """``spec`` with a relative file or directory made relative to ``base`` where it is there."""
    where, sep, name = spec.rpartition(":")
    is_file = bool(sep) and where.endswith(".py")
    path = where if is_file else spec
    if os.path.isabs(path) or not os.path.exists(os.path.join(base, path)):
        return spec
    full = os.path.join(base, path)
    return f"{full}:{name}" if is_file else full


def settings(config: Any) -> Settings:
    """The plugin's settings: each option, else its ini key, else the default."""
    values = {}
    for opt in OPTIONS:
        value = config.getoption(f"graphrt_{opt.name}")
        values[opt.name] = _from_ini(config, opt) if value is None else value
    for name, least in (("examples", 1), ("threads", 0)):
        if values[name] is not None and values[name] < least:
            raise pytest.UsageError(f"--graphrt-{name} / graphrt_{name}: must be >= {least}, got {values[name]}")
    backends = [b for item in values["backend"] or ["cpu"] for b in str(item).replace(",", " ").split()]
    return Settings(model=values["model"], backends=tuple(dict.fromkeys(backends)), mode=values["mode"],
                    examples=values["examples"], threads=values["threads"], strict=bool(values["strict"]),
                    seed=values["seed"] or 0, reference=values["reference"])


def pytest_configure(config: Any) -> None:
    """A bad option value or ini key is a usage error before anything is collected."""
    settings(config)


def pytest_generate_tests(metafunc: Any) -> None:
    """Tests that use the runner factory run once per configured backend."""
    if "graphrt_backend" in metafunc.fixturenames:
        metafunc.parametrize("graphrt_backend", settings(metafunc.config).backends, scope="session")


@pytest.fixture(scope="session")
def graphrt_settings(request: Any) -> Settings:
    """The suite's settings (options, then ini keys)."""
    return settings(request.config)


@pytest.fixture(scope="session")
def graphrt_factory(graphrt_settings: Settings, graphrt_backend: str) -> Any:
    """The runner factory of the configured model, mode and strictness on one backend."""
    if graphrt_settings.model is None:
        pytest.skip("graphrt conformance: no --graphrt-model (or ini graphrt_model) given")
    from graphrt.testing.loading import load_model
    from graphrt.testing.runners import RunnerFactory

    fields: dict[str, Any] = {"mode": graphrt_settings.mode} if graphrt_settings.mode else {}
    if graphrt_settings.strict:
        fields["strict"] = True
    return RunnerFactory(load_model(graphrt_settings.model), graphrt_backend, **fields)


@pytest.fixture(scope="session")
def graphrt_examples(graphrt_settings: Settings) -> int:
    """Examples per property (``--graphrt-examples``, default the suite's)."""
    from graphrt.testing.conformance import DEFAULT_EXAMPLES

    return DEFAULT_EXAMPLES if graphrt_settings.examples is None else graphrt_settings.examples


@pytest.fixture(scope="session")
def graphrt_threads(graphrt_settings: Settings) -> int | None:
    """torch intra-op threads while a conformance test runs (None: leave them alone)."""
    from graphrt.testing.conformance import DEFAULT_THREADS

    threads = DEFAULT_THREADS if graphrt_settings.threads is None else graphrt_settings.threads
    return threads or None


@pytest.fixture(scope="session")
def graphrt_reference(graphrt_settings: Settings) -> Callable[[Any], Any] | None:
    """The configured reference step function (None: test_matches_reference skips)."""
    if graphrt_settings.reference is None:
        return None
    from graphrt.testing.loading import load_callable

    return load_callable(graphrt_settings.reference, "--graphrt-reference")


@pytest.fixture
def graphrt_check(graphrt_factory: Any, graphrt_examples: int, graphrt_threads: int | None,
                  graphrt_settings: Settings, graphrt_reference: Callable[[Any], Any] | None
                  ) -> Callable[[str], None]:
    """``graphrt_check(name)`` runs property ``name`` on the factory's runners, torch's threads
    pinned: the test fails with the kit's FAIL line, or skips where the property does not apply."""
    from graphrt.testing.conformance import check_property, kit_threads

    def check(name: str) -> None:
        with kit_threads(graphrt_factory, graphrt_threads):
            result = check_property(name, graphrt_factory, graphrt_examples, seed=graphrt_settings.seed,
                                    reference=graphrt_reference)
        if not result.passed:
            pytest.fail(result.line(), pytrace=False)
        if not result.applicable:
            pytest.skip(result.note)

    return check
