"""The `llmhost` command: tiny-model, tiny-vision-model, tiny-lora, serve, follow, smoke, bench, gateway."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from llmhost.backend.config import BackendSettings
from llmhost.server.placement import KINDS


def _key_value(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 1-65535, got {value}")
    return value


# `llmhost <command> DIR`: (module, function, what it writes); generated, nothing downloaded.
TINY = {
    "tiny-model": ("llmhost.tiny.model", "write_tiny_model", "tiny model"),
    "tiny-vision-model": ("llmhost.tiny.vision", "write_tiny_vision_model", "tiny vision model"),
    "tiny-lora": ("llmhost.tiny.lora", "write_tiny_lora", "tiny LoRA adapter"),
}


def _write_tiny(command: str, out: Path, seed: int) -> int:
    import importlib

    module, func, what = TINY[command]
    try:
        path = getattr(importlib.import_module(module), func)(out, seed=seed)
    except ValueError as exc:
        print(f"llmhost {command}: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {what} to {path}")
    return 0


def installed_version() -> str:
    """The installed llmhost distribution's version (pyproject.toml's, the CHANGELOG's top release)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llmhost")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmhost", description="Serve LLMs with Triton + vLLM on bare metal.")
    p.add_argument("--version", action="version", version=f"llmhost {installed_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("tiny-model", help="write a tiny random Qwen2-style model (no downloads)")
    t.add_argument("dir", type=Path)
    t.add_argument("--seed", type=int, default=0)

    v = sub.add_parser("tiny-vision-model",
                       help="write a tiny random BLIP-2 model that takes an image (no downloads)")
    v.add_argument("dir", type=Path)
    v.add_argument("--seed", type=int, default=0)

    a = sub.add_parser("tiny-lora", help="write a tiny LoRA adapter for the tiny model (no downloads)")
    a.add_argument("dir", type=Path)
    a.add_argument("--seed", type=int, default=1)

    s = sub.add_parser("serve", help="run tritonserver with the llmhost vLLM backend in the foreground")
    s.add_argument("--model", type=Path, required=True, help="Hugging Face model directory")
    s.add_argument("--name", default="model", help="model name in Triton (default: model)")
    s.add_argument("--host", default="127.0.0.1", help="bind address for gRPC, and for HTTP unless --http-host")
    s.add_argument("--http-host", help="bind address for HTTP (default: --host; the roles keep it on 127.0.0.1)")
    s.add_argument("--metrics-host", default="127.0.0.1", help="bind address for metrics (default 127.0.0.1)")
    s.add_argument("--http-port", type=_port, default=8000)
    s.add_argument("--grpc-port", type=_port, default=8001)
    s.add_argument("--metrics-port", type=_port, default=8002)
    s.add_argument("--workdir", type=Path, help="where to lay out backends/ and models/ (default: a temp dir)")
    s.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    s.add_argument("--kind", choices=KINDS, help="Triton instance kind (default: KIND_CPU on cpu, KIND_MODEL on "
                   "gpu, the roles' rule; KIND_GPU pins each instance to one GPU)")
    s.add_argument("--gpus", type=_gpu_list, metavar="0,1", help="GPU ids of the model (default: the server's)")
    s.add_argument("--instances", type=int, default=1, metavar="N",
                   help="model instances (replicas: one vLLM engine and engine socket each; with KIND_GPU, N on "
                        "every GPU of --gpus); default 1")
    s.add_argument("--max-model-len", type=int)
    # The backend's defaults (llmhost.backend.config.BackendSettings), not restated.
    s.add_argument("--default-max-tokens", type=int, default=BackendSettings.default_max_tokens)
    s.add_argument("--max-n", type=int, default=BackendSettings.max_n)
    s.add_argument("--drain-timeout", type=float, default=BackendSettings.drain_timeout_s,
                   help="seconds to drain on shutdown")
    s.add_argument("--kv-cache-gib", type=int, default=1, help="CPU only: VLLM_CPU_KVCACHE_SPACE")
    s.add_argument("--engine-arg", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="extra vLLM engine argument (value parsed as JSON when it can be); the engine runs in "
                        "WORKDIR/run, so give file paths absolute")
    s.add_argument("--setting", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="a backend setting of model.json's llmhost section, e.g. --setting stream_interval_ms=0")
    s.add_argument("--multi-lora", type=Path, metavar="PATH",
                   help="a multi_lora.json (LoRA adapter names -> directories) to put beside model.json; "
                        "LoRA also needs --engine-arg enable_lora=true")
    s.add_argument("--admin-key-file", type=Path, metavar="PATH",
                   help="file with the key of Triton's admin APIs (header llmhost-admin-key), created with a "
                        "new key if missing (default: WORKDIR/admin-key)")
    s.add_argument("--triton-arg", action="append", default=[], metavar="--FLAG=VALUE",
                   help="extra tritonserver argument, e.g. --triton-arg=--http-thread-count=32")
    s.add_argument("--max-restarts", type=int, default=5, metavar="N",
                   help="restart a tritonserver that exits unasked at most N times within 10 minutes "
                        "(default 5, like the systemd unit; 0: never)")
    s.add_argument("--start-timeout", type=_positive, default=600, metavar="SECONDS",
                   help="a tritonserver that does not answer this long after its start is taken as hung, "
                        "killed and started again (a restart within --max-restarts; default 600)")

    f = sub.add_parser("follow", help="run the worker side of a model spread over several hosts (vLLM's "
                                      "headless multi-node workers), joining the head host's engine")
    f.add_argument("--model-json", type=Path, required=True,
                   help="the model's model.json, the same as the head's (its layout, nnodes, master_addr, "
                        "master_port)")
    f.add_argument("--node-rank", type=int, required=True, help="this host's rank, 1..nnodes-1 (0 is the head)")
    f.add_argument("--host-ip", help="this host's address on the network the model's hosts share (VLLM_HOST_IP)")
    f.add_argument("--head-grace", type=float, default=2.0, metavar="SECONDS",
                   help="exit (for the unit to start it again) once the head's engine has had no connection to "
                        "the workers this long (default 2)")
    f.add_argument("--textfile", metavar="PATH",
                   help="write whether the workers are joined to the head as node_exporter textfile metrics "
                        "to PATH (*.prom)")
    k = sub.add_parser("smoke", help="check that an endpoint serves; exit 1 naming what failed")
    k.add_argument("--url", default="http://127.0.0.1:8000", help="Triton HTTP URL")
    k.add_argument("--metrics-url", help="Triton metrics URL, e.g. http://127.0.0.1:8002")
    k.add_argument("--grpc-url", help="Triton gRPC HOST:PORT (default: the HTTP host, port 8001)")
    k.add_argument("--no-grpc", action="store_true", help="skip the gRPC stream check")
    k.add_argument("--model", default="model")
    k.add_argument("--max-tokens", type=int, default=16)
    k.add_argument("--timeout", type=float, default=60.0)
    k.add_argument("--json", action="store_true", help="print JSON instead of a table")
    k.add_argument("--textfile", metavar="PATH",
                   help="also write the result as node_exporter textfile metrics to PATH (*.prom)")
    for name, (_, _, text) in DELEGATED.items():
        sub.add_parser(name, help=f"{text} (see llmhost {name} --help)", add_help=False)
    sub.add_parser("gateway", add_help=False,
                   help="OpenAI-compatible API with API keys in front of Triton (see llmhost gateway --help)")
    b = sub.add_parser("bench", help="streaming load test with a concurrency sweep")
    b.add_argument("--url", default="http://127.0.0.1:8000",
                   help="Triton HTTP URL, Triton gRPC HOST:PORT (--kind grpc) or an OpenAI-compatible "
                        "base URL, with or without /v1 (--kind openai)")
    b.add_argument("--kind", choices=("http", "grpc", "openai"), default="http")
    b.add_argument("--model", default="model")
    b.add_argument("--api-key-file", type=Path, metavar="PATH",
                   help="a file holding the API key to send as a bearer token (through the gateway: --kind "
                        "openai, or grpc to its gRPC door as authorization metadata)")
    b.add_argument("--concurrency", type=_int_list, default=[1, 2, 4, 8, 16, 32, 64],
                   help="comma-separated levels (default 1,2,4,8,16,32,64)")
    g = b.add_mutually_exclusive_group()
    g.add_argument("--requests", type=int, default=64, help="requests per level (default 64)")
    g.add_argument("--duration", type=float, help="seconds per level instead of a request count")
    b.add_argument("--prompt-words", type=_range, default=(64, 64), metavar="N[-M]")
    b.add_argument("--output-tokens", type=_range, default=(128, 128), metavar="N[-M]")
    b.add_argument("--shared-prefixes", type=int, default=0, metavar="N",
                   help="each prompt starts with one of N shared prefixes (a cache-aware router's workload; "
                        "--client vllm: vLLM's prefix_repetition dataset); default 0: none")
    b.add_argument("--prefix-words", type=int, default=0, metavar="N",
                   help="words of each shared prefix (--client vllm: tokens), before the prompt's own "
                        "--prompt-words")
    b.add_argument("--turns", type=_positive, default=1, metavar="N",
                   help="multi-turn chat (--kind openai): conversations of N turns, each turn sent to "
                        "/v1/chat/completions with the history so far and the conversation's x-session-id; "
                        "with --shared-prefixes the system prompts are the prefixes (default 1: single prompts)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--no-ignore-eos", action="store_true", help="let the model stop at EOS")
    b.add_argument("--processes", type=_positive, default=1, metavar="N",
                   help="client processes to spread each level's concurrency over (default 1); results merged")
    b.add_argument("--client", choices=("llmhost", "vllm"), default="llmhost",
                   help="llmhost's own client, or vLLM's `vllm bench serve` run in process (--kind openai, or http "
                        "for Triton's generate_stream; "
                        "needs --tokenizer; random prompts of the first --prompt-words tokens)")
    b.add_argument("--tokenizer", metavar="DIR", help="the model's tokenizer (a folder), for --client vllm")
    b.add_argument("--json", type=Path, help="write results as JSON")
    b.add_argument("--plot", type=Path, help="draw throughput and latency vs concurrency (PNG)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _gpu_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU ids separated by commas, e.g. 0,1, got {text!r}") from None
    if any(v < 0 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"GPU ids must be distinct and >= 0, got {text!r}")
    return values


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"levels must be >= 1, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N-M, got {text!r}") from None
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"expected 1 <= N <= M, got {text!r}")
    return a, b


def _bench(args: argparse.Namespace) -> int:
    import os
    import platform
    import time

    from llmhost.bench.loadgen import Workload, plot, sweep_processes, table, write_json

    if args.requests is not None and args.requests < 1:
        print("llmhost bench: --requests must be >= 1", file=sys.stderr)
        return 2
    if args.shared_prefixes < 0 or args.prefix_words < 0 or bool(args.shared_prefixes) != bool(args.prefix_words):
        print("llmhost bench: --shared-prefixes N and --prefix-words N go together, each >= 1", file=sys.stderr)
        return 2
    if args.turns > 1 and (args.kind != "openai" or args.client != "llmhost"):
        print("llmhost bench: --turns needs --kind openai and llmhost's own client (--client llmhost)",
              file=sys.stderr)
        return 2
    if args.client == "vllm":
        return _bench_vllm(args)
    workload = Workload(
        requests=args.requests, duration_s=args.duration,
        prompt_words=args.prompt_words[0], prompt_words_max=args.prompt_words[1],
        output_tokens=args.output_tokens[0], output_tokens_max=args.output_tokens[1],
        seed=args.seed, ignore_eos=not args.no_ignore_eos,
        shared_prefixes=args.shared_prefixes, prefix_words=args.prefix_words, turns=args.turns,
    )
    api_key = None
    if args.api_key_file is not None:
        try:
            api_key = args.api_key_file.read_text().strip()
        except OSError as exc:
            print(f"llmhost bench: cannot read --api-key-file: {exc}", file=sys.stderr)
            return 2
        if not api_key:
            print(f"llmhost bench: --api-key-file {args.api_key_file} is empty", file=sys.stderr)
            return 2
    spec = {"kind": args.kind, "url": args.url, "model": args.model, "api_key": api_key}
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    try:
        results, client_cpu_s = sweep_processes(spec, workload, args.concurrency, args.processes,
                                                progress=not args.quiet)
    except RuntimeError as exc:  # the warm-up request or a client process failed (measured failures are counted)
        print(f"llmhost bench: {exc}", file=sys.stderr)
        return 1
    print(table(results))
    print(f"client: {args.processes} process(es), {client_cpu_s:.1f} CPU s in all")
    meta = {"kind": args.kind, "url": args.url, "model": args.model, "workload": workload.__dict__,
            "date": started, "host": platform.node(), "cpus": os.cpu_count(),
            "processes": args.processes, "client_cpu_s": client_cpu_s}
    if args.json:
        write_json(results, args.json, meta)
    if args.plot:
        plot({f"{args.kind} {args.model}": results}, args.plot, f"llmhost bench: {args.url}")
    return 1 if all(r.errors == r.requests for r in results) else 0


def _bench_vllm(args: argparse.Namespace) -> int:
    """`llmhost bench --client vllm`: vLLM's own client, one run per level (llmhost.bench.vllm_client)."""
    import dataclasses
    import json

    from llmhost.bench.vllm_client import client_argv, run_level, summarize, table

    if args.kind == "grpc" or not args.tokenizer or args.duration is not None:
        print("llmhost bench: --client vllm needs --kind openai or http (Triton's generate_stream), --tokenizer "
              "DIR and --requests (not --duration)", file=sys.stderr)
        return 2
    api_key = args.api_key_file.read_text().strip() if args.api_key_file is not None else None
    levels = []
    for concurrency in args.concurrency:
        argv = client_argv(args.url, args.model, args.tokenizer, concurrency, args.requests, args.prompt_words[0],
                           args.output_tokens[0], args.seed, not args.no_ignore_eos, args.kind,
                           args.shared_prefixes, args.prefix_words)
        levels.append(summarize(concurrency, run_level(argv, api_key)))
    print(table(levels))
    if args.json:
        args.json.write_text(json.dumps({"client": "vllm", "url": args.url, "model": args.model,
                                         "levels": [dataclasses.asdict(r) for r in levels]}, indent=1))
    return 1 if all(r.completed == 0 for r in levels) else 0


def _default_grpc(url: str) -> str:
    from urllib.parse import urlparse

    return f"{urlparse(url).hostname or '127.0.0.1'}:8001"


# Subcommands with their own argument parsers (stdlib only, so Ansible can also run
# their modules as plain scripts on a host without the venv).
DELEGATED = {
    "gpu-info": ("llmhost.cuda", "main_gpu_info", "detect NVIDIA GPUs and pick the CUDA build of vLLM/PyTorch"),
    "placement": ("llmhost.server.placement", "main_placement", "check models' GPU placement (JSON in, JSON out)"),
    "nodecheck": ("llmhost.multinode.nodecheck", "main", "check that the hosts of a model across hosts agree"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        import importlib

        module, func, _ = DELEGATED[argv[0]]
        return int(getattr(importlib.import_module(module), func)(argv[1:]))
    if argv and argv[0] == "gateway":
        from llmhost.gateway.cli import main as gateway_main

        return gateway_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command in TINY:
        return _write_tiny(args.command, args.dir, args.seed)
    if args.command == "serve":
        from llmhost.server.admin_key import AdminKeyError
        from llmhost.server.layout import LayoutError
        from llmhost.server.placement import PlacementError
        from llmhost.server.serve import ServeOptions, run

        opts = ServeOptions(
            model=args.model, name=args.name, host=args.host, http_host=args.http_host, metrics_host=args.metrics_host,
            admin_key_file=args.admin_key_file, http_port=args.http_port,
            grpc_port=args.grpc_port, metrics_port=args.metrics_port, workdir=args.workdir,
            device=args.device, max_model_len=args.max_model_len, default_max_tokens=args.default_max_tokens,
            max_n=args.max_n, drain_timeout_s=args.drain_timeout, kv_cache_gib=args.kv_cache_gib,
            engine_args=dict(args.engine_arg), settings=dict(args.setting), triton_args=list(args.triton_arg),
            kind=args.kind, gpus=args.gpus, instance_count=args.instances,
            multi_lora=args.multi_lora,
        )
        try:
            return run(opts, start_timeout_s=args.start_timeout, max_restarts=args.max_restarts)
        except (LayoutError, AdminKeyError, PlacementError) as exc:
            print(f"llmhost serve: {exc}", file=sys.stderr)
            return 2
    if args.command == "follow":
        from llmhost.multinode.follower import follow

        return follow(args.model_json, args.node_rank, args.host_ip, args.head_grace, args.textfile)
    if args.command == "smoke":
        from llmhost.smoke import Smoke, render

        grpc = None if args.no_grpc else (args.grpc_url or _default_grpc(args.url))
        checks = Smoke(args.url, args.metrics_url, grpc, args.model, args.max_tokens, args.timeout).run()
        print(render(checks, args.json))
        if args.textfile:
            from llmhost.smoke import write_textfile

            write_textfile(checks, args.textfile, args.model)
        return 0 if all(c.ok for c in checks) else 1
    if args.command == "bench":
        return _bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
