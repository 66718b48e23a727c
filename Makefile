# Every target does the set-up it needs first (idempotent; fast once the cache is warm).
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export OMP_NUM_THREADS ?= 1
export TF_CPP_MIN_LOG_LEVEL ?= 2
COMPRESSION ?= int8

.PHONY: setup demo test test-unit test-parallel doctor docs convergence bench clean

setup:
	@bash scripts/setup.sh

# horovodrun tags every write with its rank ("[1,0]<stderr>:"); the tags are stripped so that
# rank 0's progress bar redraws in place. TensorFlow's start-up banner (horovodrun imports TF to
# probe the build) is dropped.
demo: setup
	set -o pipefail; timeout 900 horovodrun -np 2 -H localhost:2 $(PY) examples/torch_digits.py \
	    --compression $(COMPRESSION) 2>&1 | sed -u -e 's/\[[0-9,]*\]<std[a-z]*>://g' \
	    -e '/^WARNING: All log messages before absl/d' -e '/^I0000 .*port.cc/d'

test: setup
	$(VENV)/bin/ruff check --quiet .
	@$(MKDOCS_BUILD)
	$(PY) -m pytest -q --durations=25 tests

# ruff's rules and line length: pyproject.toml [tool.ruff]; also the first step of `make test`
.PHONY: lint
lint: setup
	$(VENV)/bin/ruff check --quiet .

test-unit: setup
	$(PY) -m pytest -q tests/unit

test-parallel: setup
	$(PY) -m pytest -q tests/parallel

doctor: setup
	$(PY) -m hvdp doctor

# The pages of docs/ (mkdocs.yml) into build/site; any warning (a broken link or anchor) fails.
# Not --quiet: with it mkdocs 1.6 drops warnings before strict mode counts them (mkdocs issue
# #4126), so a broken link would pass; the INFO lines are filtered out instead.
MKDOCS_BUILD = set -o pipefail; NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d build/site 2>&1 \
    | { grep -v '^INFO ' || true; }
docs: setup
	@$(MKDOCS_BUILD)

# CNN + GPT, 2 workers, 3 seeds, 8 codec settings (benchmarks/results/convergence.{json,png});
# ~33 CPU-minutes (about 17 min on two idle cores, estimated; 24 min per seed on the loaded
# machine, seeds in parallel); also a stage of `make bench`
convergence: setup
	$(PY) benchmarks/convergence.py

# Not part of `make test`: timing needs a quiet machine. The slow-link stage needs root (netns, tc).
bench: setup
	@command -v tc >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get install -y -qq iproute2 >/dev/null; } || true
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info

# --- Clusters and other environments; none of these targets is part of `make test` ---------------
.PHONY: nccl-build gpu-check compat rehearsal
HVDP_CACHE  := $(or $(HVDP_CACHE_DIR),$(HOME)/.cache/hvdp)
# The project's torch pin by default (the GPU image's); "===" takes its CUDA build from PyPI
# even where a local "+cpu" build of the same version is on offer.
NCCL_TORCH  ?= $(shell sed -n 's/^torch==\([^ ]*\).*/\1/p' requirements/deps.txt)
NCCL_ENV    := $(HVDP_CACHE)/envs/nccl-torch$(NCCL_TORCH)

# The GPU image's Horovod build (NCCL ops) compiled and linked without a GPU: a separate venv
# with a CUDA build of torch (the NCCL and CUDA runtime wheels come with it), then the one recipe,
# `python -m hvdp install-horovod --gpu` (it finds the toolkit and the NCCL wheel). Ends by
# asking the installed Horovod whether NCCL is built in.
nccl-build: setup
	@test -x $(NCCL_ENV)/bin/python || python3 -m venv $(NCCL_ENV)
	$(NCCL_ENV)/bin/pip install --quiet "setuptools<81" wheel packaging cloudpickle psutil pyyaml \
	    cffi numpy "torch===$(NCCL_TORCH)" 2>&1 | { grep -v '^WARNING: Location' || true; }
	PYTHONPATH=$(CURDIR) timeout 5400 $(NCCL_ENV)/bin/python -m hvdp install-horovod --gpu \
	    --cache-dir $(HVDP_CACHE)/wheels
	cd /tmp && $(NCCL_ENV)/bin/python -c 'import horovod.torch as h; assert h.nccl_built(), "no NCCL"; \
	    print("nccl-build OK: horovod.torch nccl_built() =", h.nccl_built(), "cuda_built() =", h.cuda_built())'

# On a GPU machine, in its own environment (GPU_PYTHON: the interpreter whose CUDA torch to use):
# hvdp installed there, Horovod built for that torch with NCCL, then examples/gpu_check.py.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) -m pip install --quiet --no-deps --no-build-isolation $(CURDIR)
	cd /tmp && $(GPU_PYTHON) -m hvdp install-horovod --gpu --cache-dir $(HVDP_CACHE)/wheels
	cd /tmp && $(GPU_PYTHON) $(CURDIR)/examples/gpu_check.py

# Horovod and hvdp's torch checks against a newer torch than the pin: a fresh venv with
# COMPAT_TORCH (2.14.1: a CUDA 13 build that runs on CPU), Horovod from install-horovod --cpu
# (C++20 for torch >= 2.14), then the torch parallel checks over Gloo and MPI in that venv.
COMPAT_TORCH ?= 2.14.1
COMPAT_ENV   := $(HVDP_CACHE)/envs/compat-torch$(COMPAT_TORCH)
compat: setup
	@test -x $(COMPAT_ENV)/bin/python || python3 -m venv $(COMPAT_ENV)
	$(COMPAT_ENV)/bin/pip install --quiet "torch==$(COMPAT_TORCH)" numpy pytest pytest-timeout \
	    2>&1 | { grep -v '^WARNING: Location' || true; }
	$(COMPAT_ENV)/bin/pip install --quiet --no-deps --no-build-isolation $(CURDIR)
	cd /tmp && timeout 3600 $(COMPAT_ENV)/bin/python -m hvdp install-horovod --cpu \
	    --cache-dir $(HVDP_CACHE)/wheels
	cd /tmp && $(COMPAT_ENV)/bin/python -c 'import torch, horovod, hvdp; \
	    print("compat: torch", torch.__version__, "| horovod", horovod.__version__, "| hvdp from", hvdp.__file__)'
	$(COMPAT_ENV)/bin/python -m pytest -q -p no:cacheprovider tests/parallel/test_torch_parallel.py

# Multi-host launch over real SSH between two loopback host names (root: sshd, /etc/hosts).
# openssh-server is installed here rather than by `make setup`: on a machine with an init
# system the package starts a system sshd on port 22, which a developer set-up should not do.
rehearsal: setup
	@test -x /usr/sbin/sshd || { test "$$(id -u)" -eq 0 \
	    || { echo "make rehearsal: needs openssh-server; as root: apt-get install openssh-server" >&2; exit 1; }; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssh-server >/dev/null; }
	$(PY) -m pytest -q -rs tests/parallel/test_multihost.py

# Ray Train's TorchTrainer (2 workers, int8) on a local two-node Ray cluster, against horovodrun
# (tests/parallel/test_ray.py, also part of `make test`; about 2 min), alone. `make setup` installs
# ray[train] into the environment.
.PHONY: ray-check
ray-check: setup
	$(PY) -m pytest -q -rs -s tests/parallel/test_ray.py

# Spark's TorchDistributor (local mode, 2 processes, int8) against horovodrun
# (tests/parallel/test_spark.py; about 1.5 min). Not part of `make setup` (pyspark ~320 MB and a
# JVM): this target installs pyspark into the .venv and, as root, Debian's default-jre-headless.
.PHONY: spark-check
PYSPARK_VERSION ?= 4.3.0
spark-check: setup
	@command -v java >/dev/null || { test "$$(id -u)" -eq 0 \
	    || { echo "make spark-check: needs Java; as root: apt-get install default-jre-headless" >&2; exit 1; }; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends default-jre-headless >/dev/null; }
	@$(PY) -c 'import pyspark' 2>/dev/null || $(PY) -m pip install --quiet "pyspark==$(PYSPARK_VERSION)" \
	    2>&1 | { grep -v '^WARNING: Location' || true; }
	$(PY) -m pytest -q -rs -s tests/parallel/test_spark.py
