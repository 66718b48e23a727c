# Every target does the set-up it needs first (idempotent; fast once the cache is warm).
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export OMP_NUM_THREADS ?= 1
COMPRESSION ?= int8

.PHONY: setup demo test test-unit test-parallel doctor convergence clean

setup:
	@bash scripts/setup.sh

demo: setup
	timeout 900 horovodrun -np 2 -H localhost:2 $(PY) examples/torch_digits.py --compression $(COMPRESSION)

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
