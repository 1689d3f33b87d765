# Two commands on a fresh machine: `make bench` and `make test`. Both bootstrap .venv first.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.graphrt-installed

.PHONY: venv test test-fast bench plan gpu-check clean

venv: $(STAMP)

# constraints.txt pins torch to the CPU build on disk (anything else pulls GBs of CUDA wheels);
# pyproject.toml itself gives ranges, so a user's own torch is never replaced.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --disable-pip-version-check -c constraints.txt torch
	$(VPY) -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev]"
	touch $(STAMP)

# The whole suite (what CI runs). test-fast: the tests not marked slow, with hypothesis' fast
# profile (a fifth of the examples): every module's main behaviour, in under 3 minutes on 2 cores.
# Both on TEST_WORKERS pytest-xdist workers, a file per worker at a time (docs/testing.md); in one
# process where xdist does not import (expanded when the recipe runs, after the venv). On a 2-core
# machine, fresh clone: test 10.8 min (16.6 in one process), test-fast 2.9 min. pytest-timeout
# (pyproject.toml) fails any one test that runs past 900 s.
TEST_WORKERS ?= 2
XDIST = $(shell $(VPY) -c "import xdist" 2>/dev/null && echo "-n $(TEST_WORKERS) --dist loadfile")

test: $(STAMP)
	$(VPY) -m pytest -q $(XDIST)

test-fast: $(STAMP)
	$(VPY) -m pytest -q $(XDIST) -m "not slow" --hypothesis-profile=fast

bench: $(STAMP)
	$(VPY) -m graphrt.cli bench

plan: $(STAMP)
	$(VPY) -m graphrt.cli plan

# On a CUDA machine: the gpu tests and GPU benchmarks with that machine's own torch and JAX
# (no .venv, nothing reinstalled), one report in .gpu-check/. On a CPU: says so, exits 0.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build src/*.egg-info
