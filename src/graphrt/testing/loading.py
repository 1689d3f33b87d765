"""What the kit's command lines name: a model directory, or ``file.py:function`` /
``package.module:function`` (a model builder, or a reference step function).

A function loaded from a file may import the modules beside it (``from my_attention import
...``), as it could under pytest, whose rootdir insertion puts a test file's directory on
``sys.path``: the file's directory is importable while the file loads and whenever the kit
calls the function, without ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, Callable, Iterator

from graphrt.core.errors import ConfigError


@contextlib.contextmanager
def importable(directory: str) -> Iterator[None]:
    """``directory`` first on ``sys.path`` for the block (left where it was if it was there)."""
    directory = os.path.abspath(directory)
    added = directory not in sys.path
    if added:
        sys.path.insert(0, directory)
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(directory)


def _module_from_file(path: str, what: str) -> ModuleType:
    """The module of ``path``, executed with its directory importable; registered under its
    file name in ``sys.modules`` (as a plain import would) unless another module has it."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{what}: no file {path}")
    name = os.path.basename(path)[:-3]
    known = sys.modules.get(name)
    if known is not None and os.path.abspath(getattr(known, "__file__", "") or "") == path:
        return known
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{what}: cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    register = known is None
    if register:
        sys.modules[name] = module
    try:
        with importable(os.path.dirname(path)):
            spec.loader.exec_module(module)
    except BaseException:
        if register:
            sys.modules.pop(name, None)
        raise
    return module


def load_callable(spec: str, what: str = "model") -> Callable[..., Any]:
    """The function ``spec`` names: ``path/to/file.py:function`` (loaded from the file, whose
    directory stays importable whenever the function is called) or ``package.module:function``.
    ``what`` names the flag in errors (ConfigError)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(f"{what}: {spec!r} is not file.py:function or package.module:function")
    if where.endswith(".py"):
        module = _module_from_file(where, what)
        directory = os.path.dirname(os.path.abspath(where))
    else:
        module = importlib.import_module(where)
        directory = None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{what}: {where} has no function {name!r}")
    if directory is None:
        return fn

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with importable(directory):
            return fn(*args, **kwargs)

    return call


def load_model(spec: str) -> str | Callable[[], Any]:
    """A model directory as it is, or a model builder: ``package.module:function`` (imported)
    or ``path/to/file.py:function`` (loaded from the file, its siblings importable)."""
    if os.path.exists(spec) or ":" not in spec:
        return spec
    return load_callable(spec, "model")


__all__ = ["importable", "load_callable", "load_model"]
