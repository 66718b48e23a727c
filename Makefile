# Every target does the set-up it needs first (idempotent; fast once the cache is warm).
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export OMP_NUM_THREADS ?= 1
export TF_CPP_MIN_LOG_LEVEL ?= 2
COMPRESSION ?= int8

.PHONY: setup demo test test-unit test-parallel doctor convergence clean

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

clean:
	rm -rf $(VENV) build *.egg-info
