"""The ``graphrt`` command's exit statuses, one convention for every subcommand (as argparse's):
0 done (clean), 1 findings (a lint finding, a failed property, a missed benchmark target), 2 a
usage error -- the command could not do its job with what it was given (a flag, a model spec, a
builder, a model that does not run) -- said in one line on stderr, ``graphrt <command>: ...``,
with no traceback. A subcommand raises :class:`UsageError`; ``graphrt.cli.main`` prints it."""

from __future__ import annotations

import sys
from typing import Callable, TypeVar

#: Exit statuses of every ``graphrt`` subcommand (docs/testing.md, "Exit status").
EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2

T = TypeVar("T")


class UsageError(Exception):
    """What stops a subcommand before it has a result; its message is the one line printed."""


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, for a one-line report."""
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def run_user_code(what: str, fn: Callable[[], T]) -> T:
    """``fn()``: the user's code (a builder, a module being imported, a model's forward), whose
    exception becomes a :class:`UsageError` ``<what> raised <Type>: <message>``."""
    try:
        return fn()
    except Exception as exc:
        raise UsageError(f"{what} raised {describe(exc)}") from exc


def usage_error(command: str, message: object) -> int:
    """Print ``graphrt <command>: <message>`` as one line on stderr (whitespace, newlines
    included, collapsed) and return :data:`EXIT_USAGE`."""
    print(f"graphrt {command}: {' '.join(str(message).split())}", file=sys.stderr)
    return EXIT_USAGE


__all__ = ["EXIT_FINDINGS", "EXIT_OK", "EXIT_USAGE", "UsageError", "describe", "run_user_code", "usage_error"]
