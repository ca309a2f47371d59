"""Lab: the demo host as `make demo` leaves it (the roles' defaults: the gateway on the
host streams from the engine socket) against `vllm serve` on this machine, on the same
tiny model, both measured by vLLM's own client (`vllm bench serve`, in process:
llmhost.bench.vllm_client), in alternating order per round.

Run after `make demo`. It writes the demo's model again here (`source: tiny`, seed 0:
byte-identical weights), starts `vllm serve` on it with the demo's engine arguments,
and measures both at each concurrency: random prompts of --input-len tokens,
--output-len tokens out, --ignore-eos. Both stacks stay resident (they share this
machine's cores; the idle one waits on its queue); the client runs in this process,
and its CPU seconds per level are recorded, with the machine's load.

Usage, from the repository's root (tests.harness starts `vllm serve`):
    .venv/bin/python -m lab.demo_compare OUT [--rounds 2] [--concurrency 16,64]
Writes OUT/result.json (every level's numbers and the medians of the per-round ratios
demo gateway / vllm) and OUT/compare.log.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import requests

from lab.stream_compare import SIDES, alternate, log, measure_level, ratios, requests_for, workload_parser
from llmhost.tiny.model import write_tiny_model

NAME = "tiny"
# The demo's model entry (inventory/demo.yml) and the CPU engine arguments the roles give it.
ENGINE_ARGS = ["--max-model-len", "512", "--enforce-eager", "--dtype", "bfloat16"]
STREAMING = {
    "gateway": "OpenAI SSE (/v1/completions) from the demo host's llmhost-gateway.service, which reads "
               "the model's engine socket (one JSON line per engine step)",
    "vllm": "OpenAI SSE (/v1/completions) from vLLM's own API server on this machine, one event per engine step",
}
# The goals on a 2-core machine whose cores both stacks share (looser than a GPU host's).
GOALS = {"tps": (">=", 0.85), "ttft_p50": ("<=", 1.5), "itl_p50": ("<=", 1.5)}
MAX_TOKENS_PER_EVENT = 1.2


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for row in rows:
        for key, (op, bound) in GOALS.items():
            ok = row[key] >= bound if op == ">=" else row[key] <= bound
            out.append(f"c={row['concurrency']} {key} {row[key]}x {op} {bound}: {'met' if ok else 'MISSED'}")
        events = row["tokens_per_event"]["gateway"]
        out.append(f"c={row['concurrency']} gateway tokens per event {events} <= {MAX_TOKENS_PER_EVENT}: "
                   f"{'met' if events <= MAX_TOKENS_PER_EVENT else 'MISSED'}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = workload_parser(__doc__ or "", 2, "16,64")
    ap.add_argument("--gateway", default="http://127.0.0.1:18080/v1", help="the demo's OpenAI base URL")
    ap.add_argument("--key-file", type=Path, default=Path(".cache/demo/gateway-api-key"))
    args = ap.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    key = args.key_file.read_text().strip()
    auth = {"Authorization": f"Bearer {key}"}
    if requests.get(f"{args.gateway}/models", headers=auth, timeout=10).status_code != 200:
        raise SystemExit(f"the demo's gateway does not answer at {args.gateway}: run `make demo` first")
    model = write_tiny_model(out / "model", seed=0)
    import vllm

    from tests.harness.vllm_server import vllm_server

    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "vllm": vllm.__version__,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "workload": {"client": "vllm bench serve (in process, llmhost.bench.vllm_client), on this machine",
                     "dataset": "random", "input_len": args.input_len, "output_len": args.output_len,
                     "ignore_eos": True, "concurrency": levels, "requests": {c: requests_for(c) for c in levels}},
        "engine_args": ENGINE_ARGS, "streaming": STREAMING, "runs": {s: [] for s in SIDES}, "order": []}

    def save() -> None:
        res["ratios"] = ratios(res["runs"])
        res["verdicts"] = verdicts(res["ratios"])
        (out / "result.json").write_text(json.dumps(res, indent=1) + "\n")

    with vllm_server(model, out / "vllm-work", NAME, ENGINE_ARGS) as theirs:
        urls = {"gateway": args.gateway, "vllm": theirs.url}

        def measure(side: str, concurrency: int, rnd: int | None) -> dict[str, Any]:
            level, _, _ = measure_level(urls[side], NAME, model, concurrency, rnd, args.input_len,
                                        args.output_len, key if side == "gateway" else None)
            level.update(side=side, load_1min=os.getloadavg()[0])
            return level

        for side in SIDES:
            measure(side, 16, None)  # warm-up, not recorded
        log("both sides up and warm", out)
        alternate(res, args.rounds, levels, measure, out, save, lambda level: f"load {level['load_1min']:.2f}")
    save()
    for line in res["verdicts"]:
        log(line, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
