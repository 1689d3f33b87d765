"""Choosing the host kernel: numba where it imports, numpy otherwise or when asked."""

from __future__ import annotations

import sys

import pytest

from graphrt import ConfigError, GraphConfig, InputPreparer, Padder

from graphrt.core.inputs import host_kernels
from graphrt.config import add_cli_args, from_cli_args


@pytest.fixture
def without_numba(monkeypatch):
    """graphrt as it behaves where numba does not import."""
    monkeypatch.setitem(sys.modules, "numba", None)
    monkeypatch.setattr(host_kernels, "_numba", None)
    monkeypatch.setattr(host_kernels, "_numba_error", None)
    monkeypatch.delenv(host_kernels.KERNEL_ENV, raising=False)


def test_auto_falls_back_to_numpy_without_numba(without_numba):
    assert host_kernels.resolve_kernel("auto") == "numpy"
    assert InputPreparer(max_num_reqs=2, max_num_tokens=4, block_size=2).kernel == "numpy"
    assert Padder().kernel == "numpy"


def test_without_numba_the_same_checks_run_interpreted(without_numba):
    """The fallback needs no numba: host_loops' checks run in the interpreter, with the
    messages of the compiled path."""
    import numpy as np

    from graphrt import InputError

    prep = InputPreparer(max_num_reqs=2, max_num_tokens=8, block_size=2, num_blocks=6)
    step = dict(token_ids=np.arange(12, dtype=np.int32).reshape(2, 6),
                block_table=np.array([[1, 2, 0], [3, 4, 5]], dtype=np.int32),
                req_rows=np.array([1]), num_computed_tokens=np.array([2]), num_scheduled_tokens=np.array([3]))
    assert prep.prepare(**step).slot_mapping.tolist() == [8, 9, 10]
    with pytest.raises(InputError, match=r"block 6 is outside the KV cache's 6 blocks \(request 0, row 1, column 2\)"):
        prep.prepare(**{**step, "block_table": np.array([[1, 2, 0], [3, 4, 6]], dtype=np.int32)})
    with pytest.raises(InputError, match="request 0 schedules 0 tokens; must be >= 1"):
        prep.check(**{**step, "num_scheduled_tokens": np.array([0])})


def test_asking_for_numba_without_it_says_why(without_numba):
    with pytest.raises(ConfigError, match="numba.*does not import.*kernel='numpy'"):
        InputPreparer(max_num_reqs=2, max_num_tokens=4, block_size=2, kernel="numba")


def test_unknown_kernel_is_a_config_error():
    with pytest.raises(ConfigError, match="'fortran' is not one of"):
        host_kernels.resolve_kernel("fortran")


def test_environment_sets_the_default(monkeypatch):
    monkeypatch.setenv(host_kernels.KERNEL_ENV, "numpy")
    assert InputPreparer(max_num_reqs=2, max_num_tokens=4, block_size=2).kernel == "numpy"
    assert Padder().kernel == "numpy"
    # an explicit choice wins over the environment
    if host_kernels.resolve_kernel("auto") == "numba":
        assert Padder(kernel="numba").kernel == "numba"


def test_numba_is_the_default_where_it_imports(monkeypatch):
    pytest.importorskip("numba")
    monkeypatch.delenv(host_kernels.KERNEL_ENV, raising=False)
    assert InputPreparer(max_num_reqs=2, max_num_tokens=4, block_size=2).kernel == "numba"


def test_config_field_and_flag():
    import argparse

    args = add_cli_args(argparse.ArgumentParser()).parse_args(["--host-kernel", "numpy"])
    assert from_cli_args(args).host_kernel == "numpy"
    assert GraphConfig().host_kernel is None
    with pytest.raises(ConfigError, match="host_kernel"):
        GraphConfig.create(host_kernel="cython")
    with pytest.raises(SystemExit):
        add_cli_args(argparse.ArgumentParser()).parse_args(["--host-kernel", "cython"])


def test_compile_kernels_before_the_first_step():
    """A runner's warm-up compiles the loops for every table variant the preparer passes them
    (int32 / int64 token and block tables; request arrays always int32), so no step waits for
    the JIT; the preparer works normally afterwards."""
    import numpy as np

    numpy_prep = InputPreparer(max_num_reqs=2, max_num_tokens=4, block_size=2, kernel="numpy")
    assert numpy_prep.compile_kernels() == 0.0
    if host_kernels.resolve_kernel("auto") != "numba":
        pytest.skip("numba does not import here")
    prep = InputPreparer(max_num_reqs=2, max_num_tokens=4, block_size=2, table_width=3, kernel="numba")
    assert prep.compile_kernels() >= 0.0
    tables = {f"array({a}, 2d, C)" for a in ("int32", "int64")}
    for loop in (host_kernels.compiled("check_step"), host_kernels.compiled("write_checked_step")):
        signatures = {tuple(str(t) for t in sig[:5]) for sig in loop.signatures}
        assert {(a, b) + ("array(int32, 1d, C)",) * 3 for a in tables for b in tables} <= signatures, loop
    got = prep.prepare(token_ids=np.arange(12, dtype=np.int32).reshape(2, 6),
                       block_table=np.array([[1, 2, 0], [3, 4, 5]], dtype=np.int32),
                       req_rows=np.array([1]), num_computed_tokens=np.array([2]),
                       num_scheduled_tokens=np.array([3]))
    assert got.input_ids.tolist() == [8, 9, 10] and got.slot_mapping.tolist() == [8, 9, 10]


def test_canonical_flags_are_numpys_own():
    """``CANONICAL_FLAGS`` (the per-step test of an array the loops take as it is) agrees with
    numpy's named flags, for arrays that have them and arrays that lack each one."""
    import numpy as np

    ok = np.zeros((3, 4), dtype=np.int32)
    read_only = ok.copy()
    read_only.flags.writeable = False
    unaligned = np.frombuffer(bytearray(49), dtype=np.uint8)[1:].view(np.int32).reshape(3, 4)
    for arr in (ok, read_only, unaligned, np.asfortranarray(ok), ok[:, ::2], ok[::2]):
        flags = arr.flags
        expected = flags.c_contiguous and flags.writeable and flags.aligned
        assert (flags.num & host_kernels.CANONICAL_FLAGS == host_kernels.CANONICAL_FLAGS) == expected
    assert host_kernels.table_variant(ok) is None
    assert "read-only" in host_kernels.table_variant(read_only)
    assert "aligned" in host_kernels.table_variant(unaligned)
    assert "Fortran" in host_kernels.table_variant(np.asfortranarray(ok))
    assert "strided" in host_kernels.table_variant(ok[:, ::2])
    assert "dtype" in host_kernels.table_variant(ok.astype(">i4"))


def test_the_loops_disk_cache_is_stamped_with_every_module_they_compile():
    """numba stamps a cached function with its own file only: the loops' cache is stamped with
    every module whose functions or constants are compiled into them (each graphrt module a loop
    module imports), so an edited helper compiles the loops again instead of loading stale code."""
    pytest.importorskip("numba")
    import ast
    from pathlib import Path

    core = Path(host_kernels.__file__).parent
    for name in host_kernels.LOOP_MODULES:
        tree = ast.parse((core / f"{name}.py").read_text())
        imported = {node.module.removeprefix("graphrt.core.").replace(".", "/") + ".py" for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("graphrt.core.")}
        assert imported <= set(host_kernels.LOOP_SOURCES), (name, imported)
    locator = host_kernels.compiled("check_step")._cache._impl.locator
    assert locator.get_source_stamp() == host_kernels.loop_sources_stamp()


def test_unexpected_numba_cache_internals_compile_the_loops_without_the_disk_cache(monkeypatch, caplog):
    """The stamp reaches into numba's cache locators; a numba whose internals differ must not
    break input preparation: the loops compile without the disk cache, with a warning."""
    numba = pytest.importorskip("numba")
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl
    monkeypatch.delattr(impl, "_locator_classes")
    monkeypatch.setattr(host_kernels, "_numba", None)
    monkeypatch.setattr(host_kernels, "_compiled", {})
    monkeypatch.setattr(host_kernels, "_disk_cache", True)
    with caplog.at_level("WARNING", logger=host_kernels.__name__):
        loop = host_kernels.compiled("check_step")
    assert "without numba's disk cache" in caplog.text
    assert type(loop._cache).__name__ == "NullCache"          # numba's "no disk cache"
    assert not any(c.__name__ == "LoopSources" for c in getattr(impl, "_locator_classes", []))
