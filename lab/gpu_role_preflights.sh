#!/usr/bin/env bash
# On a real NVIDIA host: run the preflights of the roles that read the GPU driver
# (python_env: which CUDA build of vLLM/PyTorch to install; dcgm_exporter: which DCGM
# packages) in check mode against this host, and record what they decided under OUT_DIR.
# Nothing is installed or changed. Needs ansible-core importable by python3.
# Usage: lab/gpu_role_preflights.sh OUT_DIR [NVIDIA_SMI]
set -uo pipefail
out=${1:?usage: $0 OUT_DIR [NVIDIA_SMI]}
smi=${2:-$(command -v nvidia-smi)}
mkdir -p "$out"
cd "$(dirname "$0")/.."
py=$(command -v python3)
play=$(mktemp --suffix=.yml)
cat > "$play" <<'YAML'
---
- name: Preflights of the roles that read the NVIDIA driver
  hosts: localhost
  gather_facts: true
  roles:
    - role: python_env
    - role: dcgm_exporter
YAML
"$smi" > "$out/nvidia-smi.txt" 2>&1
ANSIBLE_CONFIG=ansible.cfg ANSIBLE_NOCOLOR=1 "$py" -m ansible playbook -i inventory/localhost.yml "$play" \
  --tags preflight --check -e ansible_become=false \
  -e "{\"ansible_python_interpreter\": \"$py\", \"python_env_python\": \"$py\", \"llmhost_profile\": \"gpu\",
       \"python_env_nvidia_smi\": \"$smi\", \"dcgm_exporter_nvidia_smi\": \"$smi\"}" > "$out/role-preflights.txt" 2>&1
echo "exit code: $?" | tee -a "$out/role-preflights.txt"
grep -A4 'Show the packages this host gets\|Show what this host gets\|fatal:' "$out/role-preflights.txt"
tail -3 "$out/role-preflights.txt"
rm -f "$play"
