"""The package's metadata is a library's: ranges in the extras, the bootstrap's pin apart."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
#: The versions graphrt has run on (docs/benchmarks.md): the extras must admit them.
RUN_ON = {"torch": ["2.11.0", "2.13.0"], "jax": ["0.10.2", "0.11.2"], "ray": ["2.60.0"]}
HEAVY = {"torch", "jax", "jaxlib", "flax", "torch-npu", "torch_npu"}


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_core_install_pulls_no_framework() -> None:
    names = {Requirement(r).name.lower() for r in project()["dependencies"]}
    assert names == {"numpy", "numba", "pydantic", "tqdm"}
    assert not names & HEAVY


@pytest.mark.parametrize("extra", ["torch", "jax", "flax", "npu", "plot", "ray", "dev"])
def test_extras_give_ranges_that_admit_the_versions_run_on(extra: str) -> None:
    for line in project()["optional-dependencies"][extra]:
        req = Requirement(line)
        assert not any(spec.operator in ("==", "===", "~=") for spec in req.specifier), line
        for version in RUN_ON.get(req.name, []):
            assert req.specifier.contains(Version(version)), f"{line} excludes {version}, which graphrt ran on"


def test_the_plot_extra_is_matplotlib_and_dev_installs_it() -> None:
    """``graphrt[plot]`` pulls matplotlib (the --plot pictures); CI's dev install has it too."""
    extras = project()["optional-dependencies"]
    assert [Requirement(r).name for r in extras["plot"]] == ["matplotlib"]
    assert "matplotlib" in {Requirement(r).name for r in extras["dev"]}


def test_bootstrap_pins_torch_through_the_constraints_file_only() -> None:
    pins = [Requirement(line) for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert [str(r) for r in pins if r.name == "torch"] == ["torch==2.13.0"]
    makefile = (ROOT / "Makefile").read_text()
    # every venv the Makefile builds (.venv, the engines' under .venv-engines/) installs torch and
    # graphrt's dev set under the constraints
    installs = [line for line in makefile.splitlines()
                if "pip install" in line and ("torch" in line.split() or '".[dev]"' in line)]
    assert len(installs) >= 2 and all("-c constraints.txt" in line for line in installs), installs
    assert "torch==" not in makefile and "torch==" not in (ROOT / "pyproject.toml").read_text()


#: Developer-only tools (issue 44): in the repository's tools/, not in the installed package.
DEV_TOOLS = ("transformers_zoo", "transformers_matrix")


def test_developer_tools_stay_out_of_the_installed_package() -> None:
    """The matrix generator and the zoo live in tools/; no module of src/graphrt is one or
    imports one (an installed graphrt would then fail to import it)."""
    package = ROOT / "src" / "graphrt"
    assert all((ROOT / "tools" / f"{name}.py").is_file() for name in DEV_TOOLS)
    assert not [p for p in package.rglob("*.py") if p.stem in DEV_TOOLS]
    importers = [str(p.relative_to(package)) for p in package.rglob("*.py")
                 if any(f"import {name}" in p.read_text() or f"{name} import" in p.read_text() for name in DEV_TOOLS)]
    assert not importers, importers
