"""transformers' continuous batching on graphrt's graphs: its manager (``generate_batch``,
``ContinuousBatchingManager``), scheduler and paged cache unchanged, each step padded to a graphrt
key by graphrt's rules and replayed from graphrt's graphs (``cpu``: the recording graph; CUDA or
ACL graphs where present)::

    from graphrt.integrations import transformers_cb

    transformers_cb.enable(model, backend="cpu")
    outputs = model.generate_batch(prompts, generation_config=config)
    transformers_cb.stats(model)           # keys captured, replays, eager steps by cause, padding
    transformers_cb.disable(model)

Nothing happens to transformers until :func:`enable` (or the :func:`enabled` context manager):
importing this package imports no transformers. A transformers version outside
:data:`TESTED_RANGE` is refused, naming the range. docs/engines.md, "transformers' continuous
batching".
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from typing import Any

from graphrt.core.errors import BackendUnavailableError

#: The transformers releases this integration was tested with: [first, last) as versions.
TESTED_RANGE = ("5.24", "5.25")
#: Its text, for messages and docs.
TESTED_RANGE_TEXT = f"transformers>={TESTED_RANGE[0]},<{TESTED_RANGE[1]}"


def version_reason(version: str) -> str | None:
    """Why transformers ``version`` is refused (its release outside :data:`TESTED_RANGE`), or None."""
    from packaging.version import Version          # a dependency of transformers

    release = Version(version).release
    if Version(TESTED_RANGE[0]).release <= release < Version(TESTED_RANGE[1]).release:
        return None
    return (f"transformers {version} is outside the range graphrt.integrations.transformers_cb was tested with "
            f"({TESTED_RANGE_TEXT}): its continuous-batching internals move between releases; "
            f"install a release in that range")


def unavailable_reason() -> str | None:
    """One sentence on why transformers' continuous batching cannot run on graphrt here, or None."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed: pip install 'transformers>=5.24,<5.25'"
    version = importlib.metadata.version("transformers")
    reason = version_reason(version)
    if reason is not None:
        return reason
    if importlib.util.find_spec("transformers.generation.continuous_batching") is None:
        return f"transformers {version} has no generation.continuous_batching module"
    return None


def _activation() -> Any:
    reason = unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(reason)
    return importlib.import_module("graphrt.integrations.transformers_cb.activation")


def enable(model: Any, backend: str = "cpu", **options: Any) -> None:
    """Run ``model``'s continuous batching on graphrt (:func:`.activation.enable`)."""
    _activation().enable(model, backend, **options)


def disable(model: Any) -> None:
    """Give ``model``'s continuous batching back to transformers (:func:`.activation.disable`)."""
    _activation().disable(model)


def enabled(model: Any, backend: str = "cpu", **options: Any) -> Any:
    """A context manager: :func:`enable` for the block, :func:`disable` after it."""
    return _activation().enabled(model, backend, **options)


def stats(model: Any) -> Any:
    """graphrt's statistics (:class:`~graphrt.CacheStats`) of ``model``'s latest batch processor."""
    return _activation().stats(model)


def runner_of(model: Any) -> Any:
    """``model``'s latest :class:`~.runner.GraphrtCBRunner` (its dispatcher, graph cache and
    ``reads``: cache tokens read, real and padded), or None before its first batch processor."""
    return _activation().runner_of(model)


__all__ = ["TESTED_RANGE", "disable", "enable", "enabled", "runner_of", "stats", "unavailable_reason",
           "version_reason"]
