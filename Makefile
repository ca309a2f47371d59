# llmhost — the two commands are `make demo` (mk/demo.mk) and `make test`.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PYTHON ?= python3

.PHONY: setup test test-unit test-e2e lint lint-python clean
.DEFAULT_GOAL := help

help:
	@echo "make demo       provision a local systemd container with site.yml and serve the tiny model"
	@echo "make demo-check the OpenAI API against the demo as applications use it (logprobs, tools, embeddings)"
	@echo "make demo-down  stop and remove the demo container"
	@echo "make test       lint, unit, e2e (real tritonserver + vLLM), system (booted host): about an hour"
	@echo "make test-rolling  three booted hosts behind gateways and rolling.yml under load (not in make test)"
	@echo "make setup      create .venv (vLLM CPU, Triton, test tools)"
	@echo "make bench-compare  Triton path, gateway and vLLM's own server (numbers, not a test)"
	@echo "make soak       10 minutes at concurrency 32 (numbers, not a test)"

# The venv: vLLM first, Triton second (they cannot be resolved in one pip call:
# see pyproject.toml), then drop CUDA-only wheels that break imports on CPU.
$(VENV)/.setup-done: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[cpu,test,bench]'
	$(PIP) install -q -e '.[triton]'
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(PY) -c "import vllm, pytriton, tritonclient.grpc, llmhost.backend.model" 
	touch $@

setup: $(VENV)/.setup-done

lint-python: setup
	$(VENV)/bin/ruff check src tests lab roles/llmhost/library

lint: lint-python lint-ansible lint-monitoring

test-unit: setup
	$(VENV)/bin/pytest -q tests/unit tests/records

test-e2e: setup
	$(VENV)/bin/pytest -q tests/e2e

# Every test but the two-host module (`make test-rolling`, past CI's budget): lint, unit,
# Ansible decision tests, monitoring (promtool, dashboards), e2e (real tritonserver +
# vLLM) and system (a booted Debian 12 host provisioned with site.yml). Debian packages
# it needs: prometheus (monitoring-deps); systemd-container and debootstrap (installed
# by tests/harness/rootfs.py).
# Two workers (pytest-xdist): one takes the system tests, the other the e2e tests (each
# one unit of work), then both the other modules (tests/conftest.py); TEST_WORKERS=0
# runs in one process.
# A short base directory: Unix socket paths (vLLM's, the engine sockets) in the tests'
# folders must stay under 108 bytes, and xdist adds popen-gwN/ to every one.
TEST_WORKERS ?= 2
test: setup monitoring-deps lint
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" ANSIBLE_HOME="$(CURDIR)/.cache/ansible" $(VENV)/bin/pytest \
	  -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --basetemp "$$(mktemp -d /tmp/lt.XXXX)" \
	  --durations=40 --tb=short tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

-include mk/*.mk

# Not a test: the Triton path, the gateway in front of it and vLLM's own OpenAI
# server, one at a time, five rotating rounds (about 25 minutes; docs/performance.md);
# prints the median ratios against their goals and writes bench-results/compare.{json,png}.
bench-compare: setup
	$(PY) -m lab.bench_compare --rounds 5 --concurrency 1,16,64 --duration 20

.PHONY: bench-compare

# Not part of `make test`: 10 minutes at concurrency 32, prints errors and RSS growth.
soak: setup
	$(PY) -m tests.harness.soak

.PHONY: soak
