# Every target does the set-up it needs first (idempotent; fast once the cache is warm).
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export OMP_NUM_THREADS ?= 1
export TF_CPP_MIN_LOG_LEVEL ?= 2
COMPRESSION ?= int8

.PHONY: setup demo test test-unit test-parallel doctor convergence bench clean

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
	$(PY) -m pytest -q tests

test-unit: setup
	$(PY) -m pytest -q tests/unit

test-parallel: setup
	$(PY) -m pytest -q tests/parallel

doctor: setup
	$(PY) -m hvdp doctor

convergence: setup
	$(PY) benchmarks/convergence.py

# Not part of `make test`: timing needs a quiet machine. The slow-link stage needs root (netns, tc).
bench: setup
	@command -v tc >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get install -y -qq iproute2 >/dev/null; } || true
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info

# --- Clusters (issue 7); neither target is part of `make test` ---------------------------------
.PHONY: nccl-build rehearsal
HVDP_CACHE  := $(or $(HVDP_CACHE_DIR),$(HOME)/.cache/hvdp)
# The project's torch pin by default (the GPU image's); "===" takes its CUDA build from PyPI
# even where a local "+cpu" build of the same version is on offer.
NCCL_TORCH  ?= $(shell sed -n 's/^torch==\([^ ]*\).*/\1/p' requirements/deps.txt)
NCCL_ENV    := $(HVDP_CACHE)/envs/nccl-torch$(NCCL_TORCH)
NCCL_OUT    := $(HVDP_CACHE)/wheels/nccl-torch$(NCCL_TORCH)

# The GPU image's Horovod build (NCCL ops) compiled and linked without a GPU: a separate venv
# with a CUDA build of torch (the NCCL and CUDA runtime wheels come with it), the toolkit and
# NCCL found by scripts/gpu_env.sh, then the same scripts/build_horovod.sh that `make setup` runs.
# Ends by importing the wheel and asking it whether NCCL is built in.
nccl-build: setup
	@test -x $(NCCL_ENV)/bin/python || python3 -m venv $(NCCL_ENV)
	$(NCCL_ENV)/bin/pip install --quiet "setuptools<81" wheel packaging cloudpickle psutil pyyaml \
	    cffi numpy "torch===$(NCCL_TORCH)" 2>&1 | { grep -v '^WARNING: Location' || true; }
	rm -rf $(NCCL_OUT) && HVDP_FRAMEWORKS=torch HVDP_GPU=1 timeout 5400 \
	    bash scripts/gpu_env.sh $(NCCL_ENV)/bin/python scripts/build_horovod.sh $(NCCL_ENV)/bin/python $(NCCL_OUT)
	$(NCCL_ENV)/bin/pip install --quiet --no-deps --force-reinstall $(NCCL_OUT)/horovod-*.whl
	cd /tmp && $(NCCL_ENV)/bin/python -c 'import horovod.torch as h; assert h.nccl_built(), "no NCCL"; \
	    print("nccl-build OK: horovod.torch nccl_built() =", h.nccl_built(), "cuda_built() =", h.cuda_built())'

# Multi-host launch over real SSH between two loopback host names (root: sshd, /etc/hosts).
# openssh-server is installed here rather than by `make setup`: on a machine with an init
# system the package starts a system sshd on port 22, which a developer set-up should not do.
rehearsal: setup
	@test -x /usr/sbin/sshd || { test "$$(id -u)" -eq 0 \
	    || { echo "make rehearsal: needs openssh-server; as root: apt-get install openssh-server" >&2; exit 1; }; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssh-server >/dev/null; }
	$(PY) -m pytest -q -rs tests/parallel/test_multihost.py
