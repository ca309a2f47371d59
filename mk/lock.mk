# The hash-locked requirements of the serving venv (roles/python_env/files/locks;
# docs/deploying.md): one resolve by uv pip compile --generate-hashes, with the
# indexes of this machine's pip configuration (never written into the lock).
# LOCK_PYTHONS: one lock per Python version (Debian 12: 3.11, Ubuntu 22.04: 3.10,
# Ubuntu 24.04: 3.12); LOCK_PROFILE gpu needs a machine that reaches the CUDA
# builds' indexes and a roles/python_env/files/locks/gpu.in.
LOCK_PROFILE ?= cpu
LOCK_PYTHONS ?= 3.11

.PHONY: lock

lock: setup
	set -e; for v in $(LOCK_PYTHONS); do \
	  $(PY) -m lab.pip_lock --profile $(LOCK_PROFILE) --python-version $$v --uv $(CURDIR)/$(VENV)/bin/uv; \
	done
