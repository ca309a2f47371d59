#!/usr/bin/env bash
# Verify llmhost's GPU layer on a real NVIDIA host and record what it saw under OUT_DIR:
#   - nvidia-smi outputs and `llmhost gpu-info` (driver/CUDA detection + vLLM/PyTorch match);
#   - the bundled tritonserver (nvidia-pytriton) started with GPU metrics: its nv_gpu_* series;
#   - the nvidia_driver role's plan in check mode against the real PCI bus (if ansible is there).
# Usage: lab/gpu_verify.sh OUT_DIR   (python3 must import pytriton; ansible optional)
set -uo pipefail
out=${1:?usage: $0 OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
date -u +%Y-%m-%dT%H:%M:%SZ > "$out/date.txt"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,compute_cap --format=csv > "$out/query.csv" 2>&1
python3 src/llmhost/cuda.py > "$out/gpu-info.json"; echo "gpu-info exit code: $?" | tee "$out/gpu-info.rc"
cat "$out/gpu-info.json"

site=$(python3 -c 'import importlib.util, pathlib; s = importlib.util.find_spec("pytriton"); print(pathlib.Path(s.origin).parents[1])')
ts="$site/pytriton/tritonserver"
repo=$(mktemp -d)
LD_LIBRARY_PATH="$site/nvidia_pytriton.libs:${LD_LIBRARY_PATH:-}" "$ts/bin/tritonserver" \
  --model-repository="$repo" --backend-directory="$ts/backends" --strict-readiness=false \
  --http-address=127.0.0.1 --http-port=18900 --grpc-address=127.0.0.1 --grpc-port=18901 \
  --metrics-address=127.0.0.1 --metrics-port=18902 --allow-gpu-metrics=true --metrics-interval-ms=1000 \
  > "$out/tritonserver.log" 2>&1 &
pid=$!
for _ in $(seq 1 60); do curl -sf 127.0.0.1:18900/v2/health/live >/dev/null && break; sleep 1; done
sleep 3
curl -s 127.0.0.1:18900/v2 > "$out/triton-v2.json"
curl -s 127.0.0.1:18902/metrics > "$out/triton-metrics.txt"
grep -c '^nv_gpu' "$out/triton-metrics.txt" | sed 's/^/nv_gpu series: /' | tee "$out/nv_gpu-count.txt"
grep '^nv_gpu\|^nv_energy' "$out/triton-metrics.txt"

if command -v ansible-playbook >/dev/null 2>&1 || python3 -c 'import ansible' 2>/dev/null; then
  ANSIBLE_CONFIG=ansible.cfg python3 -m ansible playbook -i inventory/localhost.yml playbooks/gpu.yml --check \
    -e "ansible_python_interpreter=$(command -v python3)" -e ansible_become=false \
    -e '{"llmhost_profile": "gpu", "nvidia_driver_allow_reboot": false}' > "$out/gpu-role-check.txt" 2>&1
  echo "gpu role check exit code: $?" | tee -a "$out/gpu-role-check.txt"
  tail -40 "$out/gpu-role-check.txt"
fi
echo "tritonserver pid $pid left running for further checks"
