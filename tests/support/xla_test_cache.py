"""One JAX persistent compilation cache for a test run, shared by its xdist workers.

Many tests compile the same programs (the same tiny model at the same limits); with the cache
each is compiled once per run and loaded from disk after. The directory is made per run (a
fresh temporary one, removed at the end), so a run never sees programs from an earlier run.

JAX counts a load from the cache as a backend compile too (``/jax/core/compile/
backend_compile_duration``), so graphrt's compile counters and "nothing recompiles" asserts
count the same with or without it; a load only also counts a persistent-cache hit. Tests about
the cache itself give ``compilation_cache_dir`` a fresh directory of their own (graphrt then moves
JAX's cache there); a test that needs JAX's cache off (one that counts graphrt's "moves the
process-wide cache" warnings) is marked ``no_session_xla_cache``. Before each test the run's
settings are put back, so no test's directory outlives it.

``GRAPHRT_TEST_XLA_CACHE``: unset, the run makes its own directory; ``off``, no shared cache;
a path, that directory (kept).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

ENV = "GRAPHRT_TEST_XLA_CACHE"
OFF = "off"
MARK = "no_session_xla_cache"
_OWNED = "_graphrt_owned_xla_cache"


def configure(config) -> None:
    """In the controller (or a lone process): make the run's directory and name it in the
    environment, which the xdist workers inherit."""
    config.addinivalue_line("markers", f"{MARK}: run with JAX's persistent compilation cache off "
                                       "(tests/support/xla_test_cache.py)")
    if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get(ENV):
        return
    path = tempfile.mkdtemp(prefix="graphrt-test-xla-cache-")
    os.environ[ENV] = path
    setattr(config, _OWNED, path)


def unconfigure(config) -> None:
    """Remove the directory this process made."""
    path = getattr(config, _OWNED, None)
    if path:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop(ENV, None)


def apply(item) -> None:
    """Before a test: JAX's cache at the run's directory (or off, for a marked test). Only where
    JAX is already imported (every module that compiles imports it when collected), so a run that
    never uses JAX does not pay for importing it."""
    jax = sys.modules.get("jax")
    if jax is None or not hasattr(jax, "config"):
        return
    path = os.environ.get(ENV) or None
    if path == OFF or item.get_closest_marker(MARK) is not None:
        path = None
    min_secs = 0.0 if path else 1.0          # 1.0: JAX's default, the setting without the cache
    if jax.config.jax_compilation_cache_dir == path and (
            path is None or jax.config.jax_persistent_cache_min_compile_time_secs == min_secs):
        return
    from jax.experimental.compilation_cache import compilation_cache as cc
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_secs)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    cc.reset_cache()                         # JAX decides once whether the cache is in use
