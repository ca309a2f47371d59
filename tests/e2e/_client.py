"""Small clients for the tests: HTTP generate / generate_stream and gRPC streaming, and
``shaped``, the rule for checks of a stream's shape (how many responses it came in).

A stream's shape depends on load as well as on the server: vLLM merges the steps of a
request whose consumer falls behind, and so does the backend's sending thread under a
backlog. On CI's two cores shared with the two-host roll a 200-token stream has come
in 46 responses where an idle machine sends about 200, and a 12-token one in 2. So a
check of the shape takes a new stream when one fails, up to ``SHAPE_TRIES`` streams
five seconds apart, and fails with the last one's figures; a server that always had
the wrong shape fails every try. What does not depend on load (the text, the counts
adding up, which response carries what) is checked on every stream, inside ``take``.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Callable, Sized
from typing import Any, TypeVar

import numpy as np
import requests
import tritonclient.grpc as grpcclient

from llmhost.smoke import parse_sse
from tests.harness.endpoint import Endpoint as Server

SHAPE_TRIES = 4
T = TypeVar("T")


def shaped(take: Callable[[], T], check: Callable[[T], None]) -> T:
    """``take()`` a stream (or a run of streams) until ``check`` passes on it, up to
    SHAPE_TRIES times; the last failure is raised as it is."""
    for attempt in range(1, SHAPE_TRIES):
        got = take()
        try:
            check(got)
        except AssertionError:
            print(f"stream {attempt} of {SHAPE_TRIES} did not have the shape asked for; another in 5 s",
                  flush=True)
            time.sleep(5)
        else:
            return got
    got = take()
    check(got)
    return got


def more_than(n: int) -> Callable[[Sized], None]:
    """A check for ``shaped``: the stream came in more than ``n`` responses."""
    def check(responses: Sized) -> None:
        assert len(responses) > n, f"a stream in {len(responses)} response(s), not more than {n}"
    return check


def generate(server: Server, **body: Any) -> dict[str, Any]:
    r = requests.post(f"{server.http}/v2/models/{server.name}/generate", json=body, timeout=120)
    data = r.json()
    data["_status"] = r.status_code
    return data


def stream(server: Server, **body: Any) -> list[dict[str, Any]]:
    body.setdefault("stream", True)
    with requests.post(f"{server.http}/v2/models/{server.name}/generate_stream", json=body, stream=True,
                       timeout=120) as r:
        assert r.status_code == 200, r.text
        return parse_sse([ln for ln in r.iter_lines(decode_unicode=True) if ln])


def grpc_stream(server: Server, inputs: dict[str, Any], params: dict[str, Any] | None = None,
                timeout_s: float = 60, target: str | None = None, headers: dict[str, str] | None = None
                ) -> tuple[list[Any], str | None]:
    """Send one streaming request to SERVER's gRPC port, or TARGET (a gateway's, with
    HEADERS); return (results, error message or None)."""
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(target or server.grpc)
    out: list[Any] = []
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)), headers=headers)
        tensors = []
        for name, value in inputs.items():
            if isinstance(value, bool):
                t = grpcclient.InferInput(name, [1], "BOOL")
                t.set_data_from_numpy(np.array([value], dtype=np.bool_))
            else:
                raw = value if isinstance(value, bytes) else str(value).encode()
                t = grpcclient.InferInput(name, [1], "BYTES")
                t.set_data_from_numpy(np.array([raw], dtype=np.object_))
            tensors.append(t)
        client.async_stream_infer(server.name, tensors, parameters=params or None, enable_empty_final_response=True)
        deadline = time.monotonic() + timeout_s
        while True:
            result, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                return out, str(error)
            resp = result.get_response()
            final = resp.parameters.get("triton_final_response")
            if result.as_numpy("text_output") is not None:
                out.append(result)
            if final is not None and final.bool_param:
                return out, None
    finally:
        client.stop_stream()
        client.close()


def texts(result: Any) -> list[str]:
    return [t.decode() for t in result.as_numpy("text_output")]


def sampling(**kw: Any) -> str:
    return json.dumps(kw)
