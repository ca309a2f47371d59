"""The repeatable GPU check: the serving path under KIND_GPU and KIND_MODEL, recorded.

Run on a GPU host whose python3 imports vLLM, nvidia-pytriton and llmhost (the device
kit: ../shared/gpu-kit). It generates a model (default: Qwen3-0.6B's shape with the tiny
model's 4096-token vocabulary, random bf16 weights, 445M parameters; `--model tiny` for
the 3.4M-parameter tiny model) and serves it twice:

* KIND_GPU: `llmhost serve --device gpu` (what a developer runs; serve renders
  config.pbtxt with instance_group kind KIND_GPU and supervises tritonserver);
* KIND_MODEL: what the Ansible roles deploy. `llmhost serve` has no kind option, so the
  model directory is rendered from the package templates with the context of
  roles/model_repository (`_model_repository_context`: kind KIND_MODEL on profile gpu,
  the profile's engine_args `{}` plus served_model_name and max_model_len, the roles'
  default_max_tokens, max_n and drain timeout), and tritonserver is started with the
  flags of systemd/tritonserver.service.j2 and the variables of tritonserver.env.j2 (over
  this process's environment, which holds the GPU machine's driver paths) and stopped
  as the unit's ExecStop does: the pid into LLMHOST_STOP_FILE, SIGTERM to tritonserver
  alone, wait. Anything still alive after that is recorded as left behind, then killed
  (systemd's KillMode=control-group would). Not reproduced: the unit's user, its
  hardening and its cgroup (the GPU machine has no systemd).

For each kind, in order: the instance group Triton loaded (GET .../config with the
admin key); `llmhost smoke`; the bad-input checks (seed beyond 2^63-1, JSON nested
100,000 deep, an invalid regex: HTTP 400 naming the input, no traceback or path,
counted as invalid_request and not engine_error); structured output (json_schema,
regex and choice through the backend's sampling parameters: the answer parses and
matches); cancellation (streams closed by the client mid-way: vLLM's
num_requests_running back to 0 on Triton's /metrics, request_cancelled_total up by
as many); Triton's GPU metrics (nv_gpu_utilization and nv_gpu_memory_used_bytes for
the GPU's uuid); stop by SIGTERM (no process, no /dev/shm segment, the GPU's memory
given back).

Tensor parallel (`--tensor-parallel-size N`, N > 1): KIND_MODEL only
(one engine spans N GPUs; the roles' default kind on profile gpu, and what `llmhost
placement` requires), the model entry carrying engine_args tensor_parallel_size N as
an inventory sets it. The host must have N GPUs. One more verdict, "tensor_parallel":
vLLM's engine config in the log says tensor_parallel_size=N and the memory of each of
the first N GPUs rose by more than a GiB while serving. NVLink multicast stays off
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 unless set).

Usage: python3 -m lab.gpu_check OUT_DIR [--model qwen3|tiny] [--kinds KIND_GPU,KIND_MODEL]
       [--tensor-parallel-size N]
Writes OUT_DIR/result.json (per kind: the numbers and each check's verdict under
"passed"), serve-kind_gpu.log, serve-kind_model.log, smoke-kind_*.json and
nvidia-smi.txt: few files, as the lent GPU machine returns at most 8. The work
directories (model repository, caches) go under --work (default /tmp/gpu-check-work).
Exit status 0 only if every check passed under every kind. The H100 run of 2026-11-24 is
in tests/fixtures/gpu/h100-580.159.04-real/device-run-2026-11-24-check/ (its test:
tests/records/test_h100_serving_checks.py; its logic without a GPU:
tests/unit/test_gpu_check.py; the TP mode's: tests/unit/test_tensor_parallel.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from lab.gpucheck.lifecycle import GRPC, HTTP, METRICS, URL, alive, http, log, tree, wait
from lab.gpucheck.model import MAX_MODEL_LEN, make_in_child

NAME = "llm"
METRICS_URL = f"http://127.0.0.1:{METRICS}"
KIND_GPU, KIND_MODEL = "KIND_GPU", "KIND_MODEL"
LEAKS = ("Traceback", 'File "', "/site-packages/", ".py")
# roles/model_repository/defaults and group_vars: what the roles render for a model
# that sets none of these itself (profile gpu).
ROLE_DEFAULTS = {"default_max_tokens": 512, "max_n": 8, "drain_timeout_s": 30}
ROLE_ENGINE_ARGS_GPU: dict[str, Any] = {}
# The JSON schema of tests/e2e/test_generate.py: bounded by construction.
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M"]}},
          "required": ["ok", "size"], "additionalProperties": False}
REGEX = "[0-9]{3}-[a-z]{2}"
CHOICES = ["red", "green", "blue"]
PROMPT = "def fibonacci(n):"
CANCEL_STREAMS, CANCEL_TOKENS = 4, 4000
# A GPU counts as used by the engine when its memory rose by more than this while serving.
ENGINE_GPU_MIB = 1024
# Multi-GPU machines shared with others: NVLink multicast must stay off (KINDS.md).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# The unit's environment as recorded: what steers CUDA, NCCL, vLLM and the backend (no secrets).
SHOWN_ENV = ("CUDA_", "NCCL_", "NVSHMEM_", "TORCH_SYMM_", "VLLM_", "HF_", "LLMHOST_", "HOME", "TMPDIR")


# --- the two ways of serving ------------------------------------------------------------

def placed_entries(model: Path, wanted: list[dict[str, Any]], gpu_count: int) -> list[dict[str, Any]]:
    """The roles' entries for several models of one host: each is roles_model_entry's under
    its own name, with the kind and GPUs the placement rule gives it (the filter
    llmhost_placement in roles/model_repository/vars: `gpus` written only where the
    inventory pinned them). WANTED holds the inventory's name, kind and gpus per model."""
    from llmhost.server.placement import plan

    entries = []
    for placed in plan(wanted, gpu_count):
        entry = roles_model_entry(model)
        entry.update(name=placed.name, kind=placed.kind)
        entry["engine_args"] = {**entry["engine_args"], "served_model_name": placed.name}
        if placed.pinned:
            entry["gpus"] = list(placed.gpus)
        entries.append(entry)
    return entries


def shown_environment(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(env.items()) if k.startswith(SHOWN_ENV)}


def roles_model_entry(model: Path, tensor_parallel_size: int = 1) -> dict[str, Any]:
    """The `model` roles/model_repository renders config.pbtxt.j2 and model.json.j2 with
    (its _model_repository_context) on profile gpu, for an entry that sets only name,
    path and max_model_len (and, for tensor parallel, engine_args tensor_parallel_size,
    which the role merges over its own engine arguments)."""
    engine = dict(ROLE_ENGINE_ARGS_GPU)
    engine.update({"served_model_name": NAME, "max_model_len": MAX_MODEL_LEN})
    if tensor_parallel_size > 1:
        engine["tensor_parallel_size"] = tensor_parallel_size
    return {"name": NAME, "path": str(model.resolve()), "kind": KIND_MODEL, "instance_count": 1,
            **ROLE_DEFAULTS, "engine_args": engine, "settings": {}, "max_model_len": MAX_MODEL_LEN}


def unit_environment(state: Path, triton: Any) -> dict[str, str]:
    """tritonserver.env.j2 (profile gpu) over this process's environment."""
    from llmhost.server.layout import python_libdir
    from llmhost.server.stopfile import STOP_FILE_ENV, STOP_FILE_NAME

    env = dict(os.environ)
    env.update({
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin:/usr/bin:/bin"]),
        "LD_LIBRARY_PATH": os.pathsep.join(p for p in (python_libdir(), str(triton.libs or ""),
                                                       os.environ.get("LD_LIBRARY_PATH", "")) if p),
        "HOME": str(state), "TMPDIR": str(state / "tmp"), "HF_HOME": str(state / "huggingface"),
        "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CACHE_ROOT": str(state / "vllm-cache"),
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        STOP_FILE_ENV: str(state / "run" / STOP_FILE_NAME),  # the unit's %t/tritonserver/stopping
    })
    return env


def unit_command(triton: Any, repo: Path, backends: Path, key: str) -> list[str]:
    """The unit's ExecStart with the roles' defaults (profile gpu; exit timeout: the drain
    + 30 s), from the template the unit renders (llmhost/server/templates/tritonserver.args.j2)."""
    from llmhost.server.admin_key import restriction
    from llmhost.server.serve import tritonserver_argv

    return tritonserver_argv(server=str(triton.server), model_repository=str(repo), backend_directory=str(backends),
                             address="127.0.0.1", http_port=HTTP, grpc_port=GRPC, metrics_address="127.0.0.1",
                             metrics_port=METRICS, gpu_metrics=True,
                             exit_timeout_s=ROLE_DEFAULTS["drain_timeout_s"] + 30, restriction=restriction(key),
                             exit_on_error=False, log_verbose=0, extra_args=[])


class Server:
    """One serving of the model under KIND; start(), then stop() (SIGTERM) records what is left."""

    def __init__(self, kind: str, model: Path, work: Path, logfile: Path, tensor_parallel_size: int = 1,
                 entries: list[dict[str, Any]] | None = None, label: str = "") -> None:
        """ENTRIES (KIND_MODEL's way only): the roles' entries of several models (placed_entries)
        instead of the one model NAME; LABEL names the work directory (default: the kind)."""
        self.kind, self.model, self.work, self.logfile = kind, model, work / (label or kind.lower()), logfile
        self.tp = tensor_parallel_size
        self.entries = entries or [roles_model_entry(model, tensor_parallel_size)]
        self.proc: subprocess.Popen[bytes] | None = None
        self.key = ""
        self.how = ""
        self.rendered_kind = ""
        self.argv: list[str] = []
        self.env: dict[str, str] = {}

    def start(self) -> None:
        from llmhost.server.admin_key import ensure_key_file, read_key

        if self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True)
        out = self.logfile.open("ab")
        if self.kind == KIND_GPU:
            cmd = [sys.executable, "-m", "llmhost.cli", "serve", "--device", "gpu", "--kind", "KIND_GPU",
                   "--model", str(self.model),
                   "--name", NAME, "--http-port", str(HTTP), "--grpc-port", str(GRPC),
                   "--metrics-port", str(METRICS), "--max-model-len", str(MAX_MODEL_LEN), "--workdir", str(self.work)]
            self.how = "llmhost serve --device gpu"
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            key_file = self.work / "admin-key"
            wait(key_file.exists, 60, 0.2)
        else:
            from llmhost.server.layout import TritonInstall, make_backend_dir, make_model_dir

            triton = TritonInstall.from_pytriton()
            make_backend_dir(self.work / "backends", triton)
            for entry in self.entries:
                make_model_dir(self.work / "models", entry)
            for d in ("tmp", "huggingface", "run"):
                (self.work / d).mkdir()
            key_file = self.work / "admin-key.env"
            ensure_key_file(key_file)
            cmd = unit_command(triton, self.work / "models", self.work / "backends", read_key(key_file))
            self.how = "tritonserver with the roles' model repository, the unit's flags and environment"
            self.env = unit_environment(self.work, triton)
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=self.work,
                                         env=self.env, start_new_session=True)
        self.argv = cmd
        self.key = read_key(key_file)
        config = (self.work / "models" / self.entries[0]["name"] / "config.pbtxt").read_text()
        m = re.search(r"kind:\s*(KIND_\w+)", config)
        self.rendered_kind = m.group(1) if m else ""

    def stop(self, shm_before: set[str]) -> dict[str, Any]:
        """SIGTERM as serve's user or the unit's ExecStop would; what is left afterwards."""
        assert self.proc is not None
        from llmhost.server.stopfile import announce_stop

        if self.kind == KIND_MODEL:
            announce_stop(self.work / "run" / "stopping", self.proc.pid)
        return sigterm_alone(self.proc, shm_before)


def sigterm_alone(proc: subprocess.Popen[bytes], shm_before: set[str]) -> dict[str, Any]:
    """SIGTERM to PROC alone (not its group), its exit awaited: how long it took and which
    of its descendants, /dev/shm segments and GPU memory outlived it. The processes left
    are then killed (systemd's KillMode=control-group; serve's reaper)."""
    kids = [pid for pid, _ in tree(proc.pid)]
    t0 = time.monotonic()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        rc: int | None = proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        rc = None
    took = time.monotonic() - t0
    time.sleep(2)
    left = alive(kids + ([proc.pid] if rc is None else []))
    res = {"rc": rc, "seconds": round(took, 1), "processes": len(kids), "processes_left": left,
           "shm_left": sorted(set(os.listdir("/dev/shm")) - shm_before)}
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return res


# --- the checks -----------------------------------------------------------------------

def ready() -> int:
    return http("GET", f"/v2/models/{NAME}/ready", timeout=3)[0]


def metrics_text() -> str:
    status, text = http("GET", "/metrics", base=METRICS_URL)
    return text if status == 200 else ""


def metric_sum(text: str, name: str, *labels: str) -> float:
    """Sum of NAME's samples carrying every one of LABELS (e.g. 'reason="engine_error"')."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(label in line for label in labels):
                total += float(line.rsplit(" ", 1)[1])
    return total


def metric(name: str, *labels: str) -> float:
    return metric_sum(metrics_text(), name, f'model="{NAME}"', *labels)


def loaded_config(key: str, name: str = NAME, base: str = URL) -> dict[str, Any]:
    """The instance groups of the model config Triton loaded (read with the admin key)."""
    from llmhost.server.admin_key import HEADER

    status, text = http("GET", f"/v2/models/{name}/config", headers={HEADER: key}, base=base)
    if status != 200:
        return {"status": status, "body": text[:300]}
    groups = json.loads(text).get("instance_group", [])
    return {"status": status, "instance_group": [{k: g.get(k) for k in ("kind", "count", "gpus")} for g in groups]}


def smoke(out: Path, name: str, http_port: int = HTTP, model: str = NAME) -> dict[str, Any]:
    """`llmhost smoke` against the server on HTTP_PORT (gRPC and metrics on the next two
    ports, as serve and the unit place them), into OUT/NAME.json."""
    cmd = [sys.executable, "-m", "llmhost.cli", "smoke", "--url", f"http://127.0.0.1:{http_port}",
           "--grpc-url", f"127.0.0.1:{http_port + 1}", "--metrics-url", f"http://127.0.0.1:{http_port + 2}",
           "--model", model, "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    (out / f"{name}.json").write_text(proc.stdout + proc.stderr)
    try:
        checks = json.loads(proc.stdout)["checks"]
    except (ValueError, KeyError):
        checks = []
    return {"rc": proc.returncode, "checks": {c["name"]: c["ok"] for c in checks}}


def bad_input() -> dict[str, Any]:
    before = (metric("vllm:request_failed_total", 'reason="engine_error"'),
              metric("vllm:request_failed_total", 'reason="invalid_request"'))
    cases = {
        "seed": ({"text_input": "hi", "max_tokens": 4, "seed": 2**64}, "'seed'"),
        "deep_json": ({"text_input": "hi", "sampling_parameters": "[" * 100000 + "]" * 100000},
                      "'sampling_parameters'"),
        "invalid_regex": ({"text_input": "hi", "max_tokens": 4, "regex": "(unclosed"}, "regex"),
    }
    res: dict[str, Any] = {}
    for name, (body, word) in cases.items():
        status, text = http("POST", f"/v2/models/{NAME}/generate", body)
        res[name] = {"status": status, "body": text[:300], "names_input": word in text,
                     "leaks": any(s in text for s in LEAKS)}
    time.sleep(2.5)  # the backend pushes its metrics once a second
    res["engine_error_delta"] = metric("vllm:request_failed_total", 'reason="engine_error"') - before[0]
    res["invalid_request_delta"] = metric("vllm:request_failed_total", 'reason="invalid_request"') - before[1]
    return res


def generate(params: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    body = {"text_input": PROMPT, "max_tokens": max_tokens, "exclude_input_in_output": True,
            "return_finish_reason": True, "return_num_output_tokens": True, **params}
    status, text = http("POST", f"/v2/models/{NAME}/generate", body, timeout=120)
    try:
        data = json.loads(text)
    except ValueError:
        data = {"error": text[:300]}
    return {"status": status, "text": data.get("text_output"), "finish_reason": data.get("finish_reason"),
            "tokens": data.get("num_output_tokens"), "error": data.get("error")}


def schema_ok(text: str | None) -> bool:
    try:
        value = json.loads(text or "")
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"ok", "size"} and isinstance(value["ok"], bool)
            and value["size"] in ("S", "M"))


def structured() -> dict[str, Any]:
    res: dict[str, Any] = {}
    # Random weights: sampled (fixed seeds) so that no single greedy path of optional
    # whitespace decides; every answer that stopped must parse.
    attempts = []
    for seed in (0, 1, 2):
        r = generate({"sampling_parameters": json.dumps({"temperature": 1.0, "seed": seed, "json_schema": SCHEMA})},
                     256)
        r["matches"] = schema_ok(r["text"])
        attempts.append(r)
        if r["matches"]:
            break
    res["json_schema"] = {"attempts": attempts, "ok": attempts[-1]["matches"] and all(
        a["matches"] for a in attempts if a["finish_reason"] == "stop")}
    r = generate({"regex": REGEX, "temperature": 0}, 16)
    r["matches"] = bool(re.fullmatch(REGEX, r["text"] or ""))
    res["regex"] = {**r, "pattern": REGEX, "ok": r["matches"]}
    r = generate({"choice": json.dumps(CHOICES), "temperature": 0}, 8)
    res["choice"] = {**r, "ok": r["text"] in CHOICES}
    return res


def stream_tokens(outcome: dict[str, Any], close: threading.Event, url: str = URL, max_tokens: int = CANCEL_TOKENS,
                  started: threading.Event | None = None, model: str = NAME) -> None:
    """One stream of MAX_TOKENS (ignore_eos) from MODEL's HTTP generate_stream on Triton at
    URL: its tokens and error into OUTCOME; closed by the client once CLOSE is set. STARTED
    is set at the first event (and when the stream ends, whatever happened)."""
    body = json.dumps({"text_input": "def main():", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                       "return_num_output_tokens": True}).encode()
    req = urllib.request.Request(f"{url}/v2/models/{model}/generate_stream", data=body, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if line.startswith("data:"):
                    event = json.loads(line[5:])
                    if "error" in event:
                        outcome["error"] = event["error"]
                        break
                    # Each response counts its own tokens.
                    outcome["tokens"] = (outcome.get("tokens") or 0) + int(event.get("num_output_tokens") or 0)
                    if started is not None:
                        started.set()
                if close.is_set():
                    break  # leaving the with block closes the connection mid-stream
    except urllib.error.HTTPError as exc:  # an error before the first token: Triton answers it as the status
        text = exc.read().decode(errors="replace")
        try:
            outcome["error"] = f"HTTP {exc.code}: {json.loads(text)['error']}"
        except (ValueError, KeyError, TypeError):
            outcome["error"] = f"HTTP {exc.code}: {text[:300]}"
    except OSError as exc:
        outcome["error"] = f"{type(exc).__name__}: {exc}"
    outcome["closed_at"] = time.monotonic()
    if started is not None:
        started.set()


def cancellation() -> dict[str, Any]:
    cancelled = metric("vllm:request_cancelled_total")
    outcomes: list[dict[str, Any]] = [{} for _ in range(CANCEL_STREAMS)]
    close = threading.Event()
    threads = [threading.Thread(target=stream_tokens, args=(o, close), daemon=True) for o in outcomes]
    for t in threads:
        t.start()
    peak = 0.0
    deadline = time.monotonic() + 6  # the gauge is pushed once a second; the streams last far longer
    while time.monotonic() < deadline and peak < CANCEL_STREAMS:
        peak = max(peak, metric("vllm:num_requests_running"))
        time.sleep(0.2)
    close.set()
    t_close = time.monotonic()
    for t in threads:
        t.join(30)
    back = wait(lambda: metric("vllm:num_requests_running") == 0, 30, 0.2)
    zero_after = None if back is None else round(time.monotonic() - t_close, 2)
    counted = wait(lambda: metric("vllm:request_cancelled_total") >= cancelled + CANCEL_STREAMS, 30, 0.2)
    time.sleep(1.5)
    return {"streams": CANCEL_STREAMS, "max_tokens": CANCEL_TOKENS, "running_seen": peak,
            "tokens_when_closed": [o.get("tokens") for o in outcomes],
            "errors": [o["error"] for o in outcomes if "error" in o],
            "running_zero_after_close_s": zero_after,
            "running_after": metric("vllm:num_requests_running"),
            "cancelled_delta": metric("vllm:request_cancelled_total") - cancelled,
            "cancelled_counted": counted is not None}


def gpu_metrics(uuids: list[str]) -> dict[str, Any]:
    text = metrics_text()
    found: dict[str, Any] = {}
    for name in ("nv_gpu_utilization", "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes",
                 "nv_gpu_power_usage"):
        for line in text.splitlines():
            m = re.match(rf'{name}\{{gpu_uuid="([^"]+)"\}} (\S+)$', line)
            if m:
                found.setdefault(name, {})[m.group(1)] = float(m.group(2))
    return {"series": found, "uuids": uuids,
            "every_gpu": all(u in found.get(n, {}) for u in uuids
                             for n in ("nv_gpu_utilization", "nv_gpu_memory_used_bytes"))}


def nvidia_smi(query: str) -> list[str]:
    p = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"], capture_output=True,
                       text=True)
    return [line.strip() for line in p.stdout.splitlines() if line.strip()]


def engine_tensor_parallel_size(log_text: str) -> int | None:
    """tensor_parallel_size of the last engine vLLM started, from its config line in the log."""
    found = re.findall(r"Initializing a V1 LLM engine .*?tensor_parallel_size=(\d+)", log_text)
    return int(found[-1]) if found else None


def engine_gpus(before_mib: list[int], serving_mib: list[int]) -> list[int]:
    """The GPUs (nvidia-smi's order) whose memory rose by more than ENGINE_GPU_MIB while serving."""
    return [i for i, (b, s) in enumerate(zip(before_mib, serving_mib, strict=True)) if s - b > ENGINE_GPU_MIB]


def check_kind(kind: str, model: Path, work: Path, out: Path, uuids: list[str],
               tensor_parallel_size: int = 1) -> dict[str, Any]:
    res: dict[str, Any] = {"tensor_parallel_size": tensor_parallel_size}
    shm_before = set(os.listdir("/dev/shm"))
    res["gpu_memory_used_mib_before"] = [int(x) for x in nvidia_smi("gpu=memory.used")]
    logfile = out / f"serve-{kind.lower()}.log"
    server = Server(kind, model, work, logfile, tensor_parallel_size)
    t0 = time.monotonic()
    try:
        server.start()
        res["how"], res["rendered_kind"] = server.how, server.rendered_kind
        res["command"], res["environment"] = server.argv, shown_environment(server.env)
        up = wait(lambda: ready() == 200 or (server.proc is not None and server.proc.poll() is not None), 300, 1.0)
        res["ready_s"] = round(time.monotonic() - t0, 1) if up is not None and ready() == 200 else None
        log(f"{kind}: ready after {res['ready_s']} s ({server.how})")
        if res["ready_s"] is not None:
            res["loaded_config"] = loaded_config(server.key)
            res["smoke"] = smoke(out, f"smoke-{kind.lower()}")
            log(f"{kind}: smoke {res['smoke']}")
            res["bad_input"] = bad_input()
            log(f"{kind}: bad input {json.dumps(res['bad_input'])[:800]}")
            res["structured"] = structured()
            log(f"{kind}: structured {json.dumps(res['structured'])[:800]}")
            res["cancellation"] = cancellation()
            log(f"{kind}: cancellation {res['cancellation']}")
            res["gpu_metrics"] = gpu_metrics(uuids)
            log(f"{kind}: gpu metrics {res['gpu_metrics']}")
            res["gpu_memory_used_mib_serving"] = [int(x) for x in nvidia_smi("gpu=memory.used")]
            res["engine_gpus"] = engine_gpus(res["gpu_memory_used_mib_before"], res["gpu_memory_used_mib_serving"])
            res["engine_tensor_parallel_size"] = engine_tensor_parallel_size(
                logfile.read_text(errors="replace") if logfile.exists() else "")
            log(f"{kind}: engine on GPUs {res['engine_gpus']}, "
                f"tensor_parallel_size {res['engine_tensor_parallel_size']}")
    except Exception as exc:  # noqa: BLE001 - recorded; the stop below still runs
        res["exception"] = f"{type(exc).__name__}: {exc}"
        log(f"{kind}: {res['exception']}")
    finally:
        if server.proc is not None:
            res["stop"] = server.stop(shm_before)
            res["stop"]["gpu_memory_used_mib_after"] = [int(x) for x in nvidia_smi("gpu=memory.used")]
            res["stop"]["compute_apps_after"] = nvidia_smi("compute-apps=pid,used_memory")
            log(f"{kind}: stop {res['stop']}")
    res["passed"] = passed(res)
    return res


def passed(res: dict[str, Any]) -> dict[str, bool]:
    """Each check's verdict (tests/records re-checks the recorded numbers themselves)."""
    want = res.get("rendered_kind")
    bad = res.get("bad_input", {})
    st = res.get("structured", {})
    cancel = res.get("cancellation", {})
    stop = res.get("stop", {})
    groups = res.get("loaded_config", {}).get("instance_group", [])
    tp = res.get("tensor_parallel_size", 1)
    extra = {} if tp == 1 else {
        "tensor_parallel": res.get("engine_tensor_parallel_size") == tp
        and set(range(tp)) <= set(res.get("engine_gpus", [])),
    }
    return {
        "served": res.get("ready_s") is not None and bool(groups) and all(g["kind"] == want for g in groups),
        "smoke": res.get("smoke", {}).get("rc") == 0,
        "bad_input": all(bad.get(n, {}).get("status") == 400 and bad[n]["names_input"] and not bad[n]["leaks"]
                         for n in ("seed", "deep_json", "invalid_regex"))
        and bad.get("engine_error_delta") == 0 and bad.get("invalid_request_delta") == 3,
        "structured": all(st.get(k, {}).get("ok") for k in ("json_schema", "regex", "choice")),
        "cancellation": cancel.get("running_seen", 0) >= 1 and cancel.get("running_after") == 0
        and cancel.get("cancelled_delta") == CANCEL_STREAMS and not cancel.get("errors")
        and all(t is not None and t < CANCEL_TOKENS for t in cancel.get("tokens_when_closed", [None])),
        "gpu_metrics": bool(res.get("gpu_metrics", {}).get("every_gpu")),
        "stop": stop.get("rc") == 0 and stop.get("processes_left") == []
        and stop.get("shm_left") == [],
        **extra,
    }


def check_tensor_parallel(tp: int, kinds: list[str]) -> str | None:
    """Why this tensor parallel size cannot be checked with these kinds, or None."""
    if tp < 1:
        return f"--tensor-parallel-size must be >= 1, got {tp}"
    if tp > 1 and kinds != [KIND_MODEL]:
        return (f"--tensor-parallel-size {tp} needs --kinds {KIND_MODEL} alone: one vLLM engine spans {tp} GPUs "
                f"and KIND_GPU pins each instance to one (the backend refuses it), got {','.join(kinds)}")
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", choices=("qwen3", "tiny"), default="qwen3")
    ap.add_argument("--kinds", default=None, help=f"default {KIND_GPU},{KIND_MODEL}; {KIND_MODEL} when "
                    "--tensor-parallel-size > 1")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-check-work"))
    args = ap.parse_args(argv)
    tp = args.tensor_parallel_size
    kinds = (args.kinds or (KIND_MODEL if tp > 1 else f"{KIND_GPU},{KIND_MODEL}")).split(",")
    why = check_tensor_parallel(tp, kinds)
    if why:
        ap.error(why)
    if tp > 1:
        for k, v in NO_MULTICAST.items():
            os.environ.setdefault(k, v)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    import vllm

    smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
    (out / "nvidia-smi.txt").write_text(smi)
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "vllm": vllm.__version__,
                           "gpu": ", ".join(nvidia_smi("gpu=name,driver_version")),
                           "uuids": nvidia_smi("gpu=uuid"), "checker_pid": os.getpid(),
                           "tensor_parallel_size": tp, "kinds": {}}
    if tp > 1:
        res["no_multicast"] = {k: os.environ.get(k) for k in NO_MULTICAST}
    if len(res["uuids"]) < tp:
        print(f"gpu_check: --tensor-parallel-size {tp} needs {tp} GPUs, nvidia-smi lists {len(res['uuids'])}",
              file=sys.stderr)
        return 2
    t0 = time.monotonic()
    model = Path(f"/tmp/lh-{args.model}")
    make_in_child(args.model, model)
    config = json.loads((model / "config.json").read_text())
    res["model"] = {"kind": args.model, "architectures": config.get("architectures"),
                    "hidden_size": config.get("hidden_size"), "num_hidden_layers": config.get("num_hidden_layers"),
                    "vocab_size": config.get("vocab_size"),
                    "bytes": sum(f.stat().st_size for f in model.glob("*.safetensors")),
                    "made_in_s": round(time.monotonic() - t0, 1)}
    log(f"model: {res['model']}")
    try:
        for kind in kinds:
            res["kinds"][kind] = check_kind(kind, model, args.work, out, res["uuids"], tp)
            (out / "result.json").write_text(json.dumps(res, indent=2) + "\n")
    finally:
        res["all_passed"] = bool(res["kinds"]) and all(all(k["passed"].values()) for k in res["kinds"].values()
                                                       if "passed" in k)
        (out / "result.json").write_text(json.dumps(res, indent=2) + "\n")
    log(f"all passed: {res['all_passed']}")
    return 0 if res["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
