"""`llmhost gateway`: run the gateway, or `llmhost gateway hash-key` to hash a key."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmhost.gateway.config import DEFAULT_MAX_BODY_BYTES, GatewayConfig
from llmhost.gateway.keys import MIN_KEY_CHARS, KeysError, KeyStore, hash_key, load_keys


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port of 1-65535, got {text!r}")
    return host.strip("[]"), int(port)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmhost gateway",
        description="OpenAI-compatible API with API keys in front of Triton. "
                    "`llmhost gateway hash-key` prints the hash of a key read from stdin.")
    p.add_argument("--upstream", type=_host_port, default=("127.0.0.1", 8001), metavar="HOST:PORT",
                   help="Triton's gRPC address (default 127.0.0.1:8001)")
    p.add_argument("--listen", type=_host_port, default=("127.0.0.1", 18080), metavar="HOST:PORT",
                   help="where the gateway listens (default 127.0.0.1:18080)")
    p.add_argument("--keys-file", type=Path, required=True, metavar="PATH",
                   help="JSON or YAML file of named keys stored as SHA-256 hashes")
    p.add_argument("--model", action="append", required=True, metavar="NAME",
                   help="a Triton model served through the gateway (repeat for several)")
    p.add_argument("--max-body-bytes", type=_positive, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body (default {DEFAULT_MAX_BODY_BYTES}); larger: 413")
    p.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="warning")
    return p


def hash_key_main(argv: list[str]) -> int:
    if argv:
        print("llmhost gateway hash-key: takes no arguments; give the key on stdin", file=sys.stderr)
        return 2
    key = sys.stdin.readline().strip()
    if len(key) < MIN_KEY_CHARS:
        print(f"llmhost gateway hash-key: the key on stdin must be at least {MIN_KEY_CHARS} characters",
              file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "hash-key":
        return hash_key_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        keys = load_keys(args.keys_file)
    except KeysError as exc:
        print(f"llmhost gateway: {args.keys_file}: {exc}", file=sys.stderr)
        return 2
    if not keys:
        print(f"llmhost gateway: {args.keys_file}: holds no keys; nobody could use the gateway", file=sys.stderr)
        return 2
    import uvicorn

    from llmhost.gateway.app import create_app

    host, port = args.upstream
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    config = GatewayConfig(upstream=target, models=list(dict.fromkeys(args.model)),
                           max_body_bytes=args.max_body_bytes)
    app = create_app(config, KeyStore(keys))
    listen_host, listen_port = args.listen
    print(f"llmhost gateway: OpenAI API on http://{args.listen[0]}:{listen_port}/v1 for "
          f"{', '.join(config.models)} via {target}; {len(keys)} key(s)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=listen_host, port=listen_port, log_level=args.log_level, access_log=False,
                server_header=False, lifespan="off")
    return 0


if __name__ == "__main__":
    sys.exit(main())
