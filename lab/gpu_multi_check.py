"""Multi-GPU run: tensor parallel and one model per GPU on a host with two GPUs.

Run on the lent two-GPU machine with the device kit (../shared/gpu-kit, after
gpu-setup.sh), from the repository root: `python3 -m lab.gpu_multi_check OUT`.
It writes the Qwen3-0.6B-shaped random model (lab.gpucheck.model) and runs, in
order, recording each phase in OUT/result.json as it ends:

1. `roles_tp`: the model with engine_args tensor_parallel_size 2 the roles' way
   (lab.gpucheck.check.check_kind under KIND_MODEL: the roles' model repository,
   the unit's command line and environment): smoke, bad input, structured output,
   cancellation, GPU metrics, stop; vLLM's engine config and both GPUs' memory.
2. `placement`: two models of one tritonserver, the roles' way, placed by `gpus:` as
   the placement rule decides: `gpu0` asks for KIND_GPU on GPU 0 (config.pbtxt's
   `gpus: [0]`), `gpu1` for GPU 1 with the default kind, KIND_MODEL (model.json's
   visible_gpus "1"): the configs Triton loaded (admin key), each model's smoke, the
   memory and compute processes of each GPU, then the unit's stop.
3. `serve_tp`: `llmhost serve --kind KIND_MODEL --engine-arg tensor_parallel_size=2`
   with `llmhost gateway --engine-sockets` in front: smoke, memory, bench round 1,
   SIGKILL of the tensor parallel worker of rank 1 (does the model stop answering
   ready, does serve's restart bring it back), then a drain (streams in flight at
   SIGTERM to serve alone) and what the stop leaves.
4. `vllm`: `vllm serve --tensor-parallel-size 2` (vLLM's OpenAI server, the same
   engine arguments): bench rounds 1 and 2, then SIGTERM to its main process alone.
5. `serve_tp_again`: phase 3's servers once more for bench round 2, then stop.

Bench: vLLM's own client in this process (llmhost.bench.vllm_client, through
lab/stream_compare.py's measure_level), random 256-token prompts, 128 tokens out,
ignore_eos, c=16/64/256 after a warm-up of 64 requests: round 1 llmhost then vLLM,
round 2 vLLM then llmhost. Both TP=2 servers need both GPUs, so they run one after
the other. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the rest of
check.NO_MULTICAST, set before anything starts).

Usage: python3 -m lab.gpu_multi_check OUT [--concurrency 16,64,256] [--phases ...] [--tp 4]
Writes OUT/result.json, OUT/multi.log, nvidia-smi lists, the rendered and loaded model
configs, smoke outputs and the servers' log tails. The two-GPU run of 2026-11-27 (2 x H200) is in
tests/fixtures/gpu/h200x2-580.159.04-real/device-run-2026-11-27-multi/ (its test:
tests/records/test_h200x2_tensor_parallel_and_placement.py).
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
from pathlib import Path
from typing import Any

from lab.gpucheck import check
from lab.gpucheck.lifecycle import alive, http, wait
from lab.gpucheck.model import MAX_MODEL_LEN, make_in_child
from lab.gpucheck.speed import GATEWAY_KEY, NAME, Server, tail
from lab.stream_compare import GpuUse, SocketGateway, level_line, measure_level, requests_for

TP = 2
PHASES = ("roles_tp", "placement", "serve_tp", "vllm", "serve_tp_again")
# The two models of the placement phase as an inventory would list them.
PLACEMENT = [{"name": "gpu0", "kind": check.KIND_GPU, "gpus": [0]}, {"name": "gpu1", "gpus": [1]}]
DRAIN_STREAMS, DRAIN_TOKENS = 4, 512
ENGINE_CONFIG = re.compile(r"Initializing a V1 LLM engine .*$", re.M)


class Run:
    def __init__(self, out: Path, work: Path) -> None:
        self.out, self.work = out, work
        self.res: dict[str, Any] = {}

    def log(self, msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        with (self.out / "multi.log").open("a") as f:
            f.write(line + "\n")

    def save(self) -> None:
        (self.out / "result.json").write_text(json.dumps(self.res, indent=1) + "\n")


def gpu_memory() -> list[int]:
    return [int(x) for x in check.nvidia_smi("gpu=memory.used")]


def compute_apps() -> list[dict[str, Any]]:
    """nvidia-smi's compute processes: pid, GPU index (by uuid), MiB, and the process's command."""
    import psutil

    index = {u: i for i, u in enumerate(check.nvidia_smi("gpu=uuid"))}
    apps = []
    for line in check.nvidia_smi("compute-apps=pid,gpu_uuid,used_memory"):
        pid, uuid, mib = (p.strip() for p in line.split(","))
        try:
            cmd = " ".join(psutil.Process(int(pid)).cmdline())[:200]
        except (psutil.Error, ValueError):
            cmd = ""
        apps.append({"pid": int(pid), "gpu": index.get(uuid), "used_mib": int(mib), "command": cmd})
    return apps


def engine_lines(logfile: Path) -> list[str]:
    text = logfile.read_text(errors="replace") if logfile.exists() else ""
    return [m.group(0)[:2000] for m in ENGINE_CONFIG.finditer(text)]


# --- phase 1: the roles' way, TP=2 ---------------------------------------------------------

def roles_tp(run: Run, model: Path, uuids: list[str]) -> None:
    res = check.check_kind(check.KIND_MODEL, model, run.work, run.out, uuids, TP)
    rendered = run.work / check.KIND_MODEL.lower() / "models" / NAME
    for name in ("config.pbtxt", "model.json"):
        if (rendered / name).exists():
            shutil.copy(rendered / name, run.out / f"roles-tp-{name}")
    res["engine_config"] = engine_lines(run.out / "serve-kind_model.log")
    run.res["roles_tp"] = res
    run.log(f"roles_tp: passed {res['passed']}")


# --- phase 2: two models, one per GPU --------------------------------------------------------

def placement(run: Run, model: Path) -> None:
    entries = check.placed_entries(model, PLACEMENT, gpu_count=len(check.nvidia_smi("gpu=uuid")))
    res: dict[str, Any] = {"inventory": PLACEMENT, "entries": [{k: e.get(k) for k in ("name", "kind", "gpus")}
                                                                 for e in entries]}
    shm_before = set(os.listdir("/dev/shm"))
    res["gpu_memory_used_mib_before"] = gpu_memory()
    server = check.Server(check.KIND_MODEL, model, run.work, run.out / "serve-placement.log", entries=entries,
                          label="placement")
    t0 = time.monotonic()
    try:
        server.start()
        res["command"], res["environment"] = server.argv, check.shown_environment(server.env)
        for e in entries:
            d = server.work / "models" / e["name"]
            shutil.copy(d / "config.pbtxt", run.out / f"placement-{e['name']}-config.pbtxt")
            shutil.copy(d / "model.json", run.out / f"placement-{e['name']}-model.json")

        def all_ready() -> bool:
            return all(http("GET", f"/v2/models/{e['name']}/ready", timeout=3)[0] == 200 for e in entries)

        up = wait(lambda: all_ready() or (server.proc is not None and server.proc.poll() is not None), 420, 1.0)
        res["ready_s"] = round(time.monotonic() - t0, 1) if up is not None and all_ready() else None
        run.log(f"placement: both ready after {res['ready_s']} s")
        if res["ready_s"] is not None:
            res["models"] = {}
            for e in entries:
                res["models"][e["name"]] = {"loaded_config": check.loaded_config(server.key, e["name"]),
                                            "smoke": check.smoke(run.out, f"smoke-{e['name']}", model=e["name"])}
            res["gpu_memory_used_mib_serving"] = gpu_memory()
            res["compute_apps"] = compute_apps()
            (run.out / "nvidia-smi-placement.txt").write_text(
                subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
            run.log(f"placement: {json.dumps(res['models'])[:600]} memory {res['gpu_memory_used_mib_serving']}")
        res["engine_config"] = engine_lines(run.out / "serve-placement.log")
    except Exception as exc:  # noqa: BLE001 - recorded; the stop below still runs
        res["exception"] = f"{type(exc).__name__}: {exc}"
        run.log(f"placement: {res['exception']}")
    finally:
        if server.proc is not None:
            res["stop"] = server.stop(shm_before)
            res["stop"]["gpu_memory_used_mib_after"] = gpu_memory()
            res["stop"]["compute_apps_after"] = compute_apps()
            run.log(f"placement: stop {res['stop']}")
    run.res["placement"] = res


# --- phases 3-5: llmhost serve TP=2 behind the gateway, vllm serve TP=2 ------------------------

class Bench:
    def __init__(self, run: Run, model: Path, levels: list[int], gpus: GpuUse) -> None:
        self.run, self.model, self.levels, self.gpus = run, model, levels, gpus
        run.res.setdefault("bench", {"workload": {
            "client": "vllm bench serve (in process, llmhost.bench.vllm_client), on the same host as the servers",
            "dataset": "random", "input_len": 256, "output_len": 128, "ignore_eos": True,
            "concurrency": levels, "requests": {c: requests_for(c) for c in levels}},
            "streaming": {"llmhost": "OpenAI SSE (/v1/completions) from llmhost gateway reading the engine "
                                     f"socket of `llmhost serve --kind KIND_MODEL` (TP={TP})",
                          "vllm": f"OpenAI SSE (/v1/completions) from `vllm serve --tensor-parallel-size {TP}`"},
            "runs": {"llmhost": [], "vllm": []}, "order": []})

    def one(self, side: str, url: str, rnd: int | None) -> None:
        key = GATEWAY_KEY if side == "llmhost" else None
        if rnd is None:
            measure_level(url, NAME, self.model, 64, None, 256, 128, key)
            return
        bench = self.run.res["bench"]
        bench["order"].append(f"round {rnd + 1}: {side}")
        for c in self.levels:
            level, t0, t1 = measure_level(url, NAME, self.model, c, rnd, 256, 128, key)
            level.update(side=side, gpu_util_pct=[self.gpus.mean(i, t0, t1) for i in range(TP)])
            bench["runs"][side].append(level)
            self.run.log(level_line(rnd, side, level, f"GPU {level['gpu_util_pct']}%"))
            self.run.save()


def engine_env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1",
                DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")


def engine_args() -> dict[str, Any]:
    return {"served_model_name": NAME, "max_model_len": MAX_MODEL_LEN, "tensor_parallel_size": TP}


def processes(server: Server) -> list[dict[str, Any]]:
    import psutil

    out = []
    for pid, name in server.processes().items():
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())[:160]
        except psutil.Error:
            cmd = ""
        out.append({"pid": pid, "name": name, "command": cmd})
    return out


def tp_worker(procs: list[dict[str, Any]], rank: int) -> int | None:
    """The pid of vLLM's tensor parallel worker of RANK (its process title names it)."""
    for p in procs:
        if re.search(rf"_TP{rank}(?![0-9])", p["name"] + " " + p["command"]):
            return int(p["pid"])
    workers = sorted(p["pid"] for p in procs if "Worker" in p["name"] + p["command"])
    return workers[rank] if len(workers) > rank else None


def serve_log_lines(logfile: Path, since: int) -> list[str]:
    text = logfile.read_bytes()[since:].decode(errors="replace") if logfile.exists() else ""
    keep = re.compile(r"llmhost serve:|engine died|EngineDeadError|unload|failed to load|restart", re.I)
    return [line[:300] for line in text.splitlines() if keep.search(line)][:40]


def kill_worker(run: Run, server: Server, gateway: Server) -> dict[str, Any]:
    procs = processes(server)
    pid = tp_worker(procs, 1)
    res: dict[str, Any] = {"processes": procs, "worker_pid": pid}
    if pid is None:
        res["error"] = "no tensor parallel worker of rank 1 found"
        return res
    old = {p["pid"] for p in procs}
    since = server.logfile.stat().st_size
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    run.log(f"serve_tp: SIGKILL worker TP1 pid {pid}")
    not_ready = wait(lambda: not server.ready(), 120, 0.2)
    res["not_ready_after_s"] = None if not_ready is None else round(not_ready, 2)
    back = wait(server.ready, 420, 1.0)
    res["ready_again_after_s"] = None if back is None else round(time.monotonic() - t_kill, 1)
    run.log(f"serve_tp: not ready after {res['not_ready_after_s']} s, ready again after {res['ready_again_after_s']} s")
    res["serve_log"] = serve_log_lines(server.logfile, since)
    res["serve_alive"] = server.proc is not None and server.proc.poll() is None
    if back is not None:
        res["smoke_after_restart"] = check.smoke(run.out, "smoke-serve-tp-after-kill", http_port=server.port)
        res["gateway_ready_after_s"] = wait(gateway.ready, 60, 0.5)
        res["gpu_memory_used_mib_after_restart"] = gpu_memory()
        res["engine_gpus_after_restart"] = [a["gpu"] for a in compute_apps()]
    res["old_processes_left"] = alive(sorted(old - {p["pid"] for p in processes(server)}))
    return res


def drain_and_stop(run: Run, server: Server, shm_before: set[str]) -> dict[str, Any]:
    """Streams in flight, then SIGTERM to `llmhost serve` alone: do they finish, what is left."""
    assert server.proc is not None
    outcomes: list[dict[str, Any]] = [{} for _ in range(DRAIN_STREAMS)]
    started = [threading.Event() for _ in outcomes]
    never = threading.Event()
    threads = [threading.Thread(target=check.stream_tokens, args=(o, never, server.url, DRAIN_TOKENS, s), daemon=True)
               for o, s in zip(outcomes, started, strict=True)]
    for t in threads:
        t.start()
    for s in started:
        s.wait(60)
    res = check.sigterm_alone(server.proc, shm_before)
    for t in threads:
        t.join(60)
    res.update(streams=DRAIN_STREAMS, max_tokens=DRAIN_TOKENS, tokens=[o.get("tokens") for o in outcomes],
               errors=[o["error"] for o in outcomes if "error" in o],
               gpu_memory_used_mib_after=gpu_memory(), compute_apps_after=compute_apps())
    run.log(f"serve_tp: drain and stop {res}")
    return res


def llmhost_side(run: Run, model: Path, bench: Bench, rounds: list[int], phase: str, kill: bool) -> None:
    from llmhost.server.admin_key import read_key

    res: dict[str, Any] = {"gpu_memory_used_mib_before": gpu_memory()}
    run.res[phase] = res
    shm_before = set(os.listdir("/dev/shm"))
    shutil.rmtree(run.work / "triton", ignore_errors=True)  # a fresh workdir for each serve
    log = run.work / f"serve-{phase}.log"
    server = Server("triton", model, run.work, log, engine_args(), engine_env(), kind=check.KIND_MODEL)
    gateway = SocketGateway(server, run.work, engine_env(), 2 * max(bench.levels))
    res["command"] = server.command()
    try:
        res["ready_s"] = server.start()
        gateway.start()
        key = read_key(run.work / "triton" / "admin-key")
        res["loaded_config"] = check.loaded_config(key, base=server.url)
        res["smoke"] = check.smoke(run.out, f"smoke-{phase}", http_port=server.port)
        res["gpu_memory_used_mib_serving"] = gpu_memory()
        res["compute_apps"] = compute_apps()
        res["engine_config"] = engine_lines(log)
        (run.out / f"nvidia-smi-{phase}.txt").write_text(
            subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
        run.log(f"{phase}: smoke {res['smoke']} memory {res['gpu_memory_used_mib_serving']}")
        run.save()
        bench.one("llmhost", gateway.url, None)
        for rnd in rounds:
            bench.one("llmhost", gateway.url, rnd)
        if kill:
            res["worker_kill"] = kill_worker(run, server, gateway)
            run.save()
    except Exception as exc:  # noqa: BLE001 - recorded; the stop below still runs
        res["exception"] = f"{type(exc).__name__}: {exc}"
        run.log(f"{phase}: {res['exception']}")
    finally:
        gateway.stop()
        if server.proc is not None and server.proc.poll() is None:
            res["drain_stop"] = drain_and_stop(run, server, shm_before)
        server.stop()
        tail(log, run.out / f"serve-{phase}.log", 200)
        run.save()


def vllm_side(run: Run, model: Path, bench: Bench, rounds: list[int]) -> None:
    res: dict[str, Any] = {"gpu_memory_used_mib_before": gpu_memory()}
    run.res["vllm"] = res
    shm_before = set(os.listdir("/dev/shm"))
    log = run.work / "vllm-server.log"
    server = Server("vllm", model, run.work, log, engine_args(), engine_env())
    res["command"] = server.command()
    try:
        res["ready_s"] = server.start()
        res["gpu_memory_used_mib_serving"] = gpu_memory()
        res["compute_apps"] = compute_apps()
        res["engine_config"] = engine_lines(log)
        run.save()
        bench.one("vllm", server.url, None)
        for rnd in rounds:
            bench.one("vllm", server.url, rnd)
    except Exception as exc:  # noqa: BLE001 - recorded; the stop below still runs
        res["exception"] = f"{type(exc).__name__}: {exc}"
        run.log(f"vllm: {res['exception']}")
    finally:
        if server.proc is not None and server.proc.poll() is None:
            res["stop"] = check.sigterm_alone(server.proc, shm_before)
            res["stop"]["gpu_memory_used_mib_after"] = gpu_memory()
            run.log(f"vllm: stop {res['stop']}")
        server.stop()
        tail(log, run.out / "vllm-server.log", 200)
        run.save()


def main(argv: list[str] | None = None) -> int:
    global TP
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--concurrency", default="16,64,256")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-multi-work"))
    ap.add_argument("--serve-tp-rounds", default="0", help="the bench rounds (from 0) of phase serve_tp")
    ap.add_argument("--vllm-rounds", default="0,1", help="the bench rounds (from 0) of phase vllm")
    ap.add_argument("--tp", type=int, default=TP, help=f"tensor parallel size (default {TP}); placement "
                    "uses GPUs 0 and 1 whatever it is")
    args = ap.parse_args(argv)
    TP = args.tp
    for k, v in check.NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    phases = args.phases.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    import vllm

    run = Run(out, args.work)
    uuids = check.nvidia_smi("gpu=uuid")
    (out / "nvidia-smi.txt").write_text(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
    (out / "nvidia-smi-L.txt").write_text(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout)
    (out / "nvidia-smi-topo.txt").write_text(
        subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout)
    run.res.update({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "vllm_version": vllm.__version__,
                    "gpus": check.nvidia_smi("gpu=index,name,driver_version,memory.total"), "uuids": uuids,
                    "cpus": os.cpu_count(), "tensor_parallel_size": TP, "phases": phases,
                    "no_multicast": {k: os.environ.get(k) for k in check.NO_MULTICAST}})
    if len(uuids) < TP:
        run.log(f"{TP} GPUs needed, nvidia-smi lists {len(uuids)}")
        return 2
    model = Path("/tmp/lh-qwen3")
    make_in_child("qwen3", model)
    run.res["model"] = {"kind": "qwen3", "bytes": sum(f.stat().st_size for f in model.glob("*.safetensors"))}
    run.save()
    gpus = GpuUse()
    bench = Bench(run, model, levels, gpus)
    try:
        if "roles_tp" in phases:
            roles_tp(run, model, uuids)
            run.save()
        if "placement" in phases:
            placement(run, model)
            run.save()
        if "serve_tp" in phases:
            llmhost_side(run, model, bench, [int(r) for r in args.serve_tp_rounds.split(",")], "serve_tp",
                         kill=True)
        if "vllm" in phases:
            vllm_side(run, model, bench, [int(r) for r in args.vllm_rounds.split(",")])
        if "serve_tp_again" in phases:
            llmhost_side(run, model, bench, [1], "serve_tp_again", kill=False)
    finally:
        gpus.close()
        run.res["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        run.save()
        run.log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
