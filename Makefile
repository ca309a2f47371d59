# llmhost — the two commands are `make demo` (mk/demo.mk) and `make test`.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PYTHON ?= python3

.PHONY: setup test test-fast test-unit test-e2e lint lint-python clean
.DEFAULT_GOAL := help

help:
	@echo "make demo       provision a local systemd container with site.yml and serve the tiny model"
	@echo "make demo-check the OpenAI API against the demo as applications use it (logprobs, tools, embeddings)"
	@echo "make demo-down  stop and remove the demo container"
	@echo "make test       lint, unit, Ansible, monitoring, e2e (real tritonserver + vLLM), system (booted hosts, rolls)"
	@echo "make test-fast  ruff, unit and recorded-run tests: the inner loop, a few minutes"
	@echo "make test-rolling  the two-host module alone: three booted hosts, rolling.yml under load"
	@echo "make setup      create .venv (vLLM CPU, Triton, test tools)"
	@echo "make lock       rewrite the serving venv's hash-locked requirements (mk/lock.mk; LOCKS=\"$(LOCKS)\")"
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

# The linters that need only the venv; lint-monitoring needs the monitoring packages too
# (`make test` runs these while those install).
LINT_VENV := lint-python lint-ansible
lint: $(LINT_VENV) lint-monitoring

test-unit: setup
	$(VENV)/bin/pytest -q tests/unit tests/records

test-e2e: setup
	$(VENV)/bin/pytest -q tests/e2e

# Every test: lint, unit, Ansible decision tests, monitoring (promtool, dashboards), e2e
# (real tritonserver + vLLM) and system (booted Debian 12 hosts provisioned with
# site.yml, the two-host module and its rolls included). Debian packages it needs:
# prometheus (monitoring-deps); systemd-container and debootstrap (installed by
# tests/harness/rootfs.py).
# The booted hosts' root filesystem (debootstrap; the harness is stdlib-only, so the
# system Python runs it) and the monitoring packages are fetched while the venv
# installs: those wait on the network and the disk, the venv on one core.
# Three workers (pytest-xdist): the system tests (the two-host module last) and the e2e
# tests are a unit of work each, one to a worker; the third worker takes the other
# modules from the start, the others after their unit, each worker with a CPU weight of
# its own (tests/conftest.py). TEST_WORKERS=0 runs everything in one process.
# A short base directory: Unix socket paths (vLLM's, the engine sockets) in the tests'
# folders must stay under 108 bytes, and xdist adds popen-gwN/ to every one.
TEST_WORKERS ?= 3
PYTEST_RUN = PATH="$(CURDIR)/$(VENV)/bin:$$PATH" ANSIBLE_HOME="$(CURDIR)/.cache/ansible" $(VENV)/bin/pytest \
	  --basetemp "$$(mktemp -d /tmp/lt.XXXX)" --tb=short
test:
	@mkdir -p .cache; \
	{ $(PYTHON) -m tests.harness rootfs && $(MAKE) --no-print-directory monitoring-deps; } > .cache/test-prerequisites.log 2>&1 & \
	prerequisites=$$!; \
	$(MAKE) --no-print-directory setup $(LINT_VENV) || { wait $$prerequisites; exit 1; }; \
	wait $$prerequisites || { cat .cache/test-prerequisites.log; \
	  echo "make test: the test hosts' root filesystem or the monitoring packages could not be installed"; exit 1; }; \
	$(MAKE) --no-print-directory lint-monitoring
	$(PYTEST_RUN) -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=40 tests

# The inner loop, a few minutes: ruff, the unit tests and the recorded runs, in two workers.
test-fast: setup lint-python
	$(PYTEST_RUN) -q -n 2 tests/unit tests/records

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
