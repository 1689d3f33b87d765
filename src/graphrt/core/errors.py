"""Errors raised by graphrt. Every one derives from :class:`GraphrtError`."""

from __future__ import annotations


class GraphrtError(Exception):
    """Base class of every error graphrt raises on purpose."""


class BackendUnavailableError(GraphrtError, RuntimeError):
    """A backend was asked for that cannot run here; the message says why."""


class InputError(GraphrtError, ValueError):
    """Bad input to a graphrt call. The message names the field and the bound.

    Raised before any persistent buffer or KV cache is touched.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class CacheMissError(GraphrtError, RuntimeError):
    """Strict mode: a step needed a graph or executable that warm-up did not build."""

    def __init__(self, key: object, reason: str, description: str | None = None) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"no captured graph / compiled executable for {description or key}: {reason}")


class GraphCaptureError(GraphrtError, RuntimeError):
    """Something inside a capture region would break a device graph (e.g. a host sync)."""


class ConfigError(GraphrtError, ValueError):
    """An invalid combination of configuration values."""
